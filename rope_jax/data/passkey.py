"""Passkey retrieval: a number hidden in filler text, asked for at the end of the window.

The synthetic long-context probe of the context-extension literature (landmark
attention, position interpolation, YaRN): a window of exactly L + 1 byte-level tokens

    filler[:d] + " The pass key is #48213. " + filler[d:]
               + " What is the pass key? The pass key is #48213"

with five random digits, the key sentence at a random depth d of the filler, and the
digits repeated as the last five targets. The model can predict them only by finding
the key sentence: an exact-match answer is retrieval across up to L positions. The `#`
(a byte the shipped corpora never hold) marks where the digits start, so retrieval
needs only a match on the one token before each digit (a two-layer induction circuit
learns it); after a plain space the first digit would need a longer match.

  training   `data.passkey_rate = r`: each training window of byte-level text becomes a
             passkey example with probability r, its own text the filler (`insert`); the
             choice and the digits are fixed by (seed, window index), so resumed runs and
             every process see the same batches. `data.passkey_weight = w` weighs the
             five answer targets w times in the loss (1: plain language modelling; a
             small model learns the retrieval far sooner with w ~ 10).
  evaluation `eval_batches(filler, L, n)`: n examples at length L from held-out text,
             depths spread evenly over the filler, weight 1 only on the five answer
             targets; `metrics.eval_sums` with `task` gives the exact-match accuracy.

Everything here is host NumPy over byte ids (`data.tokenizer`).
"""

from __future__ import annotations

import numpy as np

from rope_jax.data.byte_ids import encode

DIGITS = 5  # digits of a pass key
KEY = " The pass key is #{}. "  # the sentence hidden in the filler
QUESTION = " What is the pass key? The pass key is #"  # the window ends with the digits
OVERHEAD = len(KEY.format("0" * DIGITS)) + len(QUESTION) + DIGITS  # bytes that are not filler


def min_length() -> int:
    """The shortest window (L) that holds one byte of filler."""
    return OVERHEAD


def rate(data_config) -> float:
    return float(data_config.passkey_rate)


def weight(data_config) -> float:
    return float(data_config.passkey_weight)


def check(data_config, byte_text: bool) -> None:
    """`data.passkey_rate` lies in [0, 1]; above 0 it needs byte-level text and a
    training window long enough for one example."""
    value = data_config.passkey_rate
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ValueError(f"data.passkey_rate={value!r} must be a number in [0, 1]")
    if value and not byte_text:
        raise ValueError(
            f"data.passkey_rate={value}: passkey examples are byte-level text; this data "
            "is not (use a raw text corpus with the byte tokenizer)"
        )
    w = data_config.passkey_weight
    if isinstance(w, bool) or not isinstance(w, int | float) or not w > 0:
        raise ValueError(f"data.passkey_weight={w!r} must be a number > 0")
    if value and int(data_config.seq_len) < min_length():
        raise ValueError(
            f"data.passkey_rate={value} needs data.seq_len >= {min_length()} (one passkey "
            f"example), got {data_config.seq_len}"
        )


def check_length(length: int) -> None:
    if length < min_length():
        raise ValueError(f"a passkey window needs at least {min_length()} tokens, got {length}")


def example(filler: np.ndarray, length: int, depth: int, key: str) -> np.ndarray:
    """One passkey window: int32 [length + 1]; `filler` must hold at least
    length + 1 - OVERHEAD tokens, `depth` (0..that) is where the key sentence goes."""
    check_length(length)
    size = length + 1 - OVERHEAD
    if len(filler) < size or not 0 <= depth <= size:
        raise ValueError(f"filler of {len(filler)} tokens, depth {depth}: need {size}, 0..{size}")
    body = filler[:size]
    parts = [body[:depth], encode(KEY.format(key)), body[depth:], encode(QUESTION + key)]
    return np.concatenate(parts).astype(np.int32)


def random_key(rng: np.random.Generator) -> str:
    return "".join(str(d) for d in rng.integers(0, 10, DIGITS))


def insert(window: np.ndarray, indices: np.ndarray, *, rate: float, seed: int):
    """(windows, rows): training windows [B, T + 1] with a passkey example in place of
    row b with probability `rate`, made from row b's own first tokens, fixed by (seed,
    indices[b]); rows bool [B] marks the rows that became examples (their last DIGITS
    targets are the answer)."""
    rows = np.zeros(len(window), bool)
    if rate <= 0:
        return window, rows
    out = window.copy()
    length = window.shape[1] - 1
    size = length + 1 - OVERHEAD
    for b, index in enumerate(np.asarray(indices)):
        rng = np.random.default_rng([int(seed), int(index), 0x9A55])
        if rng.random() < rate:
            depth = int(rng.integers(0, size + 1))
            out[b] = example(window[b], length, depth, random_key(rng))
            rows[b] = True
    return out, rows


def eval_batches(filler: np.ndarray, length: int, num_examples: int, *, batch_size: int,
                 seed: int = 0):  # fmt: skip
    """Batches of `num_examples` passkey questions at window length `length`, from the
    token stream `filler` (held-out text): inputs, targets [B, L]; weights 1 on the
    answer digits only; task 0 (padding rows past the last example: task -1, weight 0).
    Example k puts its key at depth k / (n - 1) of the filler, so every depth counts."""
    check_length(length)
    size = length + 1 - OVERHEAD
    if len(filler) < size:
        raise ValueError(f"passkey filler has {len(filler)} tokens; length {length} needs {size}")
    rng = np.random.default_rng([int(seed), int(length)])
    rows = []
    for k in range(num_examples):
        start = int(rng.integers(0, len(filler) - size + 1))
        depth = round(k * size / max(num_examples - 1, 1))
        rows.append(example(filler[start : start + size], length, depth, random_key(rng)))
    for first in range(0, num_examples, batch_size):
        chunk = np.stack(rows[first : first + batch_size])
        real = len(chunk)
        if real < batch_size:  # pad to the static batch shape
            chunk = np.concatenate([chunk, np.repeat(chunk[:1], batch_size - real, axis=0)])
        weights = np.zeros((batch_size, length), np.float32)
        weights[:real, -DIGITS:] = 1.0
        task = np.where(np.arange(batch_size) < real, 0, -1).astype(np.int32)
        yield {"inputs": chunk[:, :-1], "targets": chunk[:, 1:], "weights": weights, "task": task}
