"""Tests for the RoPE variants: context scaling in the spec, partial rotation, the
attention factor, NoPE layers, local/global bases, and their config fields.

References are written out here in NumPy float64 from Hugging Face's definitions
(`q * cos + rotate_half(q) * sin` on `q[..., :rotary_dim]`, cos and sin times the
attention factor); the frequencies come from `scaling.scaled_frequencies`, which
tests/scaling_test.py checks against its own references.
"""

import json
import os
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import common
from rope_jax import pairs as pairs_lib
from rope_jax import rotary, scaling
from rope_jax.harness import runfiles
from rope_jax.nn import attention
from rope_jax.nn import model as model_lib

# One worker runs the module: the ops its eager model passes run compile once.
pytestmark = pytest.mark.xdist_group("rope_variants")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H, T = 16, 20
P = H // 2
_LONG = {"short_factor": [1.0 + 0.1 * i for i in range(P)],
         "long_factor": [1.0 + 0.5 * i for i in range(P)]}  # fmt: skip
# (scaling dict, max_position_embeddings): every rule, partial rotation with three of them.
SCALINGS = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, None),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0}, 8),
    "yarn": ({"rope_type": "yarn", "factor": 4.0}, 8),
    "yarn_mscale": ({"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.5}, 8),
    "longrope": ({"rope_type": "longrope", **_LONG, "original_max_position_embeddings": 8}, 32),
    "llama3": (
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        8,
    ),  # fmt: skip
    "proportional": (
        {"rope_type": "proportional", "factor": 2.0, "partial_rotary_factor": 0.5},
        None,
    ),  # fmt: skip
    "default_partial": ({"partial_rotary_factor": 0.5}, None),
    "linear_partial": ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.25}, None),
    "yarn_partial": ({"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5}, 8),
}


def _spec(rule, **fields) -> rotary.RopeSpec:
    """The spec of an HF `rope_parameters` dict: its pairs (partial_rotary_factor,
    proportional) and its context rule, as `pairs.from_hf` reads them."""
    selection, rule = pairs_lib.from_hf(rule)
    return rotary.RopeSpec(pairs=selection, scaling=rule, **fields)


def _hf_inv_freq(rule, max_pos, seq_len=T):
    """transformers' inv_freq for an H-wide head: a rule's ladder over D = int(H * p)
    numbers; proportional's over the whole head, its first int(p * H // 2) pairs / f."""
    rule = dict(rule)
    p = rule.pop("partial_rotary_factor", 1.0)
    if rule.get("rope_type") == "proportional":
        inv = np.zeros(H // 2, np.float32)
        turning = int(p * H // 2)
        inv[:turning] = (10000.0 ** (-2.0 * np.arange(turning) / H)) / rule.get("factor", 1.0)
        return inv
    return scaling.scaled_frequencies(
        int(H * p), base=10000.0, scaling=rule, max_position_embeddings=max_pos, seq_len=seq_len
    )[0]


def _rng(seed=0):
    return np.random.default_rng(seed)


def _normal(shape, seed=0):
    return _rng(seed).normal(size=shape).astype(np.float32)


def hf_rotate(x, positions, inv_freq, layout, factor=1.0):
    """HF: the first rotary_dim = 2 len(inv_freq) numbers rotate, the rest pass through.

    half: q * cos + rotate_half(q) * sin with cos = cat(cos, cos) (LLaMA / GPT-NeoX);
    interleaved: the complex product on pairs (2i, 2i + 1). cos, sin times `factor`.
    x [B, T, N, H], positions [B, T] -> float64 [B, T, N, H].
    """
    x = np.asarray(x, np.float64)
    dim = 2 * len(inv_freq)
    rot, rest = x[..., :dim], x[..., dim:]
    phase = np.asarray(positions, np.float64)[..., None] * np.asarray(inv_freq, np.float64)
    cos, sin = factor * np.cos(phase)[:, :, None], factor * np.sin(phase)[:, :, None]
    if layout == "half":
        cos2, sin2 = np.concatenate([cos, cos], -1), np.concatenate([sin, sin], -1)
        half = dim // 2
        rotate_half = np.concatenate([-rot[..., half:], rot[..., :half]], -1)
        out = rot * cos2 + rotate_half * sin2
    else:
        z = (rot[..., 0::2] + 1j * rot[..., 1::2]) * (cos + 1j * sin)
        out = np.stack([z.real, z.imag], -1).reshape(rot.shape)
    return np.concatenate([out, rest], -1)


def hf_attention(q, k, v, positions, inv_freq, factor, layout):
    """Causal softmax attention with HF's rotation of q and k (cos, sin times factor)."""
    qr = hf_rotate(q, positions, inv_freq, layout, factor)
    kr = hf_rotate(k, positions, inv_freq, layout, factor)
    logits = np.einsum("btnh,bsnh->bnts", qr, kr) / np.sqrt(q.shape[-1])
    t = q.shape[1]
    logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", w, np.asarray(v, np.float64))


# ---------------------------------------------------------------- rotation ops


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("name", list(SCALINGS))
def test_rotate_with_scaling_equals_hf_reference(name, layout):
    rule, max_pos = SCALINGS[name]
    spec = _spec(rule, layout=layout, max_position_embeddings=max_pos)
    x = _normal((2, T, 3, H))
    pos = _rng(1).integers(0, 50, size=(2, T))
    inv_freq = _hf_inv_freq(rule, max_pos)
    got = rotary.rotate(jnp.asarray(x), jnp.asarray(pos), spec, seq_len=T)
    np.testing.assert_allclose(np.asarray(got), hf_rotate(x, pos, inv_freq, layout), atol=2e-5)
    np.testing.assert_array_equal(rotary.frequencies(H, spec, seq_len=T), inv_freq)


def test_length_rules_read_seq_len():
    rule, max_pos = SCALINGS["dynamic"]
    spec = rotary.RopeSpec(scaling=rule, max_position_embeddings=max_pos)
    short, long = (rotary.frequencies(H, spec, seq_len=n) for n in (8, 64))
    np.testing.assert_array_equal(short, rotary.frequencies(H))  # nothing changes up to L
    assert np.all(long[1:] < short[1:])  # a larger base past L
    with pytest.raises(ValueError, match="seq_len=None.*dynamic"):
        rotary.frequencies(H, spec)
    rule, max_pos = SCALINGS["longrope"]
    spec = rotary.RopeSpec(scaling=rule, max_position_embeddings=max_pos)
    np.testing.assert_allclose(
        rotary.frequencies(H, spec, seq_len=9) * np.asarray(_LONG["long_factor"]),
        rotary.frequencies(H, spec, seq_len=8) * np.asarray(_LONG["short_factor"]),
        rtol=1e-6,
    )


@pytest.mark.parametrize("head_dim", [8, 16, 64, 128])
@pytest.mark.parametrize("base", [10000.0, 500000.0])
def test_default_rope_type_is_todays_rotation_bit_for_bit(head_dim, base):
    for plain in ({"rope_type": "default"}, {"rope_type": "default", "partial_rotary_factor": 1.0},
                  {"partial_rotary_factor": None}):  # fmt: skip
        spec = _spec(plain, base=base, max_position_embeddings=64)
        assert spec == rotary.RopeSpec(base=base) and spec.scaling is None
    inv_freq, factor = scaling.scaled_frequencies(head_dim, base=base, scaling=None)
    np.testing.assert_array_equal(rotary.frequencies(head_dim, base=base), inv_freq)
    assert factor == 1.0 == rotary.attention_factor(head_dim, base=base)
    # the config's default scaling block builds today's spec, so today's decoder
    cfg = common.base_config("tiny").model
    assert model_lib.rotation(cfg, train_seq_len=128) == rotary.RopeSpec()


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("partial, rotated", [(0.5, 8), (0.25, 4)])
def test_partial_rotation_leaves_the_tail_and_rotates_like_a_smaller_head(layout, partial, rotated):
    spec = rotary.RopeSpec(layout=layout, pairs={"rule": "first", "fraction": partial})
    x = jnp.asarray(_normal((2, T, 3, H)))
    pos = jnp.asarray(_rng(1).uniform(0, 40, size=(2, T)), jnp.float32)
    y = rotary.rotate(x, pos, spec)
    np.testing.assert_array_equal(np.asarray(y[..., rotated:]), np.asarray(x[..., rotated:]))
    small = rotary.rotate(x[..., :rotated], pos, layout=layout)  # a whole head of `rotated`
    np.testing.assert_array_equal(np.asarray(y[..., :rotated]), np.asarray(small))
    assert not np.allclose(np.asarray(y[..., :rotated]), np.asarray(x[..., :rotated]))
    # the matrix form: identity on the tail, R_p x = rotate(x, p), inverse undoes it
    mat = rotary.rotation_matrix(pos[..., None], spec, head_dim=H)  # [B, T, H, H]
    np.testing.assert_array_equal(np.asarray(mat[0, 0, rotated:, rotated:]), np.eye(H - rotated))
    np.testing.assert_allclose(
        np.asarray(jnp.einsum("btij,btnj->btni", mat, x)), np.asarray(y), atol=1e-5
    )
    back = rotary.rotate(y, pos, spec, inverse=True)
    np.testing.assert_allclose(np.asarray(back), np.asarray(x), atol=1e-5)


def test_nd_positions_with_scaling_keep_the_allocation():
    """Standard ladder: the rule changes the frequencies, each pair keeps its axis, and
    text positions (n, n, n) still equal 1-D exactly."""
    rule = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
    for kw in (dict(allocation="alternating"), dict(allocation="sections", sections=(2, 3, 3))):
        spec = rotary.RopeSpec(scaling=rule, **kw)
        freqs, axes = rotary.pair_table(H, spec, num_axes=3)
        np.testing.assert_array_equal(freqs, rotary.frequencies(H, scaling=rule))
        np.testing.assert_array_equal(axes, rotary.axis_of_pair(H, num_axes=3, **kw))
        x = jnp.asarray(_normal((1, T, 2, H)))
        n = jnp.arange(T, dtype=jnp.float32)[None]
        nd = rotary.rotate(x, jnp.repeat(n[..., None], 3, -1), spec)
        one_d = rotary.rotate(x, n, scaling=rule)
        np.testing.assert_array_equal(np.asarray(nd), np.asarray(one_d))
    partial = {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}
    spec = _spec(partial, allocation="sections", sections=(2, 1, 1))
    assert rotary.axis_of_pair(H, spec, num_axes=3).tolist() == [0, 0, 1, 2]
    with pytest.raises(ValueError, match=r"sum to the rotated pairs P'=4"):
        rotary.pair_table(H, spec, num_axes=3, sections=(3, 3, 2))
    with pytest.raises(ValueError, match="ladder='per_axis' takes no scaling"):
        rotary.RopeSpec(ladder="per_axis", scaling={"rope_type": "linear", "factor": 2.0})


# ------------------------------------------------------------------- attention


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_attention_factor_multiplies_qk_logits_by_its_square(layout):
    rule = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
            "attention_factor": 1.7}  # fmt: skip
    spec = rotary.RopeSpec(layout=layout, scaling=rule)
    q, k, v = (_normal((1, T, 2, H), seed) for seed in (1, 2, 3))
    pos = np.broadcast_to(np.arange(T), (1, T))
    inv_freq, factor = scaling.scaled_frequencies(H, base=10000.0, scaling=rule)
    assert factor == rotary.attention_factor(H, spec) == 1.7
    kw = dict(q_positions=jnp.asarray(pos), k_positions=jnp.asarray(pos), causal=True)
    got = attention.attend(*map(jnp.asarray, (q, k, v)), sites="qk", rope=spec, **kw)
    want = hf_attention(q, k, v, pos, inv_freq, factor, layout)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)
    unscaled = hf_attention(q, k, v, pos, inv_freq, 1.0, layout)
    assert np.abs(want - unscaled).max() > 1e-2  # the factor matters here
    tied = attention.attend_tied(jnp.asarray(q), jnp.asarray(k), rope=spec, **kw)
    same = attention.attend(*map(jnp.asarray, (q, k, k)), sites="qkvo", rope=spec, **kw)
    np.testing.assert_allclose(np.asarray(tied), np.asarray(same), atol=1e-5)


@pytest.mark.parametrize("sites", ["vo", "v", "o", ""])
def test_value_and_output_sites_ignore_the_attention_factor(sites):
    """The factor scales logits only: values and outputs are never scaled."""
    rule = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
    with_factor = rotary.RopeSpec(scaling={**rule, "attention_factor": 3.0})
    without = rotary.RopeSpec(scaling={**rule, "attention_factor": 1.0})
    q, k, v = (jnp.asarray(_normal((1, T, 2, H), seed)) for seed in (1, 2, 3))
    pos = jnp.asarray(_rng(4).uniform(0, 30, size=(1, T)), jnp.float32)
    kw = dict(q_positions=pos, k_positions=pos, causal=True, sites=sites)
    a = attention.attend(q, k, v, rope=with_factor, **kw)
    b = attention.attend(q, k, v, rope=without, **kw)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


SHIFT_RULES = ["linear", "yarn", "llama3", "dynamic", "yarn_partial"]


@pytest.mark.parametrize("name", SHIFT_RULES)
def test_scaled_qk_attention_is_still_relative(name):
    rule, max_pos = SCALINGS[name]
    spec = _spec(rule, max_position_embeddings=max_pos)
    q, k, v = (jnp.asarray(_normal((2, T, 2, H), seed)) for seed in (1, 2, 3))
    pos = jnp.asarray(_rng(4).integers(0, 40, size=(2, T)), jnp.float32)
    out = lambda p: attention.attend(q, k, v, q_positions=p, k_positions=p, sites="qk",
                                     rope=spec, causal=True)  # fmt: skip
    np.testing.assert_allclose(np.asarray(out(pos + 173.0)), np.asarray(out(pos)), atol=2e-4)
    stretched = np.asarray(out(pos * 3.0))  # not a shift: attention changes
    assert np.abs(stretched - np.asarray(out(pos))).max() > 1e-3


# ----------------------------------------------------------------------- model


def small_model_config(**overrides):
    """The shipped config (placeholders included), shrunk; dotted overrides."""
    cfg = common.base_config("tiny").model
    cfg.update_from_flattened_dict(
        {
            "num_layers": 2,
            "embed_dim": 32,
            "num_heads": 2,
            "num_kv_heads": 1,
            "head_dim": H,
            "mlp_dim": 64,
            **overrides,
        }  # fmt: skip
    )
    return cfg


def _attn_out(block, x, positions):
    return np.asarray(block.attn(x, positions))


@pytest.mark.slow
def test_nope_every_makes_every_kth_layer_position_free():
    x = jnp.asarray(_normal((2, T, 32)))
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.float32), (2, T))[..., None]
    jumbled = jnp.asarray(_rng(5).uniform(0, 100, size=(2, T, 1)), jnp.float32)
    for kv, sites in (("separate", "qk"), ("tied", "qkvo")):
        cfg = small_model_config(
            **{
                "rope.nope_every": 2,
                "attention.kv": kv,
                "rope.sites": sites,
                "rope.scaling.rope_type": "linear",
                "rope.scaling.factor": 2.0,
            }  # fmt: skip
        )
        assert model_lib.layer_rotations(cfg)[1] is None
        net = model_lib.Decoder(cfg, rngs=nnx.Rngs(0))
        assert [b.attn.sites for b in net.blocks] == [sites, ""]
        layer0, layer1 = net.blocks
        np.testing.assert_array_equal(_attn_out(layer1, x, pos), _attn_out(layer1, x, jumbled))
        assert np.abs(_attn_out(layer0, x, pos) - _attn_out(layer0, x, jumbled)).max() > 1e-3
    every = model_lib.layer_rotations(small_model_config(num_layers=6, **{"rope.nope_every": 3}))
    assert [spec is None for spec in every] == [False, False, True, False, False, True]


