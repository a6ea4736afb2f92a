"""The held-out loss at a context length: loss (nats/token), perplexity, bits per byte,
token count and top-1 accuracy (plus answer accuracy per task on multimodal data)."""

from __future__ import annotations

from collections.abc import Sequence

from rope_jax.harness import setup
from rope_jax.harness.evals.common import Cell, Context


class Loss:
    name = "loss"
    primary = "loss"

    def check(self, config, *, split: str, lengths: Sequence[int], examples: int) -> None:
        """Any length and any data: the split's own checks run before the evaluation."""

    def settings(self, examples: int) -> dict:
        return {}

    def score(self, ctx: Context, length: int | None) -> Cell:
        """`setup.evaluate` on `ctx.split` at `length` (None: the split's own windows, at
        the training length), `ctx.num_batches` batches."""
        total, what = ctx.num_batches or None, ctx.split + (f" @{length}" if length else "")
        return Cell(setup.evaluate(
            ctx.run, ctx.params, ctx.config, split=ctx.split, seq_len=length,
            num_batches=ctx.num_batches, watch=lambda b: ctx.watch(b, what, total=total),
        ))  # fmt: skip


TASK = Loss()
