"""Tests for rope_jax.nn.biases: position biases on the logits, through the kernels'
bias hook, in training, in every kernel that takes a bias and in cached decoding."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import common
from rope_jax.nn import biases, kernels
from rope_jax.nn import model as model_lib

T = 12


def tiny(**overrides):
    cfg = common.base_config("tiny").model
    cfg.update_from_flattened_dict({"num_layers": 2, "embed_dim": 32, "num_heads": 4,
                                    "num_kv_heads": 2, "head_dim": 8, "mlp_dim": 64,
                                    "attention.bias": "alibi", "rope.sites": "",
                                    **overrides})  # fmt: skip
    return cfg


@pytest.mark.parametrize(
    "heads, want",
    [(8, [2.0**-i for i in range(1, 9)]),
     # not a power of two: the 8 of N = 8, then every other slope of N = 16 (2^-0.5 ...)
     (12, [2.0**-i for i in range(1, 9)] + [2.0**-0.5, 2.0**-1.5, 2.0**-2.5, 2.0**-3.5]),
     (1, [2.0**-8])],
)  # fmt: skip
def test_alibi_slopes_are_geometric_for_any_head_count(heads, want):
    np.testing.assert_allclose(biases.alibi_slopes(heads), want, rtol=1e-6)


def test_alibi_is_the_distance_times_the_slope_and_relative():
    slopes = biases.alibi_slopes(4)
    q_pos = jnp.asarray([[0.0, 3.0, 7.0]])
    k_pos = jnp.asarray([[0.0, 1.0, 5.0, 7.0]])
    b = biases.SCHEMES["alibi"].fn({}, (slopes, q_pos, k_pos), jnp.arange(3), jnp.arange(4))
    want = -slopes[None, :, None, None] * np.abs(
        np.asarray(q_pos)[:, None, :, None] - np.asarray(k_pos)[:, None, None, :]
    )
    np.testing.assert_allclose(np.asarray(b), want, rtol=1e-6)
    shifted = biases.SCHEMES["alibi"].fn({}, (slopes, q_pos + 40, k_pos + 40), jnp.arange(3),
                                         jnp.arange(4))  # fmt: skip
    np.testing.assert_array_equal(np.asarray(shifted), np.asarray(b))


def _loss_and_grads(cfg, tok, pos):
    net = model_lib.Decoder(cfg, rngs=nnx.Rngs(0))

    def loss(net):
        logits = net(tok, pos)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])

    value, grads = nnx.value_and_grad(loss)(net)
    return value, jax.tree.leaves(nnx.state(grads, nnx.Param))


def fire_reference(params, q_pos, k_pos):
    """FIRE (Li et al. 2023, eq. 6 with its log transform and threshold) written out entry
    by entry in float64: b_n(i, j) = f_n(psi(i - j) / psi(max(L, i))), psi(x) = log(c x + 1),
    f an MLP 1 -> 32 -> N with ReLU; [B, N, T, S]."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    c, big_l = abs(float(p["c"])), abs(float(p["L_multiplier"]) * 512.0)
    out = np.zeros((q_pos.shape[0], p["b2"].shape[0], q_pos.shape[1], k_pos.shape[1]))
    for b in range(q_pos.shape[0]):
        for i, pi in enumerate(np.asarray(q_pos[b], np.float64)):
            for j, pj in enumerate(np.asarray(k_pos[b], np.float64)):
                x = np.log(c * max(pi - pj, 0.0) + 1) / (np.log(c * max(big_l, pi) + 1) + 1e-6)
                hidden = np.maximum(x * p["w1"][0] + p["b1"], 0.0)
                out[b, :, i, j] = hidden @ p["w2"] + p["b2"]
    return out


@pytest.mark.parametrize("threshold", [1.0, 0.01])  # L = 512 (above every position), 5.12
def test_fire_is_the_papers_formula(threshold):
    params = biases.SCHEMES["fire"].init(4, jax.random.key(0), 0)
    params = {**params, "c": jnp.asarray(0.7), "L_multiplier": jnp.asarray(threshold)}
    q_pos = jnp.asarray([[0.0, 2.0, 9.0, 30.0]])
    k_pos = jnp.asarray([[0.0, 1.0, 2.0, 9.0, 30.0]])
    got = biases.SCHEMES["fire"].fn(params, ((), q_pos, k_pos), jnp.arange(4), jnp.arange(5))
    np.testing.assert_allclose(np.asarray(got), fire_reference(params, q_pos, k_pos), atol=1e-5)
    # inside the threshold the input is the log distance over a fixed divisor; past it,
    # the divisor grows with the query's position (progressive interpolation)
    assert np.asarray(got).shape == (1, 4, 4, 5)


@pytest.mark.parametrize(
    "scheme, sites",
    [("alibi", ""), pytest.param("alibi", "qk", marks=pytest.mark.slow),
     pytest.param("fire", "", marks=pytest.mark.slow), ("fire", "qk"), ("forget", "")],
)  # fmt: skip
def test_every_kernel_runs_a_bias_alike_forward_and_backward(sites, scheme):
    tok = jnp.asarray(np.random.default_rng(0).integers(0, 259, (2, T)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.float32)[None, :, None], (2, T, 1))
    runs = {impl: _loss_and_grads(tiny(**{"rope.sites": sites, "attention.impl": impl,
                                          "attention.bias": scheme}), tok, pos)
            for impl in ("xla", "dot_product", "chunked")}  # fmt: skip
    ref_loss, ref_grads = runs["xla"]
    for loss, grads in runs.values():
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        for g, r in zip(grads, ref_grads, strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-5, rtol=1e-4)
    plain, _ = _loss_and_grads(tiny(**{"rope.sites": sites, "attention.bias": "none"}), tok, pos)
    assert abs(float(plain) - float(ref_loss)) > 1e-4  # the bias is applied


