"""The softmax-attention mixing step, with interchangeable implementations.

Rotations happen outside: callers rotate q, k (and v) before `mix` and the output after,
so a kernel here is plain grouped-query softmax attention,

  o_t = sum_s softmax_s(scale * q_t . k_s | keep(t, s)) v_s,

where keep(t, s) combines causality (s <= t + q_offset), an optional sliding window
(`window=W`: also s > t + q_offset - W, so query t sees the W keys t - W < s <= t, Hugging
Face's `sliding_window` convention), an optional chunk (`chunk=C`: also s // C ==
(t + q_offset) // C, so query t sees its own chunk of C keys up to itself: Llama 4's local
layers, HF's `attention_chunk_size`), packed-document segment ids and an optional dense
mask. A query row with no key to attend gives o_t = 0 (never NaN), in every
implementation.

Every mask and logit term travels as one value, `Terms` (`nn/kernels/terms.py`): the
layer builds it and the kernel reads it whole. A logit bias (`Bias`: a function of the
query row, the key slot and the head, computed per block where a kernel works in
blocks) is added to the scaled logits before the mask, in every kernel that registers
it, with gradients to its parameters.

Attention sinks (`sinks=` [N], gpt-oss, DeepSeek-V4): one learned logit z_n per query
head joins every softmax denominator and carries no value,

  o_t = sum_s exp(x_ts) v_s / (exp(z_n) + sum_s exp(x_ts)),

so a head may put mass nowhere; a row with no key gives o_t = 0 as before. Gradients
reach the sinks in every implementation.

Implementations (`impl`), a module each in this package, registered in `KERNELS` with
the terms each computes (a call with a term its kernel lacks goes to the kernel's
fallback for that term, or is refused in one line, in `choose`):
  "xla"          reference: scores [B, K, T, G, S] in float32, O(T * S) memory.
  "dot_product"  `jax.nn.dot_product_attention`: cuDNN flash attention on GPU for
                 fp16/bf16 inputs, XLA otherwise (see `_mix_dot_product`).
  "chunked"      pure-JAX blockwise online softmax (FlashAttention-style) with a custom
                 backward that recomputes the scores block by block: O(T * block) memory.
  "splash"       TPU Pallas splash attention (TPU only).

Shape legend:
  B batch, T query positions, S key positions, N query heads, K kv heads,
  G = N / K query heads per kv head (head n uses kv head n // G), H head dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax

from rope_jax.nn.kernels.chunked import _mix_chunked
from rope_jax.nn.kernels.dot_product import _mix_dot_product
from rope_jax.nn.kernels.splash import _mix_splash
from rope_jax.nn.kernels.terms import TERM_NAMES, Bias, Terms
from rope_jax.nn.kernels.xla import _softmax_mix

__all__ = ["IMPLS", "KERNELS", "Bias", "Kernel", "Terms", "check_impl", "choose", "mix"]


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One attention kernel: its function (q, k, v, checked `Terms`, scale=, block_size=)
    -> float32 [B, T, N, H], the terms it computes, the kernel a call goes to for each
    term it does not (its fallback), and the one backend it needs (None = any)."""

    mix: Callable
    supports: frozenset[str]
    instead: Mapping[str, str] = dataclasses.field(default_factory=dict)
    backend: str | None = None


_ALL = frozenset(TERM_NAMES)
KERNELS: dict[str, Kernel] = {
    "xla": Kernel(lambda q, k, v, terms, *, scale, block_size: _softmax_mix(
        q, k, v, terms, scale=scale), _ALL),
    "dot_product": Kernel(lambda q, k, v, terms, *, scale, block_size: _mix_dot_product(
        q, k, v, terms, scale=scale), _ALL - {"sinks", "stick_breaking"},
        instead={"sinks": "xla", "stick_breaking": "xla"}),
    "chunked": Kernel(_mix_chunked, _ALL - {"stick_breaking"}),
    "splash": Kernel(_mix_splash, _ALL - {"bias", "stick_breaking"}, backend="tpu"),
}  # fmt: skip
IMPLS = tuple(KERNELS)


