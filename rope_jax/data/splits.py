"""Which documents are held out: the one rule every reader of text follows.

Shipped corpora, archives and the digits fix each document's split by a hash of its
name (`by_name`: the play, the file's path, the image index), so their numbers compare
across readers and machines. Every other document (local files, raw or prepared, and
TFDS text without splits of its own) goes by a seeded hash of its text (`by_text`):
`percent`% validation, as many test, the rest train; identical documents land in the
same split. With 3 or more documents a held-out split left empty takes the train
document of lowest hash (`forced_moves`); a corpus of 1 or 2 documents is cut instead,
each document at line ends into its first 90% (train), next 5% (validation) and last 5%
(test) (`cut_small`). Raw `data.files` (`sources`) and `python -m rope_jax.data.prepare`
both call `label`, so the same files give the same held-out text whatever the tokenizer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections.abc import Iterable, Iterator

SPLITS = ("train", "validation", "test")
HELD_OUT_PERCENT = 1.0  # of validation and of test, for documents split by their text
_CUTS = {"train": (0.0, 0.90), "validation": (0.90, 0.95), "test": (0.95, 1.0)}


def by_name(key: str, *, validation_percent: int = 5, test_percent: int = 5) -> str:
    """The split of a named document: an md5 bucket of `key` (stable across runs,
    machines and Python versions)."""
    bucket = int.from_bytes(hashlib.md5(key.encode("utf-8")).digest()[:8], "big") % 100
    if bucket < validation_percent:
        return "validation"
    if bucket < validation_percent + test_percent:
        return "test"
    return "train"


def text_unit(text: str, seed: int = 0) -> float:
    """A document's place in [0, 1): keyed blake2b of its UTF-8 text."""
    key = seed.to_bytes(8, "little", signed=True)
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=key).digest()
    return int.from_bytes(digest, "little") / 2**64


def by_unit(unit: float, percent: float = HELD_OUT_PERCENT) -> str:
    """validation below `percent`%, test below twice that, train above."""
    if unit < percent / 100:
        return "validation"
    if unit < 2 * percent / 100:
        return "test"
    return "train"


def by_text(text: str, percent: float = HELD_OUT_PERCENT, seed: int = 0) -> str:
    return by_unit(text_unit(text, seed), percent)


def forced_moves(counts: dict, total: int, lowest: list) -> dict[int, str]:
    """{document index: held-out split} for a held-out split that `counts` (documents
    per split) leaves empty: with `total` >= 3 documents the train documents of lowest
    hash move there, one each. `lowest`: sorted (unit, index) of the two lowest-hash
    train documents split by text."""
    lowest, moves = list(lowest), {}
    for split in ("validation", "test"):
        if counts[split] == 0 and total >= 3 and lowest:
            moves[lowest.pop(0)[1]] = split
    return moves


def label(texts: Iterable[tuple[str | None, str]], percent: float = HELD_OUT_PERCENT,
          seed: int = 0) -> list[str]:  # fmt: skip
    """The split of each non-empty (fixed split or None, text) document, in memory: the
    fixed one, else `by_text` with `forced_moves`."""
    texts = list(texts)
    units = [None if fixed else text_unit(text, seed) for fixed, text in texts]
    labels = [fixed or by_unit(u, percent) for (fixed, _), u in zip(texts, units, strict=True)]
    counts = {s: labels.count(s) for s in SPLITS}
    train = sorted((u, i) for i, u in enumerate(units) if u is not None and labels[i] == "train")
    moves = forced_moves(counts, len(texts), train[:2])
    return [moves.get(i, lab) for i, lab in enumerate(labels)]


def cut(text: str, split: str) -> str:
    """`split`'s part of a document of a corpus too small to split by document: the
    first 90% / next 5% / last 5% of its characters, each cut moved to a line end."""
    start, end = _CUTS[split]
    return text[_line_end(text, start) : _line_end(text, end)]


def _line_end(text: str, fraction: float) -> int:
    at = int(len(text) * fraction)
    if at in (0, len(text)):
        return at
    newline = text.find("\n", at)
    return len(text) if newline < 0 else newline + 1


def cut_small(docs: Iterable) -> Iterator:
    """`docs` (readers.Doc) as they are, or, when there are fewer than 3 and none has a
    fixed split, each cut into its three parts (`cut`) as documents of fixed split."""
    docs = iter(docs)
    head = list(itertools.islice(docs, 3))
    if len(head) >= 3 or any(doc.split is not None for doc in head):
        yield from itertools.chain(head, docs)
        return
    for doc in head:
        text = doc.read()  # once: two documents at most
        for split in SPLITS:
            read = lambda s=split, t=text: cut(t, s)  # noqa: E731
            yield dataclasses.replace(doc, key=f"{doc.key} ({split} part)", split=split,
                                      read=read, part=True)  # fmt: skip
