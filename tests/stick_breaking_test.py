"""Stick-breaking attention (`model.attention.stick_breaking`, the kernels' term
"stick_breaking"): equal to fla-core's naive reference forward and backward (fixture by
scripts/make_bias_fixtures.py), decoded as it runs whole, refused where no kernel or
setting can take it."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rope_jax import defaults
from rope_jax.nn import kernels
from rope_jax.nn import model as model_lib

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "biases", "stick_breaking.npz")


def test_stick_breaking_equals_fla_naive_forward_and_backward():
    ref = {k: jnp.asarray(v) for k, v in np.load(FIXTURE).items()}

    def loss(q, k, v, impl):
        out = kernels.mix(q, k, v, impl=impl, causal=True, stick_breaking=True)
        return jnp.sum(out * ref["r"]), out

    for impl in ("xla", "dot_product"):  # dot_product hands the term to xla
        args = (ref["q"], ref["k"], ref["v"])
        grads, got = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(*args, impl)
        np.testing.assert_allclose(np.asarray(got), ref["out"], atol=2e-5)
        for g, name in zip(grads, ("grad_q", "grad_k", "grad_v"), strict=True):
            np.testing.assert_allclose(np.asarray(g), ref[name], atol=1e-4, rtol=1e-4)
    assert float(ref["rem"].max()) > 0.05  # some stick is left over: weights are not softmax's


def test_the_nearest_key_breaks_the_stick_first():
    """With equal logits z every key takes sigmoid(z) of what the nearer ones left:
    w_s = sigma (1 - sigma)^(t - 1 - s) for the keys s < t before the query's slot."""
    t, z = 5, 0.7
    q = jnp.zeros((1, t, 1, t)).at[..., 0].set(z)  # q . k = z for every pair
    k = jnp.zeros((1, t, 1, t)).at[..., 0].set(1.0)
    v = jnp.eye(t)[None, :, None, :]  # the output's number s is key s's weight
    w = np.asarray(kernels.mix(q, k, v, causal=True, scale=1.0, stick_breaking=True))[0, -1, 0]
    sig = 1 / (1 + np.exp(-z))
    np.testing.assert_allclose(w, [sig * (1 - sig) ** (t - 2 - s) for s in range(t - 1)] + [0],
                               rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("layers", [{}, {"attention.window": 4}])
def test_a_stick_breaking_model_decodes_as_it_runs_whole(layers):
    from tests.generate_test import assert_decodes_as_it_runs_whole, cfg

    config = cfg(sites="", **{"attention.stick_breaking": True}, **layers)
    model = model_lib.Decoder(config, rngs=nnx.Rngs(0))
    assert_decodes_as_it_runs_whole(model)


@pytest.mark.parametrize(
    "overrides, message",
    [({"attention.impl": "chunked"}, "model.attention.impl='chunked' cannot compute the "
                                     "attention term 'stick_breaking'"),
     ({"attention.sinks": True}, "model.attention.sinks=True has no meaning")],
)  # fmt: skip
def test_stick_breaking_where_it_cannot_run_is_one_line(overrides, message):
    from tests.model_test import tiny_cfg

    cfg = tiny_cfg(**{"attention.stick_breaking": True, **overrides})
    with pytest.raises(ValueError, match=message) as err:
        model_lib.Decoder(defaults.fill_model(cfg), rngs=nnx.Rngs(0))
    assert "\n" not in str(err.value)
