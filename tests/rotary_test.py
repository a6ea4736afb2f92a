"""Tests for rope_jax.rotary: the identities of docs/maths.md#rotation, golden parity, precision."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

from rope_jax import rotary

H = 16  # head dim used by the identity sweeps (P = 8 pairs)

# Every (num_axes, allocation, sections) combination the identities are swept over.
AXES_CASES = [
    (1, "alternating", None),
    (2, "alternating", None),
    (3, "alternating", None),
    (2, "sections", (3, 5)),
    (3, "sections", (2, 3, 3)),
    (2, "mrope_interleaved", (5, 3)),
    (3, "mrope_interleaved", (4, 2, 2)),
    (3, "videorope", (2, 3, 3)),
]
NEW_CASES = [c for c in AXES_CASES if c[1] in ("mrope_interleaved", "videorope")]
LAYOUTS = ["half", "interleaved"]
LADDERS = ["standard", "per_axis"]
SWEEP = list(itertools.product(AXES_CASES, LAYOUTS, LADDERS))
SWEEP_IDS = [f"A{a}-{al}-{lay}-{lad}" for (a, al, _), lay, lad in SWEEP]


def _kw(axes_case, layout, ladder):
    _, allocation, sections = axes_case
    return dict(layout=layout, ladder=ladder, allocation=allocation, sections=sections)


def _rand(seed, *shape, scale=1.0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32) * scale


# ------------------------------------------------------------------ identities 1-6


@pytest.mark.parametrize("axes_case,layout,ladder", SWEEP, ids=SWEEP_IDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_relativity(axes_case, layout, ladder, seed):
    """<R_m q, R_n k> = <q, R_{n-m} k> for random real N-D positions."""
    num_axes = axes_case[0]
    kw = _kw(axes_case, layout, ladder)
    q = _rand(seed, 1, 12, 2, H)
    k = _rand(seed + 100, 1, 12, 2, H)
    m = _rand(seed + 200, 1, 12, num_axes, scale=20.0)
    n = _rand(seed + 300, 1, 12, num_axes, scale=20.0)
    lhs = np.sum(rotary.rotate(q, m, **kw) * rotary.rotate(k, n, **kw), -1)
    rhs = np.sum(q * rotary.rotate(k, n - m, **kw), -1)
    np.testing.assert_allclose(lhs, rhs, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("axes_case,layout,ladder", SWEEP, ids=SWEEP_IDS)
def test_translation_invariance_of_attention_weights(axes_case, layout, ladder):
    num_axes = axes_case[0]
    kw = _kw(axes_case, layout, ladder)
    q, k = _rand(3, 2, 10, 2, H), _rand(4, 2, 10, 2, H)
    pos = _rand(5, 2, 10, num_axes, scale=10.0)
    shift = _rand(6, 1, 1, num_axes, scale=50.0)

    def weights(p):
        s = jnp.einsum("BTNH,BSNH->BNTS", rotary.rotate(q, p, **kw), rotary.rotate(k, p, **kw))
        return jax.nn.softmax(s, axis=-1)

    np.testing.assert_allclose(weights(pos), weights(pos + shift), atol=2e-5)


@pytest.mark.parametrize("axes_case", AXES_CASES[1:])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_degeneracy_to_1d_is_exact_with_standard_ladder(axes_case, layout):
    num_axes, allocation, sections = axes_case
    x = _rand(7, 2, 9, 3, H)
    n = _rand(8, 2, 9, scale=1000.0)
    one_d = rotary.rotate(x, n, layout=layout)
    n_d = rotary.rotate(
        x,
        np.repeat(n[..., None], num_axes, -1),
        layout=layout,
        allocation=allocation,
        sections=sections,
    )
    np.testing.assert_array_equal(np.asarray(one_d), np.asarray(n_d))


@pytest.mark.parametrize("axes_case", AXES_CASES[1:])
def test_per_axis_ladder_does_not_degenerate_exactly(axes_case):
    """per_axis changes frequencies, so (n, ..., n) is NOT plain 1-D RoPE."""
    num_axes, allocation, sections = axes_case
    x = _rand(9, 1, 9, 1, H)
    n = np.arange(9, dtype=np.float32)[None] + 1.0
    one_d = rotary.rotate(x, n)
    n_d = rotary.rotate(
        x,
        np.repeat(n[..., None], num_axes, -1),
        ladder="per_axis",
        allocation=allocation,
        sections=sections,
    )
    assert np.abs(np.asarray(one_d) - np.asarray(n_d)).max() > 1e-2


@pytest.mark.parametrize("axes_case,layout,ladder", SWEEP, ids=SWEEP_IDS)
def test_orthogonality_and_inverse(axes_case, layout, ladder):
    num_axes = axes_case[0]
    kw = _kw(axes_case, layout, ladder)
    pos = _rand(10, 6, num_axes, scale=30.0)
    mats = np.asarray(rotary.rotation_matrix(pos, head_dim=H, **kw))
    eye = np.broadcast_to(np.eye(H), mats.shape)
    np.testing.assert_allclose(np.swapaxes(mats, -1, -2) @ mats, eye, atol=1e-5)
    x = _rand(11, 1, 6, 4, H)
    back = rotary.rotate(rotary.rotate(x, pos[None], **kw), pos[None], inverse=True, **kw)
    np.testing.assert_allclose(back, x, atol=1e-5)
    # rotate agrees with the explicit matrix, and inverse with its transpose.
    y = rotary.rotate(x, pos[None], **kw)
    np.testing.assert_allclose(y, np.einsum("Tij,BTNj->BTNi", mats, x), atol=1e-5)
    y_inv = rotary.rotate(x, pos[None], inverse=True, **kw)
    np.testing.assert_allclose(y_inv, np.einsum("Tji,BTNj->BTNi", mats, x), atol=1e-5)


@pytest.mark.parametrize("axes_case,layout,ladder", SWEEP, ids=SWEEP_IDS)
def test_matches_matrix_exponential_of_commuting_generators(axes_case, layout, ladder):
    num_axes = axes_case[0]
    kw = _kw(axes_case, layout, ladder)
    gens = rotary.generators(H, num_axes=num_axes, **kw)  # [A, H, H] float64
    assert gens.shape == (num_axes, H, H)
    np.testing.assert_array_equal(gens, -np.swapaxes(gens, -1, -2))  # skew-symmetric
    for a, b in itertools.combinations(range(num_axes), 2):
        np.testing.assert_allclose(gens[a] @ gens[b], gens[b] @ gens[a], atol=1e-12)
    rng = np.random.default_rng(12)
    for _ in range(4):
        p = rng.normal(size=num_axes) * 5.0
        expected = scipy.linalg.expm(np.einsum("a,aij->ij", p, gens))
        got = rotary.rotation_matrix(p.astype(np.float32), head_dim=H, **kw)
        np.testing.assert_allclose(got, expected, atol=2e-5)


@pytest.mark.parametrize("axes_case,layout,ladder", SWEEP, ids=SWEEP_IDS)
def test_positions_are_recovered_from_the_rotation(axes_case, layout, ladder):
    num_axes, allocation, sections = axes_case
    kw = _kw(axes_case, layout, ladder)
    # theta_max = 1 for both ladders, so |p| < pi is the recoverable range.
    pos = np.random.default_rng(13).uniform(-3.1, 3.1, size=(50, num_axes)).astype(np.float32)
    mats = np.asarray(rotary.rotation_matrix(pos, head_dim=H, **kw))
    u, v = (np.arange(H // 2), np.arange(H // 2) + H // 2)
    if layout == "interleaved":
        u, v = 2 * np.arange(H // 2), 2 * np.arange(H // 2) + 1
    phase = np.arctan2(mats[:, v, u], mats[:, u, u])  # angle read off each 2x2 block
    got = rotary.recover_positions(
        phase,
        head_dim=H,
        num_axes=num_axes,
        ladder=ladder,
        allocation=allocation,
        sections=sections,
    )
    np.testing.assert_allclose(got, pos, atol=1e-5)


# ------------------------------------------------------------------ golden parity

# A float32 phase p * theta at p < 4096 carries up to ~4096 * 2**-24 * few rad of rounding
# (the same in every float32 implementation); scaled by |x| <~ 5 this bounds the error.
PARITY_ATOL = 2e-3


def _hf_llama_reference(x, pos, base=10000.0):
    """HF transformers LLaMA: inv_freq, emb = cat(freqs, freqs), x*cos + rotate_half(x)*sin."""
    d = x.shape[-1]
    inv_freq = 1.0 / (base ** (np.arange(0, d, 2, dtype=np.float64) / d))
    freqs = pos[..., None].astype(np.float64) * inv_freq  # [B, T, d/2]
    emb = np.concatenate([freqs, freqs], -1)[:, :, None, :]  # [B, T, 1, d]
    x = x.astype(np.float64)
    rotate_half = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * np.cos(emb) + rotate_half * np.sin(emb)


def _complex_reference(x, pos, base=10000.0):
    """RoFormer / Meta LLaMA: view pairs (2i, 2i+1) as complex, multiply by e^{i p theta}."""
    d = x.shape[-1]
    freqs = 1.0 / (base ** (np.arange(0, d, 2)[: d // 2].astype(np.float64) / d))
    cis = np.exp(1j * pos[..., None].astype(np.float64) * freqs)[:, :, None, :]
    xc = x.astype(np.float64).reshape(*x.shape[:-1], d // 2, 2)
    out = (xc[..., 0] + 1j * xc[..., 1]) * cis
    return np.stack([out.real, out.imag], -1).reshape(x.shape)


def _qwen2vl_reference(x, position_ids, mrope_section, base=10000.0):
    """Qwen2-VL apply_multimodal_rotary_pos_emb with position_ids [3, B, T]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (base ** (np.arange(0, d, 2, dtype=np.float64) / d))
    freqs = position_ids[..., None].astype(np.float64) * inv_freq  # [3, B, T, d/2]
    emb = np.concatenate([freqs, freqs], -1)  # [3, B, T, d]
    cos, sin = np.cos(emb), np.sin(emb)
    splits = np.cumsum(list(mrope_section) * 2)[:-1]

    def select(m):
        return np.concatenate([c[i % 3] for i, c in enumerate(np.split(m, splits, -1))], -1)

    cos, sin = select(cos)[:, :, None, :], select(sin)[:, :, None, :]  # [B, T, 1, d]
    x = x.astype(np.float64)
    rotate_half = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rotate_half * sin