def check_impl(impl: str, field: str = "impl") -> str:
    """`impl` if it names an implementation this backend can run, else one ValueError line."""
    if impl not in KERNELS:
        raise ValueError(f"{field}={impl!r} is not one of {', '.join(map(repr, IMPLS))}")
    backend = KERNELS[impl].backend
    if backend is not None and jax.default_backend() != backend:
        raise ValueError(
            f"{field}={impl!r} needs a {backend.upper()} (Pallas splash attention), but the "
            f"backend is {jax.default_backend()!r}: use 'chunked', 'dot_product' or 'xla'"
        )
    return impl


def choose(impl: str, used, field: str = "impl") -> str:
    """The kernel that runs a call of `impl` with the terms `used` (`Terms.uses()`): `impl`
    itself, or its fallback for the terms it lacks; one ValueError line naming the term
    when there is none."""
    if impl not in KERNELS:
        check_impl(impl, field)  # the one line naming the choices
    kernel = KERNELS[impl]
    lacking = sorted(set(used) - kernel.supports)
    if not lacking:
        return check_impl(impl, field)
    targets = {kernel.instead.get(term) for term in lacking}
    if None in targets or len(targets) != 1:
        term = next(t for t in lacking if t not in kernel.instead)
        able = [name for name, k in KERNELS.items() if set(used) <= k.supports]
        raise ValueError(
            f"{field}={impl!r} cannot compute the attention term {term!r}; kernels that "
            f"compute every term of this call: {', '.join(map(repr, able))}"
        )
    return check_impl(targets.pop(), field)


def mix(
    q,
    k,
    v,
    terms: Terms | None = None,
    *,
    impl: str = "xla",
    scale: float | None = None,
    block_size: int = 512,
    **fields,
) -> jax.Array:
    """sum_s softmax_s(scale * q . k_s + b) v_s over the allowed keys; float32 [B, T, N, H].

    Args:
      q: [B, T, N, H] queries (already rotated).
      k, v: [B, S, K, H] keys and values; N % K == 0, head n uses kv head n // (N / K).
      terms: the masks and logit terms (`Terms`; None = none), with `fields` (its field
        names) replacing its fields:
        causal: if True, query t attends key s iff s <= t + q_offset.
        q_offset: with `causal`, the position of query 0 among the keys: an int or a
          traced int32 scalar; 0 for training (S == T), the number of filled slots when
          decoding into a cache of S slots; None means S - T (queries are the last T
          keys). Ignored when not causal.
        q_segments, kv_segments: optional int [B, T] and [B, S] document ids of packed
          sequences (both or neither): query t attends key s only where they are equal.
        mask: optional bool [B or 1, 1 or N, T, S], True = attend; combined with the rest.
        sinks: optional float [N], one sink logit per query head (added to every softmax
          denominator, no value); None = none. Differentiable.
        window: optional sliding window W, a positive Python int, with `causal`: query t
          attends keys t + q_offset - W < s <= t + q_offset (the W latest, itself
          included: HF's `sliding_window`). A window that reaches past key 0 for every
          query is allowed (it changes nothing). "chunked" skips the key blocks wholly
          outside it (O(T * W) work).
        chunk: optional chunk C, a positive Python int, with `causal`: query t attends
          keys s <= t + q_offset in its own chunk, s // C == (t + q_offset) // C (chunks
          start at key 0; Llama 4's local layers). "chunked" skips the key blocks of other
          chunks (O(T * C) work); "dot_product" folds it into its dense mask; "splash"
          uses its lazy chunked mask where the queries start at key 0 and are whole blocks.
        bias: optional `Bias`, a logit term b(t, s, n) added to the scaled logits
          (differentiable in its parameters); every kernel but "splash".
      impl: one of IMPLS (a term it lacks goes to its fallback or is refused: `choose`).
      scale: logit scale (a Python float), default 1 / sqrt(H).
      block_size: block length along T and S for "chunked" and "splash".

    Returns:
      float32 [B, T, N, H]; rows with no allowed key are 0.
    """
    terms = Terms.of(terms, **fields).checked(q, k, v)
    kernel = KERNELS[choose(impl, terms.uses())]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return kernel.mix(q, k, v, terms, scale=scale, block_size=block_size)
