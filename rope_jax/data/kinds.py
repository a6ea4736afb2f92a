"""Which kind of data a config names, decided in one place, and what follows from it.

`kind(config.data)` is the one switch between the two kinds of input this project
trains on:

  Text        a byte-level corpus (shipped, TFDS, or local files) held in memory:
              next-token windows; one position axis.
  Prepared    a corpus prepared by `python -m rope_jax.data.prepare` (or prepared on
              first use: a shipped corpus or `data.files` with a `data.tokenizer`),
              read window by window from its shards, with the dataset's tokenizer.
  Carried     a prepared corpus's ids packed to travel (`data.carried`), held in
              memory: the same windows, without the tokenizer.
  Multimodal  question-answer sequences over digit grids (`multimodal.FAMILIES`):
              batches add `patches`, `is_patch`, `positions` (placed by the layout
              scheme `data.scheme`) and `task`; 2 or 3 position axes.

Text, Prepared and Carried batches are alike: inputs, targets, weights; `target_bytes` in
evaluation (bits per byte); segments and positions with `data.packing='documents'`.
Every kind has a `tokenizer()` and its `vocab_size`, which the model's must equal.

Everything else (the harness, the iterators, preparation) asks the kind object.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import io
import os
import re

import ml_collections
import numpy as np

from rope_jax import layouts
from rope_jax.data import (
    carried,
    digits,
    multimodal,
    packing,
    passkey,
    pipeline,
    prepared,
    sources,
    synthetic,
    tokenizers,
)


class Text:
    """A text corpus: one position axis, no tasks, windows of `data.seq_len` tokens."""

    name = "text"

    def __init__(self, data_config):
        self.config = data_config

    num_axes = 1
    task_names = ()

    def tokenizer(self) -> tokenizers.Tokenizer:
        return tokenizers.ByteTokenizer()

    @property
    def vocab_size(self) -> int:
        return tokenizers.ByteTokenizer.vocab_size

    def batch_fields(self) -> dict:
        return packing.batch_fields(self.config)

    def check(self, model_config, eval_splits=()) -> None:
        """Only the packing mode and the passkey rate: the corpus is read later."""
        packing.check(self.config, text=True)
        passkey.check(self.config, byte_text=True)
        synthetic.check(self.config)

    def prepare(self) -> None:
        sources.prepare(self.config)

    def train_iterator(self, *, seed, batch_size, shard):
        return pipeline.text_train_iterator(
            self.config, seed=seed, batch_size=batch_size, shard=shard
        )

    def eval_iterator(self, *, split, batch_size, seq_len, num_batches, shard, spread=False):
        seq_len = _positive_int(seq_len or self.config.seq_len, "seq_len")
        if num_batches is not None:
            num_batches = _positive_int(num_batches, "num_batches")
        return self._eval_batches(split=split, batch_size=batch_size, seq_len=seq_len,
                                  num_batches=num_batches, shard=shard, spread=spread)  # fmt: skip

    def _eval_batches(self, **kw):
        return pipeline.text_eval_iterator(self.config, **kw)


class Prepared(Text):
    """A prepared corpus at `path` (DIR/NAME): shards read by random access."""

    name = "prepared"

    def __init__(self, data_config, path: str):
        self.config, self.path = data_config, path

    def tokenizer(self) -> tokenizers.Tokenizer:
        return prepared.tokenizer(self.path)

    @property
    def vocab_size(self) -> int:
        return int(prepared.metadata(self.path)["tokenizer"]["vocab_size"])

    def check(self, model_config, eval_splits=()) -> None:
        """Packing, and for a dataset already prepared its tokenizer and splits."""
        packing.check(self.config, text=True)
        passkey.check(self.config, byte_text=False)
        synthetic.check(self.config)
        if prepared.auto_source(self.config) is None:
            prepared.check_tokenizer(self.config, self.path)
            c = self.config
            prepared.check_splits(self.path, [c.train_split,
                                              c.eval_split,
                                              *eval_splits])  # fmt: skip

    def prepare(self) -> None:
        prepared.ensure_prepared(self.config)

    def train_iterator(self, *, seed, batch_size, shard):
        return prepared.train_iterator(self.config, self.path, seed=seed,
                                       batch_size=batch_size, shard=shard)  # fmt: skip

    def _eval_batches(self, **kw):
        return prepared.eval_iterator(self.config, self.path, **kw)


class Carried(Text):
    """A carried corpus at `path` (`data.carried`): token ids in memory, no tokenizer."""

    name = "carried"

    def __init__(self, data_config, path: str):
        self.config, self.path = data_config, path

    def tokenizer(self) -> tokenizers.Tokenizer:
        raise ValueError(f"{sources.describe(self.config)} is a carried corpus: token ids "
                         "without their tokenizer (use the prepared dataset it was packed "
                         "from)")  # fmt: skip

    @property
    def vocab_size(self) -> int:
        return int(carried.metadata(self.path)["vocab_size"])

    def check(self, model_config, eval_splits=()) -> None:
        """Packing; no passkey or RULER windows (they are made from text)."""
        packing.check(self.config, text=True)
        passkey.check(self.config, byte_text=False)
        synthetic.check(self.config)
        if self.config.synthetic_rate:
            raise ValueError(f"data.synthetic_rate={self.config.synthetic_rate}: RULER's tasks "
                             "are made from text; a carried corpus holds only ids")  # fmt: skip

    def prepare(self) -> None:
        """Nothing to build: the folder holds every split it will ever have."""

    def _source(self, split: str) -> pipeline.TokenArray:
        return pipeline.TokenArray(*carried.arrays(self.path, split))

    def train_iterator(self, *, seed, batch_size, shard):
        """Shuffled full windows of the carried training ids, a new permutation per epoch."""
        return pipeline.stream_train_iterator(
            self.config, self._source(self.config.train_split), self.path, seed=seed,
            batch_size=batch_size, shard=shard,
        )  # fmt: skip

    def _eval_batches(self, *, split, **kw):
        """Every window of a carried split once, in order, with each target's bytes."""
        return pipeline.stream_eval_iterator(self.config, self._source(split), **kw)


