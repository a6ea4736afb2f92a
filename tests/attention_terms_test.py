"""Tests for the attention terms (`kernels.Terms`) and the logit-bias hook (`kernels.Bias`):
every kernel against a dense reference written here (scores + bias, masked softmax),
forward and gradients (the bias' own parameters included), and the kernel registry's
fallbacks and refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rope_jax.nn import kernels
from rope_jax.nn.attention import Attention

B, N, K, H = 2, 4, 2, 8
IMPLS = ("xla", "dot_product", "chunked")  # splash: no bias input (refused, tested below)


def distance_bias(params, inputs, q_idx, k_idx):
    """-slope_n |p_t - p_s| from positions (ALiBi's form, learned slopes): [B, N, t, s]."""
    q_pos, k_pos = inputs  # [B, T], [B, S]
    d = jnp.abs(q_pos[:, q_idx][:, :, None] - k_pos[:, k_idx][:, None, :])  # [B, t, s]
    return -params["slopes"][None, :, None, None] * d[:, None]


def gate_bias(params, inputs, q_idx, k_idx):
    """c_t - c_s of per-token cumulative log gates c [B, N, T] (a forgetting gate's form,
    data-dependent and per batch): [B, N, t, s]; query and key slots share c."""
    c = jnp.cumsum(jax.nn.log_sigmoid(params["gates"]), axis=-1)  # [B, N, T]
    return c[:, :, q_idx][..., None] - c[:, :, k_idx][..., None, :]


def head_bias(params, inputs, q_idx, k_idx):
    """A weight per head times a function of the key slot, broadcast over the batch and
    the rows: [N, 1, s] (3-D; a constant per head would change no softmax)."""
    return params["per_head"][:, None, None] * jnp.sin(k_idx.astype(jnp.float32))[None, None]


def reference(q, k, v, *, bias, keep, sinks=None):
    """Dense softmax(scale q.k + bias | keep) v over query heads, written out; rows
    with no key give 0."""
    g = N // K
    kk, vv = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)  # [B, S, N, H]
    x = jnp.einsum("btnh,bsnh->bnts", q, kk) * H**-0.5 + bias
    x = jnp.where(keep, x, -jnp.inf)
    if sinks is not None:
        z = jnp.broadcast_to(sinks[None, :, None, None], (*x.shape[:3], 1))
        x = jnp.concatenate([x, z], -1)
    m = jnp.max(x, -1, keepdims=True)
    e = jnp.where(jnp.isneginf(x), 0.0, jnp.exp(x - jnp.where(jnp.isneginf(m), 0, m)))
    p = e / jnp.maximum(e.sum(-1, keepdims=True), 1e-30)
    p = p[..., : kk.shape[1]]
    return jnp.einsum("bnts,bsnh->btnh", p, vv)


def _inputs(t, s, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, t, N, H)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, s, K, H)), jnp.float32) for _ in range(2))
    return q, k, v


CASES = {
    "distance-causal": dict(fn=distance_bias, t=11, s=11, causal=True),
    "distance-window-segments-sinks": dict(fn=distance_bias, t=13, s=13, causal=True, window=5,
                                           segments=True, sinks=True),
    "distance-cross": dict(fn=distance_bias, t=7, s=9, causal=False),
    "gate-causal": dict(fn=gate_bias, t=12, s=12, causal=True),
    "gate-chunk": dict(fn=gate_bias, t=12, s=12, causal=True, chunk=5),
    "head-decode": dict(fn=head_bias, t=3, s=12, causal=True, offset=6),
}  # fmt: skip


def _case(name):
    c = dict(CASES[name])
    t, s = c.pop("t"), c.pop("s")
    q, k, v = _inputs(t, s)
    rng = np.random.default_rng(1)
    q_pos = jnp.asarray(np.sort(rng.uniform(0, 20, (B, t)), -1), jnp.float32)
    k_pos = jnp.asarray(np.sort(rng.uniform(0, 20, (B, s)), -1), jnp.float32)
    params = {
        distance_bias: {"slopes": jnp.asarray(2.0 ** -np.arange(1, N + 1), jnp.float32)},
        gate_bias: {"gates": jnp.asarray(rng.normal(size=(B, N, s)) + 2.0, jnp.float32)},
        head_bias: {"per_head": jnp.asarray(rng.normal(size=N), jnp.float32)},
    }[c["fn"]]
    offset = c.get("offset", 0)
    keep = jnp.ones((B, 1, t, s), bool)
    if c.get("causal"):
        tt, ss = np.arange(t)[:, None] + offset, np.arange(s)[None]
        allowed = ss <= tt
        if c.get("window"):
            allowed &= ss > tt - c["window"]
        if c.get("chunk"):
            allowed &= ss // c["chunk"] == tt // c["chunk"]
        keep = keep & allowed
    terms = dict(causal=c.get("causal", False), q_offset=offset, window=c.get("window"),
                 chunk=c.get("chunk"))  # fmt: skip
    if c.get("segments"):
        seg = jnp.asarray(np.repeat([[0, 1]], [6, t - 6], axis=1).repeat(B, 0), jnp.int32)
        terms.update(q_segments=seg, kv_segments=seg)
        keep = keep & (seg[:, None, :, None] == seg[:, None, None, :])
    if c.get("sinks"):
        terms["sinks"] = jnp.asarray(rng.normal(size=N), jnp.float32)
    return c["fn"], (q, k, v), params, (q_pos, k_pos), terms, keep


