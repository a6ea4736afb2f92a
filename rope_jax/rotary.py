"""Rotary position encodings: 1-D and N-D, both pair layouts, every axis allocation.

Pure, jit/vmap/grad-able functions. The phase `position * frequency` is always
computed in float32, whatever the input dtype, and the output is cast back to the
input dtype (a bfloat16 phase at position 1e5 is off by hundreds of radians).

Shape legend:
  B batch, T positions, N heads, H head dim (even), P = H/2 rotation pairs,
  D the rotated block (H, or the leading D numbers: `pairs`), P' = D/2 its pairs,
  A position axes (1 text, 2 image (h, w), 3 video (t, h, w)).

Vocabulary (the same names as the config fields `config.model.rope.*`):
  base        the frequency base, 10000 by default.
  ladder      "standard": theta_i = base ** (-2 i / H) over all P pairs;
              "per_axis": each axis gets its own geometric ladder over its own pairs.
  layout      how the H numbers form pairs: "half" pairs (i, i + P) (GPT-NeoX / LLaMA
              rotate_half); "interleaved" pairs (2i, 2i + 1) (RoFormer / GPT-J).
  allocation  which axis drives pair i (`ALLOCATIONS`): "alternating" a(i) = i mod A;
              "sections" contiguous blocks of sizes `sections` (Qwen2-VL's mrope_section);
              "mrope_interleaved" Qwen3-VL's interleaved M-RoPE: a(i) = i mod A while
              i < A * sections[i mod A], else axis 0; "videorope" VideoRoPE's
              low-frequency temporal allocation: the last sections[0] pairs (the slowest)
              follow axis 0 (t), the others take turns over axes 1..A-1.
  pairs       which pairs turn (`rope_jax.pairs.PairSpec`): all | first (HF's
              partial_rotary_factor) | proportional (p-RoPE) | index | half_truncated |
              heads (its own pairs per layer and kv head; `rotate` takes one layer's).
  scaling     a context-scaling rule with Hugging Face's `rope_parameters` keys
              (`rope_jax.scaling`): rope_type linear | dynamic | yarn | longrope | llama3,
              factor, ...; None = plain RoPE.
  max_position_embeddings  L, the length the rules scale from (HF's field of that name).

These eight settings form one value, `RopeSpec`, validated when it is made. Every
function takes a spec, or its fields as keywords (`rotate(x, p, layout="interleaved")`),
or both (keywords override the spec's fields). The maths is in docs/maths.md#rotation,
docs/maths.md#multimodal-rope-variants and docs/maths.md#context-scaling.

The frequencies are a pipeline of three stages, one registry each: the ladder
(`LADDERS`), the pairs that turn (`pairs.SELECTIONS`: the block D the layout pairs, the
width the ladder spreads over, the pairs frozen at frequency 0) and the context rule
(`scaling.RULES`, standard ladder only). With a block D < H only x[..., :D] rotates (the
layout's pairs inside it, as HF's GPT-NeoX / Phi code rotates `q[..., :rotary_dim]`)
and the rest pass through. `dynamic` and `longrope` depend on the current length:
`seq_len`, a static int that they require (attention passes its number of key slots;
x's own T would be 1 in a decode step). A rule's attention factor is not part of the
rotation (which stays orthogonal): `attention_factor` returns it, and attention
multiplies the q.k logits by it once per rotated q or k site (HF multiplies cos and sin
of q and k, i.e. factor^2).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rope_jax.pairs import PairSpec
from rope_jax.scaling import RULES as SCALING_RULES
from rope_jax.scaling import check_scaling, scaled_frequencies  # noqa: F401 (the public API)

# Scaling rules whose frequencies depend on the current length (`seq_len`).
LAYOUTS = ("half", "interleaved")
# ALLOCATIONS (name -> rule placing the pairs on the axes) and LADDERS (name -> the
# frequency exponents) are defined with their rules below.


# ------------------------------------------------------------------------ the spec


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """Every rotation setting but the positions: validated once, passed as one value.

    Fields as in the module docstring; `sections` is a tuple of pairs per axis (read
    by every allocation but "alternating", which refuses it: it would go unread, like a
    scaling key its rule does not take). `scaling` may be given as a dict (or ConfigDict)
    of HF keys; it is checked by `scaling.check_scaling`, its defaults filled, and stored
    as a sorted tuple of (key, value) pairs (lists as tuples), or None when it is plain
    RoPE (rope_type "default" over the whole head).
    `max_position_embeddings` is kept only with a scaling rule. Hashable, so the
    per-shape frequency table is cached. Whether the sections and the scaling fit a head
    (sections sum to P', one per axis, and give each axis its count under the
    allocation's rule; the rotated dims; factor lists of length P') is checked with the
    head size, in `pair_table`.
    """

    base: float = 10000.0
    ladder: str = "standard"
    layout: str = "half"
    allocation: str = "alternating"
    sections: tuple[int, ...] | None = None
    pairs: PairSpec = PairSpec()
    scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int | None = None

    def __post_init__(self):
        _check_choice("ladder", self.ladder, LADDERS)
        _check_choice("layout", self.layout, LAYOUTS)
        if self.allocation == "interleaved":  # the name it had; "interleaved" is a layout
            raise ValueError(
                "allocation='interleaved' is now allocation='alternating' (a(i) = i mod A; "
                "'interleaved' names a pair layout)"
            )
        _check_choice("allocation", self.allocation, ALLOCATIONS)
        if isinstance(self.base, bool) or not isinstance(self.base, (int, float, np.number)):
            raise ValueError(f"base={self.base!r} must be a number > 1")
        if not self.base > 1.0:
            raise ValueError(f"base={self.base!r} must be > 1")
        sections = None if self.sections is None else tuple(self.sections) or None
        if sections is not None:
            if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) for s in sections):
                raise ValueError(f"sections={sections} must be non-negative integers")
            if any(s < 0 for s in sections):
                raise ValueError(f"sections={sections} must be non-negative integers")
            sections = tuple(int(s) for s in sections)
        if self.allocation != "alternating" and sections is None:
            raise ValueError(
                f"allocation={self.allocation!r} needs sections=(s_0, ..., s_{{A-1}}) "
                "summing to H/2"
            )
        if self.allocation == "alternating" and sections is not None:
            raise ValueError(
                f"sections={sections} is not read by allocation='alternating' (it would be "
                f"ignored); set allocation to one of "
                f"{', '.join(a for a in ALLOCATIONS if a != 'alternating')}, or sections=()"
            )
        scaling = _scaling_items(self.scaling)
        if scaling is not None and not LADDERS[self.ladder].takes_rule:
            raise ValueError(
                f"ladder={self.ladder!r} takes no scaling (got rope_type="
                f"{dict(scaling)['rope_type']!r}): the rules rescale the standard ladder"
            )
        object.__setattr__(self, "pairs", PairSpec.of(self.pairs))
        max_pos = self.max_position_embeddings
        if max_pos is not None and (
            isinstance(max_pos, bool) or not isinstance(max_pos, (int, np.integer)) or max_pos < 1
        ):
            raise ValueError(f"max_position_embeddings={max_pos!r} must be a positive integer")
        object.__setattr__(self, "base", float(self.base))
        object.__setattr__(self, "sections", sections)
        object.__setattr__(self, "scaling", scaling)
        max_pos = None if scaling is None or max_pos is None else int(max_pos)
        object.__setattr__(self, "max_position_embeddings", max_pos)

    @property
    def rope_type(self) -> str:
        """The scaling rule's name ("default" without one)."""
        return dict(self.scaling or ()).get("rope_type", "default")

    @classmethod
    def of(cls, rope: RopeSpec | Mapping | None = None, **settings) -> RopeSpec:
        """A spec from a spec, a mapping of `SPEC_FIELDS` keys or None, plus overrides;
        any other key is an error."""
        if isinstance(rope, RopeSpec):
            return dataclasses.replace(rope, **settings) if settings else rope
        fields = {}
        for key, value in dict(rope or {}).items():
            if key in SPEC_FIELDS:
                fields[key] = value
            else:
                allowed = ", ".join(SPEC_FIELDS)
                raise ValueError(f"{key} is not a rotation setting; allowed: {allowed}")
        return cls(**{**fields, **settings})


SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(RopeSpec))
_PLAIN = {"rope_type": "default"}


def _scaling_items(scaling) -> tuple[tuple[str, Any], ...] | None:
    """A scaling dict, ConfigDict or tuple of pairs, checked (without the head) and made
    hashable: sorted (key, value) pairs with lists as tuples; None when it is plain RoPE."""
    if scaling is None:
        return None
    if hasattr(scaling, "to_dict"):  # ml_collections.ConfigDict (not a Mapping)
        scaling = scaling.to_dict()
    elif isinstance(scaling, tuple):
        try:
            scaling = dict(scaling)
        except (TypeError, ValueError):
            raise ValueError(f"scaling={scaling!r} must be a dict of rope scaling keys") from None
    params = check_scaling(scaling, dim=None)
    if params == _PLAIN:
        return None
    hashable = lambda v: tuple(v) if isinstance(v, list) else v
    return tuple(sorted((key, hashable(value)) for key, value in params.items()))


def _check_choice(field: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{field}={value!r} is not one of {', '.join(map(repr, allowed))}")


def _check_head_dim(head_dim: int) -> None:
    if not isinstance(head_dim, (int, np.integer)) or head_dim <= 0 or head_dim % 2:
        raise ValueError(
            f"head_dim={head_dim!r} must be a positive even integer (pairs of numbers)"
        )


def _check_sections(sections, num_axes: int, head_dim: int, pairs: int) -> None:
    if len(sections) != num_axes:
        raise ValueError(
            f"sections={sections} has {len(sections)} entries but positions have {num_axes} axes"
        )
    if sum(sections) != pairs:
        what = f"head_dim/2={pairs}" if 2 * pairs == head_dim else f"the rotated pairs P'={pairs}"
        raise ValueError(f"sections={sections} must be non-negative and sum to {what}")


# ------------------------------------------------------------------ axis allocations
# Each rule: (pairs P', num_axes A, sections or None) -> axis of each pair, int [P'].


def _alternating(pairs: int, num_axes: int, sections) -> np.ndarray:
    """a(i) = i mod A: the axes take turns down the ladder."""
    return np.arange(pairs) % num_axes


def _contiguous(pairs: int, num_axes: int, sections) -> np.ndarray:
    """Qwen2-VL M-RoPE: pairs [0, s_0) follow axis 0, the next s_1 axis 1, and so on."""
    return np.repeat(np.arange(num_axes), sections)


def _mrope_interleaved(pairs: int, num_axes: int, sections) -> np.ndarray:
    """Qwen3-VL interleaved M-RoPE: a(i) = i mod A when that is an axis a >= 1 and
    i < A s_a; every other pair follows axis 0 (t)."""
    i = np.arange(pairs)
    a = i % num_axes
    return np.where((a > 0) & (i < num_axes * np.asarray(sections)[a]), a, 0)


def _low_frequency_temporal(pairs: int, num_axes: int, sections) -> np.ndarray:
    """VideoRoPE: the last s_0 pairs (the lowest frequencies) follow axis 0 (t); pair
    i < P' - s_0 follows axis 1 + (i mod (A - 1)), so h and w alternate from the top."""
    i = np.arange(pairs)
    spatial = 1 + i % max(num_axes - 1, 1)
    return np.where(i < pairs - sections[0], spatial, 0)


ALLOCATIONS = {
    "alternating": _alternating,
    "sections": _contiguous,
    "mrope_interleaved": _mrope_interleaved,
    "videorope": _low_frequency_temporal,
}


def reference_sections(allocation: str, head_dim: int, num_axes: int) -> tuple[int, ...] | None:
    """Pairs per axis scaled from the published models (None for "alternating").

    On 3 axes: "sections" (Qwen2-VL's (16, 24, 24) at H = 128) and "videorope" (the
    same split, t on the last quarter of the pairs) give t a quarter of the P pairs and
    split the rest between h and w (h the larger half); "mrope_interleaved" (Qwen3-VL's
    (24, 20, 20)) gives h and w 5/16 each and t the rest. On other A: P // A per axis,
    axis 0 taking the remainder. Every result fits its allocation's rule.
    """
    _check_choice("allocation", allocation, ALLOCATIONS)
    _check_head_dim(head_dim)
    if isinstance(num_axes, bool) or not isinstance(num_axes, (int, np.integer)) or num_axes < 1:
        raise ValueError(f"num_axes={num_axes} must be >= 1")
    pairs = head_dim // 2
    if allocation == "alternating":
        return None
    if num_axes != 3:
        rest = (pairs // num_axes,) * (num_axes - 1)
        return (pairs - sum(rest), *rest)
    if allocation == "mrope_interleaved":
        spatial = pairs * 5 // 16
        return (pairs - 2 * spatial, spatial, spatial)
    t = pairs // 4
    return (t, (pairs - t) - (pairs - t) // 2, (pairs - t) // 2)


# --------------------------------------------------------------- frequencies (host)


def _axes(head_dim: int, num_axes: int, spec: RopeSpec, pairs: int | None = None) -> np.ndarray:
    """Axis of each of the `pairs` rotated pairs (default P = H/2).

    Every allocation but "alternating" must hand axis a exactly sections[a] pairs.
    """
    if isinstance(num_axes, bool) or not isinstance(num_axes, (int, np.integer)) or num_axes < 1:
        raise ValueError(f"num_axes={num_axes} must be >= 1")
    pairs = head_dim // 2 if pairs is None else pairs
    if spec.allocation != "alternating":
        _check_sections(spec.sections, num_axes, head_dim, pairs)
    axes = ALLOCATIONS[spec.allocation](pairs, num_axes, spec.sections).astype(np.int32)
    if spec.allocation != "alternating":
        counts = tuple(int(n) for n in np.bincount(axes, minlength=num_axes))
        if counts != spec.sections:
            raise ValueError(
                f"sections={spec.sections} do not fit allocation={spec.allocation!r} over "
                f"{pairs} pairs: its rule gives {counts} pairs per axis"
            )
    return axes


def _standard_exponents(pairs: int, num_axes: int, spec: RopeSpec) -> np.ndarray:
    """2i / D for pair i of a ladder over D = 2 * pairs numbers: one geometric ladder."""
    return np.arange(pairs, dtype=np.float64) / pairs


def _per_axis_exponents(pairs: int, num_axes: int, spec: RopeSpec) -> np.ndarray:
    """j / P_a for the j-th pair of axis a (P_a pairs): each axis its own whole ladder."""
    axes = _axes(2 * pairs, num_axes, spec)
    exponent = np.zeros(pairs, dtype=np.float64)
    for a in range(num_axes):
        idx = np.flatnonzero(axes == a)
        exponent[idx] = np.arange(idx.size) / max(idx.size, 1)
    return exponent


@dataclasses.dataclass(frozen=True)
class Ladder:
    """One frequency ladder: (pairs of its width, A, spec) -> float64 exponents e_i with
    theta_i = base ** -e_i, and whether the context rules (defined on the standard
    geometric ladder) may rescale it."""

    exponents: Callable[[int, int, RopeSpec], np.ndarray]
    takes_rule: bool


LADDERS = {
    "standard": Ladder(_standard_exponents, takes_rule=True),
    "per_axis": Ladder(_per_axis_exponents, takes_rule=False),
}


@functools.lru_cache(maxsize=256)
def _scaled(dim: int, spec: RopeSpec, seq_len: int | None) -> tuple[np.ndarray, float]:
    """(float32 [dim/2] frequencies, attention factor) of a ladder over `dim` numbers
    under the spec's rule."""
    return scaled_frequencies(
        dim, base=spec.base, scaling=dict(spec.scaling),
        max_position_embeddings=spec.max_position_embeddings, seq_len=seq_len,
    )  # fmt: skip


def _ladder(head_dim: int, num_axes: int, spec: RopeSpec, seq_len) -> np.ndarray:
    """float32 [D/2]: the block's frequencies through the three stages (ladder, rule,
    pairs): the ladder over its width D_l (rescaled by the rule), laid on the block's
    first D_l/2 pairs, the frozen pairs at 0."""
    block, width, turning = spec.pairs.select(head_dim)
    if spec.scaling is None:
        exponent = LADDERS[spec.ladder].exponents(width // 2, num_axes, spec)
        ladder = (spec.base**-exponent).astype(np.float32)
    else:
        ladder = _scaled(width, spec, seq_len)[0]
    freqs = np.zeros(block // 2, np.float32)
    freqs[: ladder.size] = ladder
    if turning is not None:
        freqs[~turning] = 0.0
    return freqs


@functools.lru_cache(maxsize=256)
def _pair_table(
    head_dim: int, num_axes: int, spec: RopeSpec, seq_len: int | None
) -> tuple[np.ndarray, np.ndarray]:
    _check_head_dim(head_dim)
    freqs = _ladder(head_dim, num_axes, spec, seq_len)
    axes = _axes(head_dim, num_axes, spec, freqs.size)
    freqs.flags.writeable = axes.flags.writeable = False  # shared by the cache
    return freqs, axes


def _length(spec: RopeSpec, seq_len) -> int | None:
    """seq_len as a cache key: kept only for the rules that read it (`Rule.reads_length`)."""
    if not SCALING_RULES[spec.rope_type].reads_length or seq_len is None:
        return None
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r} must be a positive integer (a static length)")
    return int(seq_len)


def pair_table(
    head_dim: int,
    rope: RopeSpec | None = None,
    *,
    num_axes: int = 1,
    seq_len: int | None = None,
    **settings,
) -> tuple[np.ndarray, np.ndarray]:
    """(frequencies float32 [P'], axis of each pair int32 [P']): what drives every pair.

    `seq_len` is the current length, read only by the `dynamic` and `longrope` rules
    (which need it). Computed once per (head_dim, num_axes, spec, seq_len) and cached
    (read-only arrays).
    """
    spec = RopeSpec.of(rope, **settings)
    return _pair_table(int(head_dim), int(num_axes), spec, _length(spec, seq_len))


def attention_factor(
    head_dim: int, rope: RopeSpec | None = None, *, seq_len: int | None = None, **settings
) -> float:
    """The scaling rule's attention factor m (1.0 without a rule; yarn, longrope).

    HF multiplies cos and sin of both q and k by m, so the q.k logits scale by m^2; here
    the rotation stays orthogonal and attention applies m to the logits once per rotated
    q or k site (nn/attention.py), never to values or outputs.
    """
    spec = RopeSpec.of(rope, **settings)
    if spec.scaling is None:
        return 1.0
    _check_head_dim(int(head_dim))
    width = spec.pairs.select(int(head_dim))[1]
    return _scaled(width, spec, _length(spec, seq_len))[1]


def axis_of_pair(
    head_dim: int,
    rope: RopeSpec | None = None,
    *,
    num_axes: int = 1,
    seq_len: int | None = None,
    **settings,
) -> np.ndarray:
    """Which position axis drives each rotated pair.

    Returns:
      int32 [P']: a(i) in [0, A).
    """
    return pair_table(head_dim, rope, num_axes=num_axes, seq_len=seq_len, **settings)[1]


def frequencies(
    head_dim: int,
    rope: RopeSpec | None = None,
    *,
    num_axes: int = 1,
    seq_len: int | None = None,
    **settings,
) -> np.ndarray:
    """Rotation frequency of every rotated pair.

    "standard": theta_i = base ** (-2 i / D_l) for i in [0, D_l/2), regardless of axes
    (D_l = H unless `pairs` spreads the ladder over fewer numbers).
    "per_axis": the k-th pair driven by axis a (of n_a pairs) gets base ** (-k / n_a),
    i.e. every axis has the full geometric ladder over its own pairs (for 2-D with
    alternating allocation this is theta_{2j} = theta_{2j+1} = base**(-4j/H)).
    With `scaling`: `scaling.scaled_frequencies` (standard ladder only; `seq_len` for
    dynamic / longrope). `pairs` then lays the ladder on the block's pairs and sets the
    frozen ones to 0 (`rope_jax.pairs`).

    Returns:
      float32 [P'].
    """
    return pair_table(head_dim, rope, num_axes=num_axes, seq_len=seq_len, **settings)[0]


# ---------------------------------------------------------------- angles (traced)


def _num_axes(x_ndim: int, positions) -> int:
    """A from the rank of positions: [..., T] -> 1, [..., T, A] -> A."""
    if positions.ndim == x_ndim - 2:
        return 1
    if positions.ndim == x_ndim - 1:
        return int(positions.shape[-1])
    raise ValueError(
        f"positions have shape {tuple(positions.shape)} but x has rank {x_ndim} [..., T, N, H]: "
        "expected positions [..., T] (1-D) or [..., T, A] (N-D)"
    )


def angles(
    positions, rope: RopeSpec | None = None, *, head_dim: int, seq_len: int | None = None,
    **settings,
) -> jax.Array:  # fmt: skip
    """Phase of every rotated pair: angle_i = p[a(i)] * theta_i, in float32.

    Args:
      positions: [..., A] float or int (A >= 1; use positions[..., None] for 1-D).
      seq_len: the current length, for the dynamic / longrope rules.

    Returns:
      float32 [..., P'].
    """
    num_axes = int(positions.shape[-1])
    freqs, axes = pair_table(head_dim, rope, num_axes=num_axes, seq_len=seq_len, **settings)
    positions = jnp.asarray(positions).astype(jnp.float32)
    if num_axes == 1:
        per_pair = positions  # [..., 1] broadcasts over P
    else:
        per_pair = jnp.take(positions, axes, axis=-1)  # [..., P]
    return per_pair * freqs


def rotate(
    x,
    positions,
    rope: RopeSpec | None = None,
    *,
    inverse: bool = False,
    seq_len: int | None = None,
    **settings,
) -> jax.Array:
    """Rotates x by R_p (or R_p^T with inverse=True) at each token's position p.

    Pair (u, v) at angle phi becomes (u cos phi - v sin phi, u sin phi + v cos phi).
    With a partial rotary factor only x[..., :2P'] rotates; x[..., 2P':] is returned as
    it is. The scaling rule's attention factor is not applied here (`attention_factor`).

    Args:
      x: [B, T, N, H] (any leading dims: [..., T, N, H]).
      positions: [B, T] (1-D) or [B, T, A] (N-D), int or float, may be traced.
      rope: a `RopeSpec` (None = the defaults); `**settings` override its fields
        (base, ladder, layout, allocation, sections, scaling, max_position_embeddings:
        see the module docstring).
      inverse: apply the inverse rotation R^T (angle -phi), e.g. on attention outputs.
      seq_len: static current length read by the dynamic / longrope rules, which need
        it (x's T is not it in a decode step: attention passes its number of key slots).

    Returns:
      [B, T, N, H] in x's dtype.
    """
    spec = RopeSpec.of(rope, **settings)
    if x.ndim < 3:
        raise ValueError(f"x has shape {tuple(x.shape)}: expected [..., T, N, H]")
    head_dim = int(x.shape[-1])
    _check_head_dim(head_dim)
    positions = jnp.asarray(positions)
    num_axes = _num_axes(x.ndim, positions)
    if num_axes == 1 and positions.ndim == x.ndim - 2:
        positions = positions[..., None]  # [..., T, 1]
    if positions.shape[:-1] != x.shape[:-2]:
        try:
            jnp.broadcast_shapes(positions.shape[:-1], x.shape[:-2])
        except ValueError:
            raise ValueError(
                f"positions {tuple(positions.shape)} do not match x {tuple(x.shape)} on [..., T]"
            ) from None
    phase = angles(positions, spec, head_dim=head_dim, seq_len=seq_len)  # [..., T, P']
    heads = spec.pairs.heads(head_dim)  # [K, P]: a per-head selection's turning pairs
    if heads is not None:
        return _turn_heads(x, phase, heads, layout=spec.layout, inverse=inverse)
    rotated = 2 * phase.shape[-1]  # D = 2P': a partial rotation leaves x[..., D:] as it is
    if rotated == head_dim:
        return turn(x, phase, layout=spec.layout, inverse=inverse)
    turned = turn(x[..., :rotated], phase, layout=spec.layout, inverse=inverse)
    return jnp.concatenate([turned, x[..., rotated:]], -1)


def _turn_heads(x, phase, heads: np.ndarray, *, layout: str, inverse: bool) -> jax.Array:
    """`turn` with kv head k's frozen pairs at angle 0 (bool heads [K, P]); query head n
    follows kv head n // G, as its keys do."""
    num_heads, kv_heads = x.shape[-2], heads.shape[0]
    if num_heads % kv_heads:
        raise ValueError(
            f"x has {num_heads} heads, not a multiple of the {kv_heads} kv heads that "
            "pairs.index (rule 'heads') lists per layer"
        )
    grouped = x.reshape(*x.shape[:-2], kv_heads, num_heads // kv_heads, x.shape[-1])
    phase = phase[..., None, :] * heads.astype(np.float32)  # [..., T, K, P]
    # `turn` reads [..., T', N', H] with phases [..., T', P]: here T' = K, N' = G.
    return turn(grouped, phase, layout=layout, inverse=inverse).reshape(x.shape)


def turn(x, phase, *, layout: str = "half", inverse: bool = False) -> jax.Array:
    """Turns pair i of every head vector by phase_i (by -phase_i with inverse=True).

    The block-diagonal core of `rotate`, also used by the learned rotations
    (`rope_jax.learned`), whose phases differ per kv head.

    Args:
      x: [..., T, N, D], D = 2P.
      phase: float32 [..., T, P], the same for the N vectors of a token.
      layout: which numbers form pair i (`LAYOUTS`).

    Returns:
      [..., T, N, D] in x's dtype.
    """
    cos, sin = _cos_sin_table(phase)  # [..., T, P] each, float32
    if inverse:
        sin = -sin
    return _turn(x, cos, sin, layout)


def _turn(x, cos, sin, layout: str) -> jax.Array:
    """Turns every pair of x [..., T, N, D] by the angles of cos, sin [..., T, D/2]."""
    pairs = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    # Both layouts as y = x * cos + swap(x) * (+-sin), with the two members of a pair on
    # an axis of size 2, so the swap is a reversal of that axis (a strided read, no
    # concatenate: XLA emits it as one vectorised elementwise pass).
    if layout == "half":
        xp = xf.reshape(*x.shape[:-1], 2, pairs)  # [..., T, N, 2, P]: (u, v)
        c = cos[..., None, None, :]  # [..., T, 1, 1, P]
        s = sin[..., None, None, :] * _SIGN[:, None]  # [..., T, 1, 2, P]: (-sin, sin)
        out = xp * c + xp[..., ::-1, :] * s
    else:
        xp = xf.reshape(*x.shape[:-1], pairs, 2)  # [..., T, N, P, 2]: (u, v)
        c = cos[..., None, :, None]  # [..., T, 1, P, 1]
        s = sin[..., None, :, None] * _SIGN  # [..., T, 1, P, 2]
        out = xp * c + xp[..., ::-1] * s
    return out.reshape(x.shape).astype(x.dtype)


_SIGN = np.array([-1.0, 1.0], np.float32)


def _cos_sin_table(phase):
    """cos and sin of phase [..., P], materialised once.

    Left alone, XLA fuses cos/sin into the consumer's per-element loop and evaluates
    them once per head and pair member (2N times too often). A product with the
    identity is exact in float32 and is never fused into an elementwise loop, so the
    small [..., T, 2, P] table is computed once and then read.
    """
    table = jnp.stack([jnp.cos(phase), jnp.sin(phase)], axis=-2)  # [..., 2, P]
    eye = jnp.eye(phase.shape[-1], dtype=jnp.float32)
    table = jnp.einsum("...kp,pq->...kq", table, eye, precision=jax.lax.Precision.HIGHEST)
    return table[..., 0, :], table[..., 1, :]


def stationary(head_dim: int, rope: RopeSpec | None = None, **settings) -> np.ndarray:
    """bool [H] (or [K, H] for a per-head selection's layer): the numbers of a head that
    no rotation moves, the members of its frozen pairs (frequency 0) and the numbers a
    partial rotation passes through."""
    spec = RopeSpec.of(rope, **settings)
    block, _, turning = spec.pairs.select(int(head_dim))
    heads = spec.pairs.heads(int(head_dim))
    turning = heads if heads is not None else (
        np.ones(block // 2, bool) if turning is None else turning)  # fmt: skip
    u, v = _pair_indices(block, spec.layout)
    out = np.ones((*turning.shape[:-1], int(head_dim)), bool)
    out[..., u] = ~turning
    out[..., v] = ~turning
    return out


def xpos_scale(positions, head_dim: int, scale_base: float, center) -> jax.Array:
    """xPos's scale (Sun et al. 2022) of pair i at position p: zeta_i ** ((p - c) / gamma),
    zeta_i = (2i + 0.4 H) / (1.4 H) in (0, 1), gamma = `scale_base`, c = `center`.

    Queries are multiplied by it and keys divided, so pair i's share of q_m . k_n is
    damped by zeta_i ** ((m - n) / gamma) (the slow pairs, zeta near 1, least): a relative
    decay, whatever c is; c (T // 2 in the reference) keeps both factors near 1.

    Args:
      positions: [..., T] (1-D text positions), int or float.

    Returns:
      float32 [..., T, H/2].
    """
    pairs = int(head_dim) // 2
    zeta = (2.0 * np.arange(pairs) + 0.4 * head_dim) / (1.4 * head_dim)
    power = (jnp.asarray(positions, jnp.float32) - center) / float(scale_base)
    return jnp.exp(power[..., None] * np.log(zeta).astype(np.float32))


def scale_pairs(x, scale, layout: str = "half") -> jax.Array:
    """x [..., T, N, H] with both numbers of pair i (as `layout` forms them) times scale_i
    ([..., T, H/2], the same for the N heads); x's dtype."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {', '.join(map(repr, LAYOUTS))}")
    s = jnp.asarray(scale, jnp.float32)[..., None, :]  # [..., T, 1, P]
    both = jnp.concatenate([s, s], -1) if layout == "half" else jnp.repeat(s, 2, axis=-1)
    return (x.astype(jnp.float32) * both).astype(x.dtype)


def pair_norms(x, layout: str = "half") -> jax.Array:
    """|(u_i, v_i)|: the length of each rotation pair of x [..., H] -> float32 [..., H/2],
    the pairs formed as `layout` says (a rotation turns a pair and keeps its length, so
    this is the same before and after R_p)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {', '.join(map(repr, LAYOUTS))}")
    u, v = _pair_indices(int(x.shape[-1]), layout)
    xf = jnp.asarray(x, jnp.float32)
    return jnp.sqrt(xf[..., u] ** 2 + xf[..., v] ** 2)


# ------------------------------------------- matrix form (tests, analysis, small H)


def _pair_indices(rotated: int, layout: str) -> tuple[np.ndarray, np.ndarray]:
    """Indices (u_i, v_i) of the two coordinates of pair i among the first `rotated` = 2P'
    numbers of a head vector (the whole head unless the rotation is partial)."""
    pairs = rotated // 2
    if layout == "half":
        return np.arange(pairs), np.arange(pairs) + pairs
    return 2 * np.arange(pairs), 2 * np.arange(pairs) + 1


def generators(
    head_dim: int,
    rope: RopeSpec | None = None,
    *,
    num_axes: int = 1,
    seq_len: int | None = None,
    **settings,
) -> np.ndarray:
    """Skew-symmetric generators B_a with R_p = expm(sum_a p[a] B_a).

    B_a holds theta_i in the pairs driven by axis a (block [[0, -theta], [theta, 0]]);
    the B_a are block diagonal on the same blocks, so they commute. Numbers a partial
    rotation leaves alone have zero rows and columns.

    Returns:
      float64 [A, H, H].
    """
    spec = RopeSpec.of(rope, **settings)
    freqs, axes = pair_table(head_dim, spec, num_axes=num_axes, seq_len=seq_len)
    freqs = freqs.astype(np.float64)
    u, v = _pair_indices(2 * freqs.size, spec.layout)
    gens = np.zeros((num_axes, head_dim, head_dim))
    gens[axes, v, u] = freqs
    gens[axes, u, v] = -freqs
    return gens


def rotation_matrix(
    position, rope: RopeSpec | None = None, *, head_dim: int, seq_len: int | None = None,
    **settings,
) -> jax.Array:  # fmt: skip
    """The explicit rotation R_p, so that rotate(x, p)[..., :] == R_p @ x.

    Args:
      position: [..., A].

    Returns:
      float32 [..., H, H] (the identity on the numbers a partial rotation leaves alone).
    """
    spec = RopeSpec.of(rope, **settings)
    phase = angles(position, spec, head_dim=head_dim, seq_len=seq_len)  # [..., P']
    cos, sin = jnp.cos(phase), jnp.sin(phase)
    u, v = _pair_indices(2 * phase.shape[-1], spec.layout)
    eye = jnp.eye(head_dim, dtype=jnp.float32)
    mat = jnp.broadcast_to(eye, (*phase.shape[:-1], head_dim, head_dim))
    mat = mat.at[..., u, u].set(cos).at[..., v, v].set(cos)
    return mat.at[..., v, u].set(sin).at[..., u, v].set(-sin)


def recover_positions(
    phase,
    rope: RopeSpec | None = None,
    *,
    head_dim: int,
    num_axes: int = 1,
    seq_len: int | None = None,
    **settings,
) -> jax.Array:
    """Inverts the encoding: positions from (possibly wrapped) pair angles.

    Uses, per axis, the fastest pair driven by that axis: while |p[a] theta_max| < pi its
    wrapped angle atan2(sin, cos) equals p[a] * theta_max, so p[a] is recovered exactly.

    Args:
      phase: [..., P'] pair angles, e.g. atan2 of the entries of R_p.

    Returns:
      float32 [..., A].
    """
    freqs, axes = pair_table(head_dim, rope, num_axes=num_axes, seq_len=seq_len, **settings)
    fastest = []
    for a in range(num_axes):
        idx = np.flatnonzero((axes == a) & (freqs > 0))
        if idx.size == 0:
            raise ValueError(f"axis {a} drives no turning pair: its position cannot be recovered")
        fastest.append(idx[np.argmax(freqs[idx])])
    fastest = np.asarray(fastest)
    phase = jnp.asarray(phase, jnp.float32)[..., fastest]
    wrapped = jnp.arctan2(jnp.sin(phase), jnp.cos(phase))
    return wrapped / freqs[fastest]
