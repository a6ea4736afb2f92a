"""Tests for rope_jax.scaling: every rule against an independent float64 reference.

The references below are written out pair by pair from the published formulas (RoPE, position
interpolation, NTK-aware dynamic scaling, YaRN, LongRoPE, Llama 3.1)
with Hugging Face transformers' conventions; they share no code with the module.
"""

import math

import numpy as np
import pytest

from rope_jax import scaling

RTOL = 1e-6
HEAD_DIMS = [8, 64, 128]


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want), rtol=RTOL, atol=0)


# ------------------------------------------------------------------ references


def ref_theta(base, dim):
    """Plain RoPE: pair i of a dim-wide rotation turns at base ** (-2i / dim)."""
    return [1.0 / base ** (2 * i / dim) for i in range(dim // 2)]


def ref_ntk_dynamic(base, dim, factor, max_pos, seq_len):
    if seq_len > max_pos:
        base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return ref_theta(base, dim)


def ref_yarn(base, dim, factor, orig, beta_fast=32, beta_slow=1, truncate=True):
    def dim_for_rotations(r):  # solve orig * theta_i / (2 pi) = r for i
        return dim * math.log(orig / (2 * math.pi * r)) / (2 * math.log(base))

    low, high = dim_for_rotations(beta_fast), dim_for_rotations(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i, theta in enumerate(ref_theta(base, dim)):
        ramp = min(1.0, max(0.0, (i - low) / (high - low)))  # 0: extrapolate, 1: interpolate
        out.append((1 - ramp) * theta + ramp * theta / factor)
    return out


def ref_yarn_mscale(factor, m=1.0):
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def ref_llama3(base, dim, factor, low, high, orig):
    out = []
    for theta in ref_theta(base, dim):
        wavelen = 2 * math.pi / theta
        if wavelen < orig / high:
            out.append(theta)
        elif wavelen > orig / low:
            out.append(theta / factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append((1 - smooth) * theta / factor + smooth * theta)
    return out


# ------------------------------------------------------------------ default / linear


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("base", [10_000.0, 500_000.0])
def test_default_is_base_power(head_dim, base):
    for scaling_dict in (None, {}, {"rope_type": "default"}, {"type": "default"}):
        inv_freq, attn = scaling.scaled_frequencies(head_dim, base=base, scaling=scaling_dict)
        assert inv_freq.dtype == np.float32 and inv_freq.shape == (head_dim // 2,)
        i = np.arange(head_dim // 2)
        _close(inv_freq, base ** (-2.0 * i / head_dim))
        assert attn == 1.0


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_linear(head_dim, partial):
    dim = int(head_dim * partial)
    cfg = {"rope_type": "linear", "factor": 4.0}
    got, attn = scaling.scaled_frequencies(dim, base=10_000, scaling=cfg)
    _close(got, [t / 4.0 for t in ref_theta(10_000, dim)])
    assert attn == 1.0


# ------------------------------------------------------------------ dynamic


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("seq_len", [1, 2048, 4096, 4097, 10_000, 32_768])
def test_dynamic_below_and_above_threshold(head_dim, partial, seq_len):
    dim = int(head_dim * partial)
    cfg = {"rope_type": "dynamic", "factor": 2.0}
    got, attn = scaling.scaled_frequencies(
        dim, base=10_000, scaling=cfg, max_position_embeddings=4096, seq_len=seq_len
    )
    _close(got, ref_ntk_dynamic(10_000, dim, 2.0, 4096, seq_len))
    assert attn == 1.0
    if seq_len <= 4096:
        _close(got, ref_theta(10_000, dim))
    else:  # the lowest frequency moves, the highest (pair 0) never does
        assert got[-1] < ref_theta(10_000, dim)[-1] * (1 - 1e-4)
        assert got[0] == 1.0


# ------------------------------------------------------------------ yarn


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_default_knobs(head_dim, partial, truncate):
    dim = int(head_dim * partial)
    cfg = {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 4096,
    }
    if not truncate:
        cfg["truncate"] = False
    got, attn = scaling.scaled_frequencies(dim, base=10_000, scaling=cfg)
    _close(got, ref_yarn(10_000, dim, 8.0, 4096, truncate=truncate))
    _close(attn, 0.1 * math.log(8.0) + 1.0)


def test_yarn_bands_and_correction_range_uses_original_length():
    # H=128, base 1e4, L0=4096: pair ~45 makes one turn over L0, pair ~21 makes 32.
    cfg = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096}
    got, _ = scaling.scaled_frequencies(128, base=10_000, scaling=cfg)
    theta = ref_theta(10_000, 128)
    assert got[0] == pytest.approx(theta[0], rel=RTOL)  # many turns: kept
    assert got[10] == pytest.approx(theta[10], rel=RTOL)
    assert got[63] == pytest.approx(theta[63] / 16.0, rel=RTOL)  # under a turn: interpolated
    assert theta[30] / 16.0 < got[30] < theta[30]  # on the ramp
    # max_position_embeddings does not enter once factor and L0 are given.
    again, _ = scaling.scaled_frequencies(
        128, base=10_000, scaling=cfg, max_position_embeddings=65536
    )
    np.testing.assert_array_equal(got, again)


@pytest.mark.parametrize(
    "extra, want_attn",
    [
        ({"beta_fast": 16, "beta_slow": 2}, 0.1 * math.log(40.0) + 1.0),
        ({"mscale": 0.707, "mscale_all_dim": 0.707}, 1.0),
        (
            {"mscale": 1.0, "mscale_all_dim": 0.5},
            ref_yarn_mscale(40, 1.0) / ref_yarn_mscale(40, 0.5),
        ),
        ({"mscale": 0.707}, ref_yarn_mscale(40.0)),  # needs both, else ignored
        ({"mscale": 1.0, "mscale_all_dim": 0}, ref_yarn_mscale(40.0)),
        ({"attention_factor": 0.5, "mscale": 1.0, "mscale_all_dim": 0.5}, 0.5),  # given wins
    ],
)
def test_yarn_attention_factor(extra, want_attn):
    cfg = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, **extra}
    got, attn = scaling.scaled_frequencies(64, base=10_000, scaling=cfg)
    beta = {k: extra[k] for k in ("beta_fast", "beta_slow") if k in extra}
    _close(got, ref_yarn(10_000, 64, 40.0, 4096, **beta))
    _close(attn, want_attn)


def test_yarn_factor_and_original_defaults():
    # No factor: f = L / L0 (DeepSeek-V3 style). No L0: L0 = L, so f = 1 and nothing moves.
    cfg = {"rope_type": "yarn", "original_max_position_embeddings": 4096}
    got, attn = scaling.scaled_frequencies(
        64, base=10_000, scaling=cfg, max_position_embeddings=4096 * 40
    )
    _close(got, ref_yarn(10_000, 64, 40.0, 4096))
    _close(attn, 0.1 * math.log(40.0) + 1.0)
    got, attn = scaling.scaled_frequencies(
        64, base=10_000, scaling={"rope_type": "yarn"}, max_position_embeddings=4096
    )
    _close(got, ref_theta(10_000, 64))
    assert attn == 1.0


# ------------------------------------------------------------------ longrope


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("seq_len, which", [(10, "short"), (4096, "short"), (4097, "long")])
def test_longrope_short_long_selection(head_dim, partial, seq_len, which):
    dim = int(head_dim * partial)
    rng = np.random.default_rng(dim)
    short = [float(x) for x in rng.uniform(1.0, 1.5, dim // 2)]
    long = [float(x) for x in rng.uniform(1.0, 40.0, dim // 2)]
    cfg = {
        "rope_type": "longrope",
        "short_factor": short,
        "long_factor": long,
        "original_max_position_embeddings": 4096,
    }
    got, attn = scaling.scaled_frequencies(
        dim, base=10_000, scaling=cfg, max_position_embeddings=131072, seq_len=seq_len
    )
    factors = short if which == "short" else long
    _close(got, [t / s for t, s in zip(ref_theta(10_000, dim), factors, strict=True)])
    # Phi-3: f = L / L0 = 32, attention factor sqrt(1 + ln f / ln L0), for either list.
    _close(attn, math.sqrt(1 + math.log(32) / math.log(4096)))


def test_longrope_attention_factor_sources():
    ones = [1.0] * 16
    base_cfg = {"rope_type": "longrope", "short_factor": ones, "long_factor": ones}
    kw = dict(base=10_000, max_position_embeddings=8192, seq_len=100)
    # L0 defaults to L, so f = 1 and the factor is 1.
    assert scaling.scaled_frequencies(32, scaling=base_cfg, **kw)[1] == 1.0
    cfg = {**base_cfg, "original_max_position_embeddings": 2048, "factor": 8.0}
    _close(
        scaling.scaled_frequencies(32, scaling=cfg, **kw)[1],
        math.sqrt(1 + math.log(8) / math.log(2048)),
    )
    cfg = {**cfg, "attention_factor": 1.25}
    assert scaling.scaled_frequencies(32, scaling=cfg, **kw)[1] == 1.25


# ------------------------------------------------------------------ llama3


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_llama3_matches_reference(head_dim, partial):
    dim = int(head_dim * partial)
    cfg = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    got, attn = scaling.scaled_frequencies(dim, base=500_000, scaling=cfg)
    _close(got, ref_llama3(500_000, dim, 8.0, 1.0, 4.0, 8192))
    assert attn == 1.0


def test_llama3_three_bands():
    """Llama 3.1 8B: H=128, base 5e5, f=8, low 1, high 4, L0=8192."""
    cfg = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    got, _ = scaling.scaled_frequencies(128, base=500_000, scaling=cfg)
    theta = np.array(ref_theta(500_000, 128))
    wavelen = 2 * np.pi / theta
    high_band = np.flatnonzero(wavelen < 8192 / 4)
    low_band = np.flatnonzero(wavelen > 8192 / 1)
    mid_band = np.flatnonzero((wavelen >= 8192 / 4) & (wavelen <= 8192))
    assert len(high_band) and len(low_band) and len(mid_band)
    i, j, k = high_band[-1], low_band[0], mid_band[len(mid_band) // 2]
    assert got[i] == pytest.approx(theta[i], rel=RTOL)  # short wavelength: untouched
    assert got[j] == pytest.approx(theta[j] / 8.0, rel=RTOL)  # long wavelength: / factor
    s = (8192 / wavelen[k] - 1.0) / (4.0 - 1.0)
    assert 0 < s < 1
    assert got[k] == pytest.approx((1 - s) * theta[k] / 8.0 + s * theta[k], rel=RTOL)
    assert theta[k] / 8.0 < got[k] < theta[k]


def test_llama3_original_defaults_to_max_position_embeddings():
    cfg = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    got, _ = scaling.scaled_frequencies(64, base=500_000, scaling=cfg, max_position_embeddings=8192)
    _close(got, ref_llama3(500_000, 64, 8.0, 1.0, 4.0, 8192))


# ------------------------------------------------------------------ registry and checks


def test_registry_and_keys_cover_the_same_types():
    assert set(scaling.RULES) == set(scaling.SCALING_KEYS)
    assert set(scaling.RULES) >= {"default", "linear", "dynamic", "yarn", "longrope", "llama3"}
    for keys in scaling.SCALING_KEYS.values():
        assert "rope_type" in keys and "partial_rotary_factor" not in keys  # `pairs`' key


def test_check_scaling_normalises():
    assert scaling.check_scaling(None, dim=64) == {"rope_type": "default"}
    got = scaling.check_scaling(
        {"type": "yarn", "factor": 4, "beta_fast": None},
        dim=64,
        max_position_embeddings=2048,
    )
    assert got == {
        "rope_type": "yarn",
        "factor": 4,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": True,
        "original_max_position_embeddings": 2048,
    }
    given = {"rope_type": "linear", "factor": 2.0}
    scaling.check_scaling(given, dim=64)
    assert given == {"rope_type": "linear", "factor": 2.0}  # input untouched


_LONG = {"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [1.0] * 32}
_LLAMA = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
BAD = [
    ("unknown type", {"rope_type": "ntk-by-parts"}, {}, "rope_type"),
    ("unknown legacy type", {"type": "foo"}, {}, "scaling['type']='foo' must be one of"),
    ("type clash", {"type": "linear", "rope_type": "dynamic", "factor": 2.0}, {}, "type"),
    ("not a dict", "linear", {}, "scaling"),
    ("unknown key", {"rope_type": "linear", "factor": 2.0, "beta_fast": 32}, {}, "beta_fast"),
    ("theta in dict", {"rope_type": "default", "rope_theta": 1e4}, {}, "rope_theta"),
    ("missing factor", {"rope_type": "linear"}, {}, "factor"),
    ("factor < 1", {"rope_type": "linear", "factor": 0.5}, {}, "factor"),
    ("factor str", {"rope_type": "dynamic", "factor": "2"}, {}, "factor"),
    (
        "dyn no seq_len",
        {"rope_type": "dynamic", "factor": 2.0},
        {"max_position_embeddings": 8},
        "seq_len",
    ),
    (
        "dyn no max_pos",
        {"rope_type": "dynamic", "factor": 2.0},
        {"seq_len": 8},
        "max_position_embeddings",
    ),
    ("yarn no L0", {"rope_type": "yarn", "factor": 4.0}, {}, "original_max_position_embeddings"),
    ("yarn no factor", {**_YARN, "factor": None}, {}, "max_position_embeddings"),
    (
        "yarn L0 float",
        {**_YARN, "original_max_position_embeddings": 2048.5},
        {},
        "original_max_position_embeddings",
    ),
    ("yarn betas", {**_YARN, "beta_fast": 1, "beta_slow": 32}, {}, "beta_fast"),
    ("yarn beta 0", {**_YARN, "beta_slow": 0}, {}, "beta_slow"),
    ("yarn truncate", {**_YARN, "truncate": "yes"}, {}, "truncate"),
    ("yarn attn < 0", {**_YARN, "attention_factor": -1.0}, {}, "attention_factor"),
    ("yarn mscale", {**_YARN, "mscale": "big"}, {}, "mscale"),
    ("long no short", {**_LONG, "short_factor": None}, {"seq_len": 8}, "short_factor"),
    ("long short len", {**_LONG, "short_factor": [1.0] * 31}, {"seq_len": 8}, "short_factor"),
    ("long long len", {**_LONG, "long_factor": [1.0] * 33}, {"seq_len": 8}, "long_factor"),
    ("long neg", {**_LONG, "long_factor": [-1.0] * 32}, {"seq_len": 8}, "long_factor"),
    (
        "long no seq_len",
        {**_LONG, "original_max_position_embeddings": 8, "factor": 2.0},
        {},
        "seq_len",
    ),
    ("long no L0", _LONG, {"seq_len": 8}, "original_max_position_embeddings"),
    ("llama no low", {**_LLAMA, "low_freq_factor": None}, {}, "low_freq_factor"),
    ("llama order", {**_LLAMA, "high_freq_factor": 1.0}, {}, "high_freq_factor"),
    ("partial is pairs'", {"partial_rotary_factor": 0.5}, {}, "model.rope.pairs"),
    ("proportional is pairs'", {"rope_type": "proportional"}, {}, "model.rope.pairs"),
    ("dynamic on D=2", {"rope_type": "dynamic", "factor": 2.0}, {"head_dim": 2}, "D=2"),
    ("seq_len 0", None, {"seq_len": 0}, "seq_len"),
    ("max_pos neg", None, {"max_position_embeddings": -1}, "max_position_embeddings"),
    ("base 1", None, {"base": 1.0}, "base"),
    ("dim odd", None, {"head_dim": 63}, "dim=63"),
]


@pytest.mark.parametrize("cfg, kwargs, key", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_value_error_naming_the_key(cfg, kwargs, key):
    kwargs = {"head_dim": 64, "base": 10_000.0, **kwargs}
    with pytest.raises(ValueError) as err:
        scaling.scaled_frequencies(kwargs.pop("head_dim"), scaling=cfg, **kwargs)
    msg = str(err.value)
    assert key in msg and "\n" not in msg, msg


SAMPLE_PARAMS = {  # one valid setting of each rule, for the facts every rule declares
    "default": {},
    "linear": {"factor": 4.0},
    "dynamic": {"factor": 4.0},
    "yarn": {"factor": 4.0},
    "longrope": {"short_factor": [1.0] * 8, "long_factor": [1.0 + i for i in range(8)]},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
}


def test_every_key_is_a_typed_config_field_and_reads_length_is_what_the_tables_do():
    """defaults.py makes its fields from KEYS (a new key needs no second declaration), and
    a rule says it reads the length exactly when its table changes with the length."""
    from rope_jax import defaults

    taken = {k for rule in scaling.RULES.values() for k in rule.allowed} - {"rope_type"}
    assert taken == set(scaling.KEYS)
    fields = defaults.config().model.rope.scaling
    assert set(fields) == {"rope_type", *scaling.KEYS}
    assert all(fields[k] is None for k in scaling.KEYS)
    assert set(SAMPLE_PARAMS) == set(scaling.RULES)
    for name, rule in scaling.RULES.items():
        tables = [scaling.scaled_frequencies(16, base=10000.0, max_position_embeddings=64,
                                             scaling={"rope_type": name, **SAMPLE_PARAMS[name]},
                                             seq_len=n)[0] for n in (64, 512)]  # fmt: skip
        assert (not np.array_equal(*tables)) == rule.reads_length, name
