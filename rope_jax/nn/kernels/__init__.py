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

Attention sinks (`sinks=` [N], gpt-oss, DeepSeek-V4): one learned logit z_n per query
head joins every softmax denominator and carries no value,

  o_t = sum_s exp(x_ts) v_s / (exp(z_n) + sum_s exp(x_ts)),

so a head may put mass nowhere; a row with no key gives o_t = 0 as before. Gradients
reach the sinks in every implementation.

Implementations (`impl`), a module each in this package:
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

import jax
import jax.numpy as jnp

from rope_jax.nn.kernels.chunked import _mix_chunked
from rope_jax.nn.kernels.common import (
    _check_chunk,
    _check_inputs,
    _check_sinks,
    _check_window,
    _resolve_offset,
)
from rope_jax.nn.kernels.dot_product import _mix_dot_product
from rope_jax.nn.kernels.splash import _mix_splash
from rope_jax.nn.kernels.xla import _softmax_mix

IMPLS = ("xla", "dot_product", "chunked", "splash")


def check_impl(impl: str, field: str = "impl") -> str:
    """`impl` if it names an implementation this backend can run, else one ValueError line."""
    if impl not in IMPLS:
        raise ValueError(f"{field}={impl!r} is not one of {', '.join(map(repr, IMPLS))}")
    if impl == "splash" and jax.default_backend() != "tpu":
        raise ValueError(
            f"{field}='splash' needs a TPU (Pallas splash attention), but the backend is "
            f"{jax.default_backend()!r}: use 'chunked', 'dot_product' or 'xla'"
        )
    return impl


def mix(
    q,
    k,
    v,
    *,
    impl: str = "xla",
    causal: bool = False,
    q_offset=0,
    q_segments=None,
    kv_segments=None,
    mask=None,
    scale: float | None = None,
    block_size: int = 512,
    sinks=None,
    window: int | None = None,
    chunk: int | None = None,
) -> jax.Array:
    """sum_s softmax_s(scale * q . k_s) v_s over the allowed keys; float32 [B, T, N, H].

    Args:
      q: [B, T, N, H] queries (already rotated).
      k, v: [B, S, K, H] keys and values; N % K == 0, head n uses kv head n // (N / K).
      impl: one of IMPLS.
      causal: if True, query t attends key s iff s <= t + q_offset.
      q_offset: with `causal`, the position of query 0 among the keys: an int or a traced
        int32 scalar. 0 for training (S == T); the number of filled slots when decoding
        into a cache of S slots; None means S - T (queries are the last T keys).
        Ignored when not causal.
      q_segments, kv_segments: optional int [B, T] and [B, S] document ids of packed
        sequences (both or neither): query t attends key s only where they are equal.
      mask: optional bool [B or 1, 1 or N, T, S], True = attend; combined with the rest.
      scale: logit scale (a Python float), default 1 / sqrt(H).
      block_size: block length along T and S for "chunked" and "splash".
      sinks: optional float [N], one sink logit per query head (added to every softmax
        denominator, no value); None = none. Differentiable.
      window: optional sliding window W, a positive Python int, with `causal`: query t
        attends keys t + q_offset - W < s <= t + q_offset (the W latest, itself
        included: HF's `sliding_window`); None = no window. A window that reaches past
        key 0 for every query is allowed (it changes nothing). "chunked" skips the key
        blocks wholly outside it (O(T * W) work).
      chunk: optional chunk C, a positive Python int, with `causal`: query t attends keys
        s <= t + q_offset in its own chunk, s // C == (t + q_offset) // C (chunks start at
        key 0; Llama 4's local layers); None = none. "chunked" skips the key blocks of
        other chunks (O(T * C) work); "dot_product" folds it into its dense mask; "splash"
        uses its lazy chunked mask where the queries start at key 0 and are whole blocks.

    Returns:
      float32 [B, T, N, H]; rows with no allowed key are 0.
    """
    check_impl(impl)
    _check_inputs(q, k, v, q_segments, kv_segments, mask)
    window = _check_window(window, causal)
    chunk = _check_chunk(chunk, causal)
    sinks = _check_sinks(sinks, q.shape[2])
    t, s = q.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q_offset = _resolve_offset(causal, q_offset, t, s)
    if mask is not None:
        mask = jnp.asarray(mask, bool)
    kw = dict(q_offset=q_offset, q_segments=q_segments, kv_segments=kv_segments, mask=mask,
              sinks=sinks, window=window, chunk=chunk)  # fmt: skip
    if impl == "xla":
        return _softmax_mix(q, k, v, causal=causal, scale=scale, **kw)
    if impl == "dot_product":
        return _mix_dot_product(q, k, v, scale=scale, **kw)
    if impl == "chunked":
        return _mix_chunked(q, k, v, scale=scale, block_size=block_size, **kw)
    return _mix_splash(q, k, v, scale=scale, block_size=block_size, **kw)