def _check_decode_equals_forward(net, t=T):
    """Prefill t - 1 tokens, decode the last: the logits of one forward pass."""
    tok = jnp.asarray(_rng(6).integers(0, 259, size=(1, t)), jnp.int32)
    pos = jnp.arange(t, dtype=jnp.float32)[None, :, None]
    cache = net.init_cache(1, t)  # the cache length is the length dynamic / longrope read
    first, cache = net.decode(tok[:, :-1], pos[:, :-1], cache)
    last, _ = net.decode(tok[:, -1:], pos[:, -1:], cache)
    got = np.concatenate([np.asarray(first), np.asarray(last)], 1)
    np.testing.assert_allclose(got, np.asarray(net(tok)), atol=2e-4)


@pytest.mark.slow  # eager decoding: ~16 s for the first model on 2 loaded cores
@pytest.mark.parametrize("name", ["dynamic", "yarn", "longrope", "tied_nope"])
def test_decoding_with_a_scaled_model_equals_the_forward_pass(name):
    """dynamic / longrope read the cache length when decoding, T in the forward pass: equal
    here (the cache holds exactly T slots). A tied NoPE layer caches its latent unrotated."""
    cfg = small_model_config(**{"rope.max_position_embeddings": 8})
    if name == "tied_nope":
        cfg.update_from_flattened_dict({"attention.kv": "tied", "rope.sites": "qkvo",
                                        "rope.nope_every": 2})  # fmt: skip
        name = "yarn"
    cfg.rope.scaling = SCALINGS[name][0]  # a plain dict is accepted too
    _check_decode_equals_forward(model_lib.Decoder(cfg, rngs=nnx.Rngs(0)))


