"""The softmax-attention mixing step, with interchangeable implementations.

Rotations happen outside: callers rotate q, k (and v) before `mix` and the output after,
so a kernel here is plain grouped-query softmax attention,

  o_t = sum_s softmax_s(scale * q_t . k_s | keep(t, s)) v_s,

where keep(t, s) combines causality (s <= t + q_offset), packed-document segment ids and
an optional dense mask. A query row with no key to attend gives o_t = 0 (never NaN), in
every implementation.

Implementations (`impl`):
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

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

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

    Returns:
      float32 [B, T, N, H]; rows with no allowed key are 0.
    """
    check_impl(impl)
    _check_inputs(q, k, v, q_segments, kv_segments, mask)
    t, s = q.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q_offset = _resolve_offset(causal, q_offset, t, s)
    if mask is not None:
        mask = jnp.asarray(mask, bool)
    kw = dict(q_offset=q_offset, q_segments=q_segments, kv_segments=kv_segments, mask=mask)
    if impl == "xla":
        return _softmax_mix(q, k, v, causal=causal, scale=scale, **kw)
    if impl == "dot_product":
        return _mix_dot_product(q, k, v, scale=scale, **kw)
    if impl == "chunked":
        return _mix_chunked(q, k, v, scale=scale, block_size=block_size, **kw)
    return _mix_splash(q, k, v, scale=scale, block_size=block_size, **kw)


# ------------------------------------------------------------------ arguments


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


# ------------------------------------------------------------------ shared mask pieces


def _causal_keep(t_idx, s_idx, q_offset):
    """[T, S] bool: query t attends key s iff s <= t + q_offset."""
    return s_idx[None, :] <= t_idx[:, None] + q_offset


def _segment_keep(q_segments, kv_segments):
    """[B, T, S] bool: same document."""
    return q_segments[:, :, None] == kv_segments[:, None, :]


