"""DeepSeek-V4's attention (`nn.v4`): tied K/V with its RMSNorm, low-rank queries with
every head at unit RMS, an interleaved rotation of the trailing head slice, the output
turned back, per-head sinks, the grouped low-rank output and sliding layers, against
HF's `DeepseekV4Attention` (tests/data/hf/deepseek_v4_attention, made by
scripts/make_hf_fixtures.py), each piece shown to matter, decoding through the tied
cache, and bad settings as one ValueError line.

Out of scope: V4's compressed-KV layers (CSA, HCA) and their indexer; the fixture's
layer is a "sliding_attention" one, which has no compressor."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rope_jax.nn import attention, v4
from rope_jax.nn import model as model_lib
from tests import hf_blocks

# One worker runs the module: the ops its tests run eagerly (building the same decoders)
# compile once.
pytestmark = pytest.mark.xdist_group("v4")

FIXTURE = "deepseek_v4_attention"
TOLERANCE = 2e-5  # float32, atol = rtol


def hf_config() -> dict:
    return hf_blocks.config(FIXTURE)


def fixture(kind: str) -> dict:
    return hf_blocks.arrays(FIXTURE, kind)


def model_config(hf: dict, kind: str = "sliding", **changes) -> dict:
    """`config.model` of HF's DeepseekV4Config fields: one shared kv head tied as key and
    value (sites qkvo), interleaved pairs over a partial rotation, sinks, and a sliding
    window ("full": the same block under a plain causal mask)."""
    sliding = kind == "sliding"
    return {
        **hf_blocks.shape(hf),
        "attention": {"kv": "tied", "sinks": True,
                      "window": hf["sliding_window"] if sliding else 0,
                      "layer_types": ("sliding" if sliding else "full",) * hf["num_hidden_layers"],
                      "q_lora_rank": hf["q_lora_rank"], "q_l2_norm": True, "kv_norm": True,
                      "o_groups": hf["o_groups"], "o_lora_rank": hf["o_lora_rank"],
                      **changes.pop("attention", {})},
        "rope": {"sites": "qkvo", "layout": "interleaved", "base": hf["rope_theta"],
                 "pairs": {"rule": "first", "fraction": hf["partial_rotary_factor"]}},
        **changes,
    }  # fmt: skip


def decoder(hf: dict, kind: str = "sliding", **changes) -> model_lib.Decoder:
    return model_lib.Decoder(model_config(hf, kind, **changes), rngs=nnx.Rngs(0))


def to_ours(hf: dict, trailing: bool = True) -> dict:
    """HF's weights ([out, in] Linear layout) -> ours, each head's numbers reordered so
    V4's trailing rotated slice comes first (`v4.head_order`; identity without
    `trailing`). Pure rearrangements: they map HF's gradients too."""
    n, h, g = hf["num_attention_heads"], hf["head_dim"], hf["o_groups"]
    r, ro, d = hf["q_lora_rank"], hf["o_lora_rank"], hf["hidden_size"]
    rotated = int(h * hf["partial_rotary_factor"])
    order = v4.head_order(h, rotated) if trailing else np.arange(h)
    return {
        "q_lora.q_a_proj": lambda w: w.T,  # [r, D] -> [D, r]
        "q_lora.q_a_norm.scale": lambda w: w,
        "q_lora.q_b_proj": lambda w: w.T.reshape(r, n, h)[..., order],  # [N*H, r] -> [r, N, H]
        "kv_proj": lambda w: w.T.reshape(d, 1, h)[..., order],  # [H, D] -> [D, 1, H]
        "kv_norm.scale": lambda w: w[order],
        "sinks": lambda w: w,
        # [g*R, M*H] -> [g, M, H, R]
        "o_lora.o_a_proj": lambda w: w.reshape(g, ro, n // g, h).transpose(0, 2, 3, 1)[:, :, order],
        "o_lora.o_b_proj": lambda w: w.T.reshape(g, ro, d),  # [D, g*R] -> [g, R, D]
    }


HF_NAMES = {"q_lora.q_a_proj": "q_a_proj.weight", "q_lora.q_a_norm.scale": "q_a_norm.weight",
            "q_lora.q_b_proj": "q_b_proj.weight", "kv_proj": "kv_proj.weight",
            "kv_norm.scale": "kv_norm.weight", "sinks": "sinks",
            "o_lora.o_a_proj": "o_a_proj.weight", "o_lora.o_b_proj": "o_b_proj.weight"}  # fmt: skip


def _param(attn, name):
    """The parameter at dotted path `name` (None where a module on the way is absent)."""
    for part in name.split("."):
        attn = None if attn is None else getattr(attn, part)
    return attn


def loaded(attn, arrays, hf, trailing: bool = True):
    """The attention block `attn` with the fixture's weights (those it has)."""
    for name, mapping in to_ours(hf, trailing).items():
        if _param(attn, name) is not None:
            _param(attn, name)[...] = jnp.asarray(mapping(arrays[HF_NAMES[name]]))
    return attn


def forward_and_grads(attn, x, dy, call=None):
    """y = attn(x) and the gradients of sum(y * dy) for x and each weight (our layout)."""
    graph, params, rest = nnx.split(attn, nnx.Param, ...)
    positions = jnp.broadcast_to(jnp.arange(x.shape[1])[None, :, None], (*x.shape[:2], 1))
    call = call or (lambda module, x, positions: module(x, positions))

    def loss(params, x):
        y = call(nnx.merge(graph, params, rest), x, positions)
        return jnp.sum(y * dy), y

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (_, y), (d_params, dx) = grad(params, x)
    grads = {"x": np.asarray(dx)}
    for name in HF_NAMES:
        if _param(attn, name) is not None:
            grads[name] = np.asarray(_param(d_params, name)[...])
    return np.asarray(y), grads


def max_error(got, want) -> float:
    return float(np.abs(np.asarray(got) - want).max())


@pytest.mark.parametrize("impl", hf_blocks.IMPLS)
@pytest.mark.parametrize("kind", ["sliding", "full"])
def test_attention_equals_hf_deepseek_v4_forward_and_backward(kind, impl):
    """The sliding block (W = 4 < T = 12) and the same block under a full causal mask."""
    hf, arrays = hf_config(), fixture(kind)
    attn = decoder(hf, kind, attention={"impl": impl}).blocks[0].attn
    assert attn.window == (4 if kind == "sliding" else None) and attn.kv == "tied"
    y, grads = forward_and_grads(loaded(attn, arrays, hf), jnp.asarray(arrays["x"]),
                                 jnp.asarray(arrays["dy"]))  # fmt: skip
    err = max_error(y, arrays["y"])
    assert err < TOLERANCE, f"output: max abs error {err:.2e}"
    mapping = to_ours(hf)
    for name, g in grads.items():
        want = arrays["dx"] if name == "x" else mapping[name](arrays["d" + HF_NAMES[name]])
        err = max_error(g, want)
        assert err < TOLERANCE * max(1.0, np.abs(want).max()), f"d{name}: max abs error {err:.2e}"


def _without_output_rotation(module, x, positions):
    """The block with the output left unrotated: sites "qkv" over the tied latent."""
    q, c, _ = module._project(x, positions)
    o = attention.attend(q, c, c, q_positions=positions, k_positions=positions, sites="qkv",
                         rope=module.rotation(), causal=True, sinks=module._sinks(),
                         window=module.window)  # fmt: skip
    return module._out(o)


@pytest.mark.slow
def test_without_each_piece_the_fixture_is_missed():
    """Sinks, the output turned back, the trailing slice, the q head norm and the kv norm
    each move the output by far more than the tolerance."""
    hf, arrays = hf_config(), fixture("sliding")
    x = jnp.asarray(arrays["x"])
    attn = lambda **change: decoder(hf, attention=change).blocks[0].attn
    cases = {
        "sinks": (loaded(attn(sinks=False), arrays, hf), None),
        "output rotation": (loaded(attn(), arrays, hf), _without_output_rotation),
        "trailing slice": (loaded(attn(), arrays, hf, trailing=False), None),
        "q head norm": (loaded(attn(q_l2_norm=False), arrays, hf), None),
        "kv norm": (loaded(attn(kv_norm=False), arrays, hf), None),
    }
    positions = jnp.broadcast_to(jnp.arange(x.shape[1])[None, :, None], (*x.shape[:2], 1))
    for piece, (module, call) in cases.items():
        forward = call or (lambda module, x, positions: module(x, positions))
        y = nnx.jit(forward)(module, x, positions)  # the output alone, compiled
        assert max_error(y, arrays["y"]) > 1e-2, piece


def test_the_head_order_moves_the_trailing_slice_first():
    assert v4.head_order(6, 2).tolist() == [4, 5, 0, 1, 2, 3]
    assert v4.head_order(4, 4).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="rotated=3 must be even"):
        v4.head_order(8, 3)


