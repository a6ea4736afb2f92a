"""Evaluation tasks: one registry, named from the config (`eval.tasks`) and from eval.py
(`--tasks`).

  from rope_jax.harness import evals
  names = evals.parse("loss,passkey")            # ("loss", "passkey"); "ruler" = every RULER task
  evals.check(config, names, lengths=[256, 512], examples=100)   # before anything compiles
  ctx = evals.Context(run, params, config, split="validation", num_batches=20, examples=100)
  entry = evals.score(ctx, names, 512)           # {"loss": ..., "passkey_accuracy": ...}

A task is an object with a `name`, a `primary` metric (its headline number), `check`
(its settings against the config: one ValueError line, before anything compiles),
`settings` (what an evaluation file records of it), and `score(ctx, length) -> Cell`: the
metrics of one context length, and for example-based tasks one record per example (the
input, the answers, the prediction, its score). The in-training evaluation
(`harness.loop`, `eval.tasks` at the training length), `evaluate_checkpoint`
(eval_<step>.json: every task's metrics merged into each length's entry) and the suite
(`harness.suite`, eval.py --out: one cell per task and length) all iterate over it.

  loss        held-out loss, perplexity, bits per byte, top-1 accuracy (`evals.loss`)
  passkey     a five-digit key hidden in held-out text, read by teacher forcing (`evals.passkey`)
  niah_*, vt, cwe, fwe   RULER's synthetic tasks, answered by greedy decoding and scored
              as RULER scores them (`evals.generated` over `rope_jax.ruler`)

Adding a task is one module with its `Task` objects and one line in `TASKS` below.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from rope_jax.harness.evals import generated, loss, passkey
from rope_jax.harness.evals.common import Cell, Context

__all__ = ["GROUPS", "TASKS", "Cell", "Context", "Task", "check", "parse", "score", "settings"]


class Task(Protocol):
    name: str
    primary: str  # the key of the headline metric in `score(...).metrics`

    def check(self, config, *, split: str, lengths: Sequence[int], examples: int) -> None: ...

    def settings(self, examples: int) -> dict: ...

    def score(self, ctx: Context, length: int | None) -> Cell: ...


TASKS: dict[str, Task] = {task.name: task for task in (loss.TASK, passkey.TASK, *generated.TASKS)}
# names that stand for several tasks (`--tasks=ruler`)
GROUPS: dict[str, tuple[str, ...]] = {"ruler": tuple(t.name for t in generated.TASKS)}


def decoding_only(names: Sequence[str]) -> bool:
    """Whether every task of `names` answers by greedy decoding after a prefill (needs no
    position's logits but the last: `hostmem.eval_needs(..., decoding=True)`)."""
    return set(names) <= set(GROUPS["ruler"])


def parse(names: str | Iterable[str]) -> tuple[str, ...]:
    """Task names (a comma-separated string or a sequence) with groups expanded, in order,
    each once; an unknown name is a ValueError naming the nearest registered one."""
    if isinstance(names, str):
        names = names.split(",")
    out: list[str] = []
    for name in (str(n).strip() for n in names):
        if not name:
            continue
        if name not in TASKS and name not in GROUPS:
            near = difflib.get_close_matches(name, [*TASKS, *GROUPS], n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(
                f"unknown evaluation task {name!r}{hint}; tasks: {', '.join(TASKS)}; "
                f"groups: {', '.join(GROUPS)}"
            )
        out += [n for n in GROUPS.get(name, (name,)) if n not in out]
    if not out:
        raise ValueError("no evaluation task named; e.g. --tasks=loss or --tasks=ruler")
    return tuple(out)


def check(config, names: Sequence[str], *, lengths: Sequence[int], examples: int,
          split: str | None = None) -> None:  # fmt: skip
    """Every task of `names` can run on `config` at `lengths` with `examples` examples of
    held-out `split` (default `data.eval_split`): one ValueError line otherwise."""
    if isinstance(examples, bool) or not isinstance(examples, int) or examples < 1:
        raise ValueError(f"--examples={examples!r} must be a number of examples >= 1")
    for name in parse(names):
        TASKS[name].check(config, split=split or config.data.eval_split, lengths=lengths,
                          examples=examples)  # fmt: skip


def settings(names: Sequence[str], examples: int) -> dict:
    """What an evaluation file records of the tasks `names` beside their metrics."""
    out: dict[str, Any] = {}
    for name in names:
        out.update(TASKS[name].settings(examples))
    return out


def score(ctx: Context, names: Sequence[str], length: int | None) -> dict:
    """The metrics of every task of `names` at context `length`, merged in order (the
    entry of one length in eval_<step>.json, and of one in-training evaluation). None is
    the training length (a multimodal split's loss: its own window, which fits it)."""
    entry: dict[str, Any] = {}
    for name in names:
        entry.update(TASKS[name].score(ctx, length).metrics)
    return entry