def _group_mask(mask, kv_heads: int):
    """Dense mask [B or 1, 1 or N, T, S] -> [B or 1, 1 or K, T, 1 or G, S] (head n = k G + g)."""
    mb, mn = mask.shape[:2]
    if mn == 1:
        return mask[:, :, :, None, :]  # [B or 1, 1, T, 1, S]
    mask = mask.reshape(mb, kv_heads, mn // kv_heads, *mask.shape[2:])
    return mask.transpose(0, 1, 3, 2, 4)  # [B or 1, K, T, G, S]


def _and(a, b):
    return b if a is None else a & b


def _dense_keep(t: int, s: int, *, q_offset, q_segments, kv_segments, mask):
    """Combined keep-mask [B or 1, 1 or N, T, S] (the BNTS layout of jax.nn), or None."""
    keep = None if mask is None else mask
    if q_offset is not None:
        keep = _and(keep, _causal_keep(jnp.arange(t), jnp.arange(s), q_offset)[None, None])
    if q_segments is not None:
        keep = _and(keep, _segment_keep(q_segments, kv_segments)[:, None])
    return keep


def _rows_with_keys(keep):
    """keep [B or 1, 1 or N, T, S] -> [B or 1, T, 1 or N, 1]: does each query row see a key?"""
    return keep.any(-1).transpose(0, 2, 1)[..., None]


# ------------------------------------------------------------------ xla (reference)


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


# ------------------------------------------------------------------ dot_product


def _mix_dot_product(q, k, v, *, q_offset, q_segments, kv_segments, mask, scale) -> jax.Array:
    """`jax.nn.dot_product_attention`, with masks expressed the cheapest way it accepts.

    - causal with a static q_offset == 0: `is_causal=True` (cuDNN skips masked blocks).
    - causal with T == 1 (decoding one token), any q_offset, static or traced: the key
      range s <= q_offset is `key_value_seq_lengths = q_offset + 1`, no dense mask.
    - segment ids (not in the public API), a traced or nonzero q_offset with T > 1, or a
      user `mask`: the slow path. Everything is folded into one dense bool mask
      [B or 1, 1 or N, T, S] passed as `mask` (O(T * S) bytes; cuDNN adds it as a bias
      and cannot skip masked blocks). It stays on the same backend, so results agree with
      the other impls on every input; use "chunked" (or "splash" on TPU) to avoid the
      T x S mask for long packed sequences.

    Backend: jax 0.10's `implementation=None` always means XLA, so it is chosen here:
    "cudnn" on a CUDA GPU (compute capability >= 8) for fp16/bf16 inputs whose head dim
    cuDNN takes (a multiple of 8, <= 128, or <= 256 from Hopper) and, with a dense mask,
    even T and S (cuDNN's backward with a bias needs them); "xla" otherwise. Float32
    inputs therefore run jax's XLA attention (cuDNN flash attention takes only fp16/bf16;
    inputs are not downcast): correct, with float32 scores materialized like "xla".
    Rows with no allowed key are set to 0 here (jax would average all values).
    """
    (b, t, _, h), s = q.shape, k.shape[1]
    dtype = jnp.result_type(q, k, v)  # jax.nn wants one dtype for q, k, v
    q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    is_causal = q_offset is not None and _is_static(q_offset) and q_offset == 0
    dense_offset = q_offset if (q_offset is not None and not is_causal) else None
    kv_lengths = None
    if dense_offset is not None and t == 1 and mask is None and q_segments is None:
        kv_lengths = jnp.clip(jnp.asarray(q_offset, jnp.int32) + 1, 1, s)  # >= 1: no NaN
        kv_lengths = jnp.broadcast_to(kv_lengths, (b,)).astype(jnp.int32)
        has_key = jnp.asarray(q_offset >= 0)  # q_offset < 0: no key; the row is zeroed
        dense_offset = None
    else:
        has_key = None
    segs = dict(q_segments=q_segments, kv_segments=kv_segments, mask=mask)
    keep = _dense_keep(t, s, q_offset=dense_offset, **segs)
    if keep is not None:  # rows may be empty: check them against every condition
        has_key = _rows_with_keys(_dense_keep(t, s, q_offset=q_offset, **segs))
    implementation = _dot_product_backend(dtype, h, t, s, dense_mask=keep is not None)
    o = jax.nn.dot_product_attention(
        q,
        k,
        v,
        mask=keep,
        scale=scale,
        is_causal=is_causal,
        key_value_seq_lengths=kv_lengths,
        implementation=implementation,
    ).astype(jnp.float32)
    return o if has_key is None else jnp.where(has_key, o, 0.0)


def _dot_product_backend(dtype, head_dim: int, t: int, s: int, *, dense_mask: bool) -> str:
    """Returns "cudnn" where jax's cuDNN flash attention takes these inputs, else "xla"."""
    if jax.default_backend() != "gpu" or dtype not in (jnp.bfloat16, jnp.float16):
        return "xla"
    try:  # "8.0", "9.0", ...; ROCm devices have no CUDA compute capability
        major = int(str(jax.devices()[0].compute_capability).split(".")[0])
    except (AttributeError, ValueError):
        return "xla"
    if major < 8 or head_dim % 8 or head_dim > (256 if major >= 9 else 128):
        return "xla"
    if dense_mask and (t % 2 or s % 2):
        return "xla"
    return "cudnn"


# ------------------------------------------------------------------ chunked (flash)
#
# Forward, for one block of queries, over key blocks j = 0, 1, ... (FlashAttention):
#   x_j = scale * q k_j^T (masked entries -inf), m_j = max(m_{j-1}, rowmax x_j),
#   p_j = exp(x_j - m_j), l_j = exp(m_{j-1} - m_j) l_{j-1} + rowsum p_j,
#   a_j = exp(m_{j-1} - m_j) a_{j-1} + p_j v_j.
# Rescaling by exp(m_{j-1} - m_j) keeps every exponent <= 0, so nothing overflows, and
# after the last block o = a / l = softmax(x) v exactly. Only m, l (per row) and a
# (per row, H wide) persist between blocks: memory O(block_q * (block_k + H)) per step.
# The residuals for the backward are q, k, v, o and logsumexp L = m + log l (per row).
#
# Backward, with dO the output cotangent and D_t = sum_h dO_th o_th (per row):
#   P = exp(x - L) (recomputed per block, exactly the forward's probabilities),
#   dV = P^T dO, dP = dO V^T, dX = P * (dP - D), dQ = scale dX K, dK = scale dX^T Q.
# The outer loop runs over key blocks carrying dQ [T, H] (added into per query block);
# the inner loop runs over query blocks accumulating that key block's dK, dV.
# Causal loops skip blocks that are entirely in the future.


class _Config(NamedTuple):
    """Static layout of the chunked kernel (hashable: a nondiff argument of custom_vjp)."""

    block_q: int
    block_k: int
    num_q_blocks: int
    num_k_blocks: int
    kv_len: int  # valid keys S; keys at S..S_padded-1 are padding
    scale: float


class _Masks(NamedTuple):
    """Mask inputs of the chunked kernel (arrays or None), padded to whole blocks."""

    q_offset: jax.Array | None  # int32 scalar; None = not causal
    q_segments: jax.Array | None  # [B, T_padded]
    kv_segments: jax.Array | None  # [B, S_padded]
    mask: jax.Array | None  # [B or 1, 1 or K, T_padded, 1 or G, S_padded]


def _mix_chunked(
    q, k, v, *, q_offset, q_segments, kv_segments, mask, scale, block_size: int
) -> jax.Array:
    """Blockwise online-softmax attention; pads T and S to whole blocks internally."""
    (b, t, n, h), (s, kh) = q.shape, k.shape[1:3]
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be positive")
    bq, bk = min(block_size, t), min(block_size, s)
    tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
    cfg = _Config(bq, bk, tp // bq, sp // bk, s, float(scale))
    pad = lambda x, length, axis, value=0: _pad_axis(x, length, axis, value)
    masks = _Masks(
        None if q_offset is None else jnp.asarray(q_offset, jnp.int32),
        None if q_segments is None else pad(jnp.asarray(q_segments), tp, 1),
        None if kv_segments is None else pad(jnp.asarray(kv_segments), sp, 1),
        None if mask is None else pad(pad(_group_mask(mask, kh), tp, 2, False), sp, 4, False),
    )
    qg = pad(q.reshape(b, t, kh, n // kh, h), tp, 1)  # [B, T_padded, K, G, H]
    o = _flash(cfg, qg, pad(k, sp, 1), pad(v, sp, 1), masks)  # [B, T_padded, K, G, H]
    return o[:, :t].reshape(b, t, n, h)


def _pad_axis(x, length: int, axis: int, value=0):
    if x.shape[axis] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg: _Config, q, k, v, masks: _Masks):
    """q [B, Tp, K, G, H], k, v [B, Sp, K, H] -> float32 [B, Tp, K, G, H]."""
    return _flash_forward(cfg, q, k, v, masks)[0]


def _flash_fwd(cfg: _Config, q, k, v, masks: _Masks):
    o, lse = _flash_forward(cfg, q, k, v, masks)
    return o, (q, k, v, masks, o, lse)  # no per-block probabilities are kept


def _flash_bwd(cfg: _Config, residuals, do):
    q, k, v, masks, o, lse = residuals
    dq, dk, dv = _flash_backward(cfg, q, k, v, masks, o, lse, do)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None  # masks: none


_flash.defvjp(_flash_fwd, _flash_bwd)


def _block_scores(cfg: _Config, qi, kj):
    """q block [B, bq, K, G, H] . k block [B, bk, K, H] -> float32 [B, K, bq, G, bk]."""
    x = jnp.einsum("BTKGH,BSKH->BKTGS", qi, kj, preferred_element_type=jnp.float32)
    return x * cfg.scale


def _block_keep(cfg: _Config, masks: _Masks, t0, s0):
    """Keep-mask of the block at query t0, key s0, broadcastable to [B, K, bq, G, bk]."""
    t_idx, s_idx = t0 + jnp.arange(cfg.block_q), s0 + jnp.arange(cfg.block_k)
    keep = None
    if cfg.num_k_blocks * cfg.block_k != cfg.kv_len:  # padded keys
        keep = (s_idx < cfg.kv_len)[None, None, None, None, :]
    if masks.q_offset is not None:
        keep = _and(keep, _causal_keep(t_idx, s_idx, masks.q_offset)[None, None, :, None, :])
    if masks.q_segments is not None:
        qs = lax.dynamic_slice_in_dim(masks.q_segments, t0, cfg.block_q, axis=1)
        ks = lax.dynamic_slice_in_dim(masks.kv_segments, s0, cfg.block_k, axis=1)
        keep = _and(keep, _segment_keep(qs, ks)[:, None, :, None, :])
    if masks.mask is not None:
        m = lax.dynamic_slice_in_dim(masks.mask, t0, cfg.block_q, axis=2)
        keep = _and(keep, lax.dynamic_slice_in_dim(m, s0, cfg.block_k, axis=4))
    return keep


def _k_block_range(cfg: _Config, q_offset, t0):
    """Key blocks [lo, hi) that the query block at t0 can see (causal: not the future)."""
    if q_offset is None:
        return 0, cfg.num_k_blocks
    last_key = t0 + cfg.block_q - 1 + q_offset  # the last query row's last key
    return 0, jnp.clip(last_key // cfg.block_k + 1, 0, cfg.num_k_blocks)


def _q_block_range(cfg: _Config, q_offset, s0):
    """Query blocks [lo, hi) that can see the key block at s0 (causal: t >= s0 - q_offset)."""
    if q_offset is None:
        return 0, cfg.num_q_blocks
    return jnp.clip((s0 - q_offset) // cfg.block_q, 0, cfg.num_q_blocks), cfg.num_q_blocks


def _flash_forward(cfg: _Config, q, k, v, masks: _Masks):
    """Online softmax over key blocks for each query block.

    Returns o float32 [B, Tp, K, G, H] and logsumexp float32 [B, K, Tp, G] (+inf on rows
    with no allowed key, whose o is 0).
    """
    b, _, kh, g, h = q.shape
    bq, bk = cfg.block_q, cfg.block_k

    def q_block(i):
        t0 = i * bq
        qi = lax.dynamic_slice_in_dim(q, t0, bq, axis=1)

        def k_step(j, carry):
            m, l, acc = carry  # [B, K, bq, G], [B, K, bq, G], [B, K, bq, G, H]
            s0 = j * bk
            kj = lax.dynamic_slice_in_dim(k, s0, bk, axis=1)
            vj = lax.dynamic_slice_in_dim(v, s0, bk, axis=1)
            x = _block_scores(cfg, qi, kj)
            keep = _block_keep(cfg, masks, t0, s0)
            if keep is not None:
                x = jnp.where(keep, x, -jnp.inf)
            m_new = jnp.maximum(m, x.max(-1))
            m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # nothing seen yet: any
            p = jnp.exp(x - m_safe[..., None])  # masked: exp(-inf) = 0
            alpha = jnp.exp(m - m_safe)  # rescales the old sums to the new max
            pv = jnp.einsum(
                "BKTGS,BSKH->BKTGH", p.astype(v.dtype), vj, preferred_element_type=jnp.float32
            )
            return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv

        stats = jnp.zeros((b, kh, bq, g), jnp.float32)
        init = (jnp.full_like(stats, -jnp.inf), stats, jnp.zeros((b, kh, bq, g, h), jnp.float32))
        m, l, acc = lax.fori_loop(*_k_block_range(cfg, masks.q_offset, t0), k_step, init)
        seen = l > 0
        o = acc / jnp.where(seen, l, 1.0)[..., None]  # no key seen: acc = 0, o = 0
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
        return o, lse

    o, lse = lax.map(q_block, jnp.arange(cfg.num_q_blocks))  # [nq, B, K, bq, G, (H)]
    tp = cfg.num_q_blocks * bq
    o = o.transpose(1, 0, 3, 2, 4, 5).reshape(b, tp, kh, g, h)  # [B, Tp, K, G, H]
    lse = lse.transpose(1, 2, 0, 3, 4).reshape(b, kh, tp, g)  # [B, K, Tp, G]
    return o, lse


def _flash_backward(cfg: _Config, q, k, v, masks: _Masks, o, lse, do):
    """dq, dk, dv (float32) by recomputing each block's probabilities from logsumexp."""
    b, tp, kh, g, h = q.shape
    bq, bk = cfg.block_q, cfg.block_k
    do = do.astype(jnp.float32)
    delta = jnp.einsum("BTKGH,BTKGH->BKTG", do, o)  # D = rowsum(dO * o), [B, K, Tp, G]

    def k_block(dq, j):
        s0 = j * bk
        kj = lax.dynamic_slice_in_dim(k, s0, bk, axis=1)
        vj = lax.dynamic_slice_in_dim(v, s0, bk, axis=1)

        def q_step(i, carry):
            dq, dk, dv = carry
            t0 = i * bq
            qi = lax.dynamic_slice_in_dim(q, t0, bq, axis=1)
            doi = lax.dynamic_slice_in_dim(do, t0, bq, axis=1)
            lse_i = lax.dynamic_slice_in_dim(lse, t0, bq, axis=2)[..., None]
            delta_i = lax.dynamic_slice_in_dim(delta, t0, bq, axis=2)[..., None]
            p = jnp.exp(_block_scores(cfg, qi, kj) - lse_i)  # the forward's probabilities
            keep = _block_keep(cfg, masks, t0, s0)
            if keep is not None:
                p = jnp.where(keep, p, 0.0)
            dv = dv + jnp.einsum("BKTGS,BTKGH->BSKH", p, doi)
            dp = jnp.einsum("BTKGH,BSKH->BKTGS", doi, vj, preferred_element_type=jnp.float32)
            dx = p * (dp - delta_i)  # softmax backward, per row
            dk = dk + cfg.scale * jnp.einsum(
                "BKTGS,BTKGH->BSKH", dx, qi, preferred_element_type=jnp.float32
            )
            dqi = cfg.scale * jnp.einsum(
                "BKTGS,BSKH->BTKGH", dx, kj, preferred_element_type=jnp.float32
            )
            dqi = lax.dynamic_slice_in_dim(dq, t0, bq, axis=1) + dqi
            return lax.dynamic_update_slice_in_dim(dq, dqi, t0, axis=1), dk, dv

        zeros = jnp.zeros((b, bk, kh, h), jnp.float32)
        lo, hi = _q_block_range(cfg, masks.q_offset, s0)
        dq, dk, dv = lax.fori_loop(lo, hi, q_step, (dq, zeros, zeros))
        return dq, (dk, dv)

    dq0 = jnp.zeros((b, tp, kh, g, h), jnp.float32)
    dq, (dk, dv) = lax.scan(k_block, dq0, jnp.arange(cfg.num_k_blocks))
    sp = cfg.num_k_blocks * bk
    unblock = lambda x: x.transpose(1, 0, 2, 3, 4).reshape(b, sp, kh, h)  # [nk, B, bk, ..]
    return dq, unblock(dk), unblock(dv)


# ------------------------------------------------------------------ splash (TPU)


def _mix_splash(
    q, k, v, *, q_offset, q_segments, kv_segments, mask, scale, block_size: int
) -> jax.Array:
    """TPU Pallas splash attention (block-sparse flash attention).

    Causality with a static q_offset >= 0 is a lazy `CausalMask` (fully masked blocks are
    skipped); segment ids go to `SegmentIds`. A traced or negative q_offset, or a dense
    `mask` (which must then have batch 1: one kernel serves the whole batch), becomes a
    dynamic [N, T, S] mask. T and S are padded to whole blocks (block_size must be a
    multiple of 128); padded keys are masked with segment ids. Splash divides by zero on
    a row whose blocks are all skipped, so such rows of a dynamic mask attend everything
    and, like every row with no allowed key, are set to 0 afterwards.
    """
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    (b, t, n, _), s = q.shape, k.shape[1]
    if block_size % 128:
        raise ValueError(f"impl='splash' needs block_size a multiple of 128, got {block_size}")
    round_up = lambda x, m: -(-x // m) * m
    bq, bk = min(block_size, round_up(t, 128)), min(block_size, round_up(s, 128))
    tp, sp = round_up(t, bq), round_up(s, bk)
    dynamic = mask is not None or (q_offset is not None and not _is_static(q_offset))
    dynamic = dynamic or (q_offset is not None and q_offset < 0)
    if mask is not None and mask.shape[0] != 1:
        raise ValueError("impl='splash' takes a dense mask with batch 1; use impl='chunked'")

    has_key = None  # which rows have a key at all, where some may not: [B|1, T, 1|N, 1]
    if dynamic or q_segments is not None:
        segs = dict(q_segments=q_segments, kv_segments=kv_segments, mask=mask)
        has_key = _rows_with_keys(_dense_keep(t, s, q_offset=q_offset, **segs))
    heads_mask = _splash_heads_mask(splash, q_offset, mask, dynamic, n, (t, s), (tp, sp))
    segments = _splash_segments(q_segments, kv_segments, b, s, (tp, sp))
    kernel = _splash_kernel(splash, heads_mask, bq, bk, dynamic)

    dtype = jnp.result_type(q, k, v)
    heads_first = lambda x, length: _pad_axis(x.astype(dtype), length, 1).transpose(0, 2, 1, 3)
    qh = heads_first(q * scale, tp)  # splash does not scale the logits
    kh_, vh = heads_first(k, sp), heads_first(v, sp)  # [B, K, Sp, H]
    if segments is None:
        o = jax.vmap(kernel)(qh, kh_, vh)
    else:
        call = lambda q1, k1, v1, qs, ks: kernel(q1, k1, v1, segment_ids=splash.SegmentIds(qs, ks))
        o = jax.vmap(call)(qh, kh_, vh, *segments)
    o = o.transpose(0, 2, 1, 3)[:, :t].astype(jnp.float32)  # [B, T, N, H]
    return o if has_key is None else jnp.where(has_key, o, 0.0)


def _splash_heads_mask(splash, q_offset, mask, dynamic: bool, n: int, lengths, padded):
    """The kernel's mask over the padded [Tp, Sp] square for each of the N heads: a dense
    one (dynamic: traced offset or user mask, no row left all-skipped) or a lazy one."""
    (t, s), (tp, sp) = lengths, padded
    if dynamic:
        heads = _dense_keep(t, s, q_offset=q_offset, q_segments=None, kv_segments=None, mask=mask)
        heads = heads[0]  # [1 or N, T, S]: batch 1
        heads = heads | ~heads.any(-1, keepdims=True)  # no all-skipped rows (zeroed later)
        heads = _pad_axis(_pad_axis(heads, tp, 1, True), sp, 2, False)
        return jnp.broadcast_to(heads, (n, tp, sp))
    one = (
        splash.FullMask((tp, sp))
        if q_offset is None
        else splash.CausalMask((tp, sp), offset=q_offset)
    )
    return splash.MultiHeadMask([one] * n)


def _splash_segments(q_segments, kv_segments, b: int, s: int, padded):
    """(q ids [B, Tp], kv ids [B, Sp]) for the kernel: the documents' ids padded with an
    id no real token has, or ids that mask the padded keys alone; None when neither."""
    tp, sp = padded
    if q_segments is not None:
        pad_id = jnp.minimum(q_segments.min(), kv_segments.min()) - 1  # matches no real key
        return (
            _pad_axis(q_segments.astype(jnp.int32), tp, 1, pad_id),
            _pad_axis(kv_segments.astype(jnp.int32), sp, 1, pad_id),
        )
    if sp != s:  # mask the padded keys
        return (
            jnp.zeros((b, tp), jnp.int32),
            jnp.broadcast_to((jnp.arange(sp) >= s).astype(jnp.int32), (b, sp)),
        )
    return None


def _splash_kernel(splash, heads_mask, bq: int, bk: int, dynamic: bool):
    """The splash multi-head kernel with one block size per axis for every pass."""
    blocks = splash.BlockSizes(
        block_q=bq,
        block_kv=bk,
        block_kv_compute=bk,
        block_q_dkv=bq,
        block_kv_dkv=bk,
        block_kv_dkv_compute=bk,
        block_q_dq=bq,
        block_kv_dq=bk,
    )
    kernel = splash.make_splash_mha(
        mask=heads_mask, block_sizes=blocks, head_shards=1, q_seq_shards=1
    )
    if dynamic:  # the kernel turns its Python flag into an array, which a trace cannot branch on
        for name in ("fwd_mask_info", "dq_mask_info", "dkv_mask_info"):
            info = getattr(kernel, name)
            if info is not None:
                setattr(kernel, name, info._replace(is_dynamic_mask=True))
    return kernel
