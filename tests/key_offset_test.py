"""modded-nanogpt's partial key offset (`model.rope.key_offset`): a key's stationary
numbers are the previous token's; checked against modded-nanogpt's closed form, per
document, decoded as it runs whole, refused where it has no meaning."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rope_jax import defaults, rotary
from rope_jax.nn import attention
from rope_jax.nn import model as model_lib

H = 16


def test_the_offset_is_modded_nanogpts_closed_form_on_half_truncated_rope():
    """modded-nanogpt: k[:, 1:, :, H/4:H/2] = k[:, :-1, :, H/4:H/2], and the same for the
    last quarter (the rotate-half partners of its frozen pairs)."""
    k = jnp.asarray(np.random.default_rng(0).normal(size=(2, 7, 3, H)), jnp.float32)
    want = np.asarray(k).copy()
    for lo, hi in [(H // 4, H // 2), (3 * H // 4, H)]:
        want[:, 1:, :, lo:hi] = np.asarray(k)[:, :-1, :, lo:hi]
    still = rotary.stationary(H, pairs="half_truncated")
    np.testing.assert_array_equal(np.asarray(attention.offset_keys(k, still)), want)
    # partial rotation: the passed numbers are the stationary ones
    assert rotary.stationary(H, pairs={"rule": "first", "fraction": 0.25}).sum() == 12
    # a document's first key keeps its own
    starts = jnp.zeros((2, 7), bool).at[:, 4].set(True)
    got = np.asarray(attention.offset_keys(k, still, starts=starts))
    np.testing.assert_array_equal(got[:, 4], np.asarray(k)[:, 4])
    np.testing.assert_array_equal(got[:, 5], want[:, 5])


def _cfg(**extra):
    from tests.generate_test import cfg

    return cfg(**{"rope.pairs": {"rule": "half_truncated"}, "rope.key_offset": True, **extra})


def test_a_key_offset_model_decodes_as_it_runs_whole_and_differs_without_it():
    from tests.generate_test import (
        CHUNKS,
        assert_cached_equals_full,
        full_and_cached,
        text_pos,
        tokens,
    )

    model = model_lib.Decoder(_cfg(), rngs=nnx.Rngs(0))
    tok = tokens(1, 13)
    full, cached, index = full_and_cached(model, tok, text_pos(13), CHUNKS)
    assert_cached_equals_full(full, cached, index)
    plain = model_lib.Decoder(_cfg(**{"rope.key_offset": False}), rngs=nnx.Rngs(0))
    assert not np.allclose(np.asarray(plain(tok)), np.asarray(full), atol=1e-4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"rope.pairs": {"rule": "all"}}, "turns every pair: use a rule that freezes some"),
        ({"attention.kv": "tied", "rope.sites": "qkvo"}, "needs model.attention.kv='separate'"),
        ({"rope.key_offset": 1}, "model.rope.key_offset=1"),
    ],
)
def test_a_key_offset_where_it_has_no_meaning_is_one_line(overrides, message):
    with pytest.raises(ValueError, match=message) as err:
        model_lib.Decoder(_cfg(**overrides), rngs=nnx.Rngs(0))
    assert "\n" not in str(err.value) and "model.rope.key_offset" in str(err.value)


def test_a_key_offset_has_no_hf_export():
    from rope_jax.hf import config as hf_config

    cfg = defaults.fill_model(_cfg())
    with pytest.raises(Exception, match="model.rope.key_offset.*no HF class"):
        hf_config.check_exportable(cfg)
