"""The TPU splash kernel (`impl="splash"`) run by Pallas's interpreter on a CPU: the same
kernel code as on a TPU, against `xla`, over the masks it builds (causal, segment ids,
a traced decoding offset, a dense mask, lengths that are not whole blocks)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rope_jax.nn import kernels

splash = pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention")

# One worker runs the module: the interpreted kernels share the ops they compile.
pytestmark = pytest.mark.xdist_group("splash_interpret")


@pytest.fixture
def interpreted(monkeypatch):
    """splash on this backend: the TPU check lifted, the kernel interpreted."""
    monkeypatch.setattr(kernels, "check_impl", lambda impl, field="impl": impl)
    monkeypatch.setattr(splash, "make_splash_mha",
                        functools.partial(splash.make_splash_mha, interpret=True))  # fmt: skip


def _qkv(t, s, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(2, t, 4, 64)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, s, 2, 64)), jnp.float32) for _ in range(2))
    return q, k, v


CASES = {
    "causal": lambda t: dict(causal=True),
    "not causal, padded keys": lambda t: dict(causal=False),
    "segments": lambda t: dict(causal=True, q_segments=_segments(t), kv_segments=_segments(t)),
    "traced offset": lambda t: dict(causal=True, q_offset=jnp.asarray(3)),
    "dense mask": lambda t: dict(
        causal=True, mask=jnp.asarray(np.random.default_rng(1).random((1, 4, t, t)) > 0.3)
    ),  # fmt: skip
    "sinks": lambda t: dict(causal=True, sinks=jnp.linspace(-1.0, 2.0, 4)),
    "window, padded rows": lambda t: dict(causal=True, window=40),
    "window, sinks, segments": lambda t: dict(
        causal=True,
        window=40,
        sinks=jnp.linspace(-1.0, 2.0, 4),
        q_segments=_segments(t),
        kv_segments=_segments(t),
    ),  # fmt: skip
    "chunk, padded rows": lambda t: dict(causal=True, chunk=40),
    "chunk, traced offset": lambda t: dict(causal=True, chunk=40, q_offset=jnp.asarray(3)),
}


def _segments(t):
    return jnp.asarray(np.repeat([[0, 1, 2]], [t // 3, t // 3, t - 2 * (t // 3)], axis=1)
                       .repeat(2, axis=0), jnp.int32)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_splash_equals_xla_in_the_interpreter(interpreted, case):
    t = 136  # not a whole number of 128-blocks: padding on both axes
    q, k, v = _qkv(t, t)
    kw = CASES[case](t)
    got = kernels.mix(q, k, v, impl="splash", block_size=128, **kw)
    want = kernels.mix(q, k, v, impl="xla", **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("local", [{"window": 150}, {"chunk": 160}], ids=["window", "chunk"])
def test_splash_local_masks_with_sinks_equal_xla(interpreted, local):
    """Whole blocks (from key 0): the window is the kernel's lazy LocalMask, the chunk its
    ChunkedCausalMask (blocks outside them skipped)."""
    q, k, v = _qkv(384, 384)
    kw = dict(causal=True, sinks=jnp.linspace(-1.0, 2.0, 4), **local)
    loss = lambda impl: lambda q, k, v, z: jnp.sum(
        kernels.mix(q, k, v, impl=impl, block_size=128, **{**kw, "sinks": z}) ** 2)  # fmt: skip
    got = jax.value_and_grad(loss("splash"), argnums=(0, 1, 2, 3))(q, k, v, kw["sinks"])
    want = jax.value_and_grad(loss("xla"), argnums=(0, 1, 2, 3))(q, k, v, kw["sinks"])
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-4, rtol=2e-4)


def test_splash_refuses_a_block_size_it_cannot_tile(interpreted):
    q, k, v = _qkv(16, 16)
    with pytest.raises(ValueError, match="block_size a multiple of 128"):
        kernels.mix(q, k, v, impl="splash", block_size=100)
