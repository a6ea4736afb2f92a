"""Tests for rope_jax.recurrence: VO-RoPE with decaying weights == a complex-decay linear RNN."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rope_jax import rotary
from rope_jax.nn import recurrence

B, T, N, H = 2, 9, 3, 12  # 6 rotation pairs
# (num_axes, rope kwargs): 1-D text, 2-D and 3-D with both allocations.
ROPES = {
    "A1": (1, dict(base=100.0)),
    "A2-interleaved": (2, dict(base=50.0, allocation="alternating")),
    "A3-sections": (3, dict(base=200.0, allocation="sections", sections=(2, 1, 3))),
    "A3-interleaved-per_axis": (3, dict(base=30.0, ladder="per_axis")),
}
# gamma 0.9 in the quick loop; the other decays in the full suite
GAMMA_VALUES = (0.0, 0.5, 0.9, 1.0)
GAMMAS = [pytest.param(g, marks=() if g == 0.9 else pytest.mark.slow) for g in GAMMA_VALUES]


def inputs(seed, num_axes, *, integer=False):
    rng = np.random.default_rng(seed)
    v = rng.normal(size=(B, T, N, H)).astype(np.float32)
    if integer:
        pos = np.broadcast_to(np.arange(T, dtype=np.float32)[None, :, None], (B, T, num_axes))
    else:
        pos = rng.uniform(-4, 20, size=(B, T, num_axes)).astype(np.float32)
    return v, np.ascontiguousarray(pos)


def reference(v, pos, gamma, rope):
    """o_i = sum_{j<=i} gamma^(i-j) R_{p_j - p_i} v_j with explicit matrices (float64)."""
    out = np.zeros(v.shape)
    gamma = np.broadcast_to(np.asarray(gamma, np.float64), (N,))
    # R_{p_j - p_i} of every pair (i, j), built in one call: [B, T (i), T (j), H, H]
    rels = np.asarray(
        rotary.rotation_matrix(pos[:, None] - pos[:, :, None], head_dim=H, **rope), np.float64
    )
    for i in range(T):
        for j in range(i + 1):
            rel = rels[:, i, j]  # [B, H, H]
            out[:, i] += gamma[None, :, None] ** (i - j) * np.einsum("bij,bnj->bni", rel, v[:, j])
    return out


@functools.cache
def both_forms(rope_id: str, layout: str):
    """jitted (v, pos, gamma) -> (vo_decay_attention, vo_recurrence) under rotation
    `rope_id` with `layout`: one program for the two forms, gamma traced (the library
    makes it an array either way), so every gamma of the rotation shares one compile."""
    rope = dict(ROPES[rope_id][1], layout=layout)
    forms = (recurrence.vo_decay_attention, recurrence.vo_recurrence)
    return jax.jit(lambda v, pos, gamma: [form(v, pos, gamma=gamma, **rope) for form in forms])


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize(
    "rope_id",  # a rotation's cases share a worker, which compiles `both_forms` once each
    [pytest.param(r, marks=pytest.mark.xdist_group(f"recurrence-{r}")) for r in ROPES],
)  # fmt: skip
@pytest.mark.parametrize("gamma", GAMMAS)
def test_recurrence_equals_decay_attention(gamma, rope_id, layout):
    num_axes = ROPES[rope_id][0]
    v, pos = inputs(GAMMA_VALUES.index(gamma) + 10 * list(ROPES).index(rope_id), num_axes)
    a, b = both_forms(rope_id, layout)(v, pos, jnp.float32(gamma))
    assert a.shape == b.shape == (B, T, N, H) and a.dtype == b.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("rope_id", ["A1", "A3-sections"])
def test_quadratic_form_matches_the_spec_sum(rope_id):
    """vo_decay_attention is sum_j gamma^(i-j) R_{p_j - p_i} v_j (independent matrices)."""
    num_axes, rope = ROPES[rope_id]
    v, pos = inputs(1, num_axes)
    out = recurrence.vo_decay_attention(v, pos, gamma=0.8, **rope)
    np.testing.assert_allclose(np.asarray(out), reference(v, pos, 0.8, rope), atol=2e-5)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_integer_text_positions_step_is_r_minus_one(layout):
    """1-D positions 0..T-1: o_i = gamma R_{-1} o_{i-1} + v_i, written out as a loop."""
    rope = dict(base=10.0, layout=layout)
    v, pos = inputs(2, 1, integer=True)
    r_minus_one = np.asarray(rotary.rotation_matrix(np.array([-1.0]), head_dim=H, **rope))
    o, expected = np.zeros((B, N, H)), []
    for i in range(T):
        o = 0.7 * np.einsum("ij,bnj->bni", r_minus_one, o) + v[:, i]
        expected.append(o)
    expected = np.stack(expected, axis=1)
    for positions in (
        pos[..., 0],
        pos[..., 0].astype(np.int32),
        pos,
    ):  # [B, T] int/float, [B, T, 1]
        out = jax.jit(functools.partial(recurrence.vo_recurrence, gamma=0.7, **rope))(v, positions)
        np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5)
        quad = recurrence.vo_decay_attention(v, positions, gamma=0.7, **rope)
        np.testing.assert_allclose(np.asarray(quad), expected, atol=2e-5)


def test_per_head_gamma_and_relativity():
    """gamma [N] decays each head on its own; the output is invariant to shifting positions."""
    num_axes, rope = ROPES["A3-sections"]
    v, pos = inputs(3, num_axes)
    gamma = jnp.asarray([0.3, 0.9, 1.0])
    out = recurrence.vo_recurrence(v, pos, gamma=gamma, **rope)
    np.testing.assert_allclose(
        np.asarray(out),
        np.asarray(recurrence.vo_decay_attention(v, pos, gamma=gamma, **rope)),
        atol=2e-5,
    )
    for head in range(N):
        single = recurrence.vo_recurrence(v, pos, gamma=float(gamma[head]), **rope)
        np.testing.assert_allclose(np.asarray(out[:, :, head]), np.asarray(single[:, :, head]))
    moved = recurrence.vo_recurrence(v, pos + np.float32([5.5, -3.0, 7.25]), gamma=gamma, **rope)
    np.testing.assert_allclose(np.asarray(moved), np.asarray(out), atol=1e-4)


def test_traced_gamma_gradients_agree():
    """Both forms differentiate the same in gamma and v (gamma traced under jit)."""
    num_axes, rope = ROPES["A2-interleaved"]
    v, pos = inputs(4, num_axes)

    def loss(fn, gamma, v):
        return jnp.sum(jnp.sin(fn(v, pos, gamma=gamma, **rope)))

    grads = [
        jax.jit(jax.grad(functools.partial(loss, fn), argnums=(0, 1)))(0.8, v)
        for fn in (recurrence.vo_decay_attention, recurrence.vo_recurrence)
    ]
    np.testing.assert_allclose(grads[1][0], grads[0][0], rtol=1e-4)
    np.testing.assert_allclose(np.asarray(grads[1][1]), np.asarray(grads[0][1]), atol=1e-4)


def test_bfloat16_keeps_dtype():
    v, pos = inputs(5, 1)
    out = recurrence.vo_recurrence(jnp.asarray(v, jnp.bfloat16), pos, gamma=0.9)
    assert out.dtype == jnp.bfloat16
    ref = recurrence.vo_decay_attention(v, pos, gamma=0.9)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=0.1)


def test_bad_shapes_raise():
    v, pos = inputs(6, 2)
    with pytest.raises(ValueError, match="positions"):
        recurrence.vo_recurrence(v, pos[:, :-1], gamma=0.5)
    with pytest.raises(ValueError, match="gamma"):
        recurrence.vo_decay_attention(v, pos, gamma=np.ones(N + 1))
