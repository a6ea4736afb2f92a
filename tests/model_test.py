"""Tests for rope_jax.model: shapes, config validation, causality, precision, harness."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx
from flax.core import spmd as flax_spmd
from jax.sharding import PartitionSpec as P

from rope_jax import defaults
from rope_jax.nn import layers
from rope_jax.nn import model as model_lib

B, T = 2, 12


def tiny_cfg(**overrides):
    """A small config.model; overrides use dotted names ("rope.sites")."""
    cfg = ml_collections.ConfigDict(
        dict(
            vocab_size=19,
            num_layers=2,
            embed_dim=32,
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            mlp_dim=64,
            dtype="float32",
            param_dtype="float32",
            patch_dim=0,
            attention=dict(kv="separate"),
            rope=dict(
                sites="qk",
                base=10000.0,
                ladder="standard",
                layout="half",
                allocation="alternating",
                sections=(),
            ),
        )
    )
    cfg.update_from_flattened_dict(overrides)
    return cfg


def tokens(seed=0, b=B, t=T, vocab=19):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, size=(b, t)), jnp.int32)


# ------------------------------------------------------------------------ forward


@pytest.mark.parametrize("sites", ["", "qk", "vo", "qkvo"])
def test_text_forward_shape_and_dtype(sites):
    model = model_lib.Decoder(tiny_cfg(**{"rope.sites": sites}), rngs=nnx.Rngs(0))
    logits = model(tokens())
    assert logits.shape == (B, T, 19) and logits.dtype == jnp.float32
    assert np.all(np.isfinite(logits))
    # initial loss is near log(V): the init is sane
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens(1)).mean()
    assert abs(float(loss) - np.log(19)) < 1.0


def test_patch_forward():
    cfg = tiny_cfg(patch_dim=6, **{"rope.sites": "qkvo"})
    model = model_lib.Decoder(cfg, num_axes=3, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    patches = jnp.asarray(rng.normal(size=(B, T, 6)), jnp.float32)
    is_patch = jnp.zeros((B, T), bool).at[:, 3:9].set(True)
    pos = jnp.asarray(rng.uniform(0, 10, size=(B, T, 3)), jnp.float32)
    tok = tokens()
    logits = model(tok, pos, patches=patches, is_patch=is_patch)
    assert logits.shape == (B, T, 19) and logits.dtype == jnp.float32
    # tokens under patches are ignored; the patch vectors are not
    same = model(tok.at[:, 4].set(0), pos, patches=patches, is_patch=is_patch)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(same))
    other = model(tok, pos, patches=patches.at[:, 4].add(1.0), is_patch=is_patch)
    assert float(jnp.max(jnp.abs(other[:, 4:] - logits[:, 4:]))) > 1e-3
    np.testing.assert_allclose(np.asarray(other[:, :4]), np.asarray(logits[:, :4]), atol=1e-6)


def test_patches_without_patch_dim_raise():
    model = model_lib.Decoder(tiny_cfg(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="patch_dim"):
        model(tokens(), patches=jnp.zeros((B, T, 4)), is_patch=jnp.ones((B, T), bool))
    with pytest.raises(ValueError, match="positions"):
        model(tokens(), jnp.zeros((B, T, 3)))


@pytest.mark.parametrize("sites", ["qk", "vo"])
def test_causal(sites):
    """Changing token t leaves logits before t unchanged and changes them from t on."""
    model = model_lib.Decoder(tiny_cfg(**{"rope.sites": sites}), rngs=nnx.Rngs(1))
    tok = tokens(2)
    t = 7
    base, changed = model(tok), model(tok.at[:, t].set((tok[:, t] + 1) % 19))
    np.testing.assert_allclose(np.asarray(base[:, :t]), np.asarray(changed[:, :t]), atol=1e-6)
    assert float(jnp.max(jnp.abs(base[:, t:] - changed[:, t:]))) > 1e-3


def test_text_positions_default_and_degeneracy():
    """positions=None == arange(T) on all axes; on text, 3-D sections RoPE == 1-D RoPE."""
    nd = {"rope.allocation": "sections", "rope.sections": (1, 1, 2)}
    model3 = model_lib.Decoder(tiny_cfg(**nd), num_axes=3, rngs=nnx.Rngs(3))
    model1 = model_lib.Decoder(tiny_cfg(), rngs=nnx.Rngs(3))  # same seed -> same params
    tok = tokens(4)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.float32)[None, :, None], (B, T, 3))
    default = model3(tok)
    np.testing.assert_array_equal(np.asarray(default), np.asarray(model3(tok, pos)))
    np.testing.assert_allclose(np.asarray(default), np.asarray(model1(tok)), atol=1e-5)
    assert float(jnp.max(jnp.abs(default - model3(tok, pos * 1.5)))) > 1e-3  # positions matter


def test_bfloat16_compute():
    tok = tokens(5)
    f32 = model_lib.Decoder(tiny_cfg(), rngs=nnx.Rngs(4))(tok)
    bf16 = model_lib.Decoder(tiny_cfg(dtype="bfloat16"), rngs=nnx.Rngs(4))(tok)
    assert bf16.dtype == jnp.float32
    err = float(jnp.max(jnp.abs(bf16 - f32)))
    assert 0 < err < 0.05 * float(jnp.max(jnp.abs(f32))) + 0.02, err


def test_rms_norm():
    norm = layers.RMSNorm(16, param_dtype=jnp.float32)
    x = jnp.asarray(np.random.default_rng(6).normal(size=(3, 16)), jnp.float32)
    y = norm(x)
    np.testing.assert_allclose(np.sqrt(np.mean(np.square(y), -1)), 1.0, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(norm(7.0 * x)), np.asarray(y), rtol=1e-4, atol=1e-6)


def test_count_params():
    cfg = tiny_cfg()
    d, n, k, h, f, v, layers = 32, 4, 2, 8, 64, 19, 2
    per_block = 2 * d + d * n * h + 2 * d * k * h + n * h * d + 3 * d * f
    expected = v * d + layers * per_block + d + d * v
    assert model_lib.count_params(model_lib.Decoder(cfg, rngs=nnx.Rngs(0))) == expected
    with_patches = model_lib.Decoder(tiny_cfg(patch_dim=5), rngs=nnx.Rngs(0))
    assert model_lib.count_params(with_patches) == expected + 5 * d


def test_params_carry_logical_names():
    params = nnx.state(model_lib.Decoder(tiny_cfg(patch_dim=5), rngs=nnx.Rngs(0)), nnx.Param)
    names = {
        "/".join(map(str, path)): (var.get_metadata().get("out_sharding"), var.ndim)
        for path, var in nnx.to_flat_state(params)
    }
    for path, (axes, ndim) in names.items():
        assert axes is not None and len(axes) == ndim, path
    assert names["embed"][0] == ("vocab", "embed")
    assert names["patch_embed"][0] == ("patch", "embed")
    assert names["head"][0] == ("embed", "vocab")
    assert names["blocks/0/attn/q_proj"][0] == ("embed", "heads", "head_dim")
    assert names["blocks/1/attn/k_proj"][0] == ("embed", "kv_heads", "head_dim")
    assert names["blocks/1/attn/o_proj"][0] == ("heads", "head_dim", "embed")
    assert names["blocks/0/mlp/down"][0] == ("mlp", "embed")
    assert names["blocks/0/mlp_norm/scale"][0] == ("embed",)
    # flax's own reader sees them too, mapped through logical rules in context
    with flax_spmd.logical_axis_rules((("embed", "fsdp"), ("vocab", "tensor"))):
        assert nnx.get_partition_spec(params)["head"].get_value() == P("fsdp", "tensor")


BAD_CONFIGS = [
    ({"rope.sites": "qx"}, "model.rope.sites='qx'"),
    ({"rope.sites": "kk"}, "model.rope.sites='kk'"),
    ({"head_dim": 7}, "model.head_dim=7"),
    ({"num_heads": 4, "num_kv_heads": 3}, "model.num_kv_heads=3"),
    ({"rope.allocation": "sections", "rope.sections": (2, 2)}, "model.rope.sections"),
    (
        {"rope.allocation": "sections", "num_axes": 3, "rope.sections": (1, 1)},
        "model.rope.sections=(1, 1)",
    ),
    (
        {"rope.allocation": "sections", "num_axes": 3, "rope.sections": (1, 1, 1)},
        "sum to head_dim/2=4",
    ),
    ({"rope.ladder": "linear"}, "model.rope.ladder='linear'"),
    ({"rope.layout": "neox"}, "model.rope.layout='neox'"),
    ({"rope.allocation": "random"}, "model.rope.allocation='random'"),
    ({"rope.base": 1.0}, "model.rope.base=1.0"),
    ({"num_axes": 0}, "num_axes=0"),
    ({"dtype": "float16"}, "model.dtype='float16'"),
    ({"param_dtype": "int8"}, "model.param_dtype='int8'"),
    ({"vocab_size": 0}, "model.vocab_size=0"),
    ({"num_layers": -1}, "model.num_layers=-1"),
    ({"embed_dim": 0}, "model.embed_dim=0"),
    ({"mlp_dim": 0}, "model.mlp_dim=0"),
    ({"patch_dim": -2}, "model.patch_dim=-2"),
    ({"remat": "full"}, "model.remat='full'"),
    ({"attention.kv": "shared"}, "model.attention.kv='shared'"),
]


@pytest.mark.parametrize("overrides,message", BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_check_config(overrides, message):
    """`num_axes` (the data's position axes) is passed beside the model config."""
    overrides = dict(overrides)
    num_axes = overrides.pop("num_axes", 1)
    cfg = tiny_cfg(**overrides)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        model_lib.check_config(cfg, num_axes)
    with pytest.raises(ValueError, match="model.|num_axes"):
        model_lib.Decoder(cfg, num_axes=num_axes, rngs=nnx.Rngs(0))


def test_check_config_accepts_valid():
    model_lib.check_config(tiny_cfg())
    model_lib.check_config(
        tiny_cfg(**{"rope.allocation": "sections", "rope.sections": (2, 1, 1)}), num_axes=3
    )


@pytest.mark.parametrize("sites", ["", "qk", "vo", "qkv", "kvo"])
def test_tied_needs_qkvo_sites(sites):
    cfg = tiny_cfg(**{"attention.kv": "tied", "rope.sites": sites})
    message = f"model.attention.kv='tied' needs model.rope.sites='qkvo'.*model.rope.sites={sites!r}"
    with pytest.raises(ValueError, match=message):
        model_lib.check_config(cfg)
    model_lib.check_config(tiny_cfg(**{"attention.kv": "tied", "rope.sites": "qkvo"}))


def test_config_without_attention_field_is_separate():
    """Configs saved before model.attention existed build the same separate-KV model."""
    old = tiny_cfg()
    del old["attention"]
    assert defaults.fill_model(old).attention.kv == "separate"
    a = model_lib.Decoder(old, rngs=nnx.Rngs(0))(tokens())
    b = model_lib.Decoder(tiny_cfg(), rngs=nnx.Rngs(0))(tokens())
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------ tied key/value


@pytest.mark.slow
def test_tied_model_params_cache_and_gradients():
    sep_cfg = tiny_cfg(**{"rope.sites": "qkvo"})
    tied_cfg = tiny_cfg(**{"attention.kv": "tied", "rope.sites": "qkvo"})
    sep, tied = (model_lib.Decoder(c, rngs=nnx.Rngs(0)) for c in (sep_cfg, tied_cfg))
    d, k, h, layers = 32, 2, 8, 2
    assert model_lib.count_params(sep) - model_lib.count_params(tied) == layers * d * k * h
    assert model_lib.kv_cache_bytes_per_token(sep_cfg) == layers * k * h * 2 * 4
    assert model_lib.kv_cache_bytes_per_token(tied_cfg) == layers * k * h * 4
    bf16 = tiny_cfg(dtype="bfloat16", **{"attention.kv": "tied", "rope.sites": "qkvo"})
    assert model_lib.kv_cache_bytes_per_token(bf16) == layers * k * h * 2
    x = tokens(7)

    def loss(m):
        return optax.softmax_cross_entropy_with_integer_labels(m(x[:, :-1]), x[:, 1:]).mean()

    value, grads = nnx.jit(nnx.value_and_grad(loss))(tied)  # one compile, not op by op
    assert np.isfinite(float(value))
    leaves = jax.tree.leaves(grads)
    assert leaves and all(np.all(np.isfinite(g)) for g in leaves)
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in leaves)  # every weight is used
    names = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(tied, nnx.Param))}
    assert "blocks/0/attn/kv_proj" in names and "blocks/0/attn/k_proj" not in names


