"""The reference kernel (`impl="xla"`): scores [B, K, T, G, S] in float32, O(T * S) memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rope_jax.nn.kernels.common import _and, _causal_keep, _group_mask, _segment_keep
from rope_jax.nn.kernels.terms import Terms


def _softmax_mix(q, k, v, terms: Terms, *, scale: float) -> jax.Array:
    """sum_s softmax_s(q . k_s * scale + b) v_s for GQA heads; float32 [B, T, N, H].

    Scores are laid out [B, K, T, G, S], the order a dot of q [B, T, K, G, H] with
    k [B, S, K, H] produces, and the probabilities' dot with v returns [B, T, K, G, H]
    = [B, T, N, H] directly: no transpose of the [.., T, S] arrays forward or backward.
    The logit bias (if any) is computed over the whole [T, S] once and added before the
    mask. Rows with no allowed key are set to 0 (their softmax would be uniform otherwise).
    A sink z_n [N] joins each row's denominator: probabilities exp(x - m) / (sum_s
    exp(x_s - m) + exp(z - m)) with m the larger of the row's max and z (as HF's eager
    gpt-oss attention, without concatenating a column to the [.., S] scores).
    """
    (b, t, n, h), s, kh = q.shape, k.shape[1], k.shape[2]
    qg = q.reshape(b, t, kh, n // kh, h)  # [B, T, K, G, H]: head n = k * G + g
    logits = jnp.einsum("BTKGH,BSKH->BKTGS", qg, k, preferred_element_type=jnp.float32)
    logits = logits * scale  # [B, K, T, G, S]
    if terms.bias is not None:
        bias = terms.bias.at(jnp.arange(t, dtype=jnp.int32), jnp.arange(s, dtype=jnp.int32))
        logits = logits + _group_mask(bias, kh)
    keep = _mask(terms, t, s, kh)
    if terms.stick_breaking:
        return _stick_breaking_mix(logits, keep, v, terms, (b, t, n, h))
    if keep is not None:
        logits = jnp.where(keep, logits, jnp.finfo(jnp.float32).min)
    if terms.sinks is None:
        probs = jax.nn.softmax(logits, axis=-1)
    else:
        z = terms.sinks.astype(jnp.float32).reshape(1, kh, 1, n // kh, 1)  # [1, K, 1, G, 1]
        probs = _softmax_with_sink(logits, z)
    o = jnp.einsum(
        "BKTGS,BSKH->BTKGH", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
    )  # float32 until the caller's cast
    if keep is not None:
        has_key = keep.any(-1).transpose(0, 2, 1, 3)  # [B|1, T, K|1, G|1]: small, not T x S
        o = jnp.where(has_key[..., None], o, 0.0)
    return o.reshape(b, t, n, h)


def _stick_breaking_mix(z, keep, v, terms: Terms, shape) -> jax.Array:
    """Stick-breaking weights of the scaled logits z [B, K, T, G, S] in log space:
    log w_ts = log sigmoid(z_ts) + sum_{s < l} log sigmoid(-z_tl) over the allowed keys
    before the query's own slot (fla-core's naive reference, attend_current=False)."""
    b, t, n, h = shape
    s = z.shape[-1]
    own = terms.q_offset if terms.q_offset is not None else s - t
    rows = jnp.arange(t)[:, None] + own  # the query's own slot
    before = (jnp.arange(s)[None, :] < rows)[None, None, :, None, :]  # [1, 1, T, 1, S]
    allowed = before if keep is None else before & keep
    log_rest = jnp.where(allowed, jax.nn.log_sigmoid(-z), 0.0)
    later = jnp.flip(jnp.cumsum(jnp.flip(log_rest, -1), -1), -1) - log_rest  # sum over l > s
    weights = jnp.where(allowed, jnp.exp(jax.nn.log_sigmoid(z) + later), 0.0)
    o = jnp.einsum("BKTGS,BSKH->BTKGH", weights.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)  # fmt: skip
    return o.reshape(b, t, n, h)


@jax.custom_jvp
def _softmax_with_sink(x, z):
    """softmax over the last axis of x [.., S] with one more logit z [.., 1] in the
    denominator, whose probability is dropped: p = exp(x - L), L = log(sum exp(x) + exp(z)).

    Differentiated as `jax.nn.softmax` is, through its tangent: dp = p (dx - dL) with
    dL = sum p dx + p_sink dz, p_sink = exp(z - L); its transpose is softmax's backward
    on the keys' columns (the sink's column has no cotangent) and dz = -p_sink sum p dp.
    (Differentiating the division itself costs about 1.3x the step, measured.)
    """
    return _sink_probs(x, z)[0]


def _sink_probs(x, z):
    """(p [.., S], p_sink [.., 1])."""
    m = jnp.maximum(x.max(-1, keepdims=True), z)
    e, e_sink = jnp.exp(x - m), jnp.exp(z - m)
    total = e.sum(-1, keepdims=True) + e_sink
    return e / total, e_sink / total


@_softmax_with_sink.defjvp
def _softmax_with_sink_jvp(primals, tangents):
    (x, z), (dx, dz) = primals, tangents
    p, p_sink = _sink_probs(x, z)
    dl = jnp.sum(p * dx, axis=-1, keepdims=True) + p_sink * dz
    return p, p * (dx - dl)


def _mask(terms: Terms, t: int, s: int, kv_heads: int):
    """Combined bool keep-mask broadcastable to the scores [B, K, T, G, S] (5-D), or None.

    The dense mask is [B or 1, 1 or N, T, S] with head n = k * G + g. With causality,
    query t attends key s iff s <= t + q_offset, with a window W also
    s > t + q_offset - W, with a chunk C also s // C == (t + q_offset) // C; with segment
    ids only within a document.
    """
    keep = None
    if terms.causal:
        keep = _causal_keep(jnp.arange(t), jnp.arange(s), terms.q_offset, terms.window,
                            terms.chunk)  # fmt: skip
        keep = keep[None, None, :, None, :]
    if terms.q_segments is not None:
        segments = _segment_keep(terms.q_segments, terms.kv_segments)
        keep = _and(keep, segments[:, None, :, None, :])
    if terms.mask is not None:
        keep = _and(keep, _group_mask(terms.mask, kv_heads))
    return keep
