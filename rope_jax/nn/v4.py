"""DeepSeek-V4's attention: the pieces the decoder's attention adds to tied K/V.

V4's attention block (HF's `DeepseekV4Attention`, its sliding-window branch) is made of
settings the decoder already has: one shared key/value head (`model.num_kv_heads` 1,
`model.attention.kv` "tied", sites "qkvo": the latent rotated once is key and value,
the output's rotated slice turned back at the query position), a partial rotation of
interleaved pairs (`model.rope.layout`, `model.rope.pairs` rule first with its fraction),
per-head sinks (`model.attention.sinks`) and sliding layers (`model.attention.window`).
This module adds, each a field of `model.attention`:

  low-rank queries  q = W_qb RMSNorm_r(W_qa x), a rank-r latent with its own RMSNorm
                    (scale [r]) between two projections (`q_lora_rank` r; HF's q_a_proj,
                    q_a_norm, q_b_proj).
  q head norm       every query head scaled to unit RMS over H, no weight, before the
                    rotation (`q_l2_norm`; HF's q_b_norm; the maths is `irope.l2_norm`).
  kv norm           the tied latent c = RMSNorm_H(W_c x), scale [H], before its rotation
                    (`kv_norm`; HF's kv_norm).
  grouped output    the N heads in g groups of N/g; group j's N/g * H numbers are
                    projected to R, and the g * R to D: y = sum_j W_b[j] (W_a[j] o_j)
                    (`o_groups` g, `o_lora_rank` R; HF's o_a_proj, o_b_proj).

V4 rotates the *trailing* `qk_rope_head_dim` numbers of a head; this project rotates
the leading ones. A fixed permutation of each head's numbers (`head_order`) maps one
onto the other exactly: the q head norm is a mean over the head, the kv norm's scale
moves with its numbers, scores are dot products within a head, and the output (K = V,
turned back on the same slice) comes out permuted the same way, which the grouped
output's rows undo. So V4's weights load with their head dims reordered, and no
setting is needed (tests/v4_test.py checks it against HF in outputs and gradients).

Out of scope: V4's compressed-KV layers (CSA, HCA) and their indexer, and the rest of
its block (hyper-connections, mixture of experts).

Shape legend: B batch, T positions, N query heads, H head dim, D model dim,
g output groups, M = N / g heads per group, R the output rank.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rope_jax.nn.layers import RMSNorm, dense_param
from rope_jax.nn.products import dense


class Options(NamedTuple):
    """One layer's V4 settings: the `model.attention` fields of these names (all off)."""

    q_lora_rank: int = 0
    q_l2_norm: bool = False
    kv_norm: bool = False
    o_groups: int = 0
    o_lora_rank: int = 0

    @classmethod
    def of(cls, attention) -> Options:
        """The options of a `config.model.attention` section."""
        return cls(**{field: attention[field] for field in cls._fields})


OFF = Options()


def grouped_output(o, o_a, o_b, *, dtype) -> jax.Array:
    """y = sum_j (o_j . W_a[j]) . W_b[j]: the grouped low-rank output projection.

    Args:
      o: [B, T, N, H] attention output (after any rotation back).
      o_a: [g, M, H, R], group j's heads (j M ... (j + 1) M - 1) to its R numbers.
      o_b: [g, R, D], the g * R numbers to the model dim.
      dtype: compute dtype of the operands; products accumulate in float32.

    Returns:
      [B, T, D] in `dtype`.
    """
    g, m = o_a.shape[:2]
    o = o.reshape(*o.shape[:2], g, m, o.shape[-1]).astype(dtype)  # [B, T, g, M, H]
    f32 = dict(preferred_element_type=jnp.float32)
    z = jnp.einsum("btgmh,gmhr->btgr", o, o_a.astype(dtype), **f32).astype(dtype)
    return jnp.einsum("btgr,grd->btd", z, o_b.astype(dtype), **f32).astype(dtype)


