"""Where the text comes from: a `data_config` and a split name -> one token stream.

Three kinds of source, chosen by the config (see `rope_jax.data.default_config`):

* `data.files` non-empty: local text files matched by a glob, split by file;
* `data.name` in `corpora.CORPORA` (`shakespeare`, `python_stdlib`): built into
  `data.data_dir` on first use;
* any other `data.name`: a TFDS dataset that must already be on disk as
  array_record (or parquet). It is opened with `download=False` semantics: nothing
  here can start a download, and a missing dataset fails at once with one line.

Every failure a user can cause raises `DataSourceError` (a `ValueError`) with a
one-line message naming the field, the value and the fix.
"""

from __future__ import annotations

import glob
import hashlib
import os
import warnings

import numpy as np
import tensorflow_datasets as tfds
from tensorflow_datasets.core import file_adapters
from tensorflow_datasets.core.registered import DatasetNotFoundError

from rope_jax.data import corpora
from rope_jax.data.tokenizer import EOS_ID

# TFDS file formats that support random access (and so `as_data_source`).
_RANDOM_ACCESS = (file_adapters.FileFormat.ARRAY_RECORD, file_adapters.FileFormat.PARQUET)


class DataSourceError(ValueError):
    """A data source that cannot be used as configured (message is one line)."""


def _field(data_config, key: str, default):
    value = data_config.get(key, default)
    return default if value is None else value


def _data_dir(data_config) -> str | None:
    data_dir = _field(data_config, "data_dir", "")
    return os.path.expanduser(data_dir) if data_dir else None


def _shown_dir(data_dir: str | None) -> str:
    return data_dir or f"{tfds.core.constants.DATA_DIR} (the TFDS default)"


# ------------------------------------------------------------------------------ files


def _glob(pattern: str) -> list[str]:
    paths = glob.glob(os.path.expanduser(pattern), recursive=True)
    paths = sorted(p for p in paths if os.path.isfile(p))
    if not paths:
        raise DataSourceError(
            f"data.files={pattern!r} matched no files; give a glob of text files "
            "(e.g. '~/corpus/**/*.txt') or set data.files='' to use data.name"
        )
    return paths


def _file_split_assignment(paths: list[str]) -> dict[str, str]:
    """File -> split: the 5% (at least one) files with the lowest path hash go to
    validation, the next 5% to test, the rest to train. Deterministic."""
    root = os.path.commonpath(paths) if len(paths) > 1 else os.path.dirname(paths[0])
    rel = {p: os.path.relpath(p, root) for p in paths}
    order = sorted(paths, key=lambda p: (hashlib.md5(rel[p].encode()).hexdigest(), p))
    k = max(1, round(0.05 * len(paths)))
    return {
        p: "validation" if i < k else "test" if i < 2 * k else "train" for i, p in enumerate(order)
    }


def _cut_at_newline(data: bytes, fraction: float) -> int:
    cut = int(len(data) * fraction)
    newline = data.find(b"\n", cut)
    return len(data) if newline < 0 else newline + 1


def _file_documents(pattern: str, split: str) -> list[bytes]:
    """With >= 3 files the split is by whole file; with 1 or 2 files every file is cut
    (at line ends) into its first 90% for train, next 5% validation, last 5% test."""
    if split not in corpora.SPLITS:
        raise DataSourceError(f"split={split!r} is not one of {corpora.SPLITS} for data.files")
    paths = _glob(pattern)
    if len(paths) >= 3:
        assignment = _file_split_assignment(paths)
        return [_read_bytes(p) for p in paths if assignment[p] == split]
    documents = []
    for path in paths:
        data = _read_bytes(path)
        a, b = _cut_at_newline(data, 0.90), _cut_at_newline(data, 0.95)
        part = {"train": data[:a], "validation": data[a:b], "test": data[b:]}[split]
        if part:
            documents.append(part)
    return documents


_WARNED: set[str] = set()  # files already reported as not UTF-8


