"""The optimiser registries and the global-norm clip (optax's numbers, no gradient copy)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import lm
from rope_jax.harness import optim, setup


def _tree(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(rng.normal(size=(64, 32)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(7,)), jnp.float32),
        "h": jnp.asarray(rng.normal(size=(3, 5)), jnp.bfloat16),
    }


@pytest.mark.xdist_group("optim-clip")  # one worker: the ops run eagerly compile once
@pytest.mark.parametrize("max_norm", [0.1, 1.0, 1e6])  # clipped, clipped, kept
def test_the_clip_gives_optax_numbers_and_its_state(max_norm):
    """Bit for bit when nothing is clipped (t * 1 = t); to rounding when clipped (optax
    divides by the norm and multiplies by max_norm, ours multiplies by their ratio)."""
    tree = _tree()
    ours, ref = optim.clip_by_global_norm(max_norm), optax.clip_by_global_norm(max_norm)
    a, _ = jax.jit(lambda t: ours.update(t, ours.init(t)))(tree)
    b, _ = jax.jit(lambda t: ref.update(t, ref.init(t)))(tree)
    clipped = float(optax.tree.norm(tree)) >= max_norm
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y, wide = np.asarray(x, np.float32), np.asarray(y, np.float32), x.dtype == jnp.float32
        if clipped:
            np.testing.assert_allclose(x, y, rtol=5e-7 if wide else 1e-2)
        else:
            np.testing.assert_array_equal(x, y)
    assert jax.tree.structure(ours.init(tree)) == jax.tree.structure(ref.init(tree))
    nan = {k: v.at[0].set(jnp.nan) for k, v in tree.items()}  # a NaN norm clips to NaN
    assert bool(jnp.isnan(ours.update(nan, ())[0]["w"]).all())


@pytest.mark.slow  # compiles two train steps
def test_clipping_adds_no_gradient_sized_temporary():
    """XLA's temporaries of a train step are the same with and without the clip (optax's
    select between the gradients and their scaled copy cost one more gradient buffer)."""
    config = lm.get_config("size=small")
    config.model.num_layers, config.data.seq_len, config.data.global_batch_size = 2, 32, 2
    temps, params = {}, 0
    for clip in (1.0, 0.0):
        config.optim.grad_clip_norm = clip
        report = setup.dry_run(config)
        temps[clip], params = report["temp_bytes_per_device"], report["parameters"]
    assert temps[1.0] - temps[0.0] < 0.05 * 4 * params, temps  # optax.clip_by_global_norm: 0.17


def _divided_clip(max_norm):
    """The clip as it was: each array divided by the norm, then multiplied by max_norm
    (1 and 1 when nothing is clipped): optax's rounding, and a division, which XLA does
    not duplicate into Adam's two moments, so the scaled array is a buffer of its own."""

    def update(updates, state, params=None):
        norm = optim._global_norm(updates)
        keep = norm < max_norm
        divisor, factor = jnp.where(keep, 1.0, norm), jnp.where(keep, 1.0, max_norm)
        return jax.tree.map(lambda t: (t / divisor.astype(t.dtype)) * factor, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)


@pytest.mark.slow  # compiles three train steps of two 1b layers (about a minute)
def test_the_clip_keeps_no_scaled_copy_of_the_gradients_at_the_1b_width(monkeypatch):
    """Two layers of the 1b preset as the CPU runs it (bf16, chunked, remat=block, B = 1,
    T = 128), compiled, not run: the clip's temporaries over no clip's stay under a
    twentieth of the gradients (all of them alive until the norm is known is what
    clipping costs), and below the divided clip's, whose scaled arrays XLA materialised
    (616.6 MiB against 591.1 with this one and 576.1 without clipping, jax 0.10.2)."""
    from rope_jax import harness
    from rope_jax.harness import feed

    config = lm.get_config("size=1b")
    config.model.num_layers, config.model.attention.impl = 2, "chunked"
    config.model.dtype, config.model.remat = "bfloat16", "block"
    config.data.seq_len, config.data.global_batch_size = 128, 1

    def temp(clip, max_norm):
        monkeypatch.setattr(optim, "clip_by_global_norm", clip)
        config.optim.grad_clip_norm = max_norm
        run = harness.build(config, vocab_from_data=False)
        batch = feed.abstract_batch(1, 128, run.batch_sharding, ())
        grads = sum(x.size * 4 for x in jax.tree.leaves(run.abstract["params"]))
        compiled = run.train_step.lower(run.abstract, batch).compile()
        return compiled.memory_analysis().temp_size_in_bytes, grads

    ours, grads = temp(optim.clip_by_global_norm, 1.0)
    none, _ = temp(optim.clip_by_global_norm, 0.0)
    divided, _ = temp(_divided_clip, 1.0)
    assert ours - none < grads / 20, (ours, none, grads)
    assert divided - ours > 16 * 2**20, (divided, ours)  # more than a 2048 x 2048 array


def _train_steps(clip, monkeypatch, steps=3):
    """Losses and parameters of `steps` train steps of a 2-layer tiny model (float32, B = 4,
    T = 64, the same random batches) built with `clip` as the global-norm clip."""
    from rope_jax import sharding
    from rope_jax.harness import feed

    monkeypatch.setattr(optim, "clip_by_global_norm", clip)
    config = lm.get_config("size=tiny")
    config.model.dtype, config.data.global_batch_size, config.data.seq_len = "float32", 4, 64
    config.optim.warmup_steps = 1  # every step updates, each clipped (norms are above 1)
    run = setup.build(config)
    rng, losses = np.random.default_rng(0), []
    with sharding.use_mesh(run.mesh, run.rules):
        state = jax.jit(run.init_fn, out_shardings=run.shardings)()
        for _ in range(steps):
            tokens = rng.integers(0, 200, size=(4, 65)).astype(np.int32)
            batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                     "weights": np.ones((4, 64), np.float32)}  # fmt: skip
            state, m = run.train_step(state, feed.put_batch(batch, run.batch_sharding))
            losses.append(float(m["loss"]))
        assert float(m["grad_norm"]) > config.optim.grad_clip_norm  # the clip was active
        return losses, jax.tree.map(np.asarray, state["params"])


@pytest.mark.slow  # compiles two train steps
def test_a_train_step_with_the_clip_follows_optax_to_rounding(monkeypatch):
    """In a compiled step XLA rounds the two clips' steps differently in the last bits
    (the docstring); the runs must still agree to rounding: a wrong scale, a clip applied
    when it should not be or not when it should, would move them far more."""
    ours = _train_steps(optim.clip_by_global_norm, monkeypatch)
    ref = _train_steps(optax.clip_by_global_norm, monkeypatch)
    np.testing.assert_allclose(ours[0], ref[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(ours[1]), jax.tree.leaves(ref[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