QUICK = ("distance-window-segments-sinks", "gate-causal")  # the rest in the full suite


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow) for n in CASES]
)
def test_every_kernel_adds_the_bias_and_differentiates_its_parameters(name, impl):
    fn, (q, k, v), params, inputs, terms, keep = _case(name)
    t, s = q.shape[1], k.shape[1]

    def ours(q, k, v, params):
        bias = kernels.Bias(fn, params, inputs)
        o = kernels.mix(q, k, v, impl=impl, block_size=4, bias=bias, **terms)
        return o, jnp.sum(o * jnp.cos(jnp.arange(H)))

    def theirs(q, k, v, params):
        bias = jnp.broadcast_to(fn(params, inputs, jnp.arange(t), jnp.arange(s)), (B, N, t, s))
        o = reference(q, k, v, bias=bias, keep=keep, sinks=terms.get("sinks"))
        return o, jnp.sum(o * jnp.cos(jnp.arange(H)))

    got, want = ours(q, k, v, params)[0], theirs(q, k, v, params)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)
    grad = lambda f: jax.grad(lambda *a: f(*a)[1], argnums=(0, 1, 2, 3))(q, k, v, params)
    for g_ours, g_ref in zip(jax.tree.leaves(grad(ours)), jax.tree.leaves(grad(theirs)),
                             strict=True):  # fmt: skip
        np.testing.assert_allclose(np.asarray(g_ours), np.asarray(g_ref), atol=5e-5, rtol=1e-4)
    # the test can fail: the bias moves the output and its parameters get a gradient
    without = kernels.mix(q, k, v, impl=impl, block_size=4, **terms)
    assert np.abs(np.asarray(without) - np.asarray(got)).max() > 1e-3
    assert max(np.abs(np.asarray(x)).max() for x in jax.tree.leaves(grad(ours)[3])) > 1e-6


def test_the_chunked_bias_under_jit_with_a_traced_offset():
    fn, (q, k, v), params, inputs, terms, keep = _case("head-decode")
    call = jax.jit(lambda offset: kernels.mix(q, k, v, impl="chunked", block_size=4,
                                              bias=kernels.Bias(fn, params, inputs),
                                              **{**terms, "q_offset": offset}))  # fmt: skip
    want = kernels.mix(q, k, v, bias=kernels.Bias(fn, params, inputs), **terms)
    np.testing.assert_allclose(np.asarray(call(jnp.int32(6))), np.asarray(want), atol=2e-5)


def test_the_registry_sends_or_refuses_a_term_in_one_place():
    assert kernels.choose("dot_product", {"causal", "sinks"}) == "xla"  # its fallback
    assert kernels.choose("dot_product", {"causal", "bias"}) == "dot_product"
    assert kernels.choose("chunked", kernels.Terms(causal=True, sinks=1).uses()) == "chunked"
    with pytest.raises(ValueError, match=r"impl='splash' cannot compute the attention term "
                       r"'bias'; kernels that compute every term of this call: 'xla', "
                       r"'dot_product', 'chunked'") as err:  # fmt: skip
        kernels.choose("splash", {"causal", "bias"})
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="impl='flash' is not one of"):
        kernels.choose("flash", set())
    q, k, v = _inputs(4, 4)
    with pytest.raises(ValueError, match="windo is not an attention term; the terms: causal"):
        kernels.mix(q, k, v, windo=3)
    with pytest.raises(ValueError, match="bias=.* must be a kernels.Bias"):
        kernels.mix(q, k, v, bias=lambda *a: 0.0)


def test_the_layer_hands_its_terms_to_the_kernel_whole():
    """Attention builds one Terms value (causal, segments, window, sinks) and the output
    equals the kernel called with it directly on the same projections."""
    from flax import nnx

    layer = Attention(16, N, K, H, sites="", sinks=True, window=3, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(B, 6, 16)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(6, dtype=jnp.float32)[None, :, None], (B, 6, 1))
    seg = jnp.asarray([[0, 0, 0, 1, 1, 1]] * B, jnp.int32)
    got = layer(x, pos, segments=seg)
    q, k, v = layer._project(x, pos)
    terms = kernels.Terms(causal=True, q_segments=seg, kv_segments=seg, window=3,
                          sinks=layer.sinks[...])  # fmt: skip
    want = layer._out(kernels.mix(q, k, v, terms).astype(q.dtype))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