def _read_bytes(path: str) -> bytes:
    """File contents as UTF-8 (invalid bytes replaced, so decode() round-trips); a file
    that is not valid UTF-8 (binary) is a warning, once, with the count of replaced bytes."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8").encode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
    replaced = text.count("\ufffd") - raw.count("\ufffd".encode())
    if path not in _WARNED:
        _WARNED.add(path)
        warnings.warn(f"{path} is not valid UTF-8 (binary?): {replaced:,} invalid byte "
                      "sequence(s) replaced by U+FFFD", stacklevel=2)  # fmt: skip
    return text.encode("utf-8")


# ------------------------------------------------------------------------------- TFDS


def open_tfds(name: str, data_dir: str | None) -> tfds.core.DatasetBuilder:
    """A TFDS builder whose data is already on disk in a random-access format.

    Never downloads: unknown names, missing data and TFRecord-only data each raise
    `DataSourceError` in milliseconds.
    """
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except DatasetNotFoundError:
        raise DataSourceError(
            f"data.name={name!r} is neither a shipped corpus ({', '.join(corpora.CORPORA)}) "
            "nor a TFDS catalogue dataset; check the name or set data.files to a glob "
            "of local text files"
        ) from None
    except Exception as e:  # any failure to construct the builder, as one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DataSourceError(
            f"cannot open TFDS dataset data.name={name!r}: {type(e).__name__}: {first}"
        ) from None
    if not builder.is_prepared():
        raise DataSourceError(
            f"TFDS dataset {name!r} is not on disk (looked in {builder.data_dir}, "
            f"data.data_dir={_shown_dir(data_dir)}); downloads are disabled here: prepare "
            f"it on a machine with network via tfds.builder({name!r}, data_dir=...)"
            ".download_and_prepare(file_format='array_record') and copy it into "
            "data.data_dir, or set data.files to local text files"
        )
    if builder.info.file_format not in _RANDOM_ACCESS:
        raise DataSourceError(
            f"TFDS dataset {name!r} in {builder.data_dir} is stored as "
            f"{builder.info.file_format.value}, which has no random access; prepare it "
            "again with download_and_prepare(file_format='array_record')"
        )
    return builder


def _builder(data_config) -> tfds.core.DatasetBuilder:
    name = _field(data_config, "name", "")
    if not name:
        raise DataSourceError("data.name is empty and data.files is empty: set one of them")
    data_dir = _data_dir(data_config)
    if name in corpora.CORPORA:
        return corpora.build_corpus(name, data_dir)
    return open_tfds(name, data_dir)


def _tfds_documents(data_config, split: str, max_documents: int) -> list[bytes]:
    builder = _builder(data_config)
    available = list(builder.info.splits)
    if split.split("[")[0] not in available:
        raise DataSourceError(
            f"split {split!r} is not in TFDS dataset {builder.name!r}; available: {available}"
        )
    text_key = _field(data_config, "text_key", "text")
    features = builder.info.features
    if text_key.split("/")[0] not in features:
        raise DataSourceError(
            f"data.text_key={text_key!r} is not a feature of {builder.name!r}; "
            f"features: {sorted(features)}"
        )
    source = builder.as_data_source(split=split)
    count = len(source) if max_documents <= 0 else min(len(source), max_documents)
    documents = []
    for i in range(count):
        value = source[i]
        for key in text_key.split("/"):
            value = value[key]
        documents.append(value.encode("utf-8") if isinstance(value, str) else bytes(value))
    return documents


# ----------------------------------------------------------------------------- public


def documents(data_config, split: str) -> list[bytes]:
    """The UTF-8 documents of one split, in a deterministic order."""
    files = _field(data_config, "files", "")
    max_documents = int(_field(data_config, "max_documents", 0))
    if files:
        docs = _file_documents(files, split)
        return docs[:max_documents] if max_documents > 0 else docs
    return _tfds_documents(data_config, split, max_documents)


def prepare(data_config) -> None:
    """Builds a shipped text corpus if needed; checks that any other source is usable."""
    files = _field(data_config, "files", "")
    if files:
        _glob(files)
    else:
        _builder(data_config)


def describe(data_config) -> str:
    """Short name of the source for messages: `files='...'` or `name='...'`."""
    files = _field(data_config, "files", "")
    return f"data.files={files!r}" if files else f"data.name={_field(data_config, 'name', '')!r}"


def _concat(docs: list[bytes]) -> np.ndarray:
    tokens = np.empty(sum(len(d) for d in docs) + len(docs), dtype=np.uint16)
    at = 0
    for doc in docs:
        tokens[at : at + len(doc)] = np.frombuffer(doc, dtype=np.uint8)
        tokens[at + len(doc)] = EOS_ID
        at += len(doc) + 1
    tokens.flags.writeable = False
    return tokens


_STREAMS: dict[tuple, np.ndarray] = {}  # (source fields..., split) -> tokens
_MAX_STREAMS = 8


def token_stream(data_config, split: str) -> np.ndarray:
    """Byte ids of every document of `split`, each followed by EOS: uint16 [N].

    Kept in memory per (source, split) for the life of the process; read-only.
    """
    fields = ("name", "files", "data_dir", "text_key", "max_documents")
    key = tuple(str(_field(data_config, k, "")) for k in fields) + (split,)
    if key not in _STREAMS:
        docs = documents(data_config, split)
        if not docs:
            raise DataSourceError(f"split {split!r} of {describe(data_config)} has no documents")
        while len(_STREAMS) >= _MAX_STREAMS:
            _STREAMS.pop(next(iter(_STREAMS)))
        _STREAMS[key] = _concat(docs)
    return _STREAMS[key]
