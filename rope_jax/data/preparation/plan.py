"""Settings, documents and the split plan (first pass): which document goes to which split,
and what a user should hear of it.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator

from rope_jax.data import sources, splits
from rope_jax.data.readers import Doc, PrepareError

SPLITS = splits.SPLITS


HELD_OUT_PERCENT = {"validation": splits.HELD_OUT_PERCENT, "test": splits.HELD_OUT_PERCENT}


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything the output depends on (`workers` and the command do not count)."""

    source: str
    tokenizer: str
    text_key: str = "text"
    seed: int = 0
    shard_tokens: int = 50_000_000
    record_tokens: int = 16_384
    max_documents: int = 0
    tokenizer_train_bytes: int = 1_000_000_000
    compression: str = "zstd"
    byte_counts: str = "auto"
    held_out_percent: float = HELD_OUT_PERCENT["validation"]  # each of validation, test


def documents(settings: Settings, tally: Counter | None = None) -> Iterator[Doc]:
    """Every document of the source, in a fixed order (`sources.read`); `tally`
    counts the invalid UTF-8 byte sequences replaced, per file."""
    return splits.cut_small(sources.read(settings.source, settings.text_key, tally))


def source_fingerprint(settings: Settings) -> str:
    """sha256 over (path, size, mtime) of the files the source reads."""
    return sources.fingerprint(settings.source)


@dataclasses.dataclass
class SplitPlan:
    """Result of the first pass: forced moves, then per split the kept documents/bytes."""

    forced: dict[int, str]
    documents: dict[str, int]
    bytes: dict[str, int]
    cut: bool = False  # 1-2 documents, each cut 90/5/5 at line ends (`splits.cut_small`)


def _assign(index: int, doc: Doc, text: str, settings: Settings, forced: dict) -> str:
    if doc.split is not None:
        return doc.split
    return forced.get(index) or splits.by_text(text, settings.held_out_percent, settings.seed)


def _labelled(settings: Settings, forced: dict, tally: Counter | None = None
              ) -> Iterator[tuple[int, Doc, str, str]]:  # fmt: skip
    """(index, doc, split, text) of every non-empty document, in source order."""
    index = -1
    for doc in documents(settings, tally):
        text = doc.read()
        if text:
            index += 1
            yield index, doc, _assign(index, doc, text, settings, forced), text


def assigned(settings: Settings, plan: SplitPlan | None = None) -> Iterator[tuple[Doc, str, str]]:
    """(doc, split, text) of every kept document (`--max_documents` per split)."""
    kept = dict.fromkeys(SPLITS, 0)
    for _, doc, split, text in _labelled(settings, plan.forced if plan else {}):
        if not settings.max_documents or kept[split] < settings.max_documents:
            kept[split] += 1
            yield doc, split, text


def _count(settings: Settings, forced: dict, tally: Counter | None = None
           ) -> tuple[SplitPlan, int, list]:  # fmt: skip
    """One pass: kept documents and bytes per split, the number of non-empty documents,
    and (hash, index) of the two lowest-hash train documents."""
    plan = SplitPlan(forced, dict.fromkeys(SPLITS, 0), dict.fromkeys(SPLITS, 0))
    lowest, total = [], 0
    for index, doc, split, text in _labelled(settings, forced, tally):
        total += 1
        plan.cut = plan.cut or doc.part
        if doc.split is None and split == "train":
            lowest = sorted([*lowest, (splits.text_unit(text, settings.seed), index)])[:2]
        if not settings.max_documents or plan.documents[split] < settings.max_documents:
            plan.documents[split] += 1
            plan.bytes[split] += len(text.encode("utf-8"))
    return plan, total, lowest


def plan_splits(settings: Settings, tally: Counter | None = None) -> SplitPlan:
    """First pass: the split of every document. With >= 3 documents and an empty held-out
    split, the train documents with the lowest hashes move there, one each (then a
    second pass counts again; this happens for small corpora only). `tally` counts
    the invalid UTF-8 byte sequences per file."""
    plan, total, lowest = _count(settings, {}, tally)
    if total == 0:
        raise PrepareError(f"--source={settings.source!r} has no non-empty documents")
    forced = splits.forced_moves(plan.documents, total, lowest)
    return _count(settings, forced)[0] if forced else plan


def plan_warnings(settings: Settings, plan: SplitPlan, tally: Counter) -> list[str]:
    """What the first pass found that a user should hear of: input that is not valid
    UTF-8 (files, replaced sequences), held-out splits that are empty or hold a single
    document (and which flag changes that)."""
    out = []
    bad = sorted((f for f, n in tally.items() if n), key=lambda f: -tally[f])
    if bad:
        named = ", ".join(f"{f} ({tally[f]:,})" for f in bad[:3]) + ", ..." * (len(bad) > 3)
        out.append(f"{len(bad)} file(s) are not valid UTF-8 (binary?): {sum(tally.values()):,} "
                   f"invalid byte sequence(s) replaced by U+FFFD: {named}")  # fmt: skip
    total = sum(plan.documents.values())
    if plan.cut:
        return [
            *out,
            f"the source has {total // 3} document(s): each is cut at line ends into "
            "90% train, 5% validation, 5% test; give 3 or more to hold out whole ones",
        ]
    for split in ("validation", "test"):
        count = plan.documents[split]
        if count == 0:
            out.append(
                f"the {split} split is empty: the source has {total} document(s) and a "
                "held-out split needs 3 or more (one .txt file is one document; a .jsonl "
                "has one per line): give more documents, or evaluate on another split"
            )
        elif count == 1:
            out.append(
                f"the {split} split holds a single document ({plan.bytes[split]:,} bytes) "
                f"of {total}: raise --held_out_percent (now {settings.held_out_percent:g}) "
                "or give more documents to hold out more"
            )
    return out