def test_local_and_global_layers_use_their_own_base():
    linear = {"rope.scaling.rope_type": "linear", "rope.scaling.factor": 4.0}
    cfg = small_model_config(**{"rope.local_base": 100.0, "rope.global_every": 2, **linear})
    local, glob = model_lib.layer_rotations(cfg)
    assert (local.base, local.scaling) == (100.0, None)  # no context rule on local layers
    assert glob.base == 10000.0 and glob.rope_type == "linear"
    mixed = model_lib.Decoder(cfg, rngs=nnx.Rngs(0))
    all_local = model_lib.Decoder(small_model_config(**{"rope.base": 100.0}), rngs=nnx.Rngs(0))
    all_global = model_lib.Decoder(small_model_config(**linear), rngs=nnx.Rngs(0))
    x = jnp.asarray(_normal((2, T, 32)))
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.float32), (2, T))[..., None]
    out = lambda net, i: _attn_out(net.blocks[i], x, pos)
    np.testing.assert_array_equal(out(mixed, 0), out(all_local, 0))
    np.testing.assert_array_equal(out(mixed, 1), out(all_global, 1))
    assert np.abs(out(mixed, 1) - out(all_local, 1)).max() > 1e-3
    partial = small_model_config(
        **{
            "rope.local_base": 100.0,
            "rope.global_every": 2,
            **linear,
            "rope.pairs.rule": "first",
            "rope.pairs.fraction": 0.5,
        }  # fmt: skip
    )
    local, glob = model_lib.layer_rotations(partial)
    assert local.scaling is None and local.pairs == glob.pairs == pairs_lib.PairSpec("first", 0.5)


