"""TFDS datasets already on disk in a random-access format (array_record or parquet).

Opened with `download=False` semantics: nothing here can start a download, and a
missing dataset fails at once with one line. Two ways in: `data.name=NAME` reads a
split into memory (`split_documents`, under `data.data_dir`); `prepare --source=tfds:NAME`
reads every split (`documents`, under TFDS_DATA_DIR or ~/tensorflow_datasets), keeping
validation/test when the dataset has them.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator

import tensorflow_datasets as tfds
from tensorflow_datasets.core import file_adapters
from tensorflow_datasets.core.registered import DatasetNotFoundError

from rope_jax.data import corpora
from rope_jax.data.readers import DataSourceError, Doc, PrepareError

PREFIX = "tfds:"  # `--source=tfds:NAME`

# TFDS file formats that support random access (and so `as_data_source`).
_RANDOM_ACCESS = (file_adapters.FileFormat.ARRAY_RECORD, file_adapters.FileFormat.PARQUET)


def shown_dir(data_dir: str | None) -> str:
    return data_dir or f"{tfds.core.constants.DATA_DIR} (the TFDS default)"


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
            f"data.data_dir={shown_dir(data_dir)}); downloads are disabled here: prepare "
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


def text(example, text_key: str) -> str:
    """The text under `text_key` ("a/b" for nested) of a TFDS example, as str."""
    value = example
    for key in text_key.split("/"):
        value = value[key]
    return value if isinstance(value, str) else bytes(value).decode("utf-8", errors="replace")


def split_documents(builder, split: str, text_key: str, max_documents: int) -> list[bytes]:
    """The UTF-8 documents of one split of an opened builder (the first `max_documents`;
    0 = all)."""
    available = list(builder.info.splits)
    if split.split("[")[0] not in available:
        raise DataSourceError(
            f"split {split!r} is not in TFDS dataset {builder.name!r}; available: {available}"
        )
    features = builder.info.features
    if text_key.split("/")[0] not in features:
        raise DataSourceError(
            f"data.text_key={text_key!r} is not a feature of {builder.name!r}; "
            f"features: {sorted(features)}"
        )
    source = builder.as_data_source(split=split)
    count = len(source) if max_documents <= 0 else min(len(source), max_documents)
    return [text(source[i], text_key).encode("utf-8") for i in range(count)]


# ------------------------------------------------------------------- prepare --source


def is_source(source: str) -> bool:
    """Whether a `--source` names a TFDS dataset (tfds:NAME)."""
    return source.startswith(PREFIX)


def name_of(source: str) -> str:
    name = source[len(PREFIX) :]
    if not name:
        raise PrepareError(f"--source={source!r} names no TFDS dataset (tfds:NAME)")
    return name


def _builder(source: str):
    name = name_of(source)
    try:
        return open_tfds(name, os.environ.get("TFDS_DATA_DIR") or None)
    except ValueError as e:
        raise PrepareError(f"--source=tfds:{name}: {e}") from None


def documents(source: str, text_key: str = "text") -> Iterator[Doc]:
    """Documents of every split; validation/test keep their split when the dataset has
    them (then its other splits are train), else the hash decides."""
    builder = _builder(source)
    name = name_of(source)
    names = list(builder.info.splits)
    features = builder.info.features
    if text_key.split("/")[0] not in features:
        raise PrepareError(
            f"--source=tfds:{name}: no feature {text_key!r} (features: "
            f"{', '.join(sorted(features))}); set --text_key"
        )
    held_out = any(s in ("validation", "test") for s in names)
    for split in sorted(names):
        fixed = (split if split in ("validation", "test") else "train") if held_out else None
        data = builder.as_data_source(split=split)
        for i in range(len(data)):
            yield Doc(f"tfds:{name}/{split}[{i}]", fixed,
                      lambda src=data, i=i: text(src[i], text_key))  # fmt: skip


def files(source: str) -> list[str]:
    """Every file of the dataset's directory, sorted."""
    return sorted(glob.glob(os.path.join(_builder(source).data_dir, "*")))
