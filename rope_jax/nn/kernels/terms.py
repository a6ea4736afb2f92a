"""What masks or biases the attention logits, as one value handed to a kernel whole.

`Terms` holds every term of

  o_t = sum_s softmax_s(scale * q_t . k_s + b(t, s, n) | keep(t, s)) v_s

besides q, k, v and the scale: the keep-mask's parts (causality with the query offset,
a sliding window, a chunk, packed-document segment ids, a dense mask), the sink logits
and a logit bias b. Callers build one (`Terms(...)` or `Terms.of(terms, **fields)`), the
attention layer passes it unchanged, and each kernel reads the fields it computes; a
kernel registers which terms those are (`kernels.KERNELS`), so a term a kernel cannot
compute is refused, or sent to its fallback, in one place.

A logit bias (`Bias`) is a function of the query row t, the key slot s and the head n:
`fn(params, inputs, q_idx, k_idx)` gets int32 index vectors [t'] and [s'] (the rows and
slots of the block a kernel is computing: the whole [T, S] in "xla", one block at a time
in "chunked") and returns float32 broadcastable to [B, N, t', s']; `params` is a pytree
of float arrays the bias is differentiated in (learned slopes, an MLP, per-token gates),
`inputs` a pytree it is not (positions, ids). A bias that needs positions reads them
from `inputs` at q_idx / k_idx. ALiBi, FIRE and the forgetting gates are such functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from rope_jax.nn.kernels.common import (
    _check_chunk,
    _check_inputs,
    _check_sinks,
    _check_window,
    _resolve_offset,
)


@dataclasses.dataclass(frozen=True)
class Bias:
    """A logit bias b(t, s, n): `fn(params, inputs, q_idx, k_idx)` -> float32
    broadcastable to [B, N, len(q_idx), len(k_idx)] (module docstring). `fn` should be a
    module-level function: a new closure is a new kernel to compile."""

    fn: Callable[[Any, Any, Any, Any], Any]
    params: Any = ()  # float pytree: differentiated
    inputs: Any = ()  # any pytree: not differentiated

    def at(self, q_idx, k_idx, params=None):
        """The bias of rows q_idx [t'] and slots k_idx [s'], as float32 4-D
        [B or 1, N or 1, t', s'] (`params` replaces the stored ones, for a vjp)."""
        params = self.params if params is None else params
        b = jnp.asarray(self.fn(params, self.inputs, q_idx, k_idx), jnp.float32)
        if b.ndim > 4:
            raise ValueError(f"a logit bias has shape {b.shape}: expected at most [B, N, T, S]")
        return b.reshape((1,) * (4 - b.ndim) + b.shape)


@dataclasses.dataclass(frozen=True)
class Terms:
    """Every mask and logit term of one attention call (see the module docstring).

    causal      query t attends key s iff s <= t + q_offset.
    q_offset    with causal: query 0's slot among the keys, an int or a traced int32
                scalar; None = S - T (the queries are the last T keys).
    q_segments, kv_segments  int [B, T] and [B, S] document ids (both or neither):
                attend only within a document.
    mask        bool [B or 1, 1 or N, T, S], True = attend.
    window      W with causal: also s > t + q_offset - W (HF's sliding_window).
    chunk       C with causal: also s // C == (t + q_offset) // C (Llama 4's chunks).
    sinks       float [N]: one logit per query head in every denominator, no value.
    bias        a `Bias` added to the scaled logits.
    stick_breaking  weights by stick-breaking instead of softmax (Tan et al. 2024): key s
                gets sigmoid(z_ts) prod_{s < l < t'} (1 - sigmoid(z_tl)), t' = t +
                q_offset, over the allowed keys before the query's own slot (the
                nearest breaks the stick first; a row's weights sum to at most 1).
    """

    causal: bool = False
    q_offset: Any = None
    q_segments: Any = None
    kv_segments: Any = None
    mask: Any = None
    window: int | None = None
    chunk: int | None = None
    sinks: Any = None
    bias: Bias | None = None
    stick_breaking: bool = False

    @classmethod
    def of(cls, terms: Terms | None = None, **fields) -> Terms:
        """`terms` (None = none) with `fields` replacing its fields; an unknown name is
        one ValueError line."""
        unknown = sorted(set(fields) - set(FIELDS))
        if unknown:
            raise ValueError(
                f"{unknown[0]} is not an attention term; the terms: {', '.join(FIELDS)}"
            )
        terms = cls() if terms is None else terms
        return dataclasses.replace(terms, **fields) if fields else terms

    def uses(self) -> frozenset[str]:
        """The terms set here, by the names kernels register (`TERM_NAMES`)."""
        used = {
            "causal": self.causal,
            "segments": self.q_segments is not None,
            "mask": self.mask is not None,
            "window": self.window is not None,
            "chunk": self.chunk is not None,
            "sinks": self.sinks is not None,
            "bias": self.bias is not None,
            "stick_breaking": bool(self.stick_breaking),
        }
        return frozenset(name for name, on in used.items() if on)

    def checked(self, q, k, v) -> Terms:
        """These terms checked against q [B, T, N, H], k, v [B, S, K, H] and made ready
        for a kernel: q_offset resolved (None when not causal), the mask bool, the sinks
        float32 [N]. ValueError (one line) for what does not fit."""
        _check_inputs(q, k, v, self.q_segments, self.kv_segments, self.mask)
        t, s = q.shape[1], k.shape[1]
        if self.bias is not None and not isinstance(self.bias, Bias):
            raise ValueError(f"bias={self.bias!r} must be a kernels.Bias")
        return dataclasses.replace(
            self,
            causal=bool(self.causal),
            q_offset=_resolve_offset(self.causal, self.q_offset, t, s),
            mask=None if self.mask is None else jnp.asarray(self.mask, bool),
            window=_check_window(self.window, self.causal),
            chunk=_check_chunk(self.chunk, self.causal),
            sinks=_check_sinks(self.sinks, q.shape[2]),
        )


FIELDS = tuple(f.name for f in dataclasses.fields(Terms))
TERM_NAMES = ("causal", "segments", "mask", "window", "chunk", "sinks", "bias", "stick_breaking")
