"""Where the text comes from: a `data_config` and a split name -> one token stream.

Three kinds of source, chosen by the config (see `rope_jax.data.default_config`):

* `data.files` non-empty: local .txt / .jsonl / .parquet files matched by a glob,
  held out document by document (`splits.label`, the rule `prepare` follows);
* `data.name` in `corpora.CORPORA` (`shakespeare`, `python_stdlib`): built into
  `data.data_dir` on first use;
* any other `data.name`: a TFDS dataset that must already be on disk as
  array_record (or parquet). It is opened with `download=False` semantics: nothing
  here can start a download, and a missing dataset fails at once with one line.

Every failure a user can cause raises `DataSourceError` (a `ValueError`) with a
one-line message naming the field, the value and the fix.
"""

from __future__ import annotations

import collections
import glob
import os
import warnings

import numpy as np
import tensorflow_datasets as tfds
from tensorflow_datasets.core import file_adapters
from tensorflow_datasets.core.registered import DatasetNotFoundError

from rope_jax.data import corpora, readers, splits
from rope_jax.data.tokenizer import EOS_ID

# TFDS file formats that support random access (and so `as_data_source`).
_RANDOM_ACCESS = (file_adapters.FileFormat.ARRAY_RECORD, file_adapters.FileFormat.PARQUET)


class DataSourceError(ValueError):
    """A data source that cannot be used as configured (message is one line)."""


def _data_dir(data_config) -> str | None:
    data_dir = data_config.data_dir
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


_WARNED: set[str] = set()  # files already reported as not UTF-8


def _file_documents(pattern: str, split: str) -> list[bytes]:
    """`split`'s documents of the files (`readers.documents`: a .txt file is one, a
    .jsonl line or .parquet row one each), held out by `splits.label`, the rule
    `python -m rope_jax.data.prepare` follows: the same files give the same held-out
    text whatever the tokenizer."""
    if split not in splits.SPLITS:
        raise DataSourceError(f"split={split!r} is not one of {splits.SPLITS} for data.files")
    _glob(pattern)  # nothing matched: the data.files message
    tally = collections.Counter()  # invalid UTF-8 sequences replaced, per file
    try:
        docs = splits.cut_small(readers.documents(pattern, tally=tally))
        docs = [(doc.split, doc.read()) for doc in docs]
    except readers.PrepareError as e:
        raise DataSourceError(f"data.files={pattern!r}: {e}") from None
    for path in sorted(f for f, n in tally.items() if n and f not in _WARNED):
        _WARNED.add(path)
        warnings.warn(f"{path} is not valid UTF-8 (binary?): {tally[path]} invalid byte "
                      "sequence(s) replaced by U+FFFD", stacklevel=2)  # fmt: skip
    docs = [(fixed, text) for fixed, text in docs if text]
    labels = splits.label(docs)
    return [text.encode("utf-8") for (_, text), s in zip(docs, labels, strict=True) if s == split]


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
    name = data_config.name
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
    text_key = data_config.text_key
    features = builder.info.features
    if text_key.split("/")[0] not in features:
        raise DataSourceError(
            f"data.text_key={text_key!r} is not a feature of {builder.name!r}; "
            f"features: {sorted(features)}"
        )
    source = builder.as_data_source(split=split)
    count = len(source) if max_documents <= 0 else min(len(source), max_documents)
    return [readers.tfds_text(source[i], text_key).encode("utf-8") for i in range(count)]


# ----------------------------------------------------------------------------- public


def documents(data_config, split: str) -> list[bytes]:
    """The UTF-8 documents of one split, in a deterministic order."""
    files = data_config.files
    max_documents = int(data_config.max_documents)
    if files:
        docs = _file_documents(files, split)
        return docs[:max_documents] if max_documents > 0 else docs
    return _tfds_documents(data_config, split, max_documents)


def prepare(data_config) -> None:
    """Builds a shipped text corpus if needed; checks that any other source is usable."""
    files = data_config.files
    if files:
        _glob(files)
    else:
        _builder(data_config)


def describe(data_config) -> str:
    """Short name of the source for messages: `files='...'` or `name='...'`."""
    files = data_config.files
    return f"data.files={files!r}" if files else f"data.name={data_config.name!r}"


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
    key = tuple(str(data_config[k]) for k in fields) + (split,)
    if key not in _STREAMS:
        docs = documents(data_config, split)
        if not docs:
            raise DataSourceError(f"split {split!r} of {describe(data_config)} has no documents")
        while len(_STREAMS) >= _MAX_STREAMS:
            _STREAMS.pop(next(iter(_STREAMS)))
        _STREAMS[key] = _concat(docs)
    return _STREAMS[key]