def test_tied_model_is_relative_and_equals_tied_weight_separate_model():
    """Shifting every position leaves the logits; same as separate qkvo with W_k = W_v."""
    cfg = tiny_cfg(**{"attention.kv": "tied", "rope.sites": "qkvo"})
    tied = model_lib.Decoder(cfg, num_axes=2, rngs=nnx.Rngs(2))
    sep = model_lib.Decoder(tiny_cfg(**{"rope.sites": "qkvo"}), num_axes=2, rngs=nnx.Rngs(2))
    flat = dict(nnx.to_flat_state(nnx.state(tied, nnx.Param)))
    for path, var in nnx.to_flat_state(nnx.state(sep, nnx.Param)):
        name = path[:-1] + ("kv_proj",) if path[-1] in ("k_proj", "v_proj") else path
        var[...] = flat[name][...]
    tok = tokens(8)
    pos = jnp.asarray(np.random.default_rng(9).uniform(0, 20, size=(B, T, 2)), jnp.float32)
    logits = tied(tok, pos)
    np.testing.assert_allclose(np.asarray(sep(tok, pos)), np.asarray(logits), atol=1e-5)
    shifted = tied(tok, pos + jnp.asarray([100.0, -37.5]))
    np.testing.assert_allclose(np.asarray(shifted), np.asarray(logits), atol=2e-4)