@pytest.mark.parametrize("impl", ["xla", pytest.param("chunked", marks=pytest.mark.slow)])
def test_decoding_through_the_tied_cache_equals_the_full_forward(impl):
    """A sliding V4 layer (a ring of W slots of the rotated, normed latent) and a full
    one: prefill then one token at a time equals one forward pass (logits)."""
    hf = hf_config()
    model = decoder(hf, num_layers=2,
                    attention={"impl": impl, "layer_types": ("sliding", "full")})  # fmt: skip
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, hf["vocab_size"], (2, 12)))
    want = nnx.jit(lambda model, tokens: model(tokens))(model, tokens)  # one compile
    cache = model.init_cache(2, 12)
    assert [tuple(c) for c in cache["layers"]] == [("c",), ("c",)]
    assert [c["c"].shape[1:] for c in cache["layers"]] == [(4, 1, 16), (12, 1, 16)]
    got = hf_blocks.stepwise_logits(model, tokens, prompt=5)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


BAD = [
    ({"q_lora_rank": -1}, r"model.attention.q_lora_rank=-1 is invalid: must be a non-negative"),
    ({"q_lora_rank": 2.5}, r"config field model.attention.q_lora_rank=2.5: .* type <class 'int'>"),
    ({"q_l2_norm": 1}, r"config field model.attention.q_l2_norm=1: .* type <class 'bool'>"),
    ({"kv": "separate", "kv_norm": True},
     r"model.attention.kv_norm=True is invalid: normalises the tied latent: needs "
     r"model.attention.kv='tied'"),
    ({"o_groups": 3}, r"model.attention.o_groups=3 is invalid: must divide num_heads=4"),
    ({"o_groups": 2, "o_lora_rank": 0},
     r"model.attention.o_lora_rank=0 is invalid: must be > 0 with model.attention.o_groups=2"),
    ({"o_groups": 0, "o_lora_rank": 6},
     r"model.attention.o_groups=0 is invalid: must be > 0 with model.attention.o_lora_rank=6"),
]  # fmt: skip


@pytest.mark.parametrize("change, message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_v4_settings_are_one_readable_line(change, message):
    cfg = model_config(hf_config())
    cfg["attention"] = {**cfg["attention"], **change}
    with pytest.raises(ValueError, match=message) as e:
        model_lib.check_config(cfg, train_seq_len=12)
    assert "\n" not in str(e.value)
