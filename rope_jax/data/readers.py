"""The documents of local files, one reader per file kind; the data layer's two errors.

  .txt                one document per file
  .jsonl / .jsonl.gz  one per line, the text under `text_key` ("a/b" for nested keys)
  .parquet            one per row, column `text_key` (needs pyarrow)

The other kinds of source (a shipped corpus, an archive, TFDS) read their documents in
their own modules; `sources` holds the registry of every kind. Documents come in a
fixed order (files sorted, then line/row), each a `Doc` whose text is read on demand;
every bad input is a one-line `PrepareError` naming the file and line.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
from collections import Counter
from collections.abc import Callable, Iterator


class PrepareError(ValueError):
    """Bad input or settings (message is one line)."""


class DataSourceError(ValueError):
    """A data source that cannot be used as configured (message is one line)."""


@dataclasses.dataclass(frozen=True)
class Doc:
    """One document: `key` for messages, a fixed `split` (shipped corpora) or None;
    `part`: a line-cut part of a document of a corpus too small to split by document."""

    key: str
    split: str | None
    read: Callable[[], str]
    part: bool = False


# ----------------------------------------------------------------------------- sources


def source_files(pattern: str, others: tuple[str, ...] = ()) -> list[str]:
    """Sorted files matched by a glob; PrepareError if none (naming the `others` a
    --source may name instead), or of an unknown kind."""
    paths = sorted(
        p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p)
    )
    if not paths:
        raise PrepareError(
            f"--source={pattern!r} matched no files and is not a shipped corpus "
            f"({', '.join(others)})"
        )
    for path in paths:
        if _file_kind(path) is None:
            raise PrepareError(
                f"{path}: unsupported file type; --source takes .txt, .jsonl, "
                ".jsonl.gz and .parquet files"
            )
    return paths


def _file_kind(path: str) -> str | None:
    for suffix, kind in (
        (".txt", "txt"),
        (".jsonl", "jsonl"),
        (".jsonl.gz", "jsonl"),
        (".parquet", "parquet"),
    ):
        if path.endswith(suffix):
            return kind
    return None


def _value(record: dict, text_key: str):
    value = record
    for key in text_key.split("/"):
        if not isinstance(value, dict) or key not in value:
            return None, sorted(value) if isinstance(value, dict) else []
        value = value[key]
    return value, None


def decode(raw: bytes, key: str, tally: Counter | None = None) -> str:
    """UTF-8 text of `raw`, invalid byte sequences replaced by U+FFFD; their count is
    added to `tally[key]` (binary input read as text)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
    if tally is not None:
        tally[key] += text.count("\ufffd") - raw.count("\ufffd".encode())
    return text


def _jsonl_docs(path: str, text_key: str, tally: Counter | None = None) -> Iterator[Doc]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            line = decode(raw, path, tally)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise PrepareError(f"{path}:{number}: not valid JSON ({e})") from None
            value, keys = _value(record, text_key)
            if keys is not None:
                raise PrepareError(
                    f"{path}:{number}: no key {text_key!r} (keys: "
                    f"{', '.join(keys) or 'none'}); set --text_key"
                )
            if not isinstance(value, str):
                raise PrepareError(
                    f"{path}:{number}: {text_key!r} is a {type(value).__name__}, not a string"
                )
            yield Doc(f"{path}:{number}", None, lambda v=value: v)


def _parquet_docs(path: str, text_key: str) -> Iterator[Doc]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PrepareError(f"{path}: reading .parquet needs pyarrow: pip install pyarrow") from None
    try:
        file = pq.ParquetFile(path)
    except Exception as e:
        raise PrepareError(f"{path}: not a readable parquet file ({type(e).__name__})") from None
    column = text_key.split("/")[0]
    if column not in file.schema_arrow.names:
        raise PrepareError(
            f"{path}: no column {column!r} (columns: "
            f"{', '.join(file.schema_arrow.names)}); set --text_key"
        )
    row = 0
    for batch in file.iter_batches(columns=[column], batch_size=1024):
        for value in batch.column(0).to_pylist():
            row += 1
            for key in text_key.split("/")[1:]:
                value = value.get(key) if isinstance(value, dict) else None
            if not isinstance(value, str):
                raise PrepareError(f"{path}: row {row}: {text_key!r} is not a string")
            yield Doc(f"{path}:row {row}", None, lambda v=value: v)


def _txt_doc(path: str, tally: Counter | None = None) -> Doc:
    def read() -> str:
        with open(path, "rb") as f:
            return decode(f.read(), path, tally)

    return Doc(path, None, read)


def documents(
    pattern: str, text_key: str = "text", tally: Counter | None = None, others: tuple[str, ...] = ()
) -> Iterator[Doc]:
    """Every document of the files a glob matches, in a fixed order (files sorted, then
    line/row).

    `tally` (a Counter) gets, per .txt/.jsonl file that is not valid UTF-8, the number
    of invalid byte sequences replaced by U+FFFD (counted as the documents are read).
    """
    for path in source_files(pattern, others):
        kind = _file_kind(path)
        if kind == "txt":
            yield _txt_doc(path, tally)
        elif kind == "jsonl":
            yield from _jsonl_docs(path, text_key, tally)
        else:
            yield from _parquet_docs(path, text_key)
