"""Shared layers of the decoder: parameters with logical axes, RMSNorm, SwiGLU MLP.

Parameters are stored in `param_dtype` and cast to the compute `dtype` at use; norms
are computed in float32.

Shape legend: B batch, T positions, D model dim, F mlp dim, C = 2 the stacked SwiGLU
gate and up projections.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rope_jax import sharding
from rope_jax.nn.products import dense

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}  # config dtype names


def dense_param(rngs: nnx.Rngs, shape, names, *, fan_in: int, dtype, scale: float = 1.0):
    """A normal(std = scale / sqrt(fan_in)) parameter carrying logical axis `names`.

    The names live in the Variable's `out_sharding` metadata; eager sharding is off, so
    the model builds anywhere and `rope_jax.sharding` places it on a mesh explicitly.
    """
    init = jax.nn.initializers.normal(scale * fan_in**-0.5)
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=names, eager_sharding=False)


class RMSNorm(nnx.Module):
    """x / rms(x) * scale over the last axis, computed in float32; `axis` names the
    scale's logical axis ("embed" for the residual stream, "head_dim" for q/k heads)."""

    def __init__(
        self, dim: int, *, eps: float = 1e-6, dtype=jnp.float32, param_dtype, axis: str = "embed"
    ):
        self.scale = nnx.Param(
            jnp.ones((dim,), param_dtype), out_sharding=(axis,), eager_sharding=False
        )
        self.eps, self.dtype = eps, dtype

    def __call__(self, x):
        x = x.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * self.scale[...].astype(jnp.float32)).astype(self.dtype)


@jax.custom_vjp
def swiglu(gate_up):
    """silu(g) * u for gate_up [..., 2, F] = (g, u) stacked; [..., F].

    The custom backward writes (dg, du) as one stacked [..., 2, F] array in one pass;
    autodiff of the two slices would pad each gradient to [..., 2, F] and add them.
    """
    return jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]


def _swiglu_fwd(gate_up):
    return swiglu(gate_up), gate_up


def _swiglu_bwd(gate_up, dh):
    g, u = gate_up[..., 0, :], gate_up[..., 1, :]
    sig = jax.nn.sigmoid(g)
    dg = dh * u * sig * (1 + g * (1 - sig))  # d silu(g) = sig(g) (1 + g (1 - sig(g)))
    du = dh * g * sig
    return (jnp.stack([dg, du], axis=-2),)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


class MLP(nnx.Module):
    """SwiGLU: down(silu(x W_gate) * (x W_up))."""

    def __init__(self, dim: int, hidden: int, *, dtype, param_dtype, out_scale, rngs):
        p = dict(dtype=param_dtype, fan_in=dim)
        self.gate = dense_param(rngs, (dim, hidden), ("embed", "mlp"), **p)
        self.up = dense_param(rngs, (dim, hidden), ("embed", "mlp"), **p)
        self.down = dense_param(
            rngs, (hidden, dim), ("mlp", "embed"), dtype=param_dtype, fan_in=hidden, scale=out_scale
        )
        self.dtype = dtype

    def __call__(self, x):
        # One matmul for both projections (stacked on a new axis, so an "mlp"-sharded F
        # stays sharded): a single larger dot forward and backward instead of two.
        gate_up = dense(x, jnp.stack([self.gate[...], self.up[...]], axis=1), dtype=self.dtype)
        h = swiglu(gate_up)  # [B, T, C, F] -> [B, T, F]
        h = sharding.constrain(h, ("batch", "seq", "mlp"))
        return dense(h, self.down[...], dtype=self.dtype)
