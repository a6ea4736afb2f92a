"""Tests for learned rotations (`model.rope.learned`, rope_jax.learned): the start equals
the fixed rotation, relativity and orthogonality survive training, gradients reach the
frequencies and the basis, decoding with the cache equals the full forward, N-D positions,
config validation and the optimiser's decay mask."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import scipy.linalg
from flax import nnx

from rope_jax import defaults, learned, rotary
from rope_jax.harness import optim
from rope_jax.nn import model as model_lib

# One worker runs the module: the ops its eager model passes run compile once.
pytestmark = pytest.mark.xdist_group("learned_rotations")

B, T, V = 2, 10, 19
N, K, H = 4, 2, 8  # GQA: query heads n = 2k, 2k + 1 use kv head k's frequencies
KINDS = ("freqs", "commuting")
# (kv, sites): QK-RoPE, VO-RoPE and the tied cache (which needs every site).
SITE_CASES = (("separate", "qk"), ("separate", "vo"), ("tied", "qkvo"))


def cfg(kind="none", kv="separate", sites="qk", **extra):
    """A tiny config.model; `extra` uses dotted names ("rope.allocation")."""
    rope = dict(sites=sites, base=100.0, ladder="standard", layout="half",
                allocation="alternating", sections=(), learned=kind,
                pairs=dict(rule="all", fraction=None, index=()))  # fmt: skip
    c = ml_collections.ConfigDict(
        dict(
            vocab_size=V,
            num_layers=2,
            embed_dim=32,
            num_heads=N,
            num_kv_heads=K,
            head_dim=H,
            mlp_dim=48,
            dtype="float32",
            param_dtype="float32",
            patch_dim=0,
            attention=dict(kv=kv),
            rope=rope,
        )  # fmt: skip
    )
    c.update_from_flattened_dict(extra)
    return c


def tokens(seed, t=T):
    return jnp.asarray(np.random.default_rng(seed).integers(0, V, size=(B, t)), jnp.int32)


def grid_positions(seed, num_axes, t=T):
    """Random real positions [B, T, A] (not text: every axis differs)."""
    return jnp.asarray(np.random.default_rng(seed).uniform(0, 20, (B, t, num_axes)), jnp.float32)


def randomise(model, seed, scale=0.5):
    """Moves every rotation parameter off its start: frequencies on every axis, a basis
    generator far from 0 (Q far from I)."""
    rng = np.random.default_rng(seed)
    for block in model.blocks:
        attn = block.attn
        if attn.rope_freqs is not None:
            shape = attn.rope_freqs.shape
            attn.rope_freqs[...] = attn.rope_freqs[...] + rng.normal(0, scale, shape)
        if attn.rope_basis is not None:
            attn.rope_basis[...] = jnp.asarray(rng.normal(0, scale, (H, H)), jnp.float32)


def cached_logits(model, tok, pos, chunks):
    """Logits [B, T, V] fed through the decoding cache in `chunks` (summing to T)."""
    cache = model.init_cache(B, tok.shape[1] + 2)  # spare slots stay masked
    out, start = [], 0
    for n in chunks:
        logits, cache = model.decode(tok[:, start : start + n], pos[:, start : start + n], cache)
        out.append(logits)
        start += n
    return jnp.concatenate(out, axis=1)


def rotation_params(model):
    return {
        "/".join(map(str, path)): var[...]
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
        if path[-1] in learned.PARAM_NAMES
    }


# ------------------------------------------------------------------------- the start


def _assert_init_equals_none(kv, sites, num_axes=1, **extra):
    """Both kinds give the fixed rotation's logits (1e-6) at initialisation."""
    tok, pos = tokens(0), grid_positions(1, num_axes)

    def logits(kind):
        model = model_lib.Decoder(cfg(kind, kv, sites, **extra), num_axes=num_axes,
                                  rngs=nnx.Rngs(0))  # fmt: skip
        return np.asarray(model(tok, pos))

    fixed = logits("none")
    for kind in KINDS:
        np.testing.assert_allclose(logits(kind), fixed, atol=1e-6, rtol=0, err_msg=kind)


