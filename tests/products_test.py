"""Dense products (`rope_jax.nn.products`): the CPU fast form equals the plain einsum.

The "split" form changes how the backward products are laid out for XLA:CPU, never what
they compute: its value and gradients equal the plain form's to bfloat16 rounding and a
float32 reference to the rounding of the bfloat16 operands; the weight gradient stays in
the master weights' dtype.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import lm
from rope_jax.harness import steps
from rope_jax.nn import products

SHAPES = [  # (x shape, w shape, num_in): q, o (two contracted axes), stacked gate/up, head
    ((2, 24, 16), (16, 4, 8), 1),
    ((2, 24, 4, 8), (4, 8, 16), 2),
    ((3, 10, 16), (16, 2, 12), 1),
    ((1, 7, 16), (16, 37), 1),
]


def _loss(form, dtype, num_in, out_dtype=None):
    def f(x, w):
        y = products.dense(x, w, num_in=num_in, dtype=dtype, out_dtype=out_dtype, form=form)
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))


def _operands(xs, ws, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, xs), jax.random.normal(kw, ws) * ws[0] ** -0.5


@pytest.mark.parametrize("xs, ws, num_in", SHAPES)
def test_split_form_equals_plain_in_bfloat16(xs, ws, num_in):
    x, w = _operands(xs, ws)
    ref_v, (ref_dx, ref_dw) = _loss("plain", jnp.bfloat16, num_in)(x, w)
    v, (dx, dw) = _loss("split", jnp.bfloat16, num_in)(x, w)
    np.testing.assert_allclose(v, ref_v, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(dx, ref_dx, rtol=3e-2, atol=3e-2)
    np.testing.assert_allclose(dw, ref_dw, rtol=3e-2, atol=6e-2)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype == jnp.float32


@pytest.mark.parametrize("xs, ws, num_in", SHAPES)
def test_split_form_is_closer_to_float32_than_bfloat16_rounding(xs, ws, num_in):
    """The weight gradient is accumulated and returned in float32: against the float32
    products of the same bfloat16-rounded operands it is exact to float32 accuracy."""
    x, w = _operands(xs, ws, seed=1)
    xr, wr = (a.astype(jnp.bfloat16).astype(jnp.float32) for a in (x, w))
    _, (_, ref_dw) = _loss("plain", jnp.float32, num_in)(xr, wr)
    # same rounded inputs through split: only dy's rounding to bfloat16 separates them
    _, (_, dw) = _loss("split", jnp.bfloat16, num_in)(xr, wr)
    assert np.max(np.abs(dw - ref_dw)) <= 0.02 * np.max(np.abs(ref_dw))


def test_float32_output_of_a_bfloat16_product():
    x, w = _operands((2, 5, 16), (16, 37))
    y = products.dense(x, w, dtype=jnp.bfloat16, out_dtype=jnp.float32, form="split")
    assert y.dtype == jnp.float32
    _, grads = _loss("split", jnp.bfloat16, 1, out_dtype=jnp.float32)(x, w)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)


@pytest.mark.parametrize("m", [1, 6, 512, 1000, 1031, 2048])
def test_weight_grad_in_chunks_equals_the_plain_contraction(m):
    kx, kd = jax.random.split(jax.random.key(m))
    x, dy = jax.random.normal(kx, (m, 8)), jax.random.normal(kd, (m, 3, 4))
    np.testing.assert_allclose(
        products.weight_grad(x, dy, 1, chunk=256),
        jnp.einsum("MI,MNO->INO", x, dy),
        rtol=1e-5,
        atol=1e-4,
    )


def test_chunk_is_the_largest_divisor_under_the_limit():
    assert products._chunk(8192, 512) == 512
    assert products._chunk(1000, 512) == 500
    assert products._chunk(1031, 512) == 1  # a prime: one row per chunk
    assert products._chunk(100, 512) == 100


def test_forms_by_backend_and_dtype():
    assert products.choose_form(jnp.float32) == "plain"
    cpu = jax.default_backend() == "cpu"
    assert products.choose_form(jnp.bfloat16) == ("split" if cpu else "plain")
    with pytest.raises(ValueError, match="form='fast' is not one of 'auto', 'plain', 'split'"):
        products.dense(jnp.ones((2, 3)), jnp.ones((3, 4)), form="fast")


@pytest.mark.slow
def test_decoder_gradients_with_split_products_equal_plain(monkeypatch):
    """The whole bfloat16 decoder: loss and every parameter gradient with the split
    products against the same model built with plain einsums (bfloat16 tolerance)."""
    config = lm.get_config("size=tiny")
    config.model.update(num_layers=1, embed_dim=64, mlp_dim=128, dtype="bfloat16")
    tokens = jax.random.randint(jax.random.key(3), (2, 33), 0, config.model.vocab_size)
    graphdef, params = nnx.split(steps.create_model(config, 0), nnx.Param)

    def loss(params):
        logits = nnx.merge(graphdef, params)(tokens[:, :-1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    out = {}
    for form in ("plain", "split"):
        monkeypatch.setattr(products, "choose_form", lambda dtype, form=form: form)
        out[form] = jax.jit(jax.value_and_grad(loss))(params)
    (ref_loss, ref_grads), (value, grads) = out["plain"], out["split"]
    np.testing.assert_allclose(value, ref_loss, rtol=1e-2)
    pairs = zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(ref_grads), strict=True)
    for (path, g), r in pairs:
        scale = float(jnp.max(jnp.abs(r))) + 1e-6
        err = float(jnp.max(jnp.abs(g - r)))
        assert err <= 0.05 * scale, (jax.tree_util.keystr(path), err, scale)
