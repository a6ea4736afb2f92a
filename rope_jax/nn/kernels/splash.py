"""`impl="splash"`: TPU Pallas splash attention (block-sparse flash attention)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rope_jax.nn.kernels.common import _dense_keep, _is_static, _pad_axis, _rows_with_keys
from rope_jax.nn.kernels.terms import Terms


def _mix_splash(q, k, v, terms: Terms, *, scale: float, block_size: int) -> jax.Array:
    """TPU Pallas splash attention (block-sparse flash attention). It has no logit-bias
    input: the registry refuses a bias here (`kernels.KERNELS`).

    Causality with a static q_offset >= 0 is a lazy `CausalMask` (fully masked blocks are
    skipped), with a sliding window W a lazy `LocalMask` (window (W - 1, 0): blocks
    before the window are skipped too, where T is whole blocks and no query looks past
    the last key; else the window goes into the dynamic mask below); segment ids go to
    `SegmentIds`; sinks [N] to the kernel's own `sinks` (splash adds them to the
    denominator and returns their gradient). A traced or negative q_offset, or a dense
    `mask` (which must then have batch 1: one kernel serves the whole batch), becomes a
    dynamic [N, T, S] mask. T and S are padded to whole blocks (block_size must be a
    multiple of 128); padded keys are masked with segment ids. Splash divides by zero on
    a row whose blocks are all skipped, so such rows of a dynamic mask attend everything
    and, like every row with no allowed key, are set to 0 afterwards.
    """
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    q_offset, mask, window, chunk = terms.q_offset, terms.mask, terms.window, terms.chunk
    q_segments, kv_segments, sinks = terms.q_segments, terms.kv_segments, terms.sinks

    (b, t, n, _), s = q.shape, k.shape[1]
    if block_size % 128:
        raise ValueError(f"impl='splash' needs block_size a multiple of 128, got {block_size}")
    round_up = lambda x, m: -(-x // m) * m
    bq, bk = min(block_size, round_up(t, 128)), min(block_size, round_up(s, 128))
    tp, sp = round_up(t, bq), round_up(s, bk)
    dynamic = mask is not None or (q_offset is not None and not _is_static(q_offset))
    dynamic = dynamic or (q_offset is not None and q_offset < 0)
    if window is not None and not dynamic:  # a padded or late query row may see no key
        dynamic = tp != t or t + q_offset > s
    if chunk is not None and not dynamic:  # the lazy chunked mask starts at key 0
        dynamic = tp != t or t > s or q_offset != 0 or window is not None
    if mask is not None and mask.shape[0] != 1:
        raise ValueError("impl='splash' takes a dense mask with batch 1; use impl='chunked'")

    has_key = None  # which rows have a key at all, where some may not: [B|1, T, 1|N, 1]
    if dynamic or q_segments is not None:
        segs = dict(q_segments=q_segments, kv_segments=kv_segments, mask=mask)
        segs.update(window=window, chunk=chunk)
        has_key = _rows_with_keys(_dense_keep(t, s, q_offset=q_offset, **segs))
    heads_mask = _splash_heads_mask(
        splash, q_offset, mask, dynamic, n, (t, s), (tp, sp), window=window, chunk=chunk
    )
    segments = _splash_segments(q_segments, kv_segments, b, s, (tp, sp))
    kernel = _splash_kernel(splash, heads_mask, bq, bk, dynamic)

    dtype = jnp.result_type(q, k, v)
    heads_first = lambda x, length: _pad_axis(x.astype(dtype), length, 1).transpose(0, 2, 1, 3)
    qh = heads_first(q * scale, tp)  # splash does not scale the logits
    kh_, vh = heads_first(k, sp), heads_first(v, sp)  # [B, K, Sp, H]
    extra = {} if sinks is None else {"sinks": sinks}  # [N], shared by the batch
    if segments is None:
        o = jax.vmap(lambda q1, k1, v1: kernel(q1, k1, v1, **extra))(qh, kh_, vh)
    else:
        call = lambda q1, k1, v1, qs, ks: kernel(
            q1, k1, v1, segment_ids=splash.SegmentIds(qs, ks), **extra
        )
        o = jax.vmap(call)(qh, kh_, vh, *segments)
    o = o.transpose(0, 2, 1, 3)[:, :t].astype(jnp.float32)  # [B, T, N, H]
    return o if has_key is None else jnp.where(has_key, o, 0.0)


def _splash_heads_mask(
    splash, q_offset, mask, dynamic: bool, n: int, lengths, padded, *, window, chunk=None
):
    """The kernel's mask over the padded [Tp, Sp] square for each of the N heads: a dense
    one (dynamic: traced offset or user mask, no row left all-skipped) or a lazy one."""
    (t, s), (tp, sp) = lengths, padded
    if dynamic:
        heads = _dense_keep(t, s, q_offset=q_offset, q_segments=None, kv_segments=None,
                            mask=mask, window=window, chunk=chunk)  # fmt: skip
        heads = heads[0]  # [1 or N, T, S]: batch 1
        heads = heads | ~heads.any(-1, keepdims=True)  # no all-skipped rows (zeroed later)
        heads = _pad_axis(_pad_axis(heads, tp, 1, True), sp, 2, False)
        return jnp.broadcast_to(heads, (n, tp, sp))
    if q_offset is None:
        one = splash.FullMask((tp, sp))
    elif chunk is not None:  # q_offset 0, no window (else dynamic); not in the package API
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask

        one = splash_attention_mask.ChunkedCausalMask((tp, sp), chunk_size=chunk)
    elif window is None:
        one = splash.CausalMask((tp, sp), offset=q_offset)
    else:
        one = splash.LocalMask((tp, sp), window_size=(window - 1, 0), offset=q_offset)
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