def test_at_init_learned_equals_none():
    _assert_init_equals_none("separate", "qk")


@pytest.mark.slow
def test_at_init_learned_equals_none_every_site_case_and_3d():
    sections = {"rope.allocation": "sections", "rope.sections": (2, 1, 1)}
    for kv, sites in SITE_CASES:
        _assert_init_equals_none(kv, sites)
        _assert_init_equals_none(kv, sites, num_axes=3, **sections)


def test_initial_freqs_are_the_fixed_ladder_on_its_axes():
    spec = rotary.RopeSpec(base=100.0, allocation="sections", sections=(1, 2, 1))
    theta = learned.initial_freqs(H, K, spec, num_axes=3)
    freqs, axes = rotary.pair_table(H, spec, num_axes=3)
    assert theta.shape == (K, H // 2, 3) and theta.dtype == np.float32
    for i, (f, a) in enumerate(zip(freqs, axes, strict=True)):
        expected = np.zeros(3, np.float32)
        expected[a] = f
        np.testing.assert_array_equal(theta[:, i], np.broadcast_to(expected, (K, 3)))
    assert np.array_equal(learned.cayley(jnp.zeros((H, H))), np.eye(H))  # Q = I exactly


def test_none_adds_nothing_and_old_configs_read_none():
    old = cfg()
    del old.rope["learned"]
    assert defaults.fill_model(old).rope.learned == "none"
    counts = {kind: model_lib.count_params(model_lib.Decoder(cfg(kind), rngs=nnx.Rngs(0)))
              for kind in ("none", *KINDS)}  # fmt: skip
    layers, pairs = 2, H // 2
    assert counts["freqs"] - counts["none"] == layers * K * pairs * 1
    assert counts["commuting"] - counts["freqs"] == layers * H * H
    a = model_lib.Decoder(old, rngs=nnx.Rngs(0))(tokens(3))
    b = model_lib.Decoder(cfg("none"), rngs=nnx.Rngs(0))(tokens(3))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------ the rotation's algebra


def test_commuting_generators_give_the_rotation():
    """R(p) = Q D(p) Q^T = expm(sum_a p_a B_a), B_a skew-symmetric and commuting; the
    kernel (`rotate`) equals the matrix."""
    rng = np.random.default_rng(0)
    theta = rng.normal(0, 1, (K, H // 2, 2)).astype(np.float32)
    q = learned.cayley(jnp.asarray(rng.normal(0, 0.5, (H, H)), jnp.float32))
    np.testing.assert_allclose(q.T @ q, np.eye(H), atol=1e-5)
    u, v = np.arange(H // 2), np.arange(H // 2) + H // 2  # layout "half"
    p = np.array([1.7, -0.4])
    mats = np.asarray(learned.rotation_matrix(jnp.asarray(p), theta, q))  # [K, H, H]
    for k in range(K):
        gens = np.zeros((2, H, H))
        gens[:, v, u], gens[:, u, v] = theta[k].T, -theta[k].T
        gens = np.asarray(q, np.float64) @ gens @ np.asarray(q, np.float64).T
        np.testing.assert_allclose(gens[0] @ gens[1], gens[1] @ gens[0], atol=1e-5)
        np.testing.assert_allclose(gens, -gens.transpose(0, 2, 1), atol=1e-6)
        np.testing.assert_allclose(mats[k], scipy.linalg.expm(np.tensordot(p, gens, 1)),
                                   atol=2e-5)  # fmt: skip
    x = jnp.asarray(rng.normal(size=(1, 1, N, H)), jnp.float32)
    got = learned.rotate(x, jnp.asarray(p)[None, None], theta, q)[0, 0]
    want = np.einsum("nhg,ng->nh", np.repeat(mats, N // K, axis=0), x[0, 0])
    np.testing.assert_allclose(got, want, atol=1e-5)


def _assert_relative_matrices(rot, m, n):
    """R(m)^T R(n) = R(n - m) and R(m)^T R(m) = I for every kv head, positions [A]."""
    mats = lambda p: np.asarray(learned.rotation_matrix(p, rot.freqs, rot.basis), np.float64)
    rm, rn = mats(m), mats(n)  # [K, H, H]
    rm_t = np.swapaxes(rm, -1, -2)
    np.testing.assert_allclose(rm_t @ rn, mats(n - m), atol=5e-5)
    np.testing.assert_allclose(rm_t @ rm, np.broadcast_to(np.eye(H), rm.shape), atol=5e-6)


def test_relativity_with_random_parameters():
    """R(m)^T R(n) = R(n - m) for random (not initial) frequencies and basis, 3-D."""
    rng = np.random.default_rng(1)
    theta = jnp.asarray(rng.normal(0, 1, (K, H // 2, 3)), jnp.float32)
    basis = learned.cayley(jnp.asarray(rng.normal(0, 0.5, (H, H)), jnp.float32))
    m, n = (jnp.asarray(rng.uniform(-30, 30, 3), jnp.float32) for _ in "mn")
    for q in (None, basis):
        _assert_relative_matrices(learned.LearnedRotation(rotary.RopeSpec(), theta, q), m, n)


# ------------------------------------------------------------------- after training


def _train(model, steps, seed, num_axes):
    """`steps` AdamW steps (the harness's optimiser and decay mask) on random tokens."""
    optim_cfg = ml_collections.ConfigDict(
        dict(
            name="adamw",
            lr=3e-2,
            warmup_steps=0,
            schedule="constant",
            weight_decay=0.1,
            b1=0.9,
            b2=0.95,
            grad_clip_norm=1.0,
        )  # fmt: skip
    )
    optimizer = nnx.Optimizer(model, optim.make_optimizer(optim_cfg, steps), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, tok, pos):
        def loss_fn(model):
            logits = model(tok[:, :-1], pos[:, :-1])
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tok[:, 1:, None], -1))

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    for i in range(steps):
        step(model, optimizer, tokens(seed + i, T + 1), grid_positions(seed + i, num_axes, T + 1))


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_relative_and_orthogonal_after_training(kind):
    """After a few optimiser steps from random parameters: Q^T Q = I, R(m)^T R(n) =
    R(n - m) as matrices and as q.k scores (query head n with kv head n // G), and the
    model's logits ignore a common shift of all 2-D positions (sites qk)."""
    num_axes = 2
    model = model_lib.Decoder(cfg(kind), num_axes=num_axes, rngs=nnx.Rngs(1))
    randomise(model, 2)
    before = rotation_params(model)
    _train(model, 3, seed=10, num_axes=num_axes)
    after = rotation_params(model)
    assert before.keys() == after.keys() and len(after) == 2 * len(learned.KINDS[kind])
    for name in after:  # trained, not only initialised
        assert float(jnp.max(jnp.abs(after[name] - before[name]))) > 1e-3, name

    rng = np.random.default_rng(3)
    m, n = (jnp.asarray(rng.uniform(-30, 30, (B, 5, num_axes)), jnp.float32) for _ in "mn")
    q = jnp.asarray(rng.normal(size=(B, 5, N, H)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, 5, K, H)), jnp.float32)
    kq = jnp.repeat(k, N // K, axis=2)  # the key of each query head: kv head n // G
    for block in model.blocks:
        rot = block.attn.rotation()
        if kind == "commuting":
            np.testing.assert_allclose(rot.basis.T @ rot.basis, np.eye(H), atol=2e-6)
        scores = jnp.sum(rot.rotate(q, m) * jnp.repeat(rot.rotate(k, n), N // K, axis=2), -1)
        relative = jnp.sum(q * jnp.repeat(rot.rotate(k, n - m), N // K, axis=2), -1)
        np.testing.assert_allclose(scores, relative, atol=5e-4)
        np.testing.assert_allclose(jnp.linalg.norm(rot.rotate(kq, n), axis=-1),
                                   jnp.linalg.norm(kq, axis=-1), rtol=1e-5)  # fmt: skip
        _assert_relative_matrices(rot, m[0, 0], n[0, 0])

    tok, pos = tokens(4), grid_positions(5, num_axes)
    logits = model(tok, pos)
    shifted = model(tok, pos + jnp.asarray([100.0, -37.5]))
    np.testing.assert_allclose(np.asarray(shifted), np.asarray(logits), atol=5e-4)


@pytest.mark.slow
def test_gradients_reach_frequencies_and_basis():
    """Non-zero, finite gradients on every rotation parameter, at the start (S = 0, the
    ladder) and away from it, for QK, VO and the tied cache."""
    x = tokens(7, T + 1)

    def loss(model):
        logits = model(x[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), x[:, 1:, None], -1))

    grad = nnx.jit(nnx.grad(loss))
    for kv, sites in SITE_CASES:
        model = model_lib.Decoder(cfg("commuting", kv, sites), rngs=nnx.Rngs(0))
        for moved in (False, True):
            if moved:
                randomise(model, 8)
            grads = nnx.state(grad(model), nnx.Param)
            found = 0
            for path, g in nnx.to_flat_state(grads):
                if path[-1] in learned.PARAM_NAMES:
                    g = np.asarray(g[...])
                    assert np.all(np.isfinite(g)) and np.max(np.abs(g)) > 1e-7, (sites, path)
                    found += 1
            assert found == 4, (sites, found)  # 2 layers x (freqs, basis)


# ---------------------------------------------------------------- decoding, N-D


def _assert_decoding_equals_forward(kind, kv, sites, num_axes=1, **extra):
    """Prefill then one token a step == one forward, with random (trained-like) rotation
    parameters, at random real N-D positions."""
    tok, pos = tokens(1), grid_positions(2, num_axes)
    model = model_lib.Decoder(cfg(kind, kv, sites, **extra), num_axes=num_axes,
                              rngs=nnx.Rngs(0))  # fmt: skip
    randomise(model, 3)
    full = model(tok, pos)
    cached = cached_logits(model, tok, pos, [6, 1, 1, 1, 1])
    np.testing.assert_allclose(np.asarray(cached), np.asarray(full), atol=2e-5, rtol=1e-5,
                               err_msg=f"{kind} {kv} {sites} A={num_axes}")  # fmt: skip


@pytest.mark.slow
def test_tied_commuting_decoding_with_2d_positions_equals_forward():
    _assert_decoding_equals_forward("commuting", "tied", "qkvo", num_axes=2)


@pytest.mark.slow
def test_decoding_equals_full_forward():
    """Each kind with sites qk and vo, and the tied qkvo cache."""
    for kind in KINDS:
        for kv, sites in SITE_CASES:
            _assert_decoding_equals_forward(kind, kv, sites)


@pytest.mark.slow
@pytest.mark.parametrize("num_axes", [2, 3])
def test_nd_positions(num_axes):
    """A = 2, 3: the frequencies have one column per axis, decoding with N-D positions
    equals the forward, and moving the frequency of one axis moves only that axis."""
    extra = {"rope.allocation": "sections",
             "rope.sections": (2, 2) if num_axes == 2 else (2, 1, 1)}  # fmt: skip
    for kind, (kv, sites) in zip(KINDS, (("separate", "vo"), ("tied", "qkvo")), strict=True):
        _assert_decoding_equals_forward(kind, kv, sites, num_axes, **extra)
    model = model_lib.Decoder(cfg("commuting", **extra), num_axes=num_axes, rngs=nnx.Rngs(0))
    assert model.blocks[0].attn.rope_freqs.shape == (K, H // 2, num_axes)
    randomise(model, 7)
    rot = model.blocks[0].attn.rotation()
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 1, N, H)), jnp.float32)
    p = jnp.zeros((1, 1, num_axes)).at[..., -1].set(3.0)  # only the last axis is non-zero
    moved = learned.LearnedRotation(rot.spec, rot.freqs.at[..., 0].add(1.0), rot.basis)
    np.testing.assert_allclose(moved.rotate(x, p), rot.rotate(x, p), atol=1e-6)
    assert float(jnp.max(jnp.abs(moved.rotate(x, p + 1.0) - rot.rotate(x, p + 1.0)))) > 1e-2


# ------------------------------------------------------------------- config, optimiser


BAD = [
    ({"rope.learned": "mixed"}, "model.rope.learned='mixed' is invalid: must be one of 'none', "
                                "'freqs', 'commuting'"),
    ({"rope.learned": "freqs", "rope.sites": ""}, "model.rope.learned='freqs' is invalid: needs "
                                                   "rotated model.rope.sites"),
    ({"rope.learned": "commuting", "rope.scaling": {"rope_type": "yarn", "factor": 4.0}},
     "model.rope.learned='commuting' is invalid: takes only the fixed ladder over every pair "
     r"\(learned frequencies start from the fixed ladder; rope_type='yarn' rescales it\)"),
    ({"rope.learned": "freqs", "rope.pairs.rule": "first", "rope.pairs.fraction": 0.5},
     r"takes only the fixed ladder over every pair \(learned frequencies turn every pair of the "
     r"head; pairs.rule='first'"),
]  # fmt: skip


def test_config_validation():
    """One-line errors for unknown kinds and for what cannot train (no sites) or would
    be rescaled (a scaling rule); NoPE and local layers are accepted."""
    for overrides, message in BAD:
        c = cfg(**{k: v for k, v in overrides.items() if k != "rope.scaling"})
        if "rope.scaling" in overrides:
            c.rope.scaling = overrides["rope.scaling"]
        with pytest.raises(ValueError, match=message) as err:
            model_lib.check_config(c, train_seq_len=T)
        assert "\n" not in str(err.value)
    nope = model_lib.Decoder(cfg("freqs", **{"rope.nope_every": 2}), rngs=nnx.Rngs(0))
    assert nope.blocks[0].attn.rope_freqs is not None and nope.blocks[1].attn.rope_freqs is None
    local = model_lib.Decoder(
        cfg("freqs", **{"rope.local_base": 10.0, "rope.global_every": 2}), rngs=nnx.Rngs(0)
    )
    first = local.blocks[0].attn.rope_freqs[...][0, :, 0]  # a local layer: its own base
    np.testing.assert_allclose(first, rotary.frequencies(H, base=10.0), rtol=1e-6)
    np.testing.assert_allclose(local.blocks[1].attn.rope_freqs[...][0, :, 0],
                               rotary.frequencies(H, base=100.0), rtol=1e-6)  # fmt: skip


def test_rotation_parameters_are_float32_and_not_decayed():
    """Float32 under bfloat16 parameters (they feed the float32 phase), with logical
    names, and outside the AdamW decay mask (matrices are still decayed): decay would
    pull the frequencies towards NoPE and the basis towards I, which bounds nothing."""
    build = lambda: model_lib.Decoder(cfg("commuting", param_dtype="bfloat16"), rngs=nnx.Rngs(0))
    params = nnx.state(nnx.eval_shape(build), nnx.Param)  # shapes and dtypes only
    mask = dict(nnx.to_flat_state(optim._decay_mask(params)))
    for path, var in nnx.to_flat_state(params):
        axes = var.get_metadata().get("out_sharding")
        assert axes is not None and len(axes) == var.ndim, path
        if path[-1] in learned.PARAM_NAMES:
            assert var.dtype == jnp.float32 and not mask[path].get_value(), path
    assert mask[("blocks", 0, "attn", "q_proj")].get_value()
    assert not mask[("blocks", 0, "attn_norm", "scale")].get_value()
