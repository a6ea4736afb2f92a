"""The reference kernel (`impl="xla"`): scores [B, K, T, G, S] in float32, O(T * S) memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rope_jax.nn.kernels.common import _and, _causal_keep, _group_mask, _segment_keep


def _softmax_mix(
    q,
    k,
    v,
    *,
    mask,
    causal: bool,
    scale: float | None,
    q_offset=None,
    q_segments=None,
    kv_segments=None,
) -> jax.Array:
    """sum_s softmax_s(q . k_s * scale) v_s for GQA heads; float32 [B, T, N, H].

    Scores are laid out [B, K, T, G, S], the order a dot of q [B, T, K, G, H] with
    k [B, S, K, H] produces, and the probabilities' dot with v returns [B, T, K, G, H]
    = [B, T, N, H] directly: no transpose of the [.., T, S] arrays forward or backward.
    Rows with no allowed key are set to 0 (their softmax would be uniform otherwise).
    """
    (b, t, n, h), s, kh = q.shape, k.shape[1], k.shape[2]
    scale = h**-0.5 if scale is None else scale
    qg = q.reshape(b, t, kh, n // kh, h)  # [B, T, K, G, H]: head n = k * G + g
    logits = jnp.einsum("BTKGH,BSKH->BKTGS", qg, k, preferred_element_type=jnp.float32)
    logits = logits * scale  # [B, K, T, G, S]
    keep = _mask(
        mask, causal, t, s, kh, q_offset=q_offset, q_segments=q_segments, kv_segments=kv_segments
    )
    if keep is not None:
        logits = jnp.where(keep, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    o = jnp.einsum(
        "BKTGS,BSKH->BTKGH", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
    )  # float32 until the caller's cast
    if keep is not None:
        has_key = keep.any(-1).transpose(0, 2, 1, 3)  # [B|1, T, K|1, G|1]: small, not T x S
        o = jnp.where(has_key[..., None], o, 0.0)
    return o.reshape(b, t, n, h)


def _mask(
    mask,
    causal: bool,
    t: int,
    s: int,
    kv_heads: int,
    *,
    q_offset=None,
    q_segments=None,
    kv_segments=None,
):
    """Combined bool keep-mask broadcastable to the scores [B, K, T, G, S] (5-D), or None.

    `mask` is [B or 1, 1 or N, T, S] with head n = k * G + g. With `causal`, query t
    attends key s iff s <= t + q_offset (q_offset None: S - T, the queries are the last T
    keys). `q_segments` [B, T] and `kv_segments` [B, S]: attend only within a document.
    """
    keep = None
    if causal:
        offset = s - t if q_offset is None else q_offset
        keep = _causal_keep(jnp.arange(t), jnp.arange(s), offset)[None, None, :, None, :]
    if q_segments is not None:
        keep = _and(keep, _segment_keep(q_segments, kv_segments)[:, None, :, None, :])
    if mask is not None:
        mask = jnp.asarray(mask, bool)
        if mask.ndim != 4:
            raise ValueError(f"mask has shape {mask.shape}: expected [B or 1, 1 or N, T, S]")
        keep = _and(keep, _group_mask(mask, kv_heads))
    return keep
