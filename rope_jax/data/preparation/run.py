"""The preparation itself: plan, tokenizer, second pass through the workers into one shard
writer per split, metadata written last.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys
from collections import Counter, deque
from collections.abc import Iterator

import numpy as np

from rope_jax.data import shards, tokenizers
from rope_jax.data.preparation.encode import InProcess, Pool, byte_table, make_tokenizer
from rope_jax.data.preparation.plan import (
    SPLITS,
    Settings,
    SplitPlan,
    assigned,
    plan_splits,
    plan_warnings,
)
from rope_jax.data.preparation.progress import Progress
from rope_jax.data.preparation.resume import (
    SETTINGS_FILE,
    STAGING,
    check_existing,
    entry_path,
    resume_split,
    settings_record,
    write_json,
)
from rope_jax.data.preparation.space import OutOfSpace, Space, out_of_space
from rope_jax.data.readers import PrepareError

CHUNK_DOCUMENTS, CHUNK_BYTES = 256, 1 << 20  # one task for a worker


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
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        if not out_of_space(e):
            raise PrepareError(f"--data_dir={data_dir}: cannot create {out}: "
                               f"{e.strerror or e}") from None  # fmt: skip
    try:
        with _one_at_a_time(out, say):
            try:
                return _prepare(settings, out, space, say, workers, command, progress)
            except BaseException:
                _discard_unstarted(out)
                raise
    except (OSError, RuntimeError) as e:
        if not out_of_space(e):
            raise
        where = getattr(e, "filename", None) or out
        free = shutil.disk_usage(os.path.dirname(out) if not os.path.isdir(out) else out).free
        raise OutOfSpace(space.message(f"a write failed (No space left on device: {where})",
                                       free)) from None  # fmt: skip


@contextlib.contextmanager
def _one_at_a_time(out: str, say):
    """Holds DIR/.NAME.lock while DIR/NAME is prepared: a second preparation of it (the
    same command twice, two runs that auto-prepare one corpus) waits for the first,
    then finds it done, instead of writing into the same staging files. The holder
    removes the file before it lets go; a waiter that then holds a removed file's lock
    opens the path again (`_lock`)."""
    path = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.lock")
    try:
        f = _lock(path, say, out)
    except OSError:  # a read-only data dir: nothing can be written there, by anyone
        yield
        return
    with f:
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.remove(path)
            fcntl.flock(f, fcntl.LOCK_UN)


def _lock(path: str, say, out: str):
    """The open lock file at `path`, locked (waiting, with a line, while another process
    holds it), and still the file of that name."""
    said = False
    while True:
        f = open(path, "a")  # noqa: SIM115  (the caller closes it)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not said:
                say(f"prepare: another process is preparing {out}; waiting for it ({path})")
                said = True
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                return f
        except FileNotFoundError:  # removed by the holder we waited for
            pass
        f.close()


def _discard_unstarted(out: str) -> None:
    """After a failure before anything worth resuming was written (a tokenizer that
    does not load, a source with no documents): DIR/NAME holds only the staging
    settings; they are removed, and DIR/NAME with them."""
    staging = os.path.join(out, STAGING)
    try:
        if set(os.listdir(out)) <= {STAGING} and set(os.listdir(staging)) <= {SETTINGS_FILE}:
            shutil.rmtree(staging)
            os.rmdir(out)
    except OSError:  # not there, or not ours to remove
        pass


def _prepare(settings, out, space, say, workers, command, progress) -> dict:
    os.makedirs(out, exist_ok=True)
    record = settings_record(settings)
    meta = check_existing(out, record, say)
    if meta is not None:
        say(f"prepare: {out} is already prepared with these settings (shards verified)")
        return meta
    staging = os.path.join(out, STAGING)
    os.makedirs(staging, exist_ok=True)
    write_json(os.path.join(staging, SETTINGS_FILE), record)

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
    if settings.max_documents < 0:
        raise PrepareError(f"--max_documents={settings.max_documents} must be >= 0 (0: all)")
    if settings.shard_tokens < 1 or settings.record_tokens < 0:
        raise PrepareError("--shard_tokens must be >= 1 and --record_tokens >= 0")
    if settings.compression not in shards.COMPRESSION:
        raise PrepareError(f"--compression must be one of {', '.join(shards.COMPRESSION)}")
    if settings.byte_counts not in ("auto", "exact", "proportional"):
        raise PrepareError("--byte_counts must be auto, exact or proportional")
    if not 0 < settings.held_out_percent <= 50:
        raise PrepareError(f"--held_out_percent={settings.held_out_percent:g} must be in (0, 50]")
    kind, value = tokenizers.parse_spec(settings.tokenizer)
    if kind == "path" and not os.path.exists(value):  # before the output directory is made
        raise PrepareError(f"tokenizer file {value} does not exist")


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

    pool = InProcess(tokenizer_dir, exact) if workers == 1 else Pool(workers, tokenizer_dir, exact)
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
    write_json(entry_path(staging, split, len(entries[split])), entry)
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
    write_json(os.path.join(out, shards.METADATA), meta)
    shutil.rmtree(staging, ignore_errors=True)