class Multimodal:
    """Digit-grid questions (`multimodal.FAMILIES`): A from the family, tasks, patches."""

    name = "multimodal"

    def __init__(self, data_config):
        self.config = data_config
        self.family = multimodal.family(data_config)
        self.num_axes = self.family.num_axes

    @property
    def task_names(self) -> tuple:
        return multimodal.tasks(self.config)

    def tokenizer(self) -> tokenizers.Tokenizer:
        return tokenizers.ByteTokenizer()

    vocab_size = tokenizers.ByteTokenizer.vocab_size

    def batch_fields(self) -> dict:
        return multimodal.batch_fields(self.config)

    def check(self, model_config, eval_splits=()) -> None:
        packing.check(self.config, text=False)
        passkey.check(self.config, byte_text=False)
        if self.config.synthetic_rate:
            raise ValueError(f"data.synthetic_rate={self.config.synthetic_rate}: RULER's tasks are "
                             "text; this data is multimodal (use a text corpus)")  # fmt: skip
        multimodal.check_config(self.config, model_config, eval_splits)

    def prepare(self) -> None:
        digits.build(multimodal.data_dir(self.config))

    def train_iterator(self, *, seed, batch_size, shard):
        return multimodal.make_train_iterator(
            self.config, seed=seed, batch_size=batch_size, shard=shard
        )

    def eval_iterator(self, *, split, batch_size, seq_len, num_batches, shard, spread=False):
        del spread  # a split of questions: its first examples (checks refuse spread)
        seq_len = _positive_int(seq_len or multimodal.eval_seq_len(self.config), "seq_len")
        config = ml_collections.ConfigDict(self.config.to_dict())  # a mutable copy
        config.seq_len = seq_len
        global_batch = batch_size * shard[1]  # num_batches counts global batches
        num_examples = (
            _positive_int(num_batches, "num_batches") * global_batch if num_batches else 512
        )
        return multimodal.make_eval_iterator(
            config, split=split, batch_size=batch_size, num_examples=num_examples, shard=shard
        )


def kind(data_config) -> Text | Prepared | Carried | Multimodal:
    """The kind of data `config.data` names: a multimodal family, a prepared corpus (named,
    or a raw one with a `data.tokenizer`), or else raw byte-level text. Decided once per
    resolved (frozen) config: its file-system probe is not repeated."""
    if isinstance(data_config, ml_collections.FrozenConfigDict):
        return _kind_of_resolved(data_config)
    return _kind(data_config)


@functools.lru_cache(maxsize=16)
def _kind_of_resolved(data_config) -> Text | Prepared | Carried | Multimodal:
    return _kind(data_config)


def _kind(data_config) -> Text | Prepared | Carried | Multimodal:
    for of in KINDS:
        found = of(data_config)
        if found is not None:
            return found
    raise AssertionError("unreachable: Text, the last kind, takes every config")


def _multimodal(data_config) -> Multimodal | None:
    """A digit-grid family named by `data.name` (not `data.files`)."""
    if not data_config.name or sources.resolve(data_config).kind != "multimodal":
        return None
    if prepared.tokenizer_spec(data_config) not in ("", "bytes"):
        raise ValueError(
            f"data.tokenizer={prepared.tokenizer_spec(data_config)!r}: multimodal data "
            f"{data_config.name!r} is byte-level; leave data.tokenizer empty"
        )
    return Multimodal(data_config)


def _carried(data_config) -> Carried | None:
    """A carried corpus named by `data.name` (`sources.resolve`)."""
    if not data_config.name or data_config.files:
        return None
    source = sources.resolve(data_config)
    return Carried(data_config, source.spec) if source.kind == "carried" else None


def _prepared(data_config) -> Prepared | None:
    """A prepared dataset: named, or a raw source with a `data.tokenizer` (auto)."""
    path = prepared.dataset_path(data_config)
    return None if path is None else Prepared(data_config, path)