@pytest.mark.parametrize("seed", range(3))
def test_half_layout_equals_hf_llama(seed):
    x = _rand(seed, 2, 33, 4, 64)
    pos = np.random.default_rng(seed).integers(0, 4096, size=(2, 33))
    np.testing.assert_allclose(rotary.rotate(x, pos), _hf_llama_reference(x, pos), atol=PARITY_ATOL)


@pytest.mark.parametrize("seed", range(3))
def test_interleaved_layout_equals_complex_multiplication(seed):
    x = _rand(seed, 2, 33, 4, 64)
    pos = np.random.default_rng(seed).integers(0, 4096, size=(2, 33))
    got = rotary.rotate(x, pos, layout="interleaved", base=500000.0)
    np.testing.assert_allclose(got, _complex_reference(x, pos, base=500000.0), atol=PARITY_ATOL)


@pytest.mark.parametrize("seed", range(3))
def test_sections_allocation_equals_qwen2vl_mrope(seed):
    rng = np.random.default_rng(seed)
    x = _rand(seed, 2, 40, 2, 128)
    position_ids = rng.integers(0, 300, size=(3, 2, 40))
    expected = _qwen2vl_reference(x, position_ids, (16, 24, 24))
    got = rotary.rotate(
        x,
        np.moveaxis(position_ids, 0, -1),
        allocation="sections",
        sections=(16, 24, 24),
    )
    np.testing.assert_allclose(got, expected, atol=PARITY_ATOL)


