"""What the kernels share: argument checks, the causal / segment / dense keep-masks, the
scores' per-head layout, padding."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def _check_inputs(q, k, v, q_segments, kv_segments, mask) -> None:
    (b, t, n, h), (s, kh) = q.shape, k.shape[1:3]
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape or k.shape[0] != b or k.shape[3] != h:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape} do not fit [B,T,N,H] [B,S,K,H]")
    if n % kh:
        raise ValueError(f"num_heads={n} is not divisible by num_kv_heads={kh}")
    if (q_segments is None) != (kv_segments is None):
        raise ValueError("q_segments and kv_segments go together: pass both or neither")
    if q_segments is not None and (
        jnp.shape(q_segments) != (b, t) or jnp.shape(kv_segments) != (b, s)
    ):
        raise ValueError(
            f"q_segments {jnp.shape(q_segments)} and kv_segments {jnp.shape(kv_segments)} "
            f"must be [B, T] = {(b, t)} and [B, S] = {(b, s)}"
        )
    if mask is not None:
        shape = jnp.shape(mask)
        if len(shape) != 4 or shape[0] not in (1, b) or shape[1] not in (1, n):
            raise ValueError(f"mask has shape {shape}: expected [B or 1, 1 or N, T, S]")
        if shape[2:] != (t, s):
            raise ValueError(f"mask has shape {shape}: its last two axes must be T, S = {t, s}")


def _check_window(window, causal: bool) -> int | None:
    """None, or a positive Python int W that comes with causal=True."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int | np.integer) or window < 1:
        raise ValueError(f"window={window!r} must be a positive int (keys t - W < s <= t) or None")
    if not causal:
        raise ValueError(f"window={window} needs causal=True (a sliding window looks back only)")
    return int(window)


def _check_chunk(chunk, causal: bool) -> int | None:
    """None, or a positive Python int C that comes with causal=True."""
    if chunk is None:
        return None
    if isinstance(chunk, bool) or not isinstance(chunk, int | np.integer) or chunk < 1:
        raise ValueError(f"chunk={chunk!r} must be a positive int (keys s <= t with "
                         "s // C == t // C) or None")  # fmt: skip
    if not causal:
        raise ValueError(f"chunk={chunk} needs causal=True (a chunk looks back only)")
    return int(chunk)


def _check_sinks(sinks, num_heads: int):
    """None, or float32 [N]: one sink logit per query head."""
    if sinks is None:
        return None
    sinks = jnp.asarray(sinks)
    if sinks.shape != (num_heads,) or not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise ValueError(
            f"sinks must be a float array [N] = ({num_heads},) (one logit per query head), "
            f"got {sinks.dtype} {sinks.shape}"
        )
    return sinks.astype(jnp.float32)


def _resolve_offset(causal: bool, q_offset, t: int, s: int):
    """None when not causal; else a Python int (static) or an int32 scalar array (traced)."""
    if not causal:
        return None
    if q_offset is None:
        return s - t  # queries are the last T of the S keys
    if isinstance(q_offset, int | np.integer):
        return int(q_offset)
    q_offset = jnp.asarray(q_offset)
    if q_offset.shape != () or not jnp.issubdtype(q_offset.dtype, jnp.integer):
        raise ValueError(f"q_offset must be an int or an int scalar, got {q_offset}")
    return q_offset.astype(jnp.int32)


def _is_static(q_offset) -> bool:
    return isinstance(q_offset, int)


def _causal_keep(t_idx, s_idx, q_offset, window: int | None = None, chunk: int | None = None):
    """[T, S] bool: query t attends key s iff s <= t + q_offset (and, with a window W,
    s > t + q_offset - W; with a chunk C, s // C == (t + q_offset) // C)."""
    at = t_idx[:, None] + q_offset  # the query's own key index
    keep = s_idx[None, :] <= at
    if window is not None:
        keep &= s_idx[None, :] > at - window
    if chunk is not None:
        keep &= s_idx[None, :] // chunk == at // chunk
    return keep


def _segment_keep(q_segments, kv_segments):
    """[B, T, S] bool: same document."""
    return q_segments[:, :, None] == kv_segments[:, None, :]


def _group_mask(mask, kv_heads: int):
    """A per-head array (a dense mask, a logit bias) [B or 1, 1 or N, T, S] -> the scores'
    layout [B or 1, 1 or K, T, 1 or G, S] (head n = k G + g)."""
    mb, mn = mask.shape[:2]
    if mn == 1:
        return mask[:, :, :, None, :]  # [B or 1, 1, T, 1, S]
    mask = mask.reshape(mb, kv_heads, mn // kv_heads, *mask.shape[2:])
    return mask.transpose(0, 1, 3, 2, 4)  # [B or 1, K, T, G, S]


def _and(a, b):
    return b if a is None else a & b


def _dense_keep(
    t: int, s: int, *, q_offset, q_segments, kv_segments, mask, window=None, chunk=None
):
    """Combined keep-mask [B or 1, 1 or N, T, S] (the BNTS layout of jax.nn), or None."""
    keep = None if mask is None else mask
    if q_offset is not None:
        causal = _causal_keep(jnp.arange(t), jnp.arange(s), q_offset, window, chunk)
        keep = _and(keep, causal[None, None])
    if q_segments is not None:
        keep = _and(keep, _segment_keep(q_segments, kv_segments)[:, None])
    return keep


def _rows_with_keys(keep):
    """keep [B or 1, 1 or N, T, S] -> [B or 1, T, 1 or N, 1]: does each query row see a key?"""
    return keep.any(-1).transpose(0, 2, 1)[..., None]


def _pad_axis(x, length: int, axis: int, value=0):
    if x.shape[axis] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _unbroadcast(x, shape):
    """x summed over the axes where `shape` is 1 (and x is not): the cotangent of an array
    of `shape` that was broadcast to x's shape."""
    pairs = enumerate(zip(x.shape, shape, strict=True))
    axes = tuple(i for i, (a, b) in pairs if b == 1 and a != 1)
    return x.sum(axes, keepdims=True) if axes else x
