"""Tests for rope_jax.attention: every rotation site subset against a float64 reference."""

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rope_jax.nn import attention

B, T, N, K, H = 2, 7, 4, 2, 8  # GQA: 4 query heads share 2 kv heads; 4 rotation pairs
ALL_SITES = ["".join(c) for r in range(5) for c in itertools.combinations("qkvo", r)]
# (num_axes, rope kwargs): 1-D text RoPE, and 3-D with Qwen2-VL-style sections.
ROPES = {
    "A1-half": (1, dict(base=10000.0, layout="half", allocation="alternating", sections=None)),
    "A3-sections-interleaved": (
        3,
        dict(base=100.0, layout="interleaved", allocation="sections", sections=(1, 1, 2)),
    ),
    "A3-interleaved-half": (
        3,
        dict(base=500.0, layout="half", allocation="alternating", sections=None),
    ),
}


# ---------------------------------------------------------------- float64 reference


def ref_rotation(pos, rope):
    """R_p per token from the formula in docs/maths.md, built independently of rope_jax.rotary.

    pos [..., A] float64 -> [..., H, H]. theta_i = base ** (-2 i / H); pair i is
    (i, i + H/2) ("half") or (2i, 2i + 1) ("interleaved"), driven by axis i mod A or by
    contiguous sections.
    """
    pairs, num_axes = H // 2, pos.shape[-1]
    theta = rope["base"] ** (-2.0 * np.arange(pairs) / H)
    if rope["allocation"] == "sections":
        axis = np.concatenate([np.full(s, a) for a, s in enumerate(rope["sections"])])
    else:
        axis = np.arange(pairs) % num_axes
    phi = pos[..., axis] * theta  # [..., P]
    if rope["layout"] == "half":
        u, v = np.arange(pairs), np.arange(pairs) + pairs
    else:
        u, v = 2 * np.arange(pairs), 2 * np.arange(pairs) + 1
    mat = np.zeros((*pos.shape[:-1], H, H))
    mat[..., u, u] = np.cos(phi)
    mat[..., v, v] = np.cos(phi)
    mat[..., v, u] = np.sin(phi)
    mat[..., u, v] = -np.sin(phi)
    return mat


