"""Grain pipelines: a split's token stream -> batches of next-token windows.

The documents of a split, each followed by EOS, form one stream of N tokens. Window
`i` is `stream[i*T : i*T + T + 1]`; `inputs` are its first T tokens, `targets` its
last T. Consecutive windows overlap by one token, so every target position
1..N-1 of the stream is scored by exactly one window.

Batch (all numpy):
  inputs        int32   [B, T]  token ids (PAD=256 past the end of the stream)
  targets       int32   [B, T]  inputs shifted left by one
  weights       float32 [B, T]  1 for a real target, 0 for padding
  target_bytes  int32   [B, T]  evaluation only: UTF-8 bytes of each target (1 for a
                                byte id, 0 for EOS and padding), for bits per byte
  segments, positions           with data.packing='documents' (`packing`)

Training shuffles windows (seeded, a fresh permutation every epoch, forever) and
drops no data but the last partial window. Evaluation walks the windows in order
once; the last window and the last batch are padded, with weight 0, so every batch
has the full static shape [B, T].
"""

from __future__ import annotations

import grain
import numpy as np

from rope_jax.data import packing, passkey, sources, synthetic, tokenizers
from rope_jax.data.byte_ids import EOS_ID, PAD_ID

# Batches are cut with vectorised numpy, so one worker thread plus a small buffer is
# enough to keep the next batches ready while the accelerator runs a step.
READ_OPTIONS = grain.ReadOptions(num_threads=1, prefetch_buffer_size=4)


