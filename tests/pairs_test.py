"""Tests for rope_jax.pairs: which pairs turn, each selection against a reference written
out pair by pair, its composition with the ladder and the context rules, HF's spelling."""

import jax.numpy as jnp
import numpy as np
import pytest

from rope_jax import defaults, pairs, rotary, scaling


def ladder(base, dim, count=None):
    """theta_i = base ** (-2i / dim), i < count (default dim / 2)."""
    return [base ** (-2 * i / dim) for i in range(dim // 2 if count is None else count)]


@pytest.mark.parametrize(
    "head_dim, fraction, turning",
    [(256, 0.25, 32), (128, 1.0, 64), (8, 0.5, 2), (6, 0.5, 1), (64, 0.0, 0)],
)
def test_proportional_is_the_whole_head_ladder_with_its_tail_frozen(head_dim, fraction, turning):
    spec = rotary.RopeSpec(base=1e6, pairs={"rule": "proportional", "fraction": fraction})
    got = rotary.frequencies(head_dim, spec)
    want = ladder(1e6, head_dim, turning) + [0.0] * (head_dim // 2 - turning)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    # under linear at factor f (HF's proportional with its factor): every pair / f
    scaled = rotary.frequencies(head_dim, spec, scaling={"rope_type": "linear", "factor": 2.0})
    np.testing.assert_allclose(scaled, np.asarray(want) / 2, rtol=1e-6, atol=0)


@pytest.mark.parametrize("head_dim, fraction", [(32, 0.5), (64, 0.25), (16, 1.0)])
def test_first_spreads_the_ladder_over_the_leading_block(head_dim, fraction):
    dim = int(head_dim * fraction)
    spec = rotary.RopeSpec(pairs={"rule": "first", "fraction": fraction})
    np.testing.assert_allclose(rotary.frequencies(head_dim, spec), ladder(1e4, dim), rtol=1e-6)
    assert spec.pairs.block(head_dim) == dim and not spec.pairs.selection.whole_head
    # a rule works on the block's ladder: yarn over D numbers, as transformers does
    rule = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    want, factor = scaling.scaled_frequencies(dim, base=1e4, scaling=rule)
    np.testing.assert_array_equal(rotary.frequencies(head_dim, spec, scaling=rule), want)
    assert rotary.attention_factor(head_dim, spec, scaling=rule) == factor


def test_index_turns_exactly_the_listed_pairs():
    spec = rotary.RopeSpec(pairs={"rule": "index", "index": [5, 0, 2]})
    assert spec.pairs.index == (0, 2, 5)
    got = rotary.frequencies(16, spec)
    want = np.asarray(ladder(1e4, 16))
    want[[1, 3, 4, 6, 7]] = 0.0
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    # the frozen pairs' numbers come out as they went in, the turning ones do not
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 6, 2, 16)), jnp.float32)
    pos = jnp.arange(6, dtype=jnp.float32)[None] + 3.0
    y = np.asarray(rotary.rotate(x, pos, spec))
    frozen = [1, 3, 4, 6, 7]
    for u in (frozen, [i + 8 for i in frozen]):  # layout half: pair i is (i, i + P)
        np.testing.assert_array_equal(y[..., u], np.asarray(x)[..., u])
    assert not np.allclose(y[..., [0, 8]], np.asarray(x)[..., [0, 8]])


def test_half_truncated_turns_half_the_pairs_on_a_ladder_over_them():
    """modded-nanogpt's half-truncated RoPE: the first P/2 pairs turn, on a ladder spread
    over them (theta_j = base ** (-j / (P/2))), the other half are frozen (frequency 0).
    (modded-nanogpt spaces its ladder with linspace over [0, 1], ends included; here the
    standard ladder's spacing, its last exponent 1 - 2/P, is kept.)"""
    got = rotary.frequencies(32, rotary.RopeSpec(pairs="half_truncated"))
    np.testing.assert_allclose(got, ladder(1e4, 16) + [0.0] * 8, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="divisible by 4"):
        rotary.frequencies(6, rotary.RopeSpec(pairs="half_truncated"))