def ref_attend(q, k, v, qpos, kpos, sites, rope, keep):
    """Loop-free float64 attention; keep [B, N, T, S] bool."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    rq, rk = ref_rotation(np.asarray(qpos, np.float64), rope), ref_rotation(kpos, rope)
    if "q" in sites:
        q = np.einsum("btij,btnj->btni", rq, q)
    if "k" in sites:
        k = np.einsum("bsij,bsnj->bsni", rk, k)
    if "v" in sites:
        v = np.einsum("bsij,bsnj->bsni", rk, v)
    kv_head = np.arange(N) // (N // K)
    k, v = k[:, :, kv_head], v[:, :, kv_head]  # [B, S, N, H]
    logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
    logits = np.where(keep, logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    o = np.einsum("bnts,bsnh->btnh", probs, v)
    if "o" in sites:
        o = np.einsum("btji,btnj->btni", rq, o)  # R^T o
    return o


def causal_keep(t, s):
    return np.broadcast_to(np.tril(np.ones((t, s), bool), s - t), (B, N, t, s))


def inputs(seed, num_axes, t=T, s=T):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, t, N, H)).astype(np.float32)
    k = rng.normal(size=(B, s, K, H)).astype(np.float32)
    v = rng.normal(size=(B, s, K, H)).astype(np.float32)
    kpos = rng.uniform(-5, 25, size=(B, s, num_axes)).astype(np.float32)
    qpos = kpos[:, s - t :] + rng.uniform(0, 2, size=(B, t, num_axes)).astype(np.float32)
    return q, k, v, qpos, kpos


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("rope_id", list(ROPES))
@pytest.mark.parametrize("sites", ALL_SITES, ids=lambda s: s or "nope")
def test_matches_reference(sites, rope_id):
    num_axes, rope = ROPES[rope_id]
    q, k, v, qpos, kpos = inputs(
        ALL_SITES.index(sites) + 100 * list(ROPES).index(rope_id), num_axes
    )
    out = attention.attend(
        q, k, v, q_positions=qpos, k_positions=kpos, sites=sites, rope=rope, causal=True
    )
    ref = ref_attend(q, k, v, qpos, kpos, sites, rope, causal_keep(T, T))
    assert out.shape == (B, T, N, H) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("sites", ["qk", "vo", "qkvo"])
def test_explicit_mask_and_cross_lengths(sites):
    """A bool mask [B, 1, T, S] and T < S (queries are the last T keys) under jit."""
    num_axes, rope = ROPES["A3-sections-interleaved"]
    q, k, v, qpos, kpos = inputs(3, num_axes, t=3, s=T)
    mask = np.random.default_rng(4).random((B, 1, 3, T)) < 0.7
    mask[..., -1] = True  # every query sees at least its own key
    fn = jax.jit(functools.partial(attention.attend, sites=sites, rope=rope, causal=True))
    out = fn(q, k, v, q_positions=qpos, k_positions=kpos, mask=mask)
    keep = causal_keep(3, T) & mask
    np.testing.assert_allclose(
        np.asarray(out), ref_attend(q, k, v, qpos, kpos, sites, rope, keep), atol=2e-5, rtol=1e-4
    )


@pytest.mark.parametrize("rope_id", ["A1-half", "A3-sections-interleaved"])
@pytest.mark.parametrize("sites", ["", "qk", "vo", "qkvo", "v", "o", "q", "k", "qkv"])
def test_translation(sites, rope_id):
    """Relativity (docs/maths.md#rotation-sites-vo-rope): qk / vo / qkvo outputs are
    relative; v (and others) are not."""
    num_axes, rope = ROPES[rope_id]
    q, k, v, qpos, kpos = inputs(5, num_axes)
    shift = np.asarray([3.7, -11.2, 6.1][:num_axes], np.float32)
    kw = dict(sites=sites, rope=rope, causal=True)
    out = attention.attend(q, k, v, q_positions=qpos, k_positions=kpos, **kw)
    moved = attention.attend(q, k, v, q_positions=qpos + shift, k_positions=kpos + shift, **kw)
    diff = float(jnp.max(jnp.abs(out - moved)))
    if sites in ("", "qk", "vo", "qkvo"):
        assert diff < 1e-4, diff
    else:
        assert diff > 1e-2, diff


def test_nope_is_plain_attention():
    """Identity (docs/maths.md#nope): sites "" equals plain (unrotated) causal GQA attention."""
    q, k, v, qpos, kpos = inputs(6, 3)
    out = attention.attend(
        q, k, v, q_positions=qpos, k_positions=kpos, sites="", rope=ROPES["A1-half"][1],
        causal=True,
    )  # fmt: skip
    plain = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(plain), atol=1e-5)


def test_bfloat16_inputs_give_bfloat16_output():
    q, k, v, qpos, kpos = inputs(7, 1)
    rope = ROPES["A1-half"][1]
    kw = dict(q_positions=qpos, k_positions=kpos, sites="qkvo", rope=rope, causal=True)
    bf = [jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)]
    out = attention.attend(*bf, **kw)
    assert out.dtype == jnp.bfloat16
    ref = ref_attend(q, k, v, qpos, kpos, "qkvo", rope, causal_keep(T, T))
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=0.05)


@pytest.mark.parametrize("bad", ["qq", "x", "QK", "qkvoo", "q k", 3, None])
def test_bad_sites_raise(bad):
    q, k, v, qpos, kpos = inputs(8, 1)
    with pytest.raises(ValueError, match=re.escape(f"sites={bad!r}")):
        attention.attend(
            q, k, v, q_positions=qpos, k_positions=kpos, sites=bad, rope=ROPES["A1-half"][1]
        )


def test_bad_grouping_raises():
    q, k, v, qpos, kpos = inputs(9, 1)
    with pytest.raises(ValueError, match="num_kv_heads"):
        attention.attend(q[:, :, :3], k, v, q_positions=qpos, k_positions=kpos, sites="qk", rope={})


