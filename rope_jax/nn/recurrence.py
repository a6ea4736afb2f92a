"""VO-RoPE with fixed decaying weights is a complex-decay linear RNN.

The derivation is in docs/maths.md#the-linear-rnn-view.

With causal weights a_ij = gamma^(i-j) (no softmax) and rotation sites "vo", attention

  o_i = R_i^T sum_{j<=i} gamma^(i-j) R_j v_j = sum_{j<=i} gamma^(i-j) R_{p_j - p_i} v_j

obeys the recurrence

  o_i = gamma R_{p_{i-1} - p_i} o_{i-1} + v_i        (o_{-1} = 0),

because R_a R_b = R_{a+b} for the block-diagonal rotations (angles are linear in p).
For 1-D integer positions p_i = i this is o_i = gamma R_{-1} o_{i-1} + v_i: every
rotation pair is one complex number decaying by gamma and turning by -theta_i per step.

`vo_decay_attention` is the quadratic form, `vo_recurrence` the O(T) `lax.scan` form;
both rotate with `rotary.rotate` and are pure, jit/vmap/grad-able.

Shape legend: B batch, T positions, N heads, H head dim, A position axes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rope_jax import rotary


def _positions(v, positions) -> jax.Array:
    """positions [B, T] or [B, T, A] -> float32 [B, T, A], checked against v [B, T, N, H]."""
    positions = jnp.asarray(positions, jnp.float32)
    if positions.ndim == v.ndim - 2:
        positions = positions[..., None]
    if v.ndim != 4 or positions.ndim != 3 or positions.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"v {tuple(v.shape)} and positions {tuple(positions.shape)} do not fit "
            "[B, T, N, H] and [B, T] or [B, T, A]"
        )
    return positions


def _gamma(gamma, num_heads: int) -> jax.Array:
    """gamma, a scalar or one decay per head [N], as float32 [N]."""
    gamma = jnp.asarray(gamma, jnp.float32)
    if gamma.ndim > 1 or (gamma.ndim == 1 and gamma.shape[0] != num_heads):
        raise ValueError(
            f"gamma has shape {tuple(gamma.shape)}: expected a scalar or [N]=({num_heads},)"
        )
    return jnp.broadcast_to(gamma, (num_heads,))


def vo_decay_attention(v, positions, rope=None, *, gamma, **settings) -> jax.Array:
    """o_i = R_i^T sum_{j<=i} gamma^(i-j) R_j v_j, the quadratic (attention) form.

    Args:
      v: [B, T, N, H] values.
      positions: [B, T] (1-D) or [B, T, A] (N-D), int or float.
      gamma: decay, a scalar or [N] (one per head); weights gamma^(i-j) for j <= i.
      rope, **settings: the rotation, a `rotary.RopeSpec` and/or its fields as
        keywords, as in `rotary.rotate`.

    Returns:
      [B, T, N, H] in v's dtype (computed in float32).
    """
    positions, spec = _positions(v, positions), rotary.RopeSpec.of(rope, **settings)
    t, n = v.shape[1], v.shape[2]
    gamma = _gamma(gamma, n)
    lag = jnp.arange(t)[:, None] - jnp.arange(t)[None, :]  # [T, S]: i - j
    decay = jnp.where(lag >= 0, gamma[:, None, None] ** jnp.maximum(lag, 0), 0.0)  # [N, T, S]
    vr = rotary.rotate(v.astype(jnp.float32), positions, spec)  # R_j v_j
    o = jnp.einsum("NTS,BSNH->BTNH", decay, vr, precision=jax.lax.Precision.HIGHEST)
    o = rotary.rotate(o, positions, spec, inverse=True)  # R_i^T at the query position
    return o.astype(v.dtype)


def vo_recurrence(v, positions, rope=None, *, gamma, **settings) -> jax.Array:
    """o_i = gamma R_{p_{i-1} - p_i} o_{i-1} + v_i with `lax.scan`; equals `vo_decay_attention`.

    Args:
      v: [B, T, N, H] inputs.
      positions: [B, T] (1-D) or [B, T, A] (N-D), int or float.
      gamma: decay, a scalar or [N] (one per head).
      rope, **settings: the rotation, a `rotary.RopeSpec` and/or its fields as
        keywords, as in `rotary.rotate`.

    Returns:
      [B, T, N, H] in v's dtype (state carried in float32).
    """
    positions, spec = _positions(v, positions), rotary.RopeSpec.of(rope, **settings)
    b, _, n, h = v.shape
    gamma = _gamma(gamma, n)[:, None]  # [N, 1]
    step = positions[:, :-1] - positions[:, 1:]  # [B, T-1, A]: p_{i-1} - p_i
    step = jnp.concatenate([jnp.zeros_like(positions[:, :1]), step], axis=1)  # [B, T, A]

    def scan_fn(o, inputs):  # o [B, N, H] float32
        v_i, step_i = inputs  # [B, N, H], [B, A]
        turned = rotary.rotate(o[:, None], step_i[:, None], spec)[:, 0]
        o = gamma * turned + v_i.astype(jnp.float32)
        return o, o

    init = jnp.zeros((b, n, h), jnp.float32)
    xs = (jnp.moveaxis(v, 1, 0), jnp.moveaxis(step, 1, 0))  # time-major
    _, o = jax.lax.scan(scan_fn, init, xs)  # [T, B, N, H]
    return jnp.moveaxis(o, 0, 1).astype(v.dtype)