# The data kinds, asked in order; the first that takes the config is its kind. A new kind
# is a class with the methods of `Text` and one entry here.
KINDS = (_multimodal, _carried, _prepared, Text)


def check_scheme(data_config) -> None:
    """`data.scheme` must name a layout (text ignores it; multimodal data places with it)."""
    scheme = data_config.scheme
    if scheme not in layouts.SCHEMES:
        raise ValueError(f"data.scheme={scheme!r} is not one of {', '.join(layouts.SCHEMES)}")


_TFDS_LINES = re.compile(r"Downloading and preparing dataset|Dataset (\S+) downloaded and "
                         r"prepared to (\S+?)\.? Subsequent calls")  # fmt: skip


BUILD_LOCK = ".rope_jax_build.lock"  # in the data dir: one build at a time there


@contextlib.contextmanager
def build_lock(data_config):
    """Holds `<data dir>/.rope_jax_build.lock` (`fcntl.flock`, released by the kernel
    however the holder exits) while a dataset is built or prepared there: a second
    process (another eval.py, a sweep's parallel run, a second terminal) waits, saying so
    once, and then finds the build done. No lock where the data dir cannot be made."""
    root = sources.root_dir(data_config)
    try:
        os.makedirs(root, exist_ok=True)
        fd = os.open(os.path.join(root, BUILD_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # a read-only data dir: nothing is built there, the source check says so
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process building data in {root} ...", flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def ensure_built(data_config) -> None:
    """Builds a shipped corpus or the digits if needed; checks any other source is usable.
    Processes that need the same data at once build it once (`build_lock`).

    TFDS's own lines for a build ("Downloading and preparing dataset Unknown size ...",
    though nothing is downloaded) are replaced by one line saying what was built where.
    """
    with build_lock(data_config), contextlib.redirect_stdout(io.StringIO()) as captured:
        kind(data_config).prepare()
    for line in captured.getvalue().splitlines():
        match = _TFDS_LINES.search(line)
        if match is None:
            print(line)
        elif match.group(1):
            print(f"built the {match.group(1)} dataset once, in {match.group(2)} (nothing was "
                  "downloaded; later runs read it)", flush=True)  # fmt: skip


def make_train_iterator(data_config, *, seed: int, batch_size: int, process_index: int = 0,
                        process_count: int = 1):  # fmt: skip
    """Infinite, checkpointable iterator of training batches.

    Args:
      data_config: the `config.data` ConfigDict (see `rope_jax.data.default_config`).
      seed: shuffle seed; the same seed gives the same batches in the same order.
      batch_size: B, rows per batch of this process.
      process_index, process_count: for multi-host data parallelism
        (`jax.process_index()`, `jax.process_count()`): all processes shuffle the
        same global batches of `process_count * B` windows and each keeps its own
        contiguous block of B rows.

    Returns:
      A `grain.DatasetIterator`; `it.get_state()` is a small JSON-serialisable dict
      and `it.set_state(state)` resumes exactly at the batch after the snapshot.
    """
    _positive_int(data_config.seq_len, "data.seq_len")
    batch_size = _positive_int(batch_size, "batch_size")
    shard = _shard(process_index, process_count)
    if not 0 <= int(seed) < 2**32:
        raise ValueError(f"seed must lie in [0, 2**32), got {seed}")
    return kind(data_config).train_iterator(seed=seed, batch_size=batch_size, shard=shard)


def make_eval_iterator(data_config, *, split: str, batch_size: int, seq_len: int | None = None,
                       num_batches: int | None = None, process_index: int = 0,
                       process_count: int = 1, spread: bool = False):  # fmt: skip
    """Finite, deterministic, re-iterable batches covering `split` once, in order.

    Args:
      data_config: the `config.data` ConfigDict.
      split: e.g. "validation" or "test" (for TFDS datasets any split they have).
      batch_size: B; the last batch is padded with weight-0 rows to full size.
      seq_len: T; defaults to `data.seq_len`; any length works (e.g. 4x training).
        Multimodal splits default to `multimodal.eval_seq_len`, which fits every split.
      num_batches: if set, only the first `num_batches` batches (with `spread`, that
        many batches of windows evenly spaced through a text split). A multimodal split
        is its first `num_batches * batch_size * process_count` examples (512 when None),
        shared out among the processes.
      process_index, process_count: as in `make_train_iterator`; every process gets
        the same number of batches.

    Returns:
      A `grain.IterDataset`; each `iter()` starts again from the first batch.
    """
    batch_size = _positive_int(batch_size, "batch_size")
    shard = _shard(process_index, process_count)
    return kind(data_config).eval_iterator(split=split, batch_size=batch_size, seq_len=seq_len,
                                           num_batches=num_batches, shard=shard,
                                           spread=spread)  # fmt: skip


def _positive_int(value, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{field} must be a positive integer, got {value!r}")
    return int(value)


def _shard(process_index: int, process_count: int) -> tuple[int, int]:
    process_count = _positive_int(process_count, "process_count")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index must lie in [0, {process_count}), got {process_index}")
    return int(process_index), process_count
