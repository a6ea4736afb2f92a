"""`impl="chunked"`: blockwise online softmax (FlashAttention-style) in pure JAX, O(T * block)
memory, with a custom backward that recomputes the scores block by block.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from rope_jax.nn.kernels.common import (
    _and,
    _causal_keep,
    _group_mask,
    _pad_axis,
    _segment_keep,
    _unbroadcast,
)
from rope_jax.nn.kernels.terms import Bias, Terms

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
# Causal loops skip blocks that are entirely in the future, and with a sliding window W
# those wholly before it: a query block visits about (W + block) / block key blocks, so
# the work is O(T * W) instead of O(T^2); with a chunk C, those of other chunks (O(T * C)).
#
# A sink z (one logit per query head) starts each row's statistics as a key of logit z
# and no value: m_0 = z, l_0 = 1, a_0 = 0. Then L is the logsumexp over the keys and the
# sink, P = exp(x - L) are the probabilities the sink leaves to the keys, and the sink's
# gradient is dz = -sum_t exp(z - L_t) D_t (its probability times dO . o).
#
# A logit bias b (`kernels.Bias`) is computed per block from the block's rows and slots,
# x_j = scale * q k_j^T + b_j, the same in the backward; dX is b's cotangent, so the
# bias' parameters get sum_blocks vjp(b_j)(dX_j), accumulated while the blocks are visited.


class _Config(NamedTuple):
    """Static layout of the chunked kernel (hashable: a nondiff argument of custom_vjp)."""

    block_q: int
    block_k: int
    num_q_blocks: int
    num_k_blocks: int
    kv_len: int  # valid keys S; keys at S..S_padded-1 are padding
    scale: float
    window: int | None  # sliding window W (with causality); None = none
    chunk: int | None  # chunk C (with causality): keys of the query's own chunk; None = none
    q_len: int  # valid queries T (rows at T..T_padded-1 are padding)
    bias: Callable | None  # the logit bias' function (`Bias.fn`); None = no bias


class _Masks(NamedTuple):
    """Mask inputs of the chunked kernel (arrays or None), padded to whole blocks."""

    q_offset: jax.Array | None  # int32 scalar; None = not causal
    q_segments: jax.Array | None  # [B, T_padded]
    kv_segments: jax.Array | None  # [B, S_padded]
    mask: jax.Array | None  # [B or 1, 1 or K, T_padded, 1 or G, S_padded]
    bias_inputs: Any  # the logit bias' `inputs` (not differentiated); () = none


def _mix_chunked(q, k, v, terms: Terms, *, scale: float, block_size: int) -> jax.Array:
    """Blockwise online-softmax attention; pads T and S to whole blocks internally."""
    (b, t, n, h), (s, kh) = q.shape, k.shape[1:3]
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be positive")
    bq, bk = min(block_size, t), min(block_size, s)
    tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
    bias = terms.bias
    cfg = _Config(bq, bk, tp // bq, sp // bk, s, float(scale), terms.window, terms.chunk, t,
                  None if bias is None else bias.fn)  # fmt: skip
    pad = lambda x, length, axis, value=0: _pad_axis(x, length, axis, value)
    mask, q_offset = terms.mask, terms.q_offset
    masks = _Masks(
        None if q_offset is None else jnp.asarray(q_offset, jnp.int32),
        None if terms.q_segments is None else pad(jnp.asarray(terms.q_segments), tp, 1),
        None if terms.kv_segments is None else pad(jnp.asarray(terms.kv_segments), sp, 1),
        None if mask is None else pad(pad(_group_mask(mask, kh), tp, 2, False), sp, 4, False),
        () if bias is None else bias.inputs,
    )
    qg = pad(q.reshape(b, t, kh, n // kh, h), tp, 1)  # [B, T_padded, K, G, H]
    z = None if terms.sinks is None else terms.sinks.reshape(kh, n // kh)  # [K, G]
    bp = () if bias is None else bias.params
    o = _flash(cfg, qg, pad(k, sp, 1), pad(v, sp, 1), z, bp, masks)  # [B, T_padded, K, G, H]
    return o[:, :t].reshape(b, t, n, h)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg: _Config, q, k, v, z, bp, masks: _Masks):
    """q [B, Tp, K, G, H], k, v [B, Sp, K, H], sinks z [K, G] or None, the bias'
    parameters bp (a pytree; () without a bias) -> float32 [B, Tp, K, G, H]."""
    return _flash_forward(cfg, q, k, v, z, bp, masks)[0]


def _flash_fwd(cfg: _Config, q, k, v, z, bp, masks: _Masks):
    o, lse = _flash_forward(cfg, q, k, v, z, bp, masks)
    return o, (q, k, v, z, bp, masks, o, lse)  # no per-block probabilities are kept


def _flash_bwd(cfg: _Config, residuals, do):
    q, k, v, z, bp, masks, o, lse = residuals
    dq, dk, dv, dz, dbp = _flash_backward(cfg, q, k, v, z, bp, masks, o, lse, do)
    cast = lambda g, x: g.astype(x.dtype)
    return cast(dq, q), cast(dk, k), cast(dv, v), dz, dbp, None  # masks: none


_flash.defvjp(_flash_fwd, _flash_bwd)


def _block_scores(cfg: _Config, qi, kj):
    """q block [B, bq, K, G, H] . k block [B, bk, K, H] -> float32 [B, K, bq, G, bk]."""
    x = jnp.einsum("BTKGH,BSKH->BKTGS", qi, kj, preferred_element_type=jnp.float32)
    return x * cfg.scale


def _block_bias(cfg: _Config, bp, masks: _Masks, t0, s0, kv_heads: int):
    """The logit bias of the block at query t0, key s0, in the scores' layout
    [B|1, K|1, bq, G|1, bk] (padded rows and slots read the last valid one: masked)."""
    t_idx = jnp.minimum(t0 + jnp.arange(cfg.block_q, dtype=jnp.int32), cfg.q_len - 1)
    s_idx = jnp.minimum(s0 + jnp.arange(cfg.block_k, dtype=jnp.int32), cfg.kv_len - 1)
    bias = Bias(cfg.bias, bp, masks.bias_inputs).at(t_idx, s_idx)
    return _group_mask(bias, kv_heads)


def _block_keep(cfg: _Config, masks: _Masks, t0, s0):
    """Keep-mask of the block at query t0, key s0, broadcastable to [B, K, bq, G, bk]."""
    t_idx, s_idx = t0 + jnp.arange(cfg.block_q), s0 + jnp.arange(cfg.block_k)
    keep = None
    if cfg.num_k_blocks * cfg.block_k != cfg.kv_len:  # padded keys
        keep = (s_idx < cfg.kv_len)[None, None, None, None, :]
    if masks.q_offset is not None:
        causal = _causal_keep(t_idx, s_idx, masks.q_offset, cfg.window, cfg.chunk)
        keep = _and(keep, causal[None, None, :, None, :])
    if masks.q_segments is not None:
        qs = lax.dynamic_slice_in_dim(masks.q_segments, t0, cfg.block_q, axis=1)
        ks = lax.dynamic_slice_in_dim(masks.kv_segments, s0, cfg.block_k, axis=1)
        keep = _and(keep, _segment_keep(qs, ks)[:, None, :, None, :])
    if masks.mask is not None:
        m = lax.dynamic_slice_in_dim(masks.mask, t0, cfg.block_q, axis=2)
        keep = _and(keep, lax.dynamic_slice_in_dim(m, s0, cfg.block_k, axis=4))
    return keep


def _k_block_range(cfg: _Config, q_offset, t0):
    """Key blocks [lo, hi) that the query block at t0 can see (causal: not the future;
    window W: not before the first row's oldest key t0 + q_offset - W + 1; chunk C: not
    before the first row's chunk start)."""
    if q_offset is None:
        return 0, cfg.num_k_blocks
    last_key = t0 + cfg.block_q - 1 + q_offset  # the last query row's last key
    hi = jnp.clip(last_key // cfg.block_k + 1, 0, cfg.num_k_blocks)
    first_key = 0
    if cfg.window is not None:  # the first query row's oldest key
        first_key = jnp.maximum(first_key, t0 + q_offset - cfg.window + 1)
    if cfg.chunk is not None:  # the first query row's chunk start
        first_key = jnp.maximum(first_key, (t0 + q_offset) // cfg.chunk * cfg.chunk)
    return jnp.clip(first_key // cfg.block_k, 0, cfg.num_k_blocks), hi


def _q_block_range(cfg: _Config, q_offset, s0):
    """Query blocks [lo, hi) that can see the key block at s0 (causal: t >= s0 - q_offset;
    window W: t <= s0 + block_k - 1 - q_offset + W - 1, the last key still in view; chunk
    C: t + q_offset in the last key's chunk or before)."""
    if q_offset is None:
        return 0, cfg.num_q_blocks
    lo = jnp.clip((s0 - q_offset) // cfg.block_q, 0, cfg.num_q_blocks)
    last_query = cfg.num_q_blocks * cfg.block_q - 1
    if cfg.window is not None:
        last_query = jnp.minimum(last_query, s0 + cfg.block_k - 2 - q_offset + cfg.window)
    if cfg.chunk is not None:  # the last key's chunk ends at key (.. + 1) C - 1
        chunk_end = ((s0 + cfg.block_k - 1) // cfg.chunk + 1) * cfg.chunk - 1
        last_query = jnp.minimum(last_query, chunk_end - q_offset)
    return lo, jnp.clip(last_query // cfg.block_q + 1, 0, cfg.num_q_blocks)


def _flash_forward(cfg: _Config, q, k, v, z, bp, masks: _Masks):
    """Online softmax over key blocks for each query block.

    Returns o float32 [B, Tp, K, G, H] and logsumexp float32 [B, K, Tp, G] over the keys
    and the sink z [K, G] if any (+inf on rows with no allowed key and no sink; o is 0 on
    every row with no allowed key).
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
            if cfg.bias is not None:
                x = x + _block_bias(cfg, bp, masks, t0, s0, kh)
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
        acc = jnp.zeros((b, kh, bq, g, h), jnp.float32)
        if z is None:
            init = (jnp.full_like(stats, -jnp.inf), stats, acc)
        else:  # the sink is a key of logit z and no value: m = z, l = exp(z - m) = 1
            init = (stats + z[None, :, None, :], stats + 1.0, acc)
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


def _flash_backward(cfg: _Config, q, k, v, z, bp, masks: _Masks, o, lse, do):
    """dq, dk, dv (float32) by recomputing each block's probabilities from logsumexp, the
    sinks' dz [K, G] (None without sinks) and the bias parameters' cotangents (like bp)."""
    b, tp, kh, g, h = q.shape
    bq, bk = cfg.block_q, cfg.block_k
    do = do.astype(jnp.float32)
    delta = jnp.einsum("BTKGH,BTKGH->BKTG", do, o)  # D = rowsum(dO * o), [B, K, Tp, G]
    learns = cfg.bias is not None and bool(jax.tree.leaves(bp))  # the bias has parameters

    def k_block(carry, j):
        dq, dbp = carry
        s0 = j * bk
        kj = lax.dynamic_slice_in_dim(k, s0, bk, axis=1)
        vj = lax.dynamic_slice_in_dim(v, s0, bk, axis=1)

        def q_step(i, carry):
            dq, dk, dv, dbp = carry
            t0 = i * bq
            qi = lax.dynamic_slice_in_dim(q, t0, bq, axis=1)
            doi = lax.dynamic_slice_in_dim(do, t0, bq, axis=1)
            lse_i = lax.dynamic_slice_in_dim(lse, t0, bq, axis=2)[..., None]
            delta_i = lax.dynamic_slice_in_dim(delta, t0, bq, axis=2)[..., None]
            x = _block_scores(cfg, qi, kj)
            if cfg.bias is not None:
                bias_of = lambda p: _block_bias(cfg, p, masks, t0, s0, kh)
                bias, pull = jax.vjp(bias_of, bp) if learns else (bias_of(bp), None)
                x = x + bias
            p = jnp.exp(x - lse_i)  # the forward's probabilities
            keep = _block_keep(cfg, masks, t0, s0)
            if keep is not None:
                p = jnp.where(keep, p, 0.0)
            dv = dv + jnp.einsum("BKTGS,BTKGH->BSKH", p, doi)
            dp = jnp.einsum("BTKGH,BSKH->BKTGS", doi, vj, preferred_element_type=jnp.float32)
            dx = p * (dp - delta_i)  # softmax backward, per row: the logits' cotangent
            if learns:
                dbp = jax.tree.map(jnp.add, dbp, pull(_unbroadcast(dx, bias.shape))[0])
            dk = dk + cfg.scale * jnp.einsum(
                "BKTGS,BTKGH->BSKH", dx, qi, preferred_element_type=jnp.float32
            )
            dqi = cfg.scale * jnp.einsum(
                "BKTGS,BSKH->BTKGH", dx, kj, preferred_element_type=jnp.float32
            )
            dqi = lax.dynamic_slice_in_dim(dq, t0, bq, axis=1) + dqi
            return lax.dynamic_update_slice_in_dim(dq, dqi, t0, axis=1), dk, dv, dbp

        zeros = jnp.zeros((b, bk, kh, h), jnp.float32)
        lo, hi = _q_block_range(cfg, masks.q_offset, s0)
        dq, dk, dv, dbp = lax.fori_loop(lo, hi, q_step, (dq, zeros, zeros, dbp))
        return (dq, dbp), (dk, dv)

    dq0 = jnp.zeros((b, tp, kh, g, h), jnp.float32)
    dbp0 = jax.tree.map(jnp.zeros_like, bp)
    (dq, dbp), (dk, dv) = lax.scan(k_block, (dq0, dbp0), jnp.arange(cfg.num_k_blocks))
    sp = cfg.num_k_blocks * bk
    unblock = lambda x: x.transpose(1, 0, 2, 3, 4).reshape(b, sp, kh, h)  # [nk, B, bk, ..]
    dz = None
    if z is not None:  # dz = -sum_t p_sink(t) D_t, p_sink = exp(z - L)
        dz = -jnp.einsum("BKTG,BKTG->KG", jnp.exp(z[None, :, None, :] - lse), delta)
    return dq, unblock(dk), unblock(dv), dz, dbp