BAD = [
    ({"rope.scaling.rope_type": "ntk"}, "model.rope.scaling.rope_type='ntk'"),
    ({"rope.scaling.rope_type": "linear"}, "model.rope.scaling is missing required key 'factor'"),
    ({"rope.scaling.rope_type": "linear", "rope.scaling.factor": 0.5},
     "model.rope.scaling.factor=0.5"),
    ({"rope.scaling.factor": 2.0}, "model.rope.scaling has unknown key 'factor'"),
    ({"rope.pairs.rule": "first", "rope.pairs.fraction": 0.1},
     "model.rope.pairs.fraction=0.1 with rule 'first'"),
    ({"rope.pairs.rule": "first"}, "model.rope.pairs.rule='first' needs pairs.fraction"),
    ({"rope.pairs.fraction": 0.5}, "model.rope.pairs.fraction=0.5 is not read by"),
    ({"rope.pairs.rule": "index", "rope.pairs.index": (0, 99)},
     "model.rope.pairs.index=.* holds 99"),
    ({"rope.pairs.rule": "sparse"}, "model.rope.pairs.rule='sparse' is not one of"),
    ({"rope.scaling.rope_type": "dynamic", "rope.scaling.factor": 2.0},
     "model.rope.max_position_embeddings=None"),
    ({"rope.scaling.rope_type": "yarn", "rope.scaling.factor": 2.0},
     "model.rope.scaling.original_max_position_embeddings is missing"),
    ({"rope.scaling.rope_type": "longrope", "rope.scaling.short_factor": (1.0,),
      "rope.scaling.long_factor": (1.0,) * P, "rope.max_position_embeddings": 8},
     "model.rope.scaling.short_factor=.*length P'=8"),
    ({"rope.max_position_embeddings": 0}, "model.rope.max_position_embeddings=0 is invalid"),
    ({"rope.ladder": "per_axis", "rope.scaling.rope_type": "linear", "rope.scaling.factor": 2.0},
     "model.rope.ladder='per_axis' takes no scaling"),
    ({"rope.nope_every": -1}, "model.rope.nope_every=-1 is invalid"),
    ({"rope.nope_every": True}, "model.rope.nope_every=True is invalid"),
    ({"rope.global_every": 2}, "model.rope.global_every=2 is invalid: needs model.rope.local_base"),
    ({"rope.local_base": 100.0}, "model.rope.local_base=100.0 is invalid: needs model.rope.global"),
    ({"rope.local_base": 1.0, "rope.global_every": 2}, "model.rope.local_base=1.0 is invalid"),
]  # fmt: skip


