"""`impl="dot_product"`: `jax.nn.dot_product_attention`, cuDNN flash attention on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rope_jax.nn.kernels.common import _dense_keep, _is_static, _rows_with_keys
from rope_jax.nn.kernels.terms import Terms


def _mix_dot_product(q, k, v, terms: Terms, *, scale: float) -> jax.Array:
    """`jax.nn.dot_product_attention`, with masks expressed the cheapest way it accepts.

    - sinks: jax.nn takes none (its logsumexp residual is rounded to the input dtype and
      carries no gradient, so it cannot rescale the output either): the registry
      (`kernels.KERNELS`) sends a call with sinks to the `xla` kernel, on every backend.
      Use "chunked" (or "splash" on TPU) for sinks at long T.
    - a logit bias: computed over the whole [T, S] and passed as jax.nn's `bias`, on
      jax's XLA implementation (its gradient reaches the bias' parameters there).
    - causal with a static q_offset == 0: `is_causal=True` (cuDNN skips masked blocks),
      and a sliding window W as `local_window_size=(W - 1, 0)` (cuDNN's
      `sliding_window_length` W, blocks outside it skipped too).
    - causal with T == 1 (decoding one token), any q_offset, static or traced: the key
      range s <= q_offset is `key_value_seq_lengths = q_offset + 1`, no dense mask.
    - segment ids (not in the public API), a traced or nonzero q_offset with T > 1 (or
      T == 1 with a window), a chunk C (jax.nn has no chunked mask), or a user `mask`:
      the slow path. Everything is folded into
      one dense bool mask [B or 1, 1 or N, T, S] passed as `mask` (O(T * S) bytes; cuDNN
      adds it as a bias and cannot skip masked blocks). It stays on the same backend, so
      results agree with the other impls on every input; use "chunked" (or "splash" on
      TPU) to avoid the T x S mask for long packed sequences.

    Backend: jax 0.10's `implementation=None` always means XLA, so it is chosen here:
    "cudnn" on a CUDA GPU (compute capability >= 8) for fp16/bf16 inputs whose head dim
    cuDNN takes (a multiple of 8, <= 128, or <= 256 from Hopper) and, with a dense mask,
    even T and S (cuDNN's backward with a bias needs them); "xla" otherwise. Float32
    inputs therefore run jax's XLA attention (cuDNN flash attention takes only fp16/bf16;
    inputs are not downcast): correct, with float32 scores materialized like "xla".
    Rows with no allowed key are set to 0 here (jax would average all values).
    """
    q_offset, mask, window, chunk = terms.q_offset, terms.mask, terms.window, terms.chunk
    q_segments, kv_segments = terms.q_segments, terms.kv_segments
    (b, t, _, h), s = q.shape, k.shape[1]
    dtype = jnp.result_type(q, k, v)  # jax.nn wants one dtype for q, k, v
    q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    is_causal = q_offset is not None and _is_static(q_offset) and q_offset == 0 and not chunk
    dense_offset = q_offset if (q_offset is not None and not is_causal) else None
    kv_lengths = None
    local = (window - 1, 0) if is_causal and window is not None else None
    plain = mask is None and q_segments is None and not window and not chunk
    if dense_offset is not None and t == 1 and plain:
        kv_lengths = jnp.clip(jnp.asarray(q_offset, jnp.int32) + 1, 1, s)  # >= 1: no NaN
        kv_lengths = jnp.broadcast_to(kv_lengths, (b,)).astype(jnp.int32)
        has_key = jnp.asarray(q_offset >= 0)  # q_offset < 0: no key; the row is zeroed
        dense_offset = None
    else:
        has_key = None
    segs = dict(q_segments=q_segments, kv_segments=kv_segments, mask=mask, window=window,
                chunk=chunk)  # fmt: skip
    keep = _dense_keep(t, s, q_offset=dense_offset, **segs)
    if keep is not None:  # rows may be empty: check them against every condition
        has_key = _rows_with_keys(_dense_keep(t, s, q_offset=q_offset, **segs))
    implementation = _dot_product_backend(dtype, h, t, s, dense_mask=keep is not None)
    bias = None
    if terms.bias is not None:  # [B|1, N|1, T, S], on XLA (see above)
        bias = terms.bias.at(jnp.arange(t, dtype=jnp.int32), jnp.arange(s, dtype=jnp.int32))
        bias, implementation = bias.astype(dtype), "xla"
    o = jax.nn.dot_product_attention(
        q,
        k,
        v,
        bias=bias,
        mask=keep,
        scale=scale,
        is_causal=is_causal,
        key_value_seq_lengths=kv_lengths,
        local_window_size=local,
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
