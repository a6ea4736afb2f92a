"""RULER's synthetic tasks as evaluation tasks: each example's prompt (exactly `length`
minus the task's answer budget tokens of the run's tokenizer, from held-out text) is
answered by greedy decoding through the key/value cache, batched, and the answer is
scored as RULER scores it (`ruler.score_one`: string_match_all for the niah, vt, cwe and
fwe tasks). The generators and scorers are `rope_jax.ruler`'s; this module runs them on
a model.

metrics: `<task>` the mean score (0..1), `<task>_chars` the mean share of the perfect
answer's characters in place (`ruler.scoring.chars_in_place`: partial retrieval, where
RULER's score is 0 until a whole value is right), `<task>_examples` the examples scored.
One record per example: the input text, `length_tokens`, `depths` (where the task has
needles), `answers`, `prediction`, `score`, `chars`. Every process decodes every example (the
numbers of one process).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from flax import nnx

from rope_jax import data, ruler
from rope_jax.harness.evals.common import Cell, Context, text_stream
from rope_jax.nn import generate
from rope_jax.ruler import scoring


class Generated:
    """One RULER task (`ruler.TASKS[name]`)."""

    def __init__(self, name: str):
        self.name = self.primary = name

    def check(self, config, *, split: str, lengths: Sequence[int], examples: int) -> None:
        """The task's generator can make `examples` examples at every length from the
        held-out text in the run's tokenizer (`ruler.check`: template, needles and answer
        budget fit; every character encodes; enough text without repeating)."""
        tokenizer = data.kind(config.data).tokenizer()
        haystack = _haystack(config, split, examples, max(lengths))
        for length in lengths:
            ruler.check(self.name, length=length, tokenizer=tokenizer, num_examples=examples,
                        haystack=haystack, max_new_tokens=_budget(config),
                        template=config.data.task_template)  # fmt: skip

    def settings(self, examples: int) -> dict:
        return {"examples": examples}

    def score(self, ctx: Context, length: int | None) -> Cell:
        length = length or ctx.config.data.seq_len  # None: the training length
        config = ctx.config
        tokenizer = data.kind(config.data).tokenizer()
        haystack = _haystack(config, ctx.split, ctx.examples, length)
        examples = [
            ruler.make_example(self.name, length=length, index=i, seed=ctx.seed,
                               tokenizer=tokenizer, haystack=haystack,
                               depth=_depth(self.name, i, ctx.examples),
                               max_new_tokens=_budget(config), template=config.data.task_template)
            for i in range(ctx.examples)
        ]  # fmt: skip
        new = greedy(ctx, np.stack([e.prompt_ids for e in examples]),
                     max_new_tokens=examples[0].max_new_tokens, eos_id=tokenizer.eos_id,
                     what=f"{self.name} @{length}")  # fmt: skip
        records = []
        for e, ids in zip(examples, new, strict=True):
            text = tokenizer.decode(ids)
            prediction = ruler.postprocess(text)
            records.append({"input": e.text, "length_tokens": length, "depths": list(e.depths),
                            "answers": list(e.answers), "prediction": prediction,
                            "score": ruler.score_one(self.name, prediction, e.answers),
                            "chars": scoring.chars_in_place(text, e.target)})  # fmt: skip
        mean = lambda key: float(np.mean([r[key] for r in records]))
        return Cell({self.name: mean("score"), f"{self.name}_chars": mean("chars"),
                     f"{self.name}_examples": len(records)}, tuple(records))  # fmt: skip


def _haystack(config, split: str, examples: int, length: int):
    """The held-out text the examples draw from: twice what `examples` prompts of `length`
    tokens take (documents' EOS ids are dropped from it), not the whole split, which a
    prepared corpus would read from its shards for every cell."""
    return text_stream(config.data, split, max_tokens=2 * examples * length)


def _budget(config) -> int | None:
    """`eval.answer_tokens`, None for the task's own budget (0)."""
    return int(config.eval.answer_tokens) or None


def _depth(name: str, index: int, count: int) -> float | None:
    """Needle tasks: example k of n at depth k / (n - 1), so every depth is asked evenly
    (the heatmap's depth axis); None (the generator's choice) for the other tasks."""
    if not ruler.TASKS[name].depth:
        return None
    return index / max(count - 1, 1)


def greedy(ctx: Context, prompts: np.ndarray, *, max_new_tokens: int, eos_id: int,
           what: str) -> list[np.ndarray]:  # fmt: skip
    """Greedy continuations of `prompts` (int [n, P], one length) through the key/value
    cache (`nn.generate`), `eval.batch_size` at a time (the last batch padded with copies
    of its first row), each cut at its first EOS: n int arrays."""
    net = nnx.merge(ctx.run.graphdef, ctx.params)
    size, n = int(ctx.config.eval.batch_size), len(prompts)
    out = []
    starts = range(0, n, size)
    for first in ctx.watch(starts, what, total=len(starts)):
        chunk = prompts[first : first + size]
        real = len(chunk)
        if real < size:
            chunk = np.concatenate([chunk, np.repeat(chunk[:1], size - real, axis=0)])
        new = np.asarray(generate.generate(net, chunk, max_new_tokens=max_new_tokens))[:real]
        out += [row[: _first(row, eos_id)] for row in new]
    return out


def _first(row: np.ndarray, token: int) -> int:
    hits = np.flatnonzero(row == token)
    return int(hits[0]) if hits.size else len(row)


TASKS = tuple(Generated(name) for name in ruler.TASKS)
