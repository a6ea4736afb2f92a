"""Prompts of an exact token length, assembled from separately tokenized pieces.

RULER grows its haystack by whole sentences or words until prompt + answer budget fit
(a binary search on the text); here the prompt is exactly the budget, in the tokenizer's
own tokens: the fixed pieces (instructions, needles, question and answer prefix) are
tokenized one by one, and the haystack fills what is left at token granularity, whole
units first (noise sentences, distractor needles, list items, coded words), then the
first tokens of the next unit; corpus text is cut to the exact count. Needles go in at
the haystack boundary (a unit's start, or a sentence end in corpus text) nearest the
asked depth, and each example records where they went.

A prompt is token ids, not text: the decoded prompt re-tokenized in one piece may give
other ids where two pieces meet, and a haystack cut mid-word decodes to a word part.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import numpy as np

# The fewest haystack tokens a prompt must leave room for.
MIN_HAYSTACK = 16

# The grid of needle depths of RULER (and of the needle-in-a-haystack heatmaps): 40 even
# steps over 0-100%, rounded to whole percents.
DEPTHS = tuple(float(d) / 100 for d in np.round(np.linspace(0, 100, num=40)).astype(int))

_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s*$")


class TooShort(ValueError):
    """A prompt budget too small for the fixed pieces: `need` prompt tokens at least."""

    def __init__(self, need: int):
        super().__init__(f"needs a prompt of at least {need} tokens")
        self.need = int(need)


@dataclasses.dataclass(frozen=True)
class Built:
    """What a generator returns: the prompt ids int32 [budget], the reference answers,
    the needles' depths (shares 0..1 of the haystack) and the canonical continuation."""

    prompt_ids: np.ndarray
    answers: tuple[str, ...]
    depths: tuple[float, ...]
    target: str


@dataclasses.dataclass(frozen=True)
class Request:
    """One example to build: `budget` prompt tokens (`length` is the whole window, prompt
    + answer budget, which RULER's count rules read), the example's generator `rng`, the
    task family's template dict, the asked `depth` (None: drawn from DEPTHS) and, for
    corpus haystacks, `corpus(size)` -> exactly `size` ids of held-out text."""

    tokenizer: object
    budget: int
    length: int
    rng: np.random.Generator
    template: dict
    counts: dict
    depth: float | None = None
    corpus: Callable[[int], np.ndarray] | None = None

    def encode(self, text: str) -> np.ndarray:
        return encode(self.tokenizer, text)


def encode(tokenizer, text: str) -> np.ndarray:
    """Token ids int32 [n] of `text` (no special ids)."""
    return np.asarray(tokenizer.encode(text), dtype=np.int32).reshape(-1)


def fill_units(unit: Callable[[int], np.ndarray], available: int) -> tuple[list[np.ndarray], int]:
    """(pieces, whole): unit(0), unit(1), ... while they fit in `available` tokens, then
    the first tokens of the next units, so the pieces hold exactly `available` tokens;
    `whole` is the number of whole units (the rest is the cut one)."""
    pieces, used, k = [], 0, 0
    while True:
        ids = unit(k)
        if used + len(ids) > available:
            break
        pieces.append(ids)
        used, k = used + len(ids), k + 1
    whole = k
    while used < available:
        ids = unit(k)[: available - used]
        pieces.append(ids)
        used, k = used + len(ids), k + 1
    return pieces, whole


def unit_boundaries(pieces: Sequence[np.ndarray], whole: int) -> np.ndarray:
    """Token offsets where a whole unit starts, where the last whole one ends, and the end
    of the haystack (after the cut unit): a needle at depth 1 goes last, as in RULER."""
    starts = np.cumsum([len(p) for p in pieces[:whole]], dtype=np.int64)
    end = sum(len(p) for p in pieces)
    return np.unique(np.concatenate([[0], starts, [end]])).astype(np.int64)


def token_texts(ids: np.ndarray, tokenizer) -> list[str]:
    """The text of each token on its own [len(ids)] (decoded once per distinct id)."""
    unique, inverse = np.unique(np.asarray(ids), return_inverse=True)
    texts = [tokenizer.decode([int(u)]) for u in unique]
    return [texts[i] for i in np.asarray(inverse).reshape(-1)]


def sentence_boundaries(ids: np.ndarray, tokenizer) -> np.ndarray:
    """Token offsets where a sentence of corpus text ends, and 0: after a token ending in
    . ! ? (closing quotes allowed) when whitespace follows (the end of `ids` counts when
    it ends a sentence). Text with no sentence end falls back to word starts (a token that
    starts with whitespace), and text with none of those to every offset."""
    texts = token_texts(ids, tokenizer) + [" "]  # the text goes on after the haystack
    size = len(ids)
    ends = [p for p in range(1, size + 1) if _SENTENCE_END.search(texts[p - 1])
            and (texts[p - 1][-1:].isspace() or texts[p][:1].isspace())]  # fmt: skip
    if not ends:
        ends = [p for p in range(1, size) if texts[p][:1].isspace()]
    if not ends:
        ends = list(range(1, size + 1))
    return np.asarray(sorted({0, *ends}), dtype=np.int64)


def nearest(boundaries: np.ndarray, target: float) -> int:
    """The boundary closest to `target` (the first of two equally close)."""
    return int(boundaries[int(np.argmin(np.abs(boundaries - target)))])


def insert(haystack: np.ndarray, boundaries: np.ndarray, needles: Sequence[np.ndarray],
           depths: Sequence[float]) -> tuple[np.ndarray, tuple[float, ...]]:  # fmt: skip
    """(context ids, actual depths): each needle at the boundary nearest its depth x H
    (H = len(haystack)); needles at one boundary keep their order. Actual depth = haystack
    tokens before the needle / H."""
    size = len(haystack)
    where = [nearest(boundaries, d * size) for d in depths]
    pieces, last = [], 0
    for i in sorted(range(len(needles)), key=lambda i: (where[i], i)):
        pieces += [haystack[last : where[i]], needles[i]]
        last = where[i]
    pieces.append(haystack[last:])
    return concat(pieces), tuple(w / size if size else 0.0 for w in where)


def concat(pieces: Sequence[np.ndarray]) -> np.ndarray:
    """The pieces end to end, int32 [sum of lengths]."""
    return np.concatenate([np.asarray(p, np.int32).reshape(-1) for p in pieces] or
                          [np.zeros(0, np.int32)]).astype(np.int32)  # fmt: skip


def available(budget: int, fixed: Sequence[np.ndarray], minimum: int) -> int:
    """Tokens left for the haystack once the `fixed` pieces are in; TooShort when fewer
    than `minimum` are."""
    used = sum(len(p) for p in fixed)
    if budget - used < minimum:
        raise TooShort(used + minimum)
    return budget - used


def pick_depths(rng: np.random.Generator, count: int, first: float | None) -> list[float]:
    """`count` distinct depths of the grid (RULER's `random.sample(DEPTHS, n)`), the first
    one `first` when given."""
    depths = list(rng.choice(DEPTHS, size=count, replace=False))
    if first is not None:
        rest = [d for d in depths if d != first][: count - 1]
        depths = [float(first), *rest]
    return [float(d) for d in depths]


def finish(budget: int, pieces: Sequence[np.ndarray], *, answers, depths, target) -> Built:
    """The Built example; checks the prompt holds exactly `budget` tokens."""
    ids = concat(pieces)
    if len(ids) != budget:  # an assembly bug, never a user error
        raise AssertionError(f"prompt of {len(ids)} tokens, budget {budget}")
    return Built(ids, tuple(answers), tuple(float(d) for d in depths), target)