def test_the_three_stages_compose_and_match_the_old_single_rule():
    """proportional under yarn: the whole-head ladder rescaled by yarn, the tail frozen;
    per-axis ladders over a leading block; a dynamic rule needs D >= 4 of the block."""
    rule = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    spec = rotary.RopeSpec(pairs={"rule": "proportional", "fraction": 0.5}, scaling=rule)
    yarn = scaling.scaled_frequencies(32, base=1e4, scaling=rule)[0]
    np.testing.assert_array_equal(rotary.frequencies(32, spec), np.r_[yarn[:8], np.zeros(8)])
    per_axis = rotary.RopeSpec(ladder="per_axis", pairs={"rule": "first", "fraction": 0.5})
    freqs, axes = rotary.pair_table(32, per_axis, num_axes=2)
    assert freqs.shape == axes.shape == (8,)
    np.testing.assert_allclose(freqs[axes == 0], ladder(1e4, 8), rtol=1e-6)
    tiny = rotary.RopeSpec(pairs={"rule": "first", "fraction": 0.125},
                           scaling={"rope_type": "dynamic", "factor": 2.0},
                           max_position_embeddings=8)  # fmt: skip
    with pytest.raises(ValueError, match="at least 4 head numbers, got D=2"):
        rotary.frequencies(16, tiny, seq_len=8)


