"""Passkey retrieval, read by teacher forcing: a five-digit key hidden at evenly spread
depths of held-out byte-level text (`data.passkey`), its digits the only scored targets.

passkey_accuracy: every digit of the key right (exact match); passkey_digit_accuracy: the
share of digits right (chance 0.1); passkey_examples: the examples scored. Every process
scores the same examples (its own rows of each global batch).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from rope_jax import data, sharding
from rope_jax.data import passkey
from rope_jax.harness import feed, metrics, steps
from rope_jax.harness.evals.common import Cell, Context, text_stream


class Passkey:
    name = "passkey"
    primary = "passkey_accuracy"

    def check(self, config, *, split: str, lengths: Sequence[int], examples: int) -> None:
        """Byte-level text, and lengths that hold an example."""
        if data.kind(config.data).name != "text":
            raise ValueError("the passkey task needs byte-level text data (passkey examples "
                             "are bytes)")  # fmt: skip
        for length in lengths:
            passkey.check_length(length)

    def settings(self, examples: int) -> dict:
        return {"passkey_examples": examples}

    def score(self, ctx: Context, length: int | None) -> Cell:
        length = length or ctx.config.data.seq_len  # None: the training length
        run, config = ctx.run, ctx.config
        filler = text_stream(config.data, ctx.split)
        batch_size, index, count = config.eval.batch_size, jax.process_index(), jax.process_count()
        local = batch_size // count
        batches = passkey.eval_batches(filler, length, ctx.examples, batch_size=batch_size)
        rows = ({k: v[index * local : (index + 1) * local] for k, v in b.items()} for b in batches)
        placed = (feed.put_batch(b, run.batch_sharding) for b in rows)
        step = jax.jit(steps.make_eval_step(run.graphdef, num_tasks=1),
                       in_shardings=(run.shardings["params"], run.batch_sharding))  # fmt: skip
        total = -(-ctx.examples // batch_size)
        with sharding.use_mesh(run.mesh, run.rules):
            out = metrics.evaluate(step, ctx.params, ctx.watch(placed, f"passkey @{length}", total),
                                   ("passkey",))  # fmt: skip
        return Cell({"passkey_accuracy": out["answer_accuracy"],
                     "passkey_examples": out["questions"],
                     "passkey_digit_accuracy": out["accuracy"]})  # fmt: skip


TASK = Passkey()
