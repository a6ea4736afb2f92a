"""Where the text comes from: one registry of source kinds, and one resolver of a config.

`SOURCES` holds every kind of source this project reads documents from:

  corpus   a shipped corpus (`corpora.CORPORA`: shakespeare, python_stdlib), read from
           the files of the installed packages
  archive  an archive a system package installs (`archives.ARCHIVES`: linux_source, or a
           selection of its paths, linux_source:Documentation/,-drivers/)
  tfds     a TFDS dataset already on disk as array_record or parquet (`tfds_datasets`);
           never downloaded: a missing dataset fails at once with one line
  files    a glob of local .txt / .jsonl(.gz) / .parquet files (`readers`)

`parse(spec)` names the kind of a `python -m rope_jax.data.prepare --source=SPEC`;
`resolve(config.data)` names what a training config reads, for both ways of reading
it: raw bytes held in memory (`documents`, `token_stream`) and a prepared corpus read
from its shards (`prepared`, which prepares a `data.tokenizer` run on first use).
`read(spec)` and `fingerprint(spec)` are the documents and the file fingerprint of a
`--source`, whatever its kind.

Every failure a user can cause raises `DataSourceError` (a `ValueError`) with a
one-line message naming the field, the value and the fix.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import hashlib
import os
import warnings
from collections.abc import Callable, Iterator

import numpy as np
import tensorflow_datasets as tfds

from rope_jax.data import (
    archives,
    carried,
    corpora,
    multimodal,
    readers,
    shards,
    splits,
    tfds_datasets,
)
from rope_jax.data.byte_ids import EOS_ID
from rope_jax.data.readers import DataSourceError, Doc


def _data_dir(data_config) -> str | None:
    data_dir = data_config.data_dir
    return os.path.expanduser(data_dir) if data_dir else None


def root_dir(data_config) -> str:
    """`data.data_dir`, or the TFDS default data dir: where prepared datasets live."""
    return os.path.expanduser(data_config.data_dir or tfds.core.constants.DATA_DIR)


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


def _file_documents(data_config, split: str) -> list[bytes]:
    """`split`'s documents of the files (`readers.documents`: a .txt file is one, a
    .jsonl line or .parquet row one each), held out by `splits.label`, the rule
    `python -m rope_jax.data.prepare` follows: the same files give the same held-out
    text whatever the tokenizer."""
    pattern = data_config.files
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
    max_documents = int(data_config.max_documents)
    docs = [text.encode("utf-8") for (_, text), s in zip(docs, labels, strict=True) if s == split]
    return docs[:max_documents] if max_documents > 0 else docs


# ------------------------------------------------------------------ TFDS, and corpora


def _builder(data_config) -> tfds.core.DatasetBuilder:
    """The TFDS builder of a shipped corpus (built on first use) or a TFDS dataset."""
    name, data_dir = data_config.name, _data_dir(data_config)
    if name in corpora.CORPORA:
        return corpora.build_corpus(name, data_dir)
    return tfds_datasets.open_tfds(name, data_dir)


def _tfds_documents(data_config, split: str) -> list[bytes]:
    return tfds_datasets.split_documents(_builder(data_config), split, data_config.text_key,
                                         int(data_config.max_documents))  # fmt: skip


def _archive_in_memory(data_config, split: str) -> list[bytes]:
    raise DataSourceError(
        f"data.name={data_config.name!r} is an archive, read from shards only: set "
        "data.tokenizer (e.g. train:8000, or bytes via python -m rope_jax.data.prepare "
        "--tokenizer=bytes and data.name=NAME)"
    )


# --------------------------------------------------------------------------- registry


@dataclasses.dataclass(frozen=True)
class Kind:
    """One kind of source: how to tell a `--source` of it, its documents and files, how
    a config reads it raw, and whether a `data.tokenizer` prepares it on first use."""

    takes: Callable[[str], bool]  # whether a --source / data.name is of this kind
    documents: Callable[[str, str, collections.Counter | None], Iterator[Doc]]
    files: Callable[[str], list[str]]  # what `fingerprint` hashes (path, size, mtime)
    in_memory: Callable[..., list[bytes]]  # (config.data, split) -> UTF-8 documents
    ready: Callable  # (config.data) -> None: built if shipped, else checked usable
    auto_prepared: bool  # a data.tokenizer (not bytes) prepares it on first use


def _others() -> tuple[str, ...]:
    return (*corpora.CORPORA, *archives.ARCHIVES)


# The kinds of source, asked in order: the first that takes a `--source` is its kind
# (`files`, the last, takes any glob). A new kind is one entry here.
SOURCES: dict[str, Kind] = {
    "corpus": Kind(
        takes=lambda spec: spec in corpora.CORPORA,
        documents=lambda spec, text_key, tally: corpora.documents(spec),
        files=corpora.files,
        in_memory=_tfds_documents,
        ready=_builder,
        auto_prepared=True,
    ),
    "archive": Kind(
        takes=lambda spec: archives.selection(spec) is not None,
        documents=lambda spec, text_key, tally: archives.documents(spec, tally),
        files=archives.files,
        in_memory=_archive_in_memory,
        ready=lambda data_config: archives.check(archives.selection(data_config.name).name),
        auto_prepared=True,
    ),
    "tfds": Kind(
        takes=tfds_datasets.is_source,
        documents=lambda spec, text_key, tally: tfds_datasets.documents(spec, text_key),
        files=tfds_datasets.files,
        in_memory=_tfds_documents,
        ready=_builder,
        auto_prepared=False,
    ),
    "files": Kind(
        takes=lambda spec: True,
        documents=lambda spec, text_key, tally: readers.documents(spec, text_key, tally, _others()),
        files=lambda spec: readers.source_files(spec, _others()),
        in_memory=_file_documents,
        ready=lambda data_config: _glob(data_config.files),
        auto_prepared=True,
    ),
}


@dataclasses.dataclass(frozen=True)
class Source:
    """What a config or a `--source` names: `kind` (a key of `SOURCES`, or `prepared`, or
    `multimodal` or `carried`) and `spec` (the `--source` string; the dataset's DIR/NAME
    when prepared or carried; the family's name when multimodal)."""

    kind: str
    spec: str


def parse(spec: str) -> Source:
    """The kind of a `prepare --source`: a shipped corpus, an archive (or a selection of
    its paths), tfds:NAME, else a glob of files."""
    return Source(next(k for k, kind in SOURCES.items() if kind.takes(spec)), spec)


def read(spec: str, text_key: str = "text", tally: collections.Counter | None = None
         ) -> Iterator[Doc]:  # fmt: skip
    """Every document of a `--source`, in a fixed order (files sorted, then line/row).

    `tally` (a Counter) gets, per .txt/.jsonl file that is not valid UTF-8, the number
    of invalid byte sequences replaced by U+FFFD (counted as the documents are read).
    """
    yield from SOURCES[parse(spec).kind].documents(spec, text_key, tally)


def fingerprint(spec: str) -> str:
    """sha256 over (path, size, mtime) of the source files, or the corpus's own files."""
    h = hashlib.sha256()
    for path in SOURCES[parse(spec).kind].files(spec):
        stat = os.stat(path)
        h.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return h.hexdigest()


def is_prepared(path: str) -> bool:
    """A prepared dataset, complete (metadata.json) or being prepared (its staging dir)."""
    return os.path.isfile(os.path.join(path, shards.METADATA)) or os.path.isdir(
        os.path.join(path, ".staging")
    )


def tokenizes(data_config) -> bool:
    """Whether `data.tokenizer` asks for tokens other than the raw bytes of the data."""
    return str(data_config.tokenizer).strip() not in ("", "bytes")


def resolve(data_config) -> Source:
    """The one source `config.data` names.

    `data.files`, when set, is a glob of local files (`files`) and `data.name` is not
    read. Else `data.name` names, asked in this order:
      1. a multimodal family (`multimodal.FAMILIES`: digit_grids, digit_videos);
      1b. a carried corpus <data_dir>/NAME, or the folder NAME (`carried`);
      2. a shipped corpus or an archive when `data.tokenizer` asks for tokens other
         than bytes: prepared on first use into <data_dir>/prepared/;
      3. a prepared dataset <data_dir>/NAME (metadata.json, or one being prepared);
      4. a shipped corpus (`corpus`) or an archive (`archive`), read raw;
      5. else a TFDS dataset on disk under data.data_dir (`tfds`, the bare name).
    """
    if data_config.files:
        return Source("files", data_config.files)
    name = data_config.name
    if not name:
        raise DataSourceError("data.name is empty and data.files is empty: set one of them")
    if name in multimodal.FAMILIES:
        return Source("multimodal", name)
    path = os.path.join(root_dir(data_config), os.path.expanduser(name))
    if carried.is_carried(path):
        return Source("carried", path)
    own = parse(name) if not tfds_datasets.is_source(name) else None
    own = own if own is not None and own.kind != "files" else None
    if own is not None and tokenizes(data_config):
        return own
    path = os.path.join(root_dir(data_config), name)
    if is_prepared(path):
        return Source("prepared", path)
    return own or Source("tfds", name)


# ----------------------------------------------------------------------------- public


def _kind(data_config) -> Kind:
    source = resolve(data_config)
    if source.kind not in SOURCES:
        raise DataSourceError(f"{describe(data_config)} is a {source.kind} dataset "
                              f"({source.spec}), not text read raw")  # fmt: skip
    return SOURCES[source.kind]


def documents(data_config, split: str) -> list[bytes]:
    """The UTF-8 documents of one split, in a deterministic order (raw text in memory)."""
    return _kind(data_config).in_memory(data_config, split)


def prepare(data_config) -> None:
    """Builds a shipped text corpus if needed; checks that any other source is usable."""
    _kind(data_config).ready(data_config)


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