def _qwen3vl_reference(x, position_ids, mrope_section, base=10000.0):
    """Qwen3-VL apply_interleaved_mrope with position_ids [3, B, T]: start from the t
    phases, overwrite pairs 1, 4, 7, ... below 3 s_h with h's and 2, 5, 8, ... below
    3 s_w with w's; then emb = cat(freqs, freqs) and rotate_half."""
    d = x.shape[-1]
    inv_freq = 1.0 / (base ** (np.arange(0, d, 2, dtype=np.float64) / d))
    freqs = position_ids[..., None].astype(np.float64) * inv_freq  # [3, B, T, d/2]
    mixed = freqs[0].copy()
    for dim, offset in ((1, 1), (2, 2)):
        idx = slice(offset, mrope_section[dim] * 3, 3)
        mixed[..., idx] = freqs[dim, ..., idx]
    emb = np.concatenate([mixed, mixed], -1)[:, :, None, :]  # [B, T, 1, d]
    x = x.astype(np.float64)
    rotate_half = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * np.cos(emb) + rotate_half * np.sin(emb)


def _videorope_reference(x, position_ids, mrope_section, base=10000.0):
    """VideoRoPE's low-frequency temporal allocation with position_ids [3, B, T]: over the
    d cos / sin entries, chunks (s_h + s_w, s_t, s_h + s_w, s_t); in a spatial chunk entry
    j takes h's value for even j and w's for odd j, a temporal chunk takes t's."""
    d = x.shape[-1]
    inv_freq = 1.0 / (base ** (np.arange(0, d, 2, dtype=np.float64) / d))
    freqs = position_ids[..., None].astype(np.float64) * inv_freq  # [3, B, T, d/2]
    emb = np.concatenate([freqs, freqs], -1)  # [3, B, T, d]
    t, h, w = mrope_section
    picked, index = [], 0
    for i, size in enumerate([h + w, t] * 2):
        for j in range(size):
            row = (1 if j % 2 == 0 else 2) if i % 2 == 0 else 0
            picked.append(emb[row, ..., index])
            index += 1
    emb = np.stack(picked, -1)[:, :, None, :]  # [B, T, 1, d]
    x = x.astype(np.float64)
    rotate_half = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * np.cos(emb) + rotate_half * np.sin(emb)


