"""Dense-layer products `y = x W` with a backward pass in the forms the CPU runs fast.

A dense layer contracts the trailing axes I of x [M..., I...] with the leading axes of
W [I..., O...]. Its three products, forward and backward, are

  fwd  y  = x W         contracts x's last axes with W's first  (NN)
  dx   dx = dy W^T      contracts dy's last axes with W's last  (NT)
  dW   dW = x^T dy      contracts the token axes M, first in both (TN)

XLA:CPU runs bfloat16 products on its fast path (AMX tiles on Intel, AVX512-BF16 on
AMD) only in some forms: with a float32 result, and with each operand contracting
over its last axis, or over a leading axis split in two, [M/c, c, .] (a batch-reduced
contraction). The plain autodiff of a bfloat16 einsum gives bfloat16 results and a TN
weight gradient, both off that path (4-8x slower, measured in
`benchmarks/matmul_bench.py`). `dense` runs the same maths with a custom backward:
every product asks for a float32 result, the weight gradient contracts the tokens in
chunks of `c`, and the weight gradient stays float32 (the master weights' dtype), so
no bfloat16 rounding of dW happens at all.

The form is chosen per backend and dtype (`FORMS`): "split" on CPU for 16-bit compute,
"plain" (one einsum, XLA's own autodiff) elsewhere, where XLA's GPU and TPU emitters
pick their own layouts. Both give the same numbers to the compute dtype's rounding.

Shape legend: M... leading (token) axes, I... contracted input axes, O... output axes.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

CHUNK = 512  # token rows per block of the weight-gradient contraction (the CPU fast path)


def dense(x, w, *, num_in: int = 1, dtype=None, out_dtype=None, form: str = "auto") -> jax.Array:
    """x [M..., I...] . W [I..., O...] -> [M..., O...], both cast to `dtype` at use.

    Args:
      x: input; its last `num_in` axes are contracted.
      w: weight (any float dtype, e.g. float32 master weights); its first `num_in` axes
        match x's last `num_in` axes.
      num_in: how many axes are contracted.
      dtype: compute dtype of the operands (default: x's dtype).
      out_dtype: dtype of the result (default: `dtype`), e.g. float32 logits.
      form: "plain", "split" or "auto" (FORMS' choice for this backend and dtype).

    Returns:
      [M..., O...] in `out_dtype`; products accumulate in float32.
    """
    dtype = jnp.dtype(dtype or x.dtype)
    out_dtype = jnp.dtype(out_dtype or dtype)
    form = choose_form(dtype) if form == "auto" else form
    if form not in FORMS:
        raise ValueError(f"form={form!r} is not one of 'auto', {', '.join(map(repr, FORMS))}")
    with jax.named_scope(f"dense_{'x'.join(map(str, w.shape))}"):
        return FORMS[form](x.astype(dtype), w, num_in, dtype, out_dtype)


def choose_form(dtype) -> str:
    """ "split" for 16-bit products on a CPU backend, else "plain"."""
    narrow = jnp.dtype(dtype).itemsize < 4
    return "split" if narrow and jax.default_backend() == "cpu" else "plain"


def _plain(x, w, num_in: int, dtype, out_dtype):
    dims = _fwd_dims(x.ndim, num_in)
    return lax.dot_general(x, w.astype(dtype), dims, preferred_element_type=out_dtype)


def _fwd_dims(x_ndim: int, num_in: int):
    """x's last num_in axes against w's first num_in: the NN form."""
    return ((tuple(range(x_ndim - num_in, x_ndim)), tuple(range(num_in))), ((), ()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _split(x, w, num_in: int, dtype, out_dtype):
    y = lax.dot_general(
        x, w.astype(dtype), _fwd_dims(x.ndim, num_in), preferred_element_type=jnp.float32
    )
    return y.astype(out_dtype)


def _split_fwd(x, w, num_in, dtype, out_dtype):
    return _split(x, w, num_in, dtype, out_dtype), (x, w)


def _split_bwd(num_in, dtype, out_dtype, res, dy):
    x, w = res
    wc = w.astype(dtype)
    num_out = w.ndim - num_in
    dy = dy.astype(dtype)
    # dx = dy W^T: dy's last num_out axes against W's last num_out (NT).
    dims = ((tuple(range(dy.ndim - num_out, dy.ndim)), tuple(range(num_in, w.ndim))), ((), ()))
    dx = lax.dot_general(dy, wc, dims, preferred_element_type=jnp.float32).astype(x.dtype)
    return dx, weight_grad(x, dy, num_in).astype(w.dtype)


_split.defvjp(_split_fwd, _split_bwd)


def weight_grad(x, dy, num_in: int, chunk: int = CHUNK) -> jax.Array:
    """x^T dy over the token axes: x [M..., I...], dy [M..., O...] -> float32 [I..., O...].

    The M tokens are split as [M/c, c] (c the largest divisor of M up to `chunk`) and
    both axes contracted at once: the batch-reduced form XLA:CPU runs on its fast path.
    """
    lead = x.ndim - num_in
    m = math.prod(x.shape[:lead])
    c = _chunk(m, chunk)
    xs = x.reshape(m // c, c, *x.shape[lead:])
    dys = dy.reshape(m // c, c, *dy.shape[lead:])
    dims = (((0, 1), (0, 1)), ((), ()))  # [M/c, c, I...] . [M/c, c, O...] -> [I..., O...]
    return lax.dot_general(xs, dys, dims, preferred_element_type=jnp.float32)


def _chunk(m: int, limit: int) -> int:
    """The largest divisor of m that is <= limit (m itself when m <= limit)."""
    return next(c for c in range(min(m, limit), 0, -1) if m % c == 0)


FORMS = {  # form -> (x, w, num_in, dtype, out_dtype) -> y; "auto" picks by backend (choose_form)
    "plain": _plain,
    "split": _split,
}