@pytest.mark.slow  # eager decoding, step by step
@pytest.mark.parametrize("scheme", ["alibi", "fire", "forget"])
@pytest.mark.parametrize("layers", [{}, {"attention.window": 5}])
def test_decoding_with_a_bias_equals_the_forward_pass(layers, scheme):
    """The cache keeps each slot's position, so a decoded token's bias is the forward
    pass's; a sliding layer's ring keeps them in step with its keys."""
    net = model_lib.Decoder(tiny(**layers, **{"attention.bias": scheme}), rngs=nnx.Rngs(0))
    tok = jnp.asarray(np.random.default_rng(1).integers(0, 259, (1, T)), jnp.int32)
    pos = jnp.arange(T, dtype=jnp.float32)[None, :, None] + 3.0
    cache = net.init_cache(1, T)
    first, cache = net.decode(tok[:, :-4], pos[:, :-4], cache)
    steps = [first]
    for i in range(T - 4, T):
        out, cache = net.decode(tok[:, i : i + 1], pos[:, i : i + 1], cache)
        steps.append(out)
    np.testing.assert_allclose(np.concatenate([np.asarray(s) for s in steps], 1),
                               np.asarray(net(tok, pos)), atol=2e-4)  # fmt: skip


@pytest.mark.parametrize(
    "overrides, message",
    [({"attention.bias": "fire2"},
      "model.attention.bias='fire2' is not one of 'none', 'alibi', 'fire', 'forget'"),
     ({"attention.impl": "splash"}, "model.attention.impl='splash' cannot compute the "
                                    "attention term 'bias'")],
)  # fmt: skip
def test_bad_bias_settings_are_one_line(overrides, message):
    with pytest.raises(ValueError, match=message) as err:
        model_lib.check_config(tiny(**overrides), train_seq_len=T)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="reads 1-D text positions; the data has 2"):
        model_lib.check_config(tiny(), 2, train_seq_len=T)


FIXTURE = os.path.join(os.path.dirname(__file__), "data", "biases", "alibi.npz")


def test_alibi_equals_hf_bloom_slopes_and_attention():
    """HF's `build_alibi_tensor` (scripts/make_bias_fixtures.py): the slopes for every head
    count, and a causal BLOOM attention with a padded row, softmax(q k^T / sqrt(H) + m_n
    p_s) v: our -m_n |p_t - p_s| differs from it by a constant per row (p_t >= p_s where
    causal), so the attention is the same."""
    ref = np.load(FIXTURE)
    for n in ref["heads"]:
        np.testing.assert_allclose(biases.alibi_slopes(int(n)), ref[f"slopes_{n}"], rtol=1e-6)
    q, k, v, mask, positions, out = (
        jnp.asarray(ref[f"attention_{name}"])
        for name in ("q", "k", "v", "mask", "positions", "out")
    )
    b, t, n, _ = q.shape
    bias = kernels.Bias(biases.SCHEMES["alibi"].fn, {},
                        (biases.alibi_slopes(n), positions, positions))  # fmt: skip
    present = jnp.broadcast_to((mask > 0)[:, None, None, :], (b, 1, t, t))  # pad keys: none
    for impl in ("xla", "dot_product", "chunked"):
        got = kernels.mix(q, k, v, impl=impl, causal=True, mask=present, bias=bias,
                          block_size=4)  # fmt: skip
        valid = np.asarray(mask, bool)  # rows of pad queries see no key in HF either
        np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(out)[valid], atol=1e-5)


def test_forget_gates_equal_fla_naive_forgetting_attention_forward_and_backward():
    """FoX (fla-core's `naive_forgetting_attn`, scripts/make_bias_fixtures.py): softmax(q k^T /
    sqrt(H) + c_t - c_s) v with c the running sum of log sigmoid(x w + b), in every kernel
    that takes a bias; the gradients of q, k and of the gate's w and b equal torch's."""
    ref = {k: jnp.asarray(v) for k, v in np.load(FIXTURE.replace("alibi", "forget")).items()}
    scheme = biases.SCHEMES["forget"]

    def out(q, k, w, b, impl):
        sums = jnp.cumsum(scheme.cumulative({"w": w, "b": b}, ref["x"]), axis=1)
        bias = kernels.Bias(scheme.fn, {"q": sums, "k": sums}, ())
        return kernels.mix(q, k, ref["v"], impl=impl, causal=True, bias=bias, block_size=4)

    def loss(q, k, w, b, impl):
        return jnp.sum(out(q, k, w, b, impl) * ref["r"])

    for impl in ("xla", "dot_product", "chunked"):
        args = (ref["q"], ref["k"], ref["w"], ref["b"])
        np.testing.assert_allclose(np.asarray(out(*args, impl)), ref["out"], atol=2e-5)
        grads = jax.grad(loss, argnums=(0, 1, 2, 3))(*args, impl)
        for got, name in zip(grads, ("grad_q", "grad_k", "grad_w", "grad_b"), strict=True):
            np.testing.assert_allclose(np.asarray(got), ref[name], atol=1e-4, rtol=1e-4)