@pytest.mark.parametrize("overrides, message", BAD, ids=[m.split("=")[0] for _, m in BAD])
def test_config_errors_are_one_line_naming_the_field(overrides, message):
    cfg = small_model_config()
    for key, value in overrides.items():  # placeholders keep their type; plain sets for the rest
        section, _, leaf = key.rpartition(".")
        node = cfg
        for part in section.split("."):
            node = node[part]
        with node.ignore_type():
            node[leaf] = value
    with pytest.raises(ValueError) as err:
        model_lib.check_config(cfg)
    text = str(err.value)
    assert "\n" not in text and text.startswith("model.rope."), text
    assert re.match(message, text), text


def test_config_placeholders_take_their_type_and_the_command_line():
    cfg = common.base_config("tiny")
    cfg.update_from_flattened_dict({"model.rope.scaling.factor": 4})
    assert cfg.model.rope.scaling.factor == 4.0 and isinstance(cfg.model.rope.scaling.factor, float)
    assert cfg.model.rope.scaling.get_type("short_factor") is tuple
    assert cfg.model.rope.get_type("max_position_embeddings") is int
    code = (
        "import sys; from absl import flags; from ml_collections import config_flags;"
        "config_flags.DEFINE_config_file('config', None); F = flags.FLAGS; F(sys.argv);"
        "r = F.config.model.rope; print(r.scaling.factor, r.scaling.truncate, r.nope_every)"
    )  # config_flags reads the --config.* overrides from sys.argv, as train.py gets them
    args = ["--config=configs/lm.py:size=tiny", "--config.model.rope.scaling.rope_type=yarn",
            "--config.model.rope.scaling.factor=4", "--config.model.rope.nope_every=4",
            "--config.model.rope.scaling.truncate=false"]  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": ROOT}, check=True)  # fmt: skip
    assert out.stdout.split() == ["4.0", "False", "4"]


