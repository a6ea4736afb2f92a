"""Llama 4's iRoPE: rotating local layers interleaved with NoPE global ones, and the two
small pieces of maths that come with them.

The layer pattern is made of settings the decoder already has: `model.rope.nope_every`
k (layers k-1, 2k-1, ... rotate nothing; HF's `no_rope_layers[i] == 0`, whose default
`no_rope_layer_interval` 4 is k = 4) and `model.attention.layer_types` with "chunked"
on the rotating layers and "full" on the NoPE ones (HF's default `layer_types` for
Llama 4), chunk C = `model.attention.chunk` (HF's `attention_chunk_size`). HF rotates
the adjacent pairs (2i, 2i + 1) as complex numbers: `model.rope.layout = "interleaved"`.
This module adds:

  qk L2 norm    on rotating layers, q and k scaled to unit RMS over H, with no weight:
                x / sqrt(mean_h x_h^2 + eps), eps = `model.norm_eps`
                (`model.attention.qk_l2_norm`; HF's `use_qk_norm`, `Llama4TextL2Norm`).
                HF applies it after the rotation; a rotation keeps sum_h x_h^2, so the
                two commute and it is applied with the projection, before the rotation.
  temperature   on NoPE layers, the query at position p is multiplied by
                tau(p) = 1 + a * log(1 + floor((p + 1) / f)), a = `model.rope.nope_attn_scale`,
                f = `model.rope.nope_floor_scale` (HF's `attn_temperature_tuning` with
                `attn_scale` 0.1 and `floor_scale` 8192): 1 for p < f - 1, then growing
                with the log of the position, which keeps the global layers' softmax
                sharp over long contexts. p is the query's position on the first axis
                (for text its index in the sequence, HF's cache position).

Shape legend: B batch, T positions, A position axes, H head dim.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def l2_norm(x, *, eps: float) -> jax.Array:
    """x / sqrt(mean over the last axis of x^2 + eps), in float32, cast back to x's dtype.

    Args:
      x: [..., H], e.g. q [B, T, N, H] or k [B, T, K, H].
      eps: added to the mean square.
    """
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)).astype(x.dtype)


def temperature(positions, *, attn_scale: float, floor_scale: float) -> jax.Array:
    """tau(p) = 1 + attn_scale * log1p(floor((p + 1) / floor_scale)), float32 [B, T].

    Args:
      positions: [B, T, A] (or [B, T]) query positions; the first axis is read.
      attn_scale, floor_scale: a and f of the module docstring.
    """
    p = jnp.asarray(positions, jnp.float32)
    p = p[..., 0] if p.ndim == 3 else p
    return 1.0 + attn_scale * jnp.log1p(jnp.floor((p + 1.0) / floor_scale))


def _fail(field: str, value: Any, allowed: str):
    raise ValueError(f"model.{field}={value!r} is invalid: {allowed}")


def check_config(cfg, rotating: tuple[bool, ...]) -> None:
    """The iRoPE fields of `config.model` (`cfg`), given which layers rotate: one
    ValueError line naming the field. A setting must act on some layer (the L2 norm on a
    rotating one, the temperature on a NoPE one)."""
    norm = cfg.attention.qk_l2_norm
    scale, floor = cfg.rope.nope_attn_scale, cfg.rope.nope_floor_scale
    if not isinstance(norm, bool):
        _fail("attention.qk_l2_norm", norm, "must be True or False")
    if norm and cfg.attention.kv != "separate":
        _fail("attention.qk_l2_norm", norm,
              f"needs model.attention.kv='separate' (got {cfg.attention.kv!r})")  # fmt: skip
    if norm and not any(rotating):
        _fail("attention.qk_l2_norm", norm, "acts on rotating layers, and no layer rotates "
              f"(model.rope.sites={cfg.rope.sites!r})")  # fmt: skip
    number = lambda x: isinstance(x, int | float) and not isinstance(x, bool)
    if not number(scale) or scale < 0:
        _fail("rope.nope_attn_scale", scale, "must be a number >= 0 (0 = no temperature; "
              "Llama 4: 0.1)")  # fmt: skip
    if not number(floor) or floor <= 0:
        _fail("rope.nope_floor_scale", floor, "must be a number > 0 (Llama 4: 8192)")
    if scale and all(rotating):
        _fail("rope.nope_attn_scale", scale, "acts on NoPE layers, and every layer rotates "
              "(set model.rope.nope_every)")  # fmt: skip