class LowRankQuery(nnx.Module):
    """q = W_qb RMSNorm_r(W_qa x): q_a_proj [D, r] (embed, -), q_a_norm of scale [r],
    q_b_proj [r, N, H] (-, heads, head_dim); x [B, T, D] -> q [B, T, N, H]."""

    def __init__(self, embed_dim, num_heads, head_dim, rank, *, eps, dtype, param_dtype, rngs):
        d, n, h, r = embed_dim, num_heads, head_dim, rank
        self.q_a_proj = dense_param(rngs, (d, r), ("embed", None), dtype=param_dtype, fan_in=d)
        self.q_a_norm = RMSNorm(r, eps=eps, dtype=dtype, param_dtype=param_dtype, axis=None)
        self.q_b_proj = dense_param(rngs, (r, n, h), (None, "heads", "head_dim"),
                                    dtype=param_dtype, fan_in=r)  # fmt: skip
        self.dtype = dtype

    def __call__(self, x) -> jax.Array:
        latent = self.q_a_norm(dense(x, self.q_a_proj[...], dtype=self.dtype))  # [B, T, r]
        return dense(latent, self.q_b_proj[...], dtype=self.dtype)


class GroupedOutput(nnx.Module):
    """The grouped low-rank output (`grouped_output`): o_a_proj [g, M, H, R] (-, heads,
    head_dim, -), o_b_proj [g, R, D] (-, -, embed); o [B, T, N, H] -> [B, T, D]."""

    def __init__(self, embed_dim, num_heads, head_dim, groups, rank, *, out_scale, eps,
                 dtype, param_dtype, rngs):  # fmt: skip
        d, h, g, m, r = embed_dim, head_dim, groups, num_heads // groups, rank
        self.o_a_proj = dense_param(rngs, (g, m, h, r), (None, "heads", "head_dim", None),
                                    dtype=param_dtype, fan_in=m * h)  # fmt: skip
        self.o_b_proj = dense_param(rngs, (g, r, d), (None, None, "embed"), dtype=param_dtype,
                                    fan_in=g * r, scale=out_scale)  # fmt: skip
        self.dtype = dtype

    def __call__(self, o) -> jax.Array:
        return grouped_output(o, self.o_a_proj[...], self.o_b_proj[...], dtype=self.dtype)


def head_order(head_dim: int, rotated: int) -> np.ndarray:
    """The permutation taking a head laid out [unrotated | rotated] (V4: the trailing
    `rotated` numbers turn) to [rotated | unrotated] (this project: the leading ones):
    ours[..., i] = theirs[..., order[i]]. Pairs inside the rotated slice keep their order.
    """
    if not 0 < rotated <= head_dim or rotated % 2:
        raise ValueError(f"rotated={rotated} must be even and in (0, head_dim={head_dim}]")
    return np.concatenate([np.arange(head_dim - rotated, head_dim), np.arange(head_dim - rotated)])


def _fail(field: str, value: Any, allowed: str):
    raise ValueError(f"model.{field}={value!r} is invalid: {allowed}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_config(cfg) -> None:
    """The V4 fields of `config.model` (`cfg`): one ValueError line naming the field."""
    att = cfg.attention
    rank, groups, o_rank = att.q_lora_rank, att.o_groups, att.o_lora_rank
    for field, value in (("q_lora_rank", rank), ("o_groups", groups), ("o_lora_rank", o_rank)):
        if not _is_int(value) or value < 0:
            _fail(f"attention.{field}", value, "must be a non-negative integer (0 = off)")
    for field in ("q_l2_norm", "kv_norm"):
        if not isinstance(att[field], bool):
            _fail(f"attention.{field}", att[field], "must be True or False")
    if att.kv_norm and att.kv != "tied":
        _fail("attention.kv_norm", att.kv_norm, "normalises the tied latent: needs "
              f"model.attention.kv='tied' (got {att.kv!r}; qk_norm for separate k)")  # fmt: skip
    if groups and cfg.num_heads % groups:
        _fail("attention.o_groups", groups, f"must divide num_heads={cfg.num_heads} "
              "(each group holds whole heads)")  # fmt: skip
    if bool(groups) != bool(o_rank):
        (field, value), (other, set_to) = (
            (("o_lora_rank", o_rank), ("o_groups", groups)) if groups
            else (("o_groups", groups), ("o_lora_rank", o_rank))
        )  # fmt: skip
        _fail(f"attention.{field}", value, f"must be > 0 with model.attention.{other}={set_to} "
              "(the two are set together; 0 and 0 = one output projection)")  # fmt: skip