def test_module_matches_function():
    """Attention(x) == o_proj(attend(q_proj x, k_proj x, v_proj x)) with causal masking."""
    rope = dict(base=10000.0, layout="half", allocation="sections", sections=(2, 1, 1))
    layer = attention.Attention(16, N, K, H, sites="vo", rope=rope, rngs=nnx.Rngs(0))
    x = np.random.default_rng(10).normal(size=(B, T, 16)).astype(np.float32)
    pos = np.random.default_rng(11).uniform(0, 9, size=(B, T, 3)).astype(np.float32)
    q = jnp.einsum("btd,dnh->btnh", x, layer.q_proj[...])
    k = jnp.einsum("btd,dnh->btnh", x, layer.k_proj[...])
    v = jnp.einsum("btd,dnh->btnh", x, layer.v_proj[...])
    ref = ref_attend(q, k, v, pos, pos, "vo", rope, causal_keep(T, T))
    ref = np.einsum("btnh,nhd->btd", ref, np.asarray(layer.o_proj[...], np.float64))
    np.testing.assert_allclose(np.asarray(layer(x, pos)), ref, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------ tied key/value


@pytest.mark.parametrize("rope_id", list(ROPES))
def test_tied_equals_attend_with_k_equal_v(rope_id):
    """attend_tied(q, c) == attend(q, c, c, sites="qkvo") == the float64 reference."""
    num_axes, rope = ROPES[rope_id]
    q, c, _, qpos, kpos = inputs(20 + list(ROPES).index(rope_id), num_axes)
    kw = dict(q_positions=qpos, k_positions=kpos, rope=rope, causal=True)
    tied = jax.jit(functools.partial(attention.attend_tied, **kw))(q, c)
    both = attention.attend(q, c, c, sites="qkvo", **kw)
    np.testing.assert_allclose(np.asarray(tied), np.asarray(both), atol=1e-6)
    ref = ref_attend(q, c, c, qpos, kpos, "qkvo", rope, causal_keep(T, T))
    np.testing.assert_allclose(np.asarray(tied), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("rope_id", ["A1-half", "A3-sections-interleaved"])
def test_tied_is_relative(rope_id):
    """Relativity of the tied cache: shifting every position leaves the output."""
    num_axes, rope = ROPES[rope_id]
    q, c, _, qpos, kpos = inputs(21, num_axes)
    shift = np.asarray([-7.3, 12.5, 4.25][:num_axes], np.float32)
    kw = dict(rope=rope, causal=True)
    out = attention.attend_tied(q, c, q_positions=qpos, k_positions=kpos, **kw)
    moved = attention.attend_tied(q, c, q_positions=qpos + shift, k_positions=kpos + shift, **kw)
    np.testing.assert_allclose(np.asarray(moved), np.asarray(out), atol=1e-4)


def tied_and_separate(num_heads, num_kv_heads, rope, seed=0):
    """A tied layer and a separate qkvo layer whose k and v weights are both its kv weight."""
    kw = dict(sites="qkvo", rope=rope, rngs=nnx.Rngs(seed))
    tied = attention.Attention(16, num_heads, num_kv_heads, H, kv="tied", **kw)
    sep = attention.Attention(16, num_heads, num_kv_heads, H, **kw)
    sep.q_proj[...] = tied.q_proj[...]
    sep.k_proj[...] = tied.kv_proj[...]
    sep.v_proj[...] = tied.kv_proj[...]
    sep.o_proj[...] = tied.o_proj[...]
    return tied, sep


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (4, 1), (4, 4)])
@pytest.mark.parametrize("rope_id", ["A1-half", "A3-sections-interleaved"])
def test_tied_layer_equals_separate_layer_with_tied_weights(rope_id, num_heads, num_kv_heads):
    num_axes, rope = ROPES[rope_id]
    tied, sep = tied_and_separate(num_heads, num_kv_heads, rope)
    rng = np.random.default_rng(22)
    x = rng.normal(size=(B, T, 16)).astype(np.float32)
    pos = rng.uniform(0, 30, size=(B, T, num_axes)).astype(np.float32)
    out = tied(x, pos)
    assert out.shape == (B, T, 16)
    np.testing.assert_allclose(np.asarray(out), np.asarray(sep(x, pos)), atol=1e-6)
    shift = np.float32(9.5)  # relative: the layer output ignores a common shift
    np.testing.assert_allclose(np.asarray(tied(x, pos + shift)), np.asarray(out), atol=1e-4)
    assert not hasattr(tied, "k_proj") and not hasattr(tied, "v_proj")
    assert tied.kv_proj.shape == (16, num_kv_heads, H)


@pytest.mark.parametrize("sites", ["", "qk", "vo", "qkv"])
def test_tied_needs_every_site(sites):
    with pytest.raises(ValueError, match=f"kv='tied' needs sites='qkvo'.*sites={sites!r}"):
        attention.Attention(16, N, K, H, sites=sites, rope={}, kv="tied", rngs=nnx.Rngs(0))
    attention.Attention(16, N, K, H, sites="okvq", rope={}, kv="tied", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="kv='shared'"):
        attention.Attention(16, N, K, H, sites="qkvo", rope={}, kv="shared", rngs=nnx.Rngs(0))
