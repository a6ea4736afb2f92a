"""iRoPE (Llama 4): chunked attention, the q/k L2 norm of rotating layers and the query
temperature of NoPE layers, against HF's `Llama4TextAttention` (tests/data/hf/
llama4_attention, made by scripts/make_hf_fixtures.py), a direct masked softmax, and
decoding through the cache; bad settings are one ValueError line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rope_jax.nn import irope, kernels, sliding
from rope_jax.nn import model as model_lib
from tests import hf_blocks

# One worker runs the module: the ops its tests run eagerly (building the same decoders,
# the kernels outside jit) compile once.
pytestmark = pytest.mark.xdist_group("irope")

FIXTURE = "llama4_attention"
TOLERANCE = 2e-5  # float32, atol = rtol


def hf_config() -> dict:
    return hf_blocks.config(FIXTURE)


def nope_every(no_rope_layers) -> int:
    """HF's `no_rope_layers` (1 = the layer rotates) as `model.rope.nope_every` k: the
    pattern must be every k-th layer NoPE."""
    k = next(i + 1 for i, uses_rope in enumerate(no_rope_layers) if not uses_rope)
    assert list(no_rope_layers) == [int((i + 1) % k != 0) for i in range(len(no_rope_layers))]
    return k


def model_config(hf: dict, **changes) -> dict:
    """`config.model` of HF's Llama4TextConfig fields: NoPE layers by no_rope_layers, the
    rotating ones chunked (HF's default layer_types), complex pairs = interleaved."""
    k = nope_every(hf["no_rope_layers"])
    types = tuple("full" if (i + 1) % k == 0 else "chunked" for i in range(hf["num_hidden_layers"]))
    return {
        **hf_blocks.shape(hf),
        "attention": {"layer_types": types, "chunk": hf["attention_chunk_size"],
                      "qk_l2_norm": hf["use_qk_norm"], **changes.pop("attention", {})},
        "rope": {"nope_every": k, "layout": "interleaved",
                 "base": hf["rope_parameters"]["rope_theta"],
                 "nope_attn_scale": hf["attn_scale"] if hf["attn_temperature_tuning"] else 0.0,
                 "nope_floor_scale": float(hf["floor_scale"])},
        **changes,
    }  # fmt: skip


def decoder(hf: dict, **changes) -> model_lib.Decoder:
    return model_lib.Decoder(model_config(hf, **changes), rngs=nnx.Rngs(0))


# HF Linear weights [out, in] -> ours: q [D, N, H], k, v [D, K, H], o [N, H, D]
WEIGHTS = {
    "q_proj": lambda w, n, h: w.T.reshape(-1, n, h),
    "k_proj": lambda w, n, h: w.T.reshape(w.shape[1], -1, h),
    "v_proj": lambda w, n, h: w.T.reshape(w.shape[1], -1, h),
    "o_proj": lambda w, n, h: w.T.reshape(n, h, -1),
}


def loaded(attn, arrays, hf):
    """The attention block `attn` with the fixture's weights."""
    n, h = hf["num_attention_heads"], hf["head_dim"]
    for name, to_ours in WEIGHTS.items():
        getattr(attn, name)[...] = jnp.asarray(to_ours(arrays[f"{name}.weight"], n, h))
    return attn


def forward_and_grads(attn, x, dy):
    """y = attn(x) and the gradients of sum(y * dy) for x and each weight (HF's layout)."""
    graph, params, rest = nnx.split(attn, nnx.Param, ...)
    positions = jnp.broadcast_to(jnp.arange(x.shape[1])[None, :, None], (*x.shape[:2], 1))

    def loss(params, x):
        y = nnx.merge(graph, params, rest)(x, positions)
        return jnp.sum(y * dy), y

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (_, y), (d_params, dx) = grad(params, x)
    grads = {"x": dx}
    for name in WEIGHTS:
        g = np.asarray(d_params[name][...])
        grads[f"{name}.weight"] = g.reshape(g.shape[0], -1).T if name != "o_proj" else (
            g.reshape(-1, g.shape[-1]).T)  # fmt: skip
    return np.asarray(y), grads


@pytest.mark.parametrize("impl", hf_blocks.IMPLS)
@pytest.mark.parametrize("layer, kind", [(0, "rope"), (1, "nope")])
def test_attention_equals_hf_llama4_forward_and_backward(layer, kind, impl):
    """Layer 0 rotates (complex pairs), L2-normalises q, k and attends in chunks of 4;
    layer 1 is NoPE with the query temperature over the full causal mask."""
    hf = hf_config()
    arrays = hf_blocks.arrays(FIXTURE, kind)
    attn = decoder(hf, attention={"impl": impl}).blocks[layer].attn
    assert (attn.chunk, bool(attn.sites)) == ((4, True) if kind == "rope" else (None, False))
    assert attn.qk_l2_norm == (kind == "rope") and (attn.temperature is None) == (kind == "rope")
    y, grads = forward_and_grads(loaded(attn, arrays, hf), jnp.asarray(arrays["x"]),
                                 jnp.asarray(arrays["dy"]))  # fmt: skip
    np.testing.assert_allclose(y, arrays["y"], atol=TOLERANCE, rtol=TOLERANCE)
    for name, g in grads.items():
        want = arrays["dx" if name == "x" else f"d{name}"]
        np.testing.assert_allclose(g, want, atol=TOLERANCE, rtol=TOLERANCE, err_msg=name)


@pytest.mark.slow
def test_without_each_piece_the_fixture_is_missed():
    """The fixture tells the pieces apart: no chunk, no L2 norm, half pairs or no
    temperature each move the output by far more than the tolerance."""
    hf = hf_config()
    rope, nope = (hf_blocks.arrays(FIXTURE, k) for k in ("rope", "nope"))
    changes = [
        (0, rope, {"attention": {"layer_types": ("full", "full"), "chunk": 0}}),
        (0, rope, {"attention": {"qk_l2_norm": False}}),
        (0, rope, {"rope": {**model_config(hf)["rope"], "layout": "half"}}),
        (1, nope, {"rope": {**model_config(hf)["rope"], "nope_attn_scale": 0.0}}),
    ]
    for layer, arrays, change in changes:
        attn = loaded(decoder(hf, **change).blocks[layer].attn, arrays, hf)
        x = jnp.asarray(arrays["x"])
        positions = jnp.broadcast_to(jnp.arange(x.shape[1])[None, :, None], (*x.shape[:2], 1))
        y = nnx.jit(lambda attn, x, positions: attn(x, positions))(attn, x, positions)
        assert np.abs(np.asarray(y) - arrays["y"]).max() > 1e-2, change


def test_chunked_attention_equals_a_direct_masked_softmax():
    """Query t sees keys s <= t with s // C == t // C, in each kernel, offset too."""
    rng = np.random.default_rng(0)
    b, t, n, kh, h, c, offset = 2, 11, 4, 2, 8, 3, 2
    q = rng.standard_normal((b, t, n, h)).astype(np.float32)
    k, v = (rng.standard_normal((b, t + offset, kh, h)).astype(np.float32) for _ in "kv")
    at = np.arange(t)[:, None] + offset  # the query's key index
    s = np.arange(t + offset)[None, :]
    keep = (s <= at) & (s // c == at // c)
    kg, vg = (np.repeat(a, n // kh, axis=2) for a in (k, v))  # head n uses kv head n // G
    x = np.where(keep, np.einsum("btnh,bsnh->bnts", q, kg) / np.sqrt(h), -np.inf)
    p = np.exp(x - x.max(-1, keepdims=True))
    want = np.einsum("bnts,bsnh->btnh", p / p.sum(-1, keepdims=True), vg)
    for impl in ("xla", "chunked", "dot_product"):
        got = kernels.mix(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), impl=impl,
                          causal=True, q_offset=offset, chunk=c, block_size=4)  # fmt: skip
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5, err_msg=impl)


def test_temperature_and_l2_norm_are_hf_formulas():
    p = jnp.arange(10)[None, :, None]
    tau = irope.temperature(p, attn_scale=0.5, floor_scale=4.0)
    want = 1 + 0.5 * np.log1p(np.floor((np.arange(10) + 1) / 4))
    np.testing.assert_allclose(np.asarray(tau)[0], want, rtol=1e-6)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 8)), jnp.float32)
    y = np.asarray(irope.l2_norm(x, eps=1e-5))
    np.testing.assert_allclose((y**2).mean(-1), 1.0, rtol=1e-4)


