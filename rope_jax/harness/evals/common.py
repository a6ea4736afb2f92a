"""What every evaluation task shares: the context it scores in and the cell it returns."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from rope_jax import data
from rope_jax.data import prepared, sources


@dataclasses.dataclass(frozen=True)
class Cell:
    """The result of one task at one context length.

    metrics: numbers, merged into that length's entry of eval_<step>.json (so their keys
      name the task where they could collide: `passkey_accuracy`, `niah_single_1`).
    records: one dict per example for example-based tasks (eval.py --out writes them to
      examples/<task>_<length>.jsonl), () for the others.
    """

    metrics: dict
    records: tuple = ()


@dataclasses.dataclass(frozen=True)
class Context:
    """What a task scores with: one set of parameters of a built run.

    run: `setup.Setup` (graphdef, mesh, shardings, the jitted eval step).
    params: the parameters (a checkpoint's, or the training state's).
    config: the run's resolved config (its data section names the held-out text).
    split: the held-out split the tasks read.
    num_batches: batches of the loss task per length (0 = the whole split).
    examples: examples per length of the example-based tasks.
    seed: the examples' seed (the same seed gives the same examples).
    progress: None or `harness.progress.Progress` (progress lines, a check for a signal).
    step: the checkpoint step, for progress lines.
    """

    run: Any
    params: Any
    config: Any
    split: str
    num_batches: int = 0
    examples: int = 100
    seed: int = 0
    progress: Any = None
    step: int = 0

    def watch(self, items, what: str, total: int | None = None, unit: str = "batch"):
        """`items` passed through `progress.watch` (a line every few seconds), or as is."""
        if self.progress is None:
            return items
        return self.progress.watch(items, what=f"eval step {self.step}, {what}", total=total,
                                   unit=unit)  # fmt: skip


def text_stream(data_config, split: str, max_tokens: int | None = None) -> np.ndarray:
    """Token ids of `split`'s documents, each followed by EOS (at most `max_tokens` of
    them): the held-out text that example-based tasks draw from. Raw byte-level text and
    prepared corpora have one; multimodal and carried data have none (ValueError)."""
    kind = data.kind(data_config)
    if kind.name == "text":
        stream = sources.token_stream(data_config, split)
        return stream if max_tokens is None else stream[:max_tokens]
    if kind.name == "prepared":
        tokens = prepared.open_split(kind.path, split)
        stop = len(tokens) if max_tokens is None else min(len(tokens), max_tokens)
        return tokens.read(0, stop)["tokens"]
    if kind.name == "carried":
        why = ("token ids without their tokenizer, and these tasks are written as text (use "
               "the prepared dataset it was packed from)")  # fmt: skip
    else:
        why = "its tasks are its own questions, not text retrieval (use a text corpus)"
    raise ValueError(f"data {data_config.name!r} is {kind.name} data: {why}; passkey and the "
                     "RULER tasks need held-out text")  # fmt: skip
