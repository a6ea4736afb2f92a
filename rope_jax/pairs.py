"""Which rotation pairs turn: the middle stage of the frequency pipeline.

A head's frequencies are made in three stages, each one registry and one field of
`rotary.RopeSpec`, checked once:

  ladder        the geometric ladder of frequencies (`rotary.LADDERS`: standard, per_axis);
  pairs         which pairs of the head turn (this module, `SELECTIONS`);
  context rule  how the ladder is rescaled to run past the trained length
                (`scaling.RULES`: default, linear, dynamic, yarn, longrope, llama3).

A selection decides three numbers of an H-wide head: the block D of head numbers the
layout forms pairs in (the whole head, or the leading D numbers, the rest passing
through unrotated, as Hugging Face's `partial_rotary_factor` rotates `q[..., :D]`), the
width D_l the ladder is spread over (theta_i = base ** (-2 i / D_l)), and which of the
block's D/2 pairs turn (the others get frequency 0: the identity).

  all             D = D_l = H, every pair turns (plain RoPE).
  first           D = D_l = int(H * fraction): the leading D numbers rotate on their own
                  ladder, the rest pass (GPT-NeoX / Phi / DeepSeek partial rotation; HF's
                  `partial_rotary_factor` under every rope_type but proportional).
  proportional    D = D_l = H, the first floor(fraction * H / 2) pairs turn: p-RoPE (Barbero
                  et al. 2024) and HF's rope_type "proportional" (Gemma): the whole-head
                  ladder with its lowest-frequency (1 - p) of the pairs frozen.
  index           D = D_l = H, the listed pair indices turn (`index`, 0 = the fastest):
                  an explicit mask, e.g. MHA2MLA's high / low / uniform / 2-norm choices.
  half_truncated  D = H, D_l = H / 2: the first P/2 pairs turn on a ladder spread over
                  them, the other half are frozen (modded-nanogpt's half-truncated RoPE).
  heads           D = D_l = H, per layer and kv head its own pairs turn: `index[l][k]`
                  lists the pairs of kv head k of layer l (its query heads follow it), e.g.
                  MHA2MLA's 2-norm choice, which ranks every head's pairs by their share of
                  the logits. The model gives each layer its slice (`PairSpec.layer`);
                  `rotate` reads that layer's [K, P] mask (`PairSpec.heads`).

Every entry says what code elsewhere asks of it (`Selection.whole_head`, `.hf`); no other
module compares a selection's name. Pure host NumPy, no JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from numbers import Integral, Real
from typing import Any

import numpy as np

# (head_dim H, fraction, index) -> (block D, ladder width D_l, turning pairs bool [D/2] or None)
Select = Callable[[int, Any, Any], tuple[int, int, np.ndarray | None]]


@dataclasses.dataclass(frozen=True)
class Selection:
    """One rule for which pairs turn, whole: what it computes and every fact about it."""

    select: Select
    means: str
    takes: tuple[str, ...] = ()  # which of `PairSpec`'s settings it reads (fraction, index)
    whole_head: bool = True  # the layout pairs the whole head (frozen pairs have frequency 0)
    per_head: bool = False  # `index` is per layer and kv head ([L][K] lists of pairs)
    # Hugging Face `rope_parameters` keys that spell it, given the spec; None: no HF spelling
    hf: Callable[[PairSpec], dict] | None = None


def _all(head_dim, fraction, index):
    return head_dim, head_dim, None


def _first(head_dim, fraction, index):
    dim = int(head_dim * fraction)
    if dim < 2 or dim % 2:
        raise ValueError(
            f"pairs.fraction={fraction!r} with rule 'first': D = int({head_dim} * fraction) "
            f"must be even and >= 2, got D={dim}"
        )
    return dim, dim, None


def _proportional(head_dim, fraction, index):
    pairs = head_dim // 2
    turning = np.arange(pairs) < int(fraction * head_dim // 2)
    return head_dim, head_dim, turning


def _index(head_dim, fraction, index):
    pairs = head_dim // 2
    bad = [i for i in index if not 0 <= i < pairs]
    if bad:
        raise ValueError(
            f"pairs.index={tuple(index)} holds {bad[0]}, not a pair of an H={head_dim} head "
            f"(0 <= i < {pairs})"
        )
    turning = np.zeros(pairs, bool)
    turning[list(index)] = True
    return head_dim, head_dim, turning


def _half_truncated(head_dim, fraction, index):
    if head_dim % 4:
        raise ValueError(
            f"pairs.rule='half_truncated' needs head_dim divisible by 4 (half of the pairs "
            f"turn, on a ladder over them), got head_dim={head_dim}"
        )
    return head_dim, head_dim // 2, np.arange(head_dim // 2) < head_dim // 4


def _heads(head_dim, fraction, index):
    """The whole-head ladder; the per-head masks are `PairSpec.heads`."""
    pairs = head_dim // 2
    bad = [i for layer in index for head in layer for i in head if not 0 <= i < pairs]
    if bad:
        raise ValueError(
            f"pairs.index (rule 'heads') holds {bad[0]}, not a pair of an H={head_dim} head "
            f"(0 <= i < {pairs})"
        )
    return head_dim, head_dim, None


def _hf_first(spec: PairSpec) -> dict:
    return {"partial_rotary_factor": spec.fraction}


def _hf_proportional(spec: PairSpec) -> dict:
    return {"rope_type": "proportional", "partial_rotary_factor": spec.fraction}


SELECTIONS: dict[str, Selection] = {
    "all": Selection(_all, "every pair turns", hf=lambda spec: {}),
    "first": Selection(
        _first, "the leading int(H * fraction) numbers rotate, the rest pass",
        takes=("fraction",), whole_head=False, hf=_hf_first,
    ),
    "proportional": Selection(
        _proportional, "whole-head ladder, the first floor(fraction * H/2) pairs turn (p-RoPE)",
        takes=("fraction",), hf=_hf_proportional,
    ),
    "index": Selection(_index, "the listed pairs turn (0 = the fastest)", takes=("index",)),
    "half_truncated": Selection(
        _half_truncated, "the first half of the pairs turn on a ladder over them, half frozen"
    ),
    "heads": Selection(
        _heads, "per layer and kv head, the listed pairs turn (index[l][k])",
        takes=("index",), per_head=True,
    ),
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class PairSpec:
    """Which pairs turn: a `SELECTIONS` rule and the settings it reads (validated when
    made; the rest must be unset). Hashable. Whether it fits a head is checked with the
    head, in `select`."""

    rule: str = "all"
    fraction: float | None = None  # first, proportional: a number in [0, 1]
    index: tuple | None = None  # index: distinct pair indices; heads: [L][K] tuples of them

    def __post_init__(self):
        if self.rule not in SELECTIONS:
            raise ValueError(
                f"pairs.rule={self.rule!r} is not one of {', '.join(map(repr, SELECTIONS))}"
            )
        selection = SELECTIONS[self.rule]
        index = None if self.index is None else tuple(self.index) or None
        for name, value in (("fraction", self.fraction), ("index", index)):
            if name in selection.takes and value is None:
                raise ValueError(f"pairs.rule={self.rule!r} needs pairs.{name}")
            if name not in selection.takes and value is not None:
                raise ValueError(
                    f"pairs.{name}={value!r} is not read by pairs.rule={self.rule!r} (it would "
                    "be ignored); unset it"
                )
        if self.fraction is not None:
            f = self.fraction
            if isinstance(f, bool) or not isinstance(f, Real) or not 0 <= f <= 1:
                raise ValueError(f"pairs.fraction={f!r} must be a number in [0, 1]")
            object.__setattr__(self, "fraction", float(f))
        if index is not None:
            index = _per_head(index) if selection.per_head else _indices(index, index)
        object.__setattr__(self, "index", index)

    @property
    def selection(self) -> Selection:
        return SELECTIONS[self.rule]

    @classmethod
    def of(cls, pairs: PairSpec | Mapping | str | None = None) -> PairSpec:
        """A spec from a spec, a rule name, a mapping of its fields (a ConfigDict too; None
        values unset) or None (every pair)."""
        if isinstance(pairs, PairSpec):
            return pairs
        if pairs is None:
            return cls()
        if isinstance(pairs, str):
            return cls(rule=pairs)
        if hasattr(pairs, "to_dict"):  # ml_collections.ConfigDict (not a Mapping)
            pairs = pairs.to_dict()
        if not isinstance(pairs, Mapping):
            raise ValueError(f"pairs={pairs!r} must be a rule name or a dict of its fields")
        fields = {f.name for f in dataclasses.fields(cls)}
        for key in pairs:
            if key not in fields:
                raise ValueError(f"pairs has unknown key {key!r}; allowed: {', '.join(fields)}")
        return cls(**{k: v for k, v in pairs.items() if v is not None})

    def select(self, head_dim: int) -> tuple[int, int, np.ndarray | None]:
        """(block D, ladder width D_l, turning pairs bool [D/2] or None = all) for a head."""
        return self.selection.select(int(head_dim), self.fraction, self.index)

    def layer(self, layer: int, num_layers: int) -> PairSpec:
        """What layer `layer` of `num_layers` rotates by: a per-head selection's own slice
        (one layer), any other selection itself. ValueError if the layers do not match."""
        if not self.selection.per_head:
            return self
        if len(self.index) != num_layers:
            raise ValueError(
                f"pairs.index (rule {self.rule!r}) lists {len(self.index)} layers; the model "
                f"has num_layers={num_layers}"
            )
        return PairSpec(self.rule, index=(self.index[layer],))

    def heads(self, head_dim: int) -> np.ndarray | None:
        """bool [K, P]: which pairs of each kv head turn, for one layer's slice of a
        per-head selection (`layer`); None for a selection that is the same in every head."""
        if not self.selection.per_head:
            return None
        if len(self.index) != 1:
            raise ValueError(
                f"pairs.rule={self.rule!r} lists {len(self.index)} layers: a rotation takes one "
                "layer's slice (PairSpec.layer, as the model does)"
            )
        self.select(head_dim)  # the indices fit the head
        mask = np.zeros((len(self.index[0]), int(head_dim) // 2), bool)
        for k, turning in enumerate(self.index[0]):
            mask[k, list(turning)] = True
        return mask

    def block(self, head_dim: int) -> int:
        """D: the head numbers the layout forms pairs in (the rest pass unrotated)."""
        return self.select(head_dim)[0]

    def config(self) -> dict:
        """The `model.rope.pairs` section of this spec (unset settings None)."""
        return {"rule": self.rule, "fraction": self.fraction, "index": self.index or ()}


def _indices(index, shown) -> tuple[int, ...]:
    """Distinct pair indices, sorted; ValueError naming `shown` (the whole setting)."""
    if isinstance(index, (str, bytes)) or not hasattr(index, "__iter__"):
        raise ValueError(f"pairs.index={shown!r} must be pair indices (integers)")
    index = tuple(index)
    if any(isinstance(i, bool) or not isinstance(i, Integral) for i in index):
        raise ValueError(f"pairs.index={shown!r} must be pair indices (integers)")
    if len(set(index)) != len(index):
        raise ValueError(f"pairs.index={shown!r} names a pair twice")
    return tuple(sorted(int(i) for i in index))


def _per_head(index) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """[L][K] lists of pair indices as nested tuples, every layer with the same K heads."""
    shape = "a list per layer of a list per kv head of pair indices"
    try:
        layers = tuple(tuple(_indices(head, head) for head in layer) for layer in index)
    except (TypeError, ValueError) as e:
        raise ValueError(f"pairs.index (rule 'heads') must be {shape}: {e}") from None
    if len({len(layer) for layer in layers}) != 1 or not layers[0]:
        raise ValueError(f"pairs.index (rule 'heads') must be {shape}, the same kv heads in "
                         f"every layer; got {[len(layer) for layer in layers]} heads")  # fmt: skip
    return layers


# ------------------------------------------------------ Hugging Face's vocabulary


def from_hf(params: Mapping) -> tuple[PairSpec, dict]:
    """(pairs, context rule) from a dict of Hugging Face `rope_parameters` keys, where
    `partial_rotary_factor` (under any rope_type) and rope_type "proportional" say which
    pairs turn: proportional becomes pairs "proportional" under `linear` at its factor
    (`default` at factor 1); any other rope_type with a factor p < 1 becomes pairs
    "first" (transformers spreads that rule's ladder over the leading int(H p) numbers).
    The returned rule dict holds neither key."""
    params = {k: v for k, v in dict(params).items() if v is not None}
    fraction = params.pop("partial_rotary_factor", None)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "proportional":
        params.pop("type", None)
        factor = params.pop("factor", 1.0)
        params["rope_type"] = "default" if factor == 1 else "linear"
        if factor != 1:
            params["factor"] = factor
        return PairSpec("proportional", 1.0 if fraction is None else fraction), params
    if fraction is None or fraction == 1:
        return PairSpec(), params
    return PairSpec("first", fraction), params


def to_hf(spec: PairSpec, rule: Mapping) -> dict | None:
    """The Hugging Face `rope_parameters` keys of a pair selection under a context rule
    (a checked dict with rope_type), or None when HF has no spelling for the two
    together: a selection with no HF form, or proportional under a rule other than
    default / linear (HF's proportional scales by one factor, as linear does)."""
    spelled = spec.selection.hf
    if spelled is None:
        return None
    keys = spelled(spec)
    if "rope_type" not in keys:
        return {**dict(rule), **keys}
    if rule.get("rope_type", "default") not in ("default", "linear"):
        return None
    extra = {"factor": rule["factor"]} if "factor" in rule else {}
    return {**keys, **extra}