@pytest.mark.slow
def test_a_saved_scaled_config_loads_and_builds_the_same_model(tmp_path):
    config = common.base_config("tiny")
    config.model.update_from_flattened_dict(
        {
            "num_layers": 1,
            "embed_dim": 32,
            "num_heads": 2,
            "num_kv_heads": 1,
            "mlp_dim": 64,
            "rope.scaling.rope_type": "linear",
            "rope.scaling.factor": 2.0,
        }  # fmt: skip
    )
    runfiles.save_config(str(tmp_path), config)
    loaded = runfiles.load_config(str(tmp_path))
    assert (
        json.loads((tmp_path / "config.json").read_text())["model"]["rope"]["scaling"]["factor"]
        == 2.0
    )
    seq_len = config.data.seq_len
    a = model_lib.Decoder(config.model, train_seq_len=seq_len, rngs=nnx.Rngs(0))
    b = model_lib.Decoder(loaded.model, train_seq_len=seq_len, rngs=nnx.Rngs(0))
    spec = model_lib.rotation(loaded.model, train_seq_len=seq_len)
    assert spec.rope_type == "linear" and spec.max_position_embeddings == seq_len
    assert spec == model_lib.rotation(config.model, train_seq_len=seq_len)
    np.testing.assert_array_equal(rotary.frequencies(32, spec), rotary.frequencies(32) / 2)
    tok = jnp.asarray(_rng(7).integers(0, 259, size=(1, 24)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(a(tok)), np.asarray(b(tok)))
    assert np.isfinite(np.asarray(b(tok))).all()


def _four_steps(config, data_dir) -> None:
    """A run of four steps at T = 32 on `data_dir`, checkpointed at its end."""
    config.data.data_dir = data_dir
    config.data.seq_len, config.data.global_batch_size = 32, 8
    config.optim.warmup_steps = 2
    config.train.num_steps, config.train.log_every_steps = 4, 2
    config.train.eval_every_steps, config.train.ckpt_every_steps = 0, 4
    config.eval.num_batches, config.eval.batch_size = 1, 8


@pytest.mark.slow
def test_a_model_trained_with_linear_scaling_evaluates_under_its_own_and_another_rule(
    data_dir, tmp_path
):
    """Train a few steps with scaling=linear factor 2, evaluate at 1x and 2x; then the same
    checkpoint under yarn through evaluate_checkpoint(rope_scaling=...) (eval.py's
    --rope_scaling), written beside the first result with a tag."""
    import eval as eval_lib
    import train
    from configs import lm

    config = lm.get_config("size=tiny")
    m = config.model
    m.num_layers, m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = (
        1,
        32,
        2,
        1,
        16,
        64,
    )
    m.rope.scaling.rope_type, m.rope.scaling.factor = "linear", 2.0
    _four_steps(config, data_dir)
    workdir = str(tmp_path / "linear")
    train.train_and_evaluate(config, workdir)
    saved = json.load(open(os.path.join(workdir, "config.json")))
    assert saved["model"]["rope"]["scaling"]["rope_type"] == "linear"
    result = eval_lib.evaluate_checkpoint(workdir, seq_lens=[32, 64], num_batches=1)
    assert all(np.isfinite(result[k]["loss"]) for k in ("32", "64"))

    yarn = {"rope_type": "yarn", "factor": 2.0}
    with pytest.raises(ValueError, match="--rope_scaling evaluates another model .* --tag"):
        eval_lib.evaluate_checkpoint(workdir, seq_lens=[32, 64], num_batches=1, rope_scaling=yarn)
    other = eval_lib.evaluate_checkpoint(
        workdir, seq_lens=[32, 64], num_batches=1, tag="yarn", rope_scaling=yarn,
        max_position_embeddings=32,
    )  # fmt: skip
    assert json.load(open(os.path.join(workdir, "config.json"))) == saved  # left as trained
    assert (
        json.load(open(os.path.join(workdir, "eval_4_yarn.json")))["settings"]["rope_scaling"]
        == yarn
    )
    assert np.isfinite(other["64"]["loss"]) and other["64"]["loss"] != result["64"]["loss"]


@pytest.mark.parametrize(
    "rule,error",
    [
        (None, "changes no rotation under rope_type='default', which reads no length here"),
        ({"rope_type": "linear", "factor": 2.0}, "changes no rotation under rope_type='linear'"),
        (
            {
                "rope_type": "llama3",
                "factor": 2.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "changes no rotation under rope_type='llama3'",
        ),
        (
            {"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
            None,
        ),  # its original length defaults to L, which it then reads
        ({"rope_type": "dynamic", "factor": 2.0}, None),
        ({"rope_type": "yarn", "factor": 2.0}, None),
    ],
)
def test_a_max_position_embeddings_no_rule_reads_is_refused_not_ignored(rule, error):
    """eval.py --max_position_embeddings under a rule that reads no length used to write a
    tagged result equal to the run's own (and a continuation the same as without it)."""
    from configs import lm
    from rope_jax.harness.evaluate import with_rope_scaling

    config = lm.get_config("size=tiny")  # trained at T = 128
    if error is None:
        out = with_rope_scaling(config, rule, max_position_embeddings=512)
        assert out.model.rope.max_position_embeddings == 512
    else:
        with pytest.raises(ValueError, match=re.escape(f"--max_position_embeddings=512 {error}")):
            with_rope_scaling(config, rule, max_position_embeddings=512)
    assert with_rope_scaling(config, rule, max_position_embeddings=128)  # its own, said again


def test_a_rule_given_at_evaluation_keeps_the_runs_rotated_slice():
    """A run that rotates an eighth of each head (V4's slice), evaluated under dynamic NTK:
    at its own T the rule changes nothing, so every pair's angle is the run's own; the
    rule once replaced the rotated share with 1 (the whole head rotating). Which pairs
    turn is the model's: --rope_scaling cannot say it."""
    from configs import lm
    from rope_jax import harness
    from rope_jax.harness.evaluate import with_rope_scaling

    config = lm.get_config("size=tiny,row=v4")
    rule = {"rope_type": "dynamic", "factor": 4.0}
    out = with_rope_scaling(config, rule, max_position_embeddings=128)
    assert (out.model.rope.pairs.rule, out.model.rope.pairs.fraction) == ("first", 0.125)
    assert out.model.rope.scaling.rope_type == "dynamic"
    head_dim, t = config.model.head_dim, config.data.seq_len
    tables = [
        rotary.pair_table(head_dim, model_lib.rotation(c.model, 1, train_seq_len=t), seq_len=t)[0]
        for c in (harness.resolve(config), out)
    ]
    np.testing.assert_array_equal(*tables)
    with pytest.raises(ValueError, match=r"--rope_scaling: .*'partial_rotary_factor'.*"
                       r"model.rope.pairs"):  # fmt: skip
        with_rope_scaling(config, {**rule, "partial_rotary_factor": 1.0})


def _proportional_tiny():
    from configs import lm

    config = lm.get_config("size=tiny")
    config.model.rope.pairs.rule, config.model.rope.pairs.fraction = "proportional", 0.5
    return config


def test_a_proportional_run_under_another_rule_keeps_its_pairs():
    """Evaluating a p-RoPE run (half the pairs frozen) under yarn once kept only the
    rotated share and rotated the first half of the head on yarn's ladder: a different
    model, read silently (2.618 against 2.478 as trained). Now the rule alone changes:
    yarn at factor 1 changes no frequency, so the table is the run's own."""
    from rope_jax import harness
    from rope_jax.harness.evaluate import with_rope_scaling

    config = _proportional_tiny()
    out = with_rope_scaling(config, {"rope_type": "yarn", "factor": 1.0})
    head_dim, t = config.model.head_dim, config.data.seq_len
    own, other = (
        model_lib.rotation(c.model, 1, train_seq_len=t) for c in (harness.resolve(config), out)
    )
    assert other.rope_type == "yarn" and other.pairs == own.pairs
    np.testing.assert_array_equal(rotary.frequencies(head_dim, own),
                                  rotary.frequencies(head_dim, other))  # fmt: skip
    assert rotary.attention_factor(head_dim, other) == 1.0
    # a config saved before `pairs` existed (HF's keys in the scaling section) reads the same
    old = harness.resolve(config).to_dict()
    old["model"]["rope"].pop("pairs")
    old["model"]["rope"]["scaling"].update(rope_type="proportional", partial_rotary_factor=0.5)
    assert model_lib.rotation(harness.resolve(old).model, 1, train_seq_len=t) == own


@pytest.mark.slow
def test_a_trained_proportional_run_scores_the_same_under_yarn_at_factor_one(data_dir, tmp_path):
    """The end-to-end form of the rule swap: train a p-RoPE run a few steps, evaluate it as
    trained and under yarn at factor 1 (no frequency changes): the same loss."""
    import eval as eval_lib
    import train

    config = _proportional_tiny()
    _four_steps(config, data_dir)
    workdir = str(tmp_path / "prope")
    train.train_and_evaluate(config, workdir)
    own = eval_lib.evaluate_checkpoint(workdir, seq_lens=[32], num_batches=1)
    yarn = eval_lib.evaluate_checkpoint(
        workdir,
        seq_lens=[32],
        num_batches=1,
        tag="yarn1",
        rope_scaling={"rope_type": "yarn", "factor": 1.0},
    )
    assert np.isfinite(own["32"]["loss"])
    np.testing.assert_allclose(yarn["32"]["loss"], own["32"]["loss"], rtol=1e-6)
