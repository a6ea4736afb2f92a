"""RoPE context-scaling rules: the frequency ladder for running a model past its training length.

Pure host NumPy maths (float64 inside, float32 out). `scaled_frequencies` returns `(inv_freq,
attention_factor)`: the angular frequency theta_i of each rotated pair (pair i turns by t theta_i
at position t) and a scalar that multiplies BOTH cos and sin, so rotated q.k logits scale by its
square. `scaling` is a dict with the Hugging Face `rope_scaling` / `rope_parameters` key names
(None: plain RoPE; None values count as absent; old key `type` = `rope_type`); `check_scaling`
validates one and fills its defaults before anything compiles.

Shapes: D the head numbers the ladder is spread over (the whole head H, or fewer when a pair
selection of `rope_jax.pairs` says so), P' = D/2 pairs, theta_i = base ** (-2 i / D), i < P'.
A rule rescales this ladder; which pairs of a head turn is not a rule's business (`pairs`:
Hugging Face's `partial_rotary_factor` and rope_type "proportional" are read there).

f = factor, L = max_position_embeddings (the length the model now claims), L0 =
original_max_position_embeddings (the pretraining length, default L), T = seq_len:
  default       theta_i.
  linear        theta_i / f: positions squeezed by f.
  dynamic       NTK-aware base change at the current length: with T' = max(T, L),
                base' = base * (f T' / L - (f - 1)) ** (D / (D - 2)); nothing changes up to L.
  yarn          each pair is blended between theta_i (kept) and theta_i / f (interpolated) by
                how many turns it makes over L0. Pair index d(b) = D ln(L0 / (2 pi b)) /
                (2 ln base) makes b turns; low = floor(d(beta_fast)), high = ceil(d(beta_slow))
                (no rounding if truncate=False), clipped to [0, D - 1]. Pairs below low are
                kept, above high interpolated, a linear ramp in the index between. beta_fast 32,
                beta_slow 1, f defaults to L / L0. attention_factor: m(f, 1) with
                m(f, s) = 0.1 s ln f + 1 (1 if f <= 1), or m(f, mscale) / m(f, mscale_all_dim)
                when both are given and non-zero.
  longrope      theta_i / s_i with the P' rescale factors s = long_factor if T > L0, else
                short_factor. f defaults to L / L0; attention_factor: sqrt(1 + ln f / ln L0)
                (1 if f <= 1) whichever list is in use.
  llama3        by wavelength w_i = 2 pi / theta_i, with lo, hi = low_freq_factor,
                high_freq_factor: w < L0 / hi keeps theta_i, w > L0 / lo gets theta_i / f, in
                between (1 - s) theta_i / f + s theta_i with s = (L0 / w - lo) / (hi - lo).
attention_factor is 1 except for yarn and longrope; an explicit `attention_factor` key wins.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from numbers import Integral, Real
from typing import NamedTuple

import numpy as np

BASE_KEYS = "rope_type"  # every rule takes it
# HF's keys for which pairs rotate belong to the pair selection, not to a rule
PAIR_HINT = (
    " (which pairs rotate is model.rope.pairs, not a context rule: rope_jax.pairs.from_hf "
    "reads HF's partial_rotary_factor and proportional)"
)


@dataclasses.dataclass(frozen=True)
class Rule:
    """One context-scaling rule, whole: its frequencies, whether they depend on the current
    length T (then a table is made per length), and every fact about its keys."""

    frequencies: Callable[..., tuple[np.ndarray, float]]  # (params, *, dim, base, max_pos, seq_len)
    keys: str = ""  # the keys it takes besides BASE_KEYS
    required: tuple[str, ...] = ()
    defaults: Mapping = dataclasses.field(default_factory=dict)
    check: Callable[[dict], None] | None = None  # relations between its keys
    reads_length: bool = False  # its frequencies change with seq_len
    least_dim: int = 2  # the fewest ladder numbers D it is defined on

    @property
    def allowed(self) -> frozenset[str]:
        return frozenset(f"{BASE_KEYS} {self.keys}".split())


def _real(v) -> bool:
    return isinstance(v, Real) and not isinstance(v, bool) and math.isfinite(v)


def _pos_int(v) -> bool:
    return isinstance(v, Integral) and not isinstance(v, bool) and v >= 1


def _factor_list(v) -> bool:
    return isinstance(v, Sequence) and not isinstance(v, str) and all(_real(x) and x > 0 for x in v)


class Key(NamedTuple):
    """One HF `rope_parameters` key: the config field's type, which values it takes (a
    test, and the same in words), and what it means (the config's comment)."""

    kind: type
    ok: Callable[[object], bool]
    allowed: str
    means: str


def _positive(means: str) -> Key:
    return Key(float, lambda v: _real(v) and v > 0, "a number > 0", means)


def _factors(means: str) -> Key:
    return Key(tuple, _factor_list, "a list of numbers > 0", means)


def _finite(means: str) -> Key:
    return Key(float, _real, "a finite number", means)


# Every key a rule may take besides rope_type: defaults.py makes one typed None config
# field of each (`model.rope.scaling.<key>`), commented by `means`.
KEYS: dict[str, Key] = {
    "factor": Key(float, lambda v: _real(v) and v >= 1, "a number >= 1",
                  "f, context extension factor (>= 1)"),
    "original_max_position_embeddings": Key(int, _pos_int, "a positive integer", "L0; None = L"),
    "attention_factor": _positive("logit factor (yarn, longrope)"),
    "beta_fast": _positive("yarn: turns kept as they are (32)"),
    "beta_slow": _positive("yarn: turns fully interpolated (1)"),
    "mscale": _finite("yarn: attention factor numerator scale"),
    "mscale_all_dim": _finite("yarn: ... denominator scale"),
    "truncate": Key(bool, lambda v: isinstance(v, bool), "True or False",
                    "yarn: round the ramp ends (True)"),
    "short_factor": _factors("longrope: P' rescales, T <= L0"),
    "long_factor": _factors("longrope: P' rescales, T > L0"),
    "low_freq_factor": _positive("llama3: wavelengths > L0/low"),
    "high_freq_factor": _positive("llama3: wavelengths < L0/high"),
}  # fmt: skip


def _bad(key: str, value, rope_type: str, allowed: str) -> ValueError:
    return ValueError(f"scaling[{key!r}]={value!r} for rope_type={rope_type!r}: must be {allowed}")


def _check_arg(name: str, value, ok, allowed: str, *, optional: bool = False) -> None:
    if not (optional and value is None) and not ok(value):
        raise ValueError(f"{name}={value!r} must be {allowed}")


def _need(name: str, value, rope_type: str, why: str):
    if value is None:
        raise ValueError(f"{name}=None but rope_type={rope_type!r} needs it ({why})")
    return value


def _check_dim(params: dict, dim: int) -> None:
    """The ladder width D fits the rule (dynamic's exponent D / (D - 2) needs D >= 4)."""
    least = RULES[params["rope_type"]].least_dim
    if dim < least:
        raise ValueError(
            f"rope_type={params['rope_type']!r} needs a ladder over at least {least} head "
            f"numbers, got D={dim} (fewer pairs rotate: see model.rope.pairs)"
        )


def check_scaling(
    scaling: Mapping | None, *, dim: int | None, max_position_embeddings=None
) -> dict:
    """Validates a scaling dict and returns a new one with rope_type and defaults filled.

    `max_position_embeddings`, when known, fills the default `original_max_position_embeddings`
    of yarn / longrope / llama3. `dim` is D, the head numbers the ladder spreads over;
    `dim=None` skips the checks that need it (D's least size per rule and the
    lengths of short_factor / long_factor), for a spec made before its head is known. Raises
    ValueError (one line naming the key) on bad input.
    """
    _check_arg(
        "dim", dim, lambda v: _pos_int(v) and v % 2 == 0, "a positive even int",
        optional=True,
    )  # fmt: skip
    max_pos = max_position_embeddings
    _check_arg("max_position_embeddings", max_pos, _pos_int, "a positive integer", optional=True)
    if scaling is not None and not isinstance(scaling, Mapping):
        raise ValueError(f"scaling={scaling!r} must be a dict of rope scaling keys or None")
    params = {k: v for k, v in (scaling or {}).items() if v is not None}
    named = "type" if "type" in params and "rope_type" not in params else "rope_type"
    if "type" in params:  # the old spelling of rope_type
        old = params.pop("type")
        if params.setdefault("rope_type", old) != old:
            raise ValueError(
                f"scaling['type']={old!r} clashes with rope_type={params['rope_type']!r}"
            )
    rope_type = params.setdefault("rope_type", "default")
    if not isinstance(rope_type, str) or rope_type not in RULES:  # the key the dict has
        hint = PAIR_HINT if rope_type == "proportional" else ""
        raise ValueError(
            f"scaling[{named!r}]={rope_type!r} must be one of {', '.join(RULES)}{hint}"
        )
    rule = RULES[rope_type]
    allowed = rule.allowed
    for key in params:
        if key not in allowed:
            hint = {"rope_theta": " (pass the base as base=)",
                    "partial_rotary_factor": PAIR_HINT}.get(key, "")  # fmt: skip
            raise ValueError(
                f"scaling has unknown key {key!r} for rope_type={rope_type!r}{hint}; "
                f"allowed: {', '.join(sorted(allowed))}"
            )
    for key in rule.required:
        if key not in params:
            raise ValueError(f"scaling is missing required key {key!r} for rope_type={rope_type!r}")
    for key, value in params.items():
        key_spec = KEYS.get(key)  # rope_type is already checked
        ok, words = (key_spec.ok, key_spec.allowed) if key_spec else (bool, "")
        if not ok(value):
            raise _bad(key, value, rope_type, words)
    params = {**rule.defaults, **params}
    if "original_max_position_embeddings" in allowed and max_pos is not None:
        params.setdefault("original_max_position_embeddings", max_pos)
    if dim is not None:
        _check_dim(params, dim)
    for key in ("short_factor", "long_factor"):
        if key in params:
            if dim is not None and len(params[key]) != dim // 2:
                raise _bad(key, params[key], rope_type, f"a list of length P'={dim // 2}")
            params[key] = [float(x) for x in params[key]]
    if rule.check is not None:
        rule.check(params)
    return params


def _check_yarn(params: dict) -> None:
    if params["beta_fast"] < params["beta_slow"]:
        raise _bad("beta_fast", params["beta_fast"], "yarn", f">= beta_slow={params['beta_slow']}")


def _check_llama3(params: dict) -> None:
    if params["high_freq_factor"] <= params["low_freq_factor"]:
        words = f"> low_freq_factor={params['low_freq_factor']}"
        raise _bad("high_freq_factor", params["high_freq_factor"], "llama3", words)


# ------------------------------------------------------------------- rules (float64)


def _ladder(base: float, dim: int, pairs: int | None = None) -> np.ndarray:
    """theta_i = base ** (-2 i / dim) for the first `pairs` (default dim // 2) pairs."""
    pairs = dim // 2 if pairs is None else pairs
    return base ** (-2.0 * np.arange(pairs, dtype=np.float64) / dim)


def _original(params: dict, rope_type: str) -> int:
    if "original_max_position_embeddings" not in params:
        raise ValueError(
            f"scaling['original_max_position_embeddings'] is missing for rope_type={rope_type!r} "
            "and max_position_embeddings=None (its default); give one of them"
        )
    return params["original_max_position_embeddings"]


def _context_factor(params: dict, max_pos, original: int, rope_type: str) -> float:
    """f, or L / L0 when the dict has no factor (Phi-3 / DeepSeek-V3 style configs)."""
    if "factor" in params:
        return float(params["factor"])
    why = "scaling['factor'] is missing, so it defaults to max_position_embeddings / original"
    return _need("max_position_embeddings", max_pos, rope_type, why) / original


def _linear(params, *, dim, base, max_pos, seq_len):
    return _ladder(base, dim) / params.get("factor", 1.0), 1.0  # default: f = 1


def _dynamic(params, *, dim, base, max_pos, seq_len):
    length = _need("max_position_embeddings", max_pos, "dynamic", "the threshold length L")
    now = max(_need("seq_len", seq_len, "dynamic", "the base depends on it"), length)
    f = params["factor"]
    return _ladder(base * (f * now / length - (f - 1)) ** (dim / (dim - 2)), dim), 1.0


def _mscale(f: float, s: float = 1.0) -> float:
    return 1.0 if f <= 1 else 0.1 * s * math.log(f) + 1.0


def _yarn(params, *, dim, base, max_pos, seq_len):
    l0 = _original(params, "yarn")
    f = _context_factor(params, max_pos, l0, "yarn")

    def pair_at(turns):  # the (fractional) pair index that makes `turns` turns over L0
        return dim * math.log(l0 / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_at(params["beta_fast"]), pair_at(params["beta_slow"])
    if params["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    theta = _ladder(base, dim)
    inv_freq = theta / f * ramp + theta * (1.0 - ramp)
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if "attention_factor" in params:
        return inv_freq, params["attention_factor"]
    if mscale and mscale_all_dim:  # both given and non-zero, else both are ignored
        return inv_freq, _mscale(f, mscale) / _mscale(f, mscale_all_dim)
    return inv_freq, _mscale(f)


def _longrope(params, *, dim, base, max_pos, seq_len):
    l0 = _original(params, "longrope")
    f = _context_factor(params, max_pos, l0, "longrope")
    now = _need("seq_len", seq_len, "longrope", "it picks long_factor or short_factor")
    rescale = np.asarray(params["long_factor" if now > l0 else "short_factor"], np.float64)
    if "attention_factor" in params:
        attention_factor = params["attention_factor"]
    else:
        attention_factor = 1.0 if f <= 1 else math.sqrt(1 + math.log(f) / math.log(l0))
    return _ladder(base, dim) / rescale, attention_factor


def _llama3(params, *, dim, base, max_pos, seq_len):
    l0, f = _original(params, "llama3"), params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    theta = _ladder(base, dim)
    wavelen = 2 * math.pi / theta
    smooth = (l0 / wavelen - low) / (high - low)
    blend = (1 - smooth) * theta / f + smooth * theta
    return np.where(wavelen < l0 / high, theta, np.where(wavelen > l0 / low, theta / f, blend)), 1.0


RULES: dict[str, Rule] = {
    "default": Rule(_linear),
    "linear": Rule(_linear, "factor", required=("factor",)),
    "dynamic": Rule(_dynamic, "factor", required=("factor",), reads_length=True, least_dim=4),
    "yarn": Rule(
        _yarn,
        "factor original_max_position_embeddings attention_factor beta_fast beta_slow mscale"
        " mscale_all_dim truncate",
        defaults={"beta_fast": 32.0, "beta_slow": 1.0, "truncate": True},
        check=_check_yarn,
    ),
    "longrope": Rule(
        _longrope,
        "factor original_max_position_embeddings attention_factor short_factor long_factor",
        required=("short_factor", "long_factor"),
        reads_length=True,
    ),
    "llama3": Rule(
        _llama3,
        "factor original_max_position_embeddings low_freq_factor high_freq_factor",
        required=("factor", "low_freq_factor", "high_freq_factor"),
        check=_check_llama3,
    ),
}
# rope_type -> the keys it takes (what HF's `rope_parameters` may hold for it)
SCALING_KEYS: dict[str, frozenset[str]] = {name: rule.allowed for name, rule in RULES.items()}


def scaled_frequencies(
    dim: int,
    *,
    base: float,
    scaling: Mapping | None = None,
    max_position_embeddings: int | None = None,
    seq_len: int | None = None,
) -> tuple[np.ndarray, float]:
    """Per-pair frequencies of a ladder over `dim` = D head numbers under the rule `scaling`
    (module docstring; D is the whole head H unless fewer numbers rotate).

    `base` is HF's rope_theta (> 1); `max_position_embeddings` is L, the model's maximum length;
    `seq_len` is T, the current length (dynamic and longrope need it). Returns float32 inv_freq
    [D/2] and the attention factor that multiplies both cos and sin.
    """
    max_pos = max_position_embeddings
    _check_arg("dim", dim, lambda v: _pos_int(v) and v % 2 == 0, "a positive even int")
    params = check_scaling(scaling, dim=dim, max_position_embeddings=max_pos)
    _check_arg("base", base, lambda v: _real(v) and v > 1, "a number > 1")
    _check_arg("seq_len", seq_len, _pos_int, "a positive integer", optional=True)
    rule = RULES[params["rope_type"]].frequencies
    inv_freq, attention_factor = rule(params, dim=dim, base=base, max_pos=max_pos, seq_len=seq_len)
    return inv_freq.astype(np.float32), float(attention_factor)