class TokenArray:
    """A window source over a token stream held in memory (a raw split's bytes, or the ids
    of a carried corpus, `data.carried`): window i is stream[i*T : i*T + T + 1], PAD past
    the end; documents end with EOS.

    `token_bytes`: the UTF-8 bytes of each token of the stream ([N], as `tokens`), or None
    for byte ids (1 for a byte id, 0 for EOS); all zero where the bytes are unknown."""

    def __init__(self, tokens: np.ndarray, token_bytes: np.ndarray | None = None):
        self.tokens, self.token_bytes = tokens, token_bytes

    def __len__(self) -> int:
        return len(self.tokens)

    def windows(self, rows: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
        """`tokens` int32 [B, T+1] and `valid` bool [B, T+1] of windows `rows`; `bytes`
        (each token's UTF-8 bytes, 0 for padding). Segments follow from EOS (`Windows`)."""
        n = len(self.tokens)
        pos = rows[:, None] * seq_len + np.arange(seq_len + 1)[None, :]  # [B, T+1]
        valid = pos < n
        tokens = np.where(valid, self.tokens[np.minimum(pos, n - 1)], PAD_ID).astype(np.int32)
        if self.token_bytes is None:
            counts = tokens < 256
        else:
            counts = self.token_bytes[np.minimum(pos, n - 1)]
        return {"tokens": tokens, "valid": valid, "bytes": (counts * valid).astype(np.int32)}


class Windows:
    """Grain map: window indices [process_count * B] -> a batch dict of [B, T] arrays, from
    any window source (`TokenArray` in memory, `shards.TokenSplit` on disk): its
    `windows(rows, T)` gives tokens, valid and bytes [B, T+1], and, for a source that
    knows its documents, segment_ids and positions (else they follow from EOS).

    With `shard=(index, count)` the indices are a global batch for `count` processes and
    this process keeps its contiguous block of B rows, number `index`. With
    `passkey=(rate, seed, weight)` a row becomes a passkey example with probability rate,
    its answer targets weighted `weight` (`passkey.insert`, training only); with
    `synthetic` (a `synthetic.Mix`) a row becomes an example of one of RULER's tasks
    (`synthetic.Mix.insert`, training only), its answer targets weighted likewise.
    """

    def __init__(self, source, seq_len: int, shard: tuple[int, int] = (0, 1), *,
                 packing_mode: str = "stream", target_bytes: bool = False,
                 passkey: tuple[float, int, float] = (0.0, 0, 1.0), synthetic=None):  # fmt: skip
        self.source = TokenArray(source) if isinstance(source, np.ndarray) else source
        self.seq_len = seq_len
        self.shard = shard
        self.packing_mode, self.target_bytes = packing_mode, target_bytes
        self.passkey, self.synthetic = passkey, synthetic

    def __call__(self, indices) -> dict[str, np.ndarray]:
        index, count = self.shard
        rows = np.asarray(indices, dtype=np.int64).reshape(count, -1)[index]
        w = self.source.windows(rows, self.seq_len)
        window, valid = w["tokens"], w["valid"]
        rate, seed, weight = self.passkey
        examples = None
        if rate > 0:  # training windows: always whole (valid everywhere)
            window, examples = passkey.insert(window, rows, rate=rate, seed=seed)
        answer = None
        if self.synthetic is not None:  # the haystack: this window's text and the next's
            text = np.concatenate(
                [window, self.source.windows(rows + 1, self.seq_len)["tokens"]], 1
            )
            window, answer = self.synthetic.insert(window, text, rows)
            if examples is not None:  # a row made a task example is no passkey example
                examples &= ~answer.any(axis=1)
        batch = {
            "inputs": np.ascontiguousarray(window[:, :-1]),
            "targets": np.ascontiguousarray(window[:, 1:]),
            "weights": valid[:, 1:].astype(np.float32),
        }
        if examples is not None and weight != 1:
            batch["weights"][examples, -passkey.DIGITS :] = weight
        if answer is not None and self.synthetic.weight != 1:
            batch["weights"][answer[:, 1:]] = self.synthetic.weight
        if self.packing_mode == "documents" and "segment_ids" in w:
            batch.update(packing.fields(w["segment_ids"][:, :-1], w["positions"][:, :-1]))
        elif self.packing_mode == "documents":
            batch.update(packing.from_stream(batch["inputs"], valid[:, :-1], EOS_ID))
        if self.target_bytes:
            batch["target_bytes"] = np.ascontiguousarray(w["bytes"][:, 1:])
        return batch


def text_train_iterator(data_config, *, seed: int, batch_size: int, shard: tuple[int, int]):
    """Training windows of a text corpus, shuffled per epoch, forever (see module doc)."""
    tokens = sources.token_stream(data_config, data_config.train_split)
    return stream_train_iterator(data_config, TokenArray(tokens), sources.describe(data_config),
                                 seed=seed, batch_size=batch_size, shard=shard)  # fmt: skip


def stream_train_iterator(data_config, source: TokenArray, what: str, *, seed: int,
                          batch_size: int, shard: tuple[int, int]):  # fmt: skip
    """Training windows of a token stream held in memory (`source`; `what` names it in
    the error), with the config's passkey and RULER examples, shuffled per epoch, forever."""
    seq_len = int(data_config.seq_len)
    num_windows = (len(source) - 1) // seq_len
    if num_windows < 1:
        raise sources.DataSourceError(
            f"the train split of {what} has {len(source)} tokens, "
            f"fewer than data.seq_len + 1 = {seq_len + 1}"
        )
    mix = synthetic.Mix.of(data_config, seed=seed, tokenizer=tokenizers.ByteTokenizer(),
                           text=source.tokens[: 4 * seq_len + 4])  # fmt: skip
    windows = Windows(source, seq_len, shard, packing_mode=packing.mode(data_config),
                      passkey=(passkey.rate(data_config), seed, passkey.weight(data_config)),
                      synthetic=mix)  # fmt: skip
    return shuffled_batches(num_windows, windows, seed=seed, batch_size=batch_size, shard=shard)


def shuffled_batches(num_windows: int, windows, *, seed: int, batch_size: int, shard,
                     options: grain.ReadOptions = READ_OPTIONS):  # fmt: skip
    """Training batches of any window source: the indices 0..num_windows-1 shuffled
    (seeded, a new permutation every epoch, forever), cut into global batches of
    `process_count * B` and mapped by `windows` (indices -> this process's batch).
    A checkpointable `grain.DatasetIterator`."""
    ds = (
        grain.MapDataset.range(num_windows)
        .seed(int(seed))
        .shuffle()  # a new permutation per epoch: repeat() reseeds each epoch
        .repeat()
        .batch(batch_size * shard[1], drop_remainder=True)
        .map(windows)
    )
    return iter(ds.to_iter_dataset(options))


def ordered_batches(num_windows: int, windows, *, batch_size: int, shard, num_batches: int | None,
                    options: grain.ReadOptions = READ_OPTIONS, spread: bool = False):  # fmt: skip
    """Evaluation batches: every window once, in order, padded to whole global batches
    (the padding rows past the end have weight 0); the first `num_batches` if set, or
    with `spread` that many batches of windows evenly spaced through the split."""
    global_batch = batch_size * shard[1]
    if spread and num_batches is not None and num_batches * global_batch < num_windows:
        want = num_batches * global_batch  # windows evenly through the split
        picks = np.arange(want, dtype=np.int64) * num_windows // want
        ds = grain.MapDataset.source(picks.tolist())
    else:
        ds = grain.MapDataset.range(-(-num_windows // global_batch) * global_batch)
    ds = ds.batch(global_batch).map(windows)
    if num_batches is not None:
        ds = ds[:num_batches]
    return ds.to_iter_dataset(options)


def num_eval_windows(num_tokens: int, seq_len: int) -> int:
    """Windows needed to score all `num_tokens - 1` targets of a stream once."""
    return -(-(num_tokens - 1) // seq_len)


def text_eval_iterator(data_config, *, split: str, batch_size: int, seq_len: int,
                       num_batches: int | None, shard: tuple[int, int],
                       spread: bool = False):  # fmt: skip
    """Every window of a text split once, in order, padded to whole batches."""
    return stream_eval_iterator(data_config, TokenArray(sources.token_stream(data_config, split)),
                                batch_size=batch_size, seq_len=seq_len, num_batches=num_batches,
                                shard=shard, spread=spread)  # fmt: skip


def stream_eval_iterator(data_config, source: TokenArray, *, batch_size: int, seq_len: int,
                         num_batches: int | None, shard: tuple[int, int],
                         spread: bool = False):  # fmt: skip
    """Every window of a token stream held in memory once, in order, padded to whole
    batches, with each target's bytes."""
    windows = Windows(source, seq_len, shard, packing_mode=packing.mode(data_config),
                      target_bytes=True)  # fmt: skip
    return ordered_batches(num_eval_windows(len(source), seq_len), windows,
                           batch_size=batch_size, shard=shard, num_batches=num_batches,
                           spread=spread)  # fmt: skip
