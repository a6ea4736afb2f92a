"""xPos (`model.rope.xpos_scale_base`): rotated queries and keys scaled by zeta ** (+-p /
gamma), checked against rotary-embedding-torch (fixture made by
scripts/make_bias_fixtures.py), relative, decoded as it runs whole, refused where it has
no meaning."""

import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rope_jax import defaults, rotary
from rope_jax.nn import attention
from rope_jax.nn import model as model_lib

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "biases", "xpos.npz")


def test_rotation_and_decay_equal_rotary_embedding_torch():
    ref = np.load(FIXTURE)
    q, k = (jnp.asarray(ref[n]).transpose(0, 2, 1, 3) for n in ("q", "k"))  # [B, T, N, H]
    t = q.shape[1]
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.float32), q.shape[:2])
    spec = rotary.RopeSpec(layout="interleaved", base=10000.0)
    gamma = float(ref["gamma"])
    rq = attention.decay(rotary.rotate(q, pos, spec), pos, gamma, t, "interleaved")
    rk = attention.decay(rotary.rotate(k, pos, spec), pos, gamma, t, "interleaved", key=True)
    np.testing.assert_allclose(np.asarray(rq), ref["rq"].transpose(0, 2, 1, 3), rtol=2e-5,
                               atol=2e-5)  # fmt: skip
    np.testing.assert_allclose(np.asarray(rk), ref["rk"].transpose(0, 2, 1, 3), rtol=2e-5,
                               atol=2e-5)  # fmt: skip
    # pair 0's share of q_m . k_n is damped by zeta_0 ** ((m - n) / gamma), zeta_0 = 0.4 / 1.4
    one = jnp.zeros_like(q).at[..., :2].set(q[..., :2])  # interleaved pair 0 alone
    plain = lambda a, b: jnp.einsum("bnh,bnh->bn", a, b)
    r = lambda x: rotary.rotate(x, pos, spec)
    dq = attention.decay(r(one), pos, gamma, t, "interleaved")
    dk = attention.decay(r(jnp.zeros_like(k).at[..., :2].set(k[..., :2])), pos, gamma, t,
                         "interleaved", key=True)  # fmt: skip
    want = plain(r(one)[:, -1], r(jnp.zeros_like(k).at[..., :2].set(k[..., :2]))[:, 0])
    np.testing.assert_allclose(
        np.asarray(plain(dq[:, -1], dk[:, 0])),
        np.asarray(want) * (0.4 / 1.4) ** ((t - 1) / gamma),
        rtol=1e-4,
    )


def test_xpos_attention_is_relative():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 9, 2, 8)), jnp.float32) for _ in range(3))
    pos = jnp.arange(9.0)[None]
    out = lambda p: attention.attend(q, k, v, q_positions=p, k_positions=p, sites="qk",
                                     xpos=4.0, causal=True)  # fmt: skip
    np.testing.assert_allclose(np.asarray(out(pos)), np.asarray(out(pos + 37.0)), atol=2e-5)
    plain = attention.attend(q, k, v, q_positions=pos, k_positions=pos, sites="qk", causal=True)
    assert not np.allclose(np.asarray(out(pos)), np.asarray(plain), atol=1e-3)


def test_an_xpos_model_decodes_as_it_runs_whole():
    from tests.generate_test import assert_decodes_as_it_runs_whole, cfg

    model = model_lib.Decoder(cfg(**{"rope.xpos_scale_base": 8.0}), rngs=nnx.Rngs(0))
    assert all(block.attn.xpos == 8.0 for block in model.blocks)
    assert_decodes_as_it_runs_whole(model)


@pytest.mark.parametrize(
    "overrides, num_axes, message",
    [
        ({"rope.sites": "vo"}, 1, "needs sites with q and k, got model.rope.sites='vo'"),
        ({"attention.kv": "tied", "rope.sites": "qkvo"}, 1, "needs model.attention.kv='separate'"),
        ({}, 2, "the data has 2 position axes"),
        ({"rope.xpos_scale_base": -1.0}, 1, "must be a number >= 0"),
    ],
)
def test_xpos_where_it_has_no_meaning_is_one_line(overrides, num_axes, message):
    from tests.model_test import tiny_cfg

    cfg = tiny_cfg(**{"rope.xpos_scale_base": 512.0, **overrides})
    with pytest.raises(ValueError, match=message) as err:
        model_lib.Decoder(cfg, num_axes=num_axes, rngs=nnx.Rngs(0))
    assert "\n" not in str(err.value) and "model.rope.xpos_scale_base" in str(err.value)


def test_xpos_has_no_hf_export():
    from rope_jax.hf import config as hf_config
    from tests.model_test import tiny_cfg

    cfg = defaults.fill_model(tiny_cfg(**{"rope.xpos_scale_base": 512.0}))
    with pytest.raises(Exception, match="model.rope.xpos_scale_base.*xPos's decay has no HF"):
        hf_config.check_exportable(cfg)
