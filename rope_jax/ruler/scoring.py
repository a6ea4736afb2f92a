"""RULER's scorers (`scripts/eval/synthetic/constants.py`, `scripts/eval/evaluate.py`).

    string_match_all   per example, the share of its references found in the prediction
                       (a case-insensitive substring test), averaged over examples
    string_match_part  per example, 1 if any of its references is found, averaged

RULER reports them x 100 rounded to 2 decimals; here they are shares 0..1, unrounded.
`postprocess` is RULER's `postprocess_pred`, applied to a prediction before scoring.
`chars_in_place` is not RULER's: the share of a perfect answer's characters that the
continuation has at the same place, a measure of partial retrieval (a 7-digit value with
4 digits right scores 0 by RULER's scorers; chance is about 0.1 a digit).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(prediction: str) -> str:
    """RULER's clean-up: strip, control characters (\\x00-\\x1f) to newlines, strip."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def _found(prediction: str, references: Sequence[str]) -> list[float]:
    low = prediction.lower()
    return [1.0 if r.lower() in low else 0.0 for r in references]


def _check(predictions, references) -> None:
    if len(predictions) != len(references) or not predictions:
        raise ValueError(f"{len(predictions)} predictions for {len(references)} reference "
                         "lists: need as many, at least one")  # fmt: skip
    if any(isinstance(r, str) or not len(r) for r in references):
        raise ValueError("each example's references must be a non-empty list of strings")


def match_all(prediction: str, references: Sequence[str]) -> float:
    """One example's string_match_all score: share of `references` in `prediction`."""
    found = _found(prediction, references)
    return sum(found) / len(found)


def match_part(prediction: str, references: Sequence[str]) -> float:
    """One example's string_match_part score: 1.0 if any reference is in `prediction`."""
    return max(_found(prediction, references))


def string_match_all(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's string_match_all as a share 0..1 (RULER: x 100, rounded to 2 decimals)."""
    _check(predictions, references)
    return sum(map(match_all, predictions, references)) / len(predictions)


def string_match_part(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's string_match_part as a share 0..1 (RULER: x 100, rounded to 2 decimals)."""
    _check(predictions, references)
    return sum(map(match_part, predictions, references)) / len(predictions)


def chars_in_place(continuation: str, target: str) -> float:
    """Share of `target`'s characters equal to `continuation`'s at the same index."""
    if not target:
        raise ValueError("chars_in_place: the target is empty")
    return sum(a == b for a, b in zip(continuation, target, strict=False)) / len(target)


SCORERS = {"all": (string_match_all, match_all), "part": (string_match_part, match_part)}
