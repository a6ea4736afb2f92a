"""Grain pipelines: a split's token stream -> batches of next-token windows.

The documents of a split, each followed by EOS, form one stream of N tokens. Window
`i` is `stream[i*T : i*T + T + 1]`; `inputs` are its first T tokens, `targets` its
last T. Consecutive windows overlap by one token, so every target position
1..N-1 of the stream is scored by exactly one window.

Batch (all numpy):
  inputs   int32   [B, T]  token ids (PAD=256 past the end of the stream)
  targets  int32   [B, T]  inputs shifted left by one
  weights  float32 [B, T]  1 for a real target, 0 for padding

Training shuffles windows (seeded, a fresh permutation every epoch, forever) and
drops no data but the last partial window. Evaluation walks the windows in order
once; the last window and the last batch are padded, with weight 0, so every batch
has the full static shape [B, T].
"""

from __future__ import annotations

import grain
import numpy as np

from rope_jax.data import multimodal, sources
from rope_jax.data.tokenizer import PAD_ID

# Batches are cut with vectorised numpy, so one worker thread plus a small buffer is
# enough to keep the next batches ready while the accelerator runs a step.
READ_OPTIONS = grain.ReadOptions(num_threads=1, prefetch_buffer_size=4)


class Windows:
    """Grain map: a batch of window indices [P*B] -> a batch dict of [B, T] arrays.

    With `shard=(p, P)` the indices are a global batch for P processes and this
    process keeps its contiguous block of B rows, number p.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, shard: tuple[int, int] = (0, 1)):
        self.tokens = tokens
        self.seq_len = seq_len
        self.shard = shard

    def __call__(self, indices) -> dict[str, np.ndarray]:
        index, count = self.shard
        indices = np.asarray(indices, dtype=np.int64).reshape(count, -1)[index]
        n, t = len(self.tokens), self.seq_len
        pos = indices[:, None] * t + np.arange(t + 1)[None, :]  # [B, T+1]
        valid = pos < n
        window = np.where(valid, self.tokens[np.minimum(pos, n - 1)], PAD_ID).astype(np.int32)
        return {
            "inputs": np.ascontiguousarray(window[:, :-1]),
            "targets": np.ascontiguousarray(window[:, 1:]),
            "weights": valid[:, 1:].astype(np.float32),
        }


def _positive_int(value, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{field} must be a positive integer, got {value!r}")
    return int(value)


def _shard(process_index: int, process_count: int) -> tuple[int, int]:
    process_count = _positive_int(process_count, "process_count")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index must lie in [0, {process_count}), got {process_index}")
    return int(process_index), process_count


def _train_split(data_config) -> str:
    return data_config.get("train_split", None) or "train"


def make_train_iterator(
    data_config,
    *,
    seed: int,
    batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
    rope=None,
):
    """Infinite, checkpointable iterator of training batches.

    Args:
      data_config: the `config.data` ConfigDict (see `rope_jax.data.default_config`).
      seed: shuffle seed; the same seed gives the same batches in the same order.
      batch_size: B, rows per batch of this process.
      process_index, process_count: for multi-host data parallelism
        (`jax.process_index()`, `jax.process_count()`): all processes shuffle the
        same global batches of `process_count * B` windows and each keeps its own
        contiguous block of B rows.
      rope: `config.model.rope`; multimodal datasets (`multimodal.FAMILIES`) need its
        `scheme` for the batches' positions. Text ignores it.

    Returns:
      A `grain.DatasetIterator`; `it.get_state()` is a small JSON-serialisable dict
      and `it.set_state(state)` resumes exactly at the batch after the snapshot.
    """
    seq_len = _positive_int(data_config.get("seq_len", None), "data.seq_len")
    batch_size = _positive_int(batch_size, "batch_size")
    shard = _shard(process_index, process_count)
    if not 0 <= int(seed) < 2**32:
        raise ValueError(f"seed must lie in [0, 2**32), got {seed}")
    if multimodal.is_multimodal(data_config):
        return multimodal.make_train_iterator(
            data_config, _rope(rope, data_config), seed=seed, batch_size=batch_size, shard=shard
        )
    tokens = sources.token_stream(data_config, _train_split(data_config))
    num_windows = (len(tokens) - 1) // seq_len
    if num_windows < 1:
        raise sources.DataSourceError(
            f"the train split of {sources.describe(data_config)} has {len(tokens)} tokens, "
            f"fewer than data.seq_len + 1 = {seq_len + 1}"
        )
    ds = (
        grain.MapDataset.range(num_windows)
        .seed(int(seed))
        .shuffle()  # a new permutation per epoch: repeat() reseeds each epoch
        .repeat()
        .batch(batch_size * shard[1], drop_remainder=True)
        .map(Windows(tokens, seq_len, shard))
    )
    return iter(ds.to_iter_dataset(READ_OPTIONS))


def num_eval_windows(num_tokens: int, seq_len: int) -> int:
    """Windows needed to score all `num_tokens - 1` targets of a stream once."""
    return -(-(num_tokens - 1) // seq_len)


def make_eval_iterator(
    data_config,
    *,
    split: str,
    batch_size: int,
    seq_len: int | None = None,
    num_batches: int | None = None,
    process_index: int = 0,
    process_count: int = 1,
    rope=None,
):
    """Finite, deterministic, re-iterable batches covering `split` once, in order.

    Args:
      data_config: the `config.data` ConfigDict.
      split: e.g. "validation" or "test" (for TFDS datasets any split they have).
      batch_size: B; the last batch is padded with weight-0 rows to full size.
      seq_len: T; defaults to `data.seq_len`; any length works (e.g. 4x training).
      num_batches: if set, only the first `num_batches` batches.
      process_index, process_count: as in `make_train_iterator`; every process gets
        the same number of batches.
      rope: as in `make_train_iterator`. A multimodal split is its first
        `num_batches * batch_size` examples (512 when num_batches is None), padded to
        `seq_len` (default `multimodal.eval_seq_len`, which fits every split).

    Returns:
      A `grain.IterDataset`; each `iter()` starts again from the first batch.
    """
    if multimodal.is_multimodal(data_config) and not seq_len:
        seq_len = multimodal.eval_seq_len(data_config)
    seq_len = _positive_int(seq_len or data_config.get("seq_len", None), "seq_len")
    batch_size = _positive_int(batch_size, "batch_size")
    shard = _shard(process_index, process_count)
    if multimodal.is_multimodal(data_config):
        num_examples = (
            _positive_int(num_batches, "num_batches") * batch_size if num_batches else 512
        )
        return multimodal.make_eval_iterator(
            _with_seq_len(data_config, seq_len),
            _rope(rope, data_config),
            split=split,
            batch_size=batch_size,
            num_examples=num_examples,
            shard=shard,
        )
    tokens = sources.token_stream(data_config, split)
    global_batch = batch_size * shard[1]
    rows = num_eval_windows(len(tokens), seq_len)
    rows = -(-rows // global_batch) * global_batch  # pad to whole batches
    ds = grain.MapDataset.range(rows).batch(global_batch).map(Windows(tokens, seq_len, shard))
    if num_batches is not None:
        ds = ds[: _positive_int(num_batches, "num_batches")]
    return ds.to_iter_dataset(READ_OPTIONS)


def _rope(rope, data_config):
    if rope is None or "scheme" not in rope:
        raise ValueError(
            f"data.name={data_config.name!r} is multimodal: pass rope=config.model.rope "
            "(its scheme places the patches)"
        )
    return rope


def _with_seq_len(data_config, seq_len: int):
    config = data_config.copy_and_resolve_references()
    config.seq_len = seq_len
    return config