@pytest.mark.parametrize("head_dim,sections", [(128, (24, 20, 20)), (16, (4, 2, 2))])
def test_mrope_interleaved_allocation_equals_qwen3vl(head_dim, sections):
    for seed in range(2):
        rng = np.random.default_rng(seed)
        x = _rand(seed, 2, 24, 2, head_dim)
        position_ids = rng.integers(0, 300, size=(3, 2, 24))
        expected = _qwen3vl_reference(x, position_ids, sections)
        got = rotary.rotate(
            x, np.moveaxis(position_ids, 0, -1), allocation="mrope_interleaved", sections=sections
        )
        np.testing.assert_allclose(got, expected, atol=PARITY_ATOL)


def test_mrope_interleaved_pairs_follow_the_published_rule():
    """Axis of each pair read off the rule applied to pair labels: pair i of axis a is
    labelled a * P + i, the rule picks one label per pair."""
    for head_dim, sections in [(128, (24, 20, 20)), (16, (4, 2, 2)), (32, (6, 5, 5))]:
        pairs = head_dim // 2
        labels = np.arange(3 * pairs).reshape(3, pairs)
        mixed = labels[0].copy()
        for dim, offset in ((1, 1), (2, 2)):
            idx = slice(offset, sections[dim] * 3, 3)
            mixed[idx] = labels[dim, idx]
        got = rotary.axis_of_pair(
            head_dim, num_axes=3, allocation="mrope_interleaved", sections=sections
        )
        np.testing.assert_array_equal(got, mixed // pairs)
        np.testing.assert_array_equal(np.bincount(got, minlength=3), sections)
    table = rotary.axis_of_pair(128, num_axes=3, allocation="mrope_interleaved",
                                sections=(24, 20, 20))  # fmt: skip
    np.testing.assert_array_equal(table[:60], np.arange(60) % 3)  # t h w t h w ...
    np.testing.assert_array_equal(table[60:], [0, 0, 0, 0])  # the slowest four: t


@pytest.mark.parametrize("head_dim,sections", [(128, (16, 24, 24)), (16, (2, 3, 3))])
def test_videorope_allocation_equals_reference(head_dim, sections):
    rng = np.random.default_rng(5)
    x = _rand(5, 2, 24, 2, head_dim)
    position_ids = rng.integers(0, 300, size=(3, 2, 24))
    expected = _videorope_reference(x, position_ids, sections)
    got = rotary.rotate(
        x, np.moveaxis(position_ids, 0, -1), allocation="videorope", sections=sections
    )
    np.testing.assert_allclose(got, expected, atol=PARITY_ATOL)


def test_videorope_gives_time_the_lowest_frequencies():
    freqs, axes = rotary.pair_table(128, num_axes=3, allocation="videorope",
                                    sections=(16, 24, 24))  # fmt: skip
    assert freqs[axes == 0].max() < freqs[axes > 0].min()  # t strictly below h and w
    np.testing.assert_array_equal(axes[48:], 0)
    np.testing.assert_array_equal(axes[:48], np.tile([1, 2], 24))  # h, w alternate
    # The other allocations hand t the fastest pair.
    for allocation, sections in (("sections", (16, 24, 24)),
                                 ("mrope_interleaved", (24, 20, 20))):  # fmt: skip
        f, a = rotary.pair_table(128, num_axes=3, allocation=allocation, sections=sections)
        assert f[a == 0].max() == 1.0


def test_new_allocations_are_relative_and_orthogonal():
    """The identities the sweep checks for every allocation, on the new ones (quick)."""
    for axes_case, layout in itertools.product(NEW_CASES, LAYOUTS):
        num_axes = axes_case[0]
        kw = _kw(axes_case, layout, "standard")
        q, k = _rand(40, 1, 8, 2, H), _rand(41, 1, 8, 2, H)
        m = _rand(42, 1, 8, num_axes, scale=20.0)
        n = _rand(43, 1, 8, num_axes, scale=20.0)
        lhs = np.sum(rotary.rotate(q, m, **kw) * rotary.rotate(k, n, **kw), -1)
        rhs = np.sum(q * rotary.rotate(k, n - m, **kw), -1)
        np.testing.assert_allclose(lhs, rhs, atol=2e-4, rtol=2e-4)
        mats = np.asarray(rotary.rotation_matrix(m[0], head_dim=H, **kw))
        eye = np.broadcast_to(np.eye(H), mats.shape)
        np.testing.assert_allclose(np.swapaxes(mats, -1, -2) @ mats, eye, atol=1e-5)
        back = rotary.rotate(rotary.rotate(q, m, **kw), m, inverse=True, **kw)
        np.testing.assert_allclose(back, q, atol=1e-5)
        text = rotary.rotate(q, m[..., 0], layout=layout)  # (n, ..., n) is RoPE-1D
        nd = rotary.rotate(q, np.repeat(m[..., :1], num_axes, -1), **kw)
        np.testing.assert_array_equal(np.asarray(text), np.asarray(nd))


def test_reference_sections_fit_their_allocation():
    assert rotary.reference_sections("sections", 128, 3) == (16, 24, 24)  # Qwen2-VL
    assert rotary.reference_sections("mrope_interleaved", 128, 3) == (24, 20, 20)  # Qwen3-VL
    assert rotary.reference_sections("videorope", 128, 3) == (16, 24, 24)  # VideoRoPE
    assert rotary.reference_sections("alternating", 128, 3) is None
    for allocation in rotary.ALLOCATIONS:
        for head_dim, num_axes in itertools.product((8, 16, 32, 64, 128), (1, 2, 3, 4)):
            sections = rotary.reference_sections(allocation, head_dim, num_axes)
            rotary.axis_of_pair(head_dim, num_axes=num_axes, allocation=allocation,
                                sections=sections)  # fmt: skip


def test_new_allocations_reject_sections_their_rule_cannot_give():
    cases = [
        ("mrope_interleaved", 32, (4, 6, 6), r"\(4, 6, 6\) do not fit.*gives \(6, 5, 5\)"),
        ("videorope", 32, (4, 7, 5), r"\(4, 7, 5\) do not fit.*gives \(4, 6, 6\)"),
        ("videorope", 32, (4, 6, 5), r"sum to head_dim/2=16"),
    ]
    for allocation, head_dim, sections, match in cases:
        with pytest.raises(ValueError, match=match):
            rotary.axis_of_pair(head_dim, num_axes=3, allocation=allocation, sections=sections)
    for allocation in ("mrope_interleaved", "videorope"):
        with pytest.raises(ValueError, match=rf"allocation='{allocation}' needs sections="):
            rotary.RopeSpec(allocation=allocation)
    with pytest.raises(ValueError, match="allocation='mrope'.*'mrope_interleaved', 'videorope'"):
        rotary.RopeSpec(allocation="mrope")


# ------------------------------------------------------------------ precision


def test_bf16_at_large_position_keeps_bf16_rounding_error():
    """The phase is computed in float32: error stays at bf16 rounding level at 1e5."""
    x = jnp.asarray(_rand(20, 1, 8, 2, 128)).astype(jnp.bfloat16)
    pos = 100_000 + np.arange(8)[None]
    expected = _hf_llama_reference(np.asarray(x, np.float64), pos)
    got = np.asarray(rotary.rotate(x, pos), np.float64)
    scale = np.abs(expected).max()
    assert np.abs(got - expected).max() <= 2.0**-7 * scale  # bf16 has 8 mantissa bits

    # The classic bug: a bfloat16 phase is wrong by whole radians at this position.
    inv_freq = rotary.frequencies(128).astype(jnp.bfloat16)
    bad_phase = jnp.asarray(pos, jnp.bfloat16)[..., None] * inv_freq
    good_phase = pos[..., None].astype(np.float64) * rotary.frequencies(128).astype(np.float64)
    assert np.abs(np.asarray(bad_phase, np.float64) - good_phase).max() > 1.0


def test_output_dtype_follows_input():
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        x = jnp.ones((1, 3, 1, 8), dtype)
        assert rotary.rotate(x, jnp.arange(3)[None]).dtype == dtype


# ------------------------------------------------------------------ transformations


def test_jit_vmap_grad_with_traced_positions():
    x = jnp.asarray(_rand(30, 4, 6, 2, H))
    pos = jnp.asarray(_rand(31, 4, 6, 2, scale=5.0))
    kw = dict(allocation="sections", sections=(3, 5), layout="interleaved")
    eager = rotary.rotate(x, pos, **kw)
    jitted = jax.jit(lambda a, p: rotary.rotate(a, p, **kw))(x, pos)
    np.testing.assert_allclose(jitted, eager, atol=1e-6)
    # vmap over the batch: per-example x [T, N, H], positions [T, A].
    vmapped = jax.vmap(lambda a, p: rotary.rotate(a, p, **kw))(x, pos)
    np.testing.assert_allclose(vmapped, eager, atol=1e-6)

    # d/dp <R_p q, k> computed by autodiff equals a finite difference.
    def score(p):
        return jnp.sum(rotary.rotate(x, p, **kw) * x[:, ::-1])

    g = jax.jit(jax.grad(score))(pos)
    assert g.shape == pos.shape and np.isfinite(np.asarray(g)).all()
    eps = 1e-2
    delta = jnp.zeros_like(pos).at[0, 0, 1].set(eps)
    fd = (score(pos + delta) - score(pos - delta)) / (2 * eps)
    np.testing.assert_allclose(g[0, 0, 1], fd, rtol=2e-2, atol=2e-2)


def test_frequencies_ladders():
    np.testing.assert_allclose(rotary.frequencies(8), 10000.0 ** (-np.arange(4) / 4), rtol=1e-6)
    per_axis = rotary.frequencies(8, ladder="per_axis", num_axes=2)
    j = np.arange(2)
    expected = np.repeat(10000.0 ** (-4.0 * j / 8), 2)  # theta_2j = theta_2j+1 = base^(-4j/d)
    np.testing.assert_allclose(per_axis, expected, rtol=1e-6)
    sections = rotary.frequencies(
        8, ladder="per_axis", num_axes=2, allocation="sections", sections=(1, 3)
    )
    np.testing.assert_allclose(
        sections, [1.0, 1.0, 10000 ** (-1 / 3), 10000 ** (-2 / 3)], rtol=1e-6
    )


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "x_shape,pos_shape,kw,match",
    [
        ((1, 4, 2, 7), (1, 4), {}, "head_dim=7"),
        ((1, 4, 2, 8), (1, 4, 2), dict(allocation="sections", sections=(1, 2)), "sum to"),
        ((1, 4, 2, 8), (1, 4, 3), dict(allocation="sections", sections=(2, 2)), "3 axes"),
        ((1, 4, 2, 8), (1, 4, 2), dict(allocation="sections"), "sections="),
        ((1, 4, 2, 8), (1, 4, 2, 2), {}, "positions have shape"),
        ((1, 4, 2, 8), (1, 5), {}, "do not match"),
        ((1, 4, 2, 8), (1, 4), dict(layout="rotate_half"), "layout='rotate_half'"),
        ((1, 4, 2, 8), (1, 4), dict(allocation="blocks"), "allocation='blocks'"),
        ((1, 4, 2, 8), (1, 4), dict(ladder="ntk"), "ladder='ntk'"),
    ],
)
def test_bad_input_raises_clear_value_error(x_shape, pos_shape, kw, match):
    with pytest.raises(ValueError, match=match):
        rotary.rotate(jnp.zeros(x_shape), jnp.zeros(pos_shape), **kw)


def test_the_alternating_allocation_was_called_interleaved():
    """ "interleaved" names a pair layout; the allocation a(i) = i mod A is "alternating".
    The old name is one line, and a config saved with it loads under the new one."""
    from rope_jax import defaults

    with pytest.raises(ValueError, match="allocation='interleaved' is now allocation="
                       "'alternating'") as err:  # fmt: skip
        rotary.RopeSpec(allocation="interleaved")
    assert "\n" not in str(err.value)
    old = {"model": {"rope": {"allocation": "interleaved", "layout": "interleaved"}}}
    rope = defaults.migrate(old)["model"]["rope"]
    assert rope == {"allocation": "alternating", "layout": "interleaved"}
    assert rotary.RopeSpec().allocation == "alternating"