# ----------------------------------------------------------------------- training


@pytest.mark.slow
def test_tiny_model_learns_repeating_sequence():
    model = model_lib.Decoder(tiny_cfg(**{"rope.sites": "vo"}), rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    seq = jnp.tile(jnp.asarray([3, 1, 4, 1, 5, 9, 2, 6], jnp.int32), (4, 3))  # [4, 24]

    @nnx.jit
    def train_step(model, optimizer, seq):
        def loss_fn(model):
            logits = model(seq[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, seq[:, 1:]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(train_step(model, optimizer, seq)) for _ in range(30)]
    assert losses[-1] < 0.3 * losses[0], losses


@pytest.mark.slow
def test_block_remat_gives_the_same_loss_and_gradients():
    x = tokens(3)

    def loss_and_grads(remat):
        net = model_lib.Decoder(tiny_cfg(remat=remat, **{"rope.sites": "qkvo"}), rngs=nnx.Rngs(0))

        def loss(m):
            return jnp.mean(jax.nn.log_softmax(m(x))[..., 0])

        return nnx.jit(nnx.value_and_grad(loss))(net)

    (l0, g0), (l1, g1) = loss_and_grads("none"), loss_and_grads("block")
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------ sinks and sliding layers


def attention_cfg(**attention):
    cfg = tiny_cfg()
    for key, value in attention.items():
        cfg.attention[key] = value
    return cfg


BAD_ATTENTION = [
    (dict(window=-1), "model.attention.window=-1 is invalid: must be a non-negative integer"),
    (dict(window=2.5), "model.attention.window=2.5: .* cannot be casted to type <class 'int'>"),
    (dict(window=12), "model.attention.window=12 is invalid: must be below data.seq_len=12"),
    (dict(window=4, layer_types=("sliding",)),
     r"model.attention.layer_types=\('sliding',\) is invalid: has 1 entries: needs one per "
     r"layer \(model.num_layers=2\)"),
    (dict(layer_types=("sliding", "full")), "has 'sliding' layers but model.attention.window=0"),
    (dict(window=4, layer_types=("full", "full")), "model.attention.window=4 is invalid: has no "
     "sliding layer"),
    (dict(window=4, layer_types=("full", "local")), "has 'local': each must be one of 'full', "
     "'sliding'"),
    (dict(window=4, layer_types="sliding"), "model.attention.layer_types='sliding': .* type "
     "<class 'tuple'>"),
    (dict(sinks=1), "model.attention.sinks=1: .* type <class 'bool'>"),
]  # fmt: skip


@pytest.mark.parametrize("attention,message", BAD_ATTENTION, ids=[m[:40] for _, m in BAD_ATTENTION])
def test_bad_sinks_windows_and_layer_types_are_one_line_before_compiling(attention, message):
    with pytest.raises(ValueError, match=message):
        model_lib.check_config(attention_cfg(**attention), train_seq_len=12)


def test_the_section_checks_its_own_types_when_filled_in_place():
    """A caller's section that bypasses the typed defaults is checked by the model."""
    from rope_jax.nn import sliding

    attention = ml_collections.ConfigDict(dict(sinks=1, window=0, layer_types=()))
    with pytest.raises(ValueError, match="model.attention.sinks=1 is invalid: must be True"):
        sliding.layer_windows(attention, 2)
    attention = ml_collections.ConfigDict(dict(sinks=False, window=0, layer_types="full"))
    with pytest.raises(ValueError, match="layer_types='full' is invalid: must be a tuple"):
        sliding.layer_windows(attention, 2)


def test_layer_types_default_to_all_sliding_with_a_window():
    from rope_jax.nn import sliding

    checked = lambda **a: model_lib.check_config(attention_cfg(**a)).attention
    windows = lambda **a: sliding.layer_windows(checked(**a), 2)
    assert windows() == (None, None)
    assert windows(window=4) == (4, 4)  # Mistral: every layer
    assert windows(window=4, layer_types=("full", "sliding")) == (None, 4)
    model = model_lib.Decoder(attention_cfg(window=4, layer_types=("full", "sliding")),
                              rngs=nnx.Rngs(0))  # fmt: skip
    assert [b.attn.window for b in model.blocks] == [None, 4]


def test_sinks_are_a_zero_initialised_heads_parameter_only_when_asked():
    """No new parameter without sinks: checkpoints of earlier runs restore as they were."""
    flat = lambda cfg: {
        "/".join(map(str, path)): var
        for path, var in nnx.to_flat_state(nnx.state(model_lib.Decoder(cfg, rngs=nnx.Rngs(0)),
                                                     nnx.Param))
    }  # fmt: skip
    old = tiny_cfg()  # a config saved before the fields existed, filled by the defaults
    plain, sinks = flat(old), flat(attention_cfg(sinks=True))
    assert not any("sinks" in path for path in plain)
    assert set(flat(attention_cfg(sinks=False, window=4))) == set(plain)
    assert set(sinks) - set(plain) == {"blocks/0/attn/sinks", "blocks/1/attn/sinks"}
    var = sinks["blocks/1/attn/sinks"]
    assert var.get_metadata().get("out_sharding") == ("heads",)
    np.testing.assert_array_equal(np.asarray(var.get_value()), np.zeros(4, np.float32))