HF_CASES = [
    ({}, pairs.PairSpec(), {}),
    ({"partial_rotary_factor": 1.0}, pairs.PairSpec(), {}),
    ({"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5},
     pairs.PairSpec("first", 0.5), {"rope_type": "yarn", "factor": 4.0}),
    ({"rope_type": "proportional", "partial_rotary_factor": 0.25},
     pairs.PairSpec("proportional", 0.25), {"rope_type": "default"}),
    ({"rope_type": "proportional", "factor": 2.0, "partial_rotary_factor": 0.5},
     pairs.PairSpec("proportional", 0.5), {"rope_type": "linear", "factor": 2.0}),
]  # fmt: skip


@pytest.mark.parametrize("given, want_pairs, want_rule", HF_CASES)
def test_hf_keys_become_pairs_and_a_rule_and_back(given, want_pairs, want_rule):
    got_pairs, got_rule = pairs.from_hf(given)
    assert got_pairs == want_pairs and got_rule == want_rule
    back = pairs.to_hf(got_pairs, scaling.check_scaling(got_rule, dim=None))
    again = pairs.from_hf(back)
    assert again[0] == want_pairs
    assert scaling.check_scaling(again[1], dim=None) == scaling.check_scaling(want_rule, dim=None)


def test_selections_without_an_hf_spelling_say_so():
    assert pairs.to_hf(pairs.PairSpec("index", index=(0, 1)), {"rope_type": "default"}) is None
    assert pairs.to_hf(pairs.PairSpec("half_truncated"), {"rope_type": "default"}) is None
    prop = pairs.PairSpec("proportional", 0.5)
    assert pairs.to_hf(prop, {"rope_type": "yarn", "factor": 4.0}) is None  # HF: one factor


BAD = [
    ({"rule": "sparse"}, "pairs.rule='sparse' is not one of"),
    ({"rule": "first"}, "pairs.rule='first' needs pairs.fraction"),
    ({"rule": "all", "fraction": 0.5}, "pairs.fraction=0.5 is not read by pairs.rule='all'"),
    ({"rule": "proportional", "fraction": 1.5}, r"pairs.fraction=1.5 must be a number in \[0, 1\]"),
    ({"rule": "index", "index": (1, 1)}, "names a pair twice"),
    ({"rule": "index", "index": (0.5,)}, "must be pair indices"),
    ({"rule": "index"}, "needs pairs.index"),
    ({"rule": "all", "mask": (1,)}, "pairs has unknown key 'mask'"),
]


@pytest.mark.parametrize("given, message", BAD, ids=[b[1][:30] for b in BAD])
def test_bad_selections_are_one_line(given, message):
    with pytest.raises(ValueError, match=message) as err:
        rotary.RopeSpec(pairs=given)
    assert "\n" not in str(err.value)


def test_a_selection_that_does_not_fit_the_head_is_one_line_at_the_table():
    with pytest.raises(ValueError, match=r"pairs.index=\(0, 9\) holds 9, not a pair of an H=16"):
        rotary.frequencies(16, pairs={"rule": "index", "index": (0, 9)})
    with pytest.raises(ValueError, match=r"D = int\(16 \* fraction\) must be even and >= 2"):
        rotary.frequencies(16, pairs={"rule": "first", "fraction": 0.2})


def test_a_length_reading_rule_needs_the_length_in_rotate():
    """A decode step has T = 1: a dynamic rule must be told the current length, not read
    it from x (it once defaulted to x's T and used length 1 silently)."""
    spec = rotary.RopeSpec(scaling={"rope_type": "dynamic", "factor": 2.0},
                           max_position_embeddings=8)  # fmt: skip
    x = jnp.ones((1, 1, 1, 16))
    with pytest.raises(ValueError, match="seq_len=None but rope_type='dynamic' needs it"):
        rotary.rotate(x, jnp.zeros((1, 1)), spec)
    long = rotary.rotate(x, jnp.full((1, 1), 30.0), spec, seq_len=32)
    short = rotary.rotate(x, jnp.full((1, 1), 30.0), spec, seq_len=8)
    assert not np.allclose(np.asarray(long), np.asarray(short))


# ------------------------------------------------------------- per-head selections

HEADS = ((0, 1, 5), (2, 3), (7,))  # one layer: the pairs of each of 3 kv heads (H = 16)


def test_heads_turns_each_kv_heads_own_pairs_and_its_query_heads_follow():
    """Query heads 2k, 2k + 1 (G = 2) turn kv head k's pairs, as `index` would turn them;
    the inverse undoes it."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 6, 16)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(5.0)[None] * 7, (2, 5))
    spec = rotary.RopeSpec(pairs={"rule": "heads", "index": (HEADS,)})
    y = rotary.rotate(x, pos, spec)
    for k, turning in enumerate(HEADS):
        one = rotary.RopeSpec(pairs={"rule": "index", "index": turning})
        want = rotary.rotate(x[:, :, 2 * k : 2 * k + 2], pos, one)
        np.testing.assert_array_equal(np.asarray(y[:, :, 2 * k : 2 * k + 2]), np.asarray(want))
    back = rotary.rotate(y, pos, spec, inverse=True)
    np.testing.assert_allclose(np.asarray(back), np.asarray(x), atol=1e-6)
    assert pairs.to_hf(spec.pairs, {"rope_type": "default"}) is None  # no HF spelling


def test_a_model_gives_each_layer_its_heads_and_equal_heads_are_the_index_rule():
    from flax import nnx

    from rope_jax.nn import model as model_lib
    from tests.model_test import tiny_cfg, tokens

    same = ((1, 3), (0, 2))  # 2 kv heads of an H = 8 head, both layers
    index = model_lib.Decoder(tiny_cfg(**{"rope.pairs": {"rule": "index", "index": (0, 2)}}),
                              rngs=nnx.Rngs(0))  # fmt: skip
    wide = ((0, 2), (0, 2))  # every head the index rule's pairs
    for layers, equal in [((wide, wide), True), ((same, same), False)]:
        cfg = tiny_cfg(**{"rope.pairs": {"rule": "heads", "index": layers}})
        model = model_lib.Decoder(cfg, rngs=nnx.Rngs(0))
        rotations = model_lib.layer_rotations(defaults.fill_model(cfg))
        assert [r.pairs.index for r in rotations] == [(layer,) for layer in layers]
        close = np.allclose(np.asarray(model(tokens())), np.asarray(index(tokens())), atol=1e-6)
        assert close == equal


@pytest.mark.parametrize(
    "layers, message",
    [
        ((((0,), (1,)),), "lists 1 layers; the model has num_layers=2"),
        ((((0,),), ((1,),)), "lists 1 kv heads in layer 0; the model has num_kv_heads=2"),
        ((((0,), (4,)),) * 2, r"holds 4, not a pair of an H=8 head"),
    ],
)
def test_per_head_selections_that_do_not_fit_the_model_are_one_line(layers, message):
    from rope_jax.nn import model as model_lib
    from tests.model_test import tiny_cfg

    cfg = tiny_cfg(**{"rope.pairs": {"rule": "heads", "index": layers}})
    with pytest.raises(ValueError, match=message) as err:
        model_lib.layer_rotations(defaults.fill_model(cfg))
    assert "\n" not in str(err.value) and str(err.value).startswith("model.rope.")


def test_a_per_head_selection_decodes_as_it_runs_whole():
    from flax import nnx

    from rope_jax.nn import model as model_lib
    from tests.generate_test import assert_decodes_as_it_runs_whole, cfg

    layers = (((0, 3), (1,)), ((2,), (0, 1, 2, 3)))
    model = model_lib.Decoder(cfg(**{"rope.pairs": {"rule": "heads", "index": layers}}),
                              rngs=nnx.Rngs(0))  # fmt: skip
    assert_decodes_as_it_runs_whole(model)
