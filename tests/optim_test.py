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


@pytest.mark.parametrize("max_norm", [0.1, 1.0, 1e6])  # clipped, clipped, kept
def test_the_clip_gives_optax_numbers_bit_for_bit_and_its_state(max_norm):
    tree = _tree()
    ours, ref = optim.clip_by_global_norm(max_norm), optax.clip_by_global_norm(max_norm)
    a, _ = jax.jit(lambda t: ours.update(t, ours.init(t)))(tree)
    b, _ = jax.jit(lambda t: ref.update(t, ref.init(t)))(tree)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
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