@pytest.mark.parametrize("impl", ["xla", pytest.param("chunked", marks=pytest.mark.slow)])
def test_decoding_through_the_cache_equals_the_full_forward(impl):
    """A chunked layer's ring of C slots (chunk ids as segments) and a NoPE layer's
    temperature at the cached positions: prefill then one token at a time equals one
    forward pass (logits), past several chunks."""
    hf = hf_config()
    model = decoder(hf, attention={"impl": impl})
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, hf["vocab_size"], (2, 14)))
    want = nnx.jit(lambda model, tokens: model(tokens))(model, tokens)  # one compile
    cache = model.init_cache(2, 14)
    assert [next(iter(c.values())).shape[1] for c in cache["layers"]] == [4, 14]
    got = hf_blocks.stepwise_logits(model, tokens, prompt=5)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    chunked = model_lib.check_config(model_config(hf))
    full = model_lib.check_config(model_config(hf, attention={"layer_types": ("full",) * 2,
                                                              "chunk": 0}))  # fmt: skip
    assert model_lib.kv_cache_bytes(chunked, 14) * 14 == model_lib.kv_cache_bytes(full, 14) * 9


BAD = [
    ({"attention": {"chunk": -2, "layer_types": ("chunked", "full")}},
     r"model.attention.chunk=-2 is invalid: must be a non-negative integer"),
    ({"attention": {"chunk": 0, "layer_types": ("chunked", "full")}},
     r"has 'chunked' layers but model.attention.chunk=0"),
    ({"attention": {"chunk": 4, "layer_types": ("full", "full")}},
     r"model.attention.chunk=4 is invalid: has no chunked layer to act on"),
    ({"attention": {"chunk": 12, "layer_types": ("chunked", "full")}},
     r"model.attention.chunk=12 is invalid: must be below data.seq_len=12"),
    ({"attention": {"chunk": 4, "layer_types": ("chunked", "local")}},
     r"has 'local': each must be one of 'full', 'sliding', 'chunked'"),
    ({"attention": {"chunk": 4, "window": 3, "layer_types": ()}},
     r"must name each layer's type when both model.attention.window and "
     r"model.attention.chunk are set"),
    ({"attention": {"kv": "tied", "chunk": 4, "layer_types": ("chunked", "full")},
      "rope": {"sites": "qkvo", "nope_every": 2}},
     r"model.attention.qk_l2_norm=True is invalid: needs model.attention.kv='separate'"),
    ({"rope": {"sites": "", "nope_every": 2}},
     r"model.attention.qk_l2_norm=True is invalid: acts on rotating layers, and no layer"),
    ({"rope": {"nope_every": 0, "nope_attn_scale": 0.1}},
     r"model.rope.nope_attn_scale=0.1 is invalid: acts on NoPE layers, and every layer"),
    ({"rope": {"nope_every": 2, "nope_attn_scale": -1.0}},
     r"model.rope.nope_attn_scale=-1.0 is invalid: must be a number >= 0"),
    ({"rope": {"nope_every": 2, "nope_floor_scale": 0.0}},
     r"model.rope.nope_floor_scale=0.0 is invalid: must be a number > 0"),
]  # fmt: skip


@pytest.mark.parametrize("change, message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_chunks_and_layer_patterns_are_one_readable_line(change, message):
    cfg = model_config(hf_config())
    for section, fields in change.items():
        cfg[section] = {**cfg[section], **fields}
    with pytest.raises(ValueError, match=message) as e:
        model_lib.check_config(cfg, train_seq_len=12)
    assert "\n" not in str(e.value)


def test_chunk_needs_causal_and_a_positive_size_in_the_kernel():
    q = k = v = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match="chunk=0 must be a positive int"):
        kernels.mix(q, k, v, causal=True, chunk=0)
    with pytest.raises(ValueError, match="chunk=2 needs causal=True"):
        kernels.mix(q, k, v, chunk=2)


def test_chunk_segments_mark_each_tokens_chunk_and_unfilled_slots():
    q, kv = sliding.chunk_segments(1, 4, 2, 3, 4)  # ring of 4 slots, tokens 3, 4 new
    assert np.asarray(q).tolist() == [[0, 1]]
    assert np.asarray(kv).tolist() == [[-1, 0, 0, 0, 0, 1]]  # tokens -1, 0, 1, 2 | 3, 4
