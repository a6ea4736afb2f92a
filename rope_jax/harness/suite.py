"""The evaluation suite: every task at every length, one resumable cell at a time.

  from rope_jax.harness import suite
  suite.run("runs/x", "runs/x/ruler", tasks=("niah_single_1", "vt"), lengths=[512, 1024],
            examples=100)

eval.py --out=DIR runs it. As each (task, length) cell finishes, process 0 writes

  DIR/results.json                    {"workdir", "step", "train_seq_len", "settings",
                                       "cells": {task: {length: {"score", "examples",
                                       "metrics", "seconds", "settings", "code"}}}}
  DIR/examples/<task>_<length>.jsonl  one line per example (the input text,
                                       `length_tokens`, `depths`, `answers`,
                                       `prediction`, `score`) for example-based tasks

both atomically, so a crash loses at most the cell in progress and the same command
resumes at the first unfinished cell. The settings (checkpoint step, split, examples,
seed, template, answer budget, rope scaling, dataset) are those of the whole directory:
a rerun with others is refused unless `overwrite` (which starts the directory afresh);
more tasks or lengths add cells. DIR holds one lock while the suite runs.
"""

from __future__ import annotations

import json
import os
import time

import jax

from rope_jax import data, provenance
from rope_jax.harness import checks, console, distributed, evals, hostmem, runfiles, setup
from rope_jax.harness import workdir as workdir_lib
from rope_jax.harness.evaluate import (
    parse_seq_lens,
    restore,
    with_answer_tokens,
    with_data,
    with_pairs,
    with_rope_scaling,
)

RESULTS = "results.json"
EXAMPLES = "examples"


def examples_path(out: str, task: str, length: int) -> str:
    return os.path.join(out, EXAMPLES, f"{task}_{length}.jsonl")


def load(out: str) -> dict | None:
    """DIR/results.json, or None when there is none yet."""
    path = os.path.join(out, RESULTS)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a suite's results file ({e}): move it away") from None


def run(workdir: str, out: str, *, tasks=None, lengths=(), examples: int | None = None,
        step: int | None = None, split: str | None = None, num_batches: int | None = None,
        fallback: bool = False, overwrite: bool = False, rope_scaling: dict | None = None,
        max_position_embeddings: int | None = None, data_name: str | None = None,
        data_dir: str | None = None, answer_tokens: int | None = None, pairs=None,
        progress=None) -> dict:  # fmt: skip
    """Scores every (task, length) cell not yet in `out` (see the module doc); returns the
    results file's content. Defaults: `eval.tasks`, the training length and
    `eval.seq_lens`, `eval.examples`, `data.eval_split`, `eval.num_batches`,
    `eval.answer_tokens`. `pairs` (a `pairs.PairSpec` or its fields) evaluates the run
    with other pairs turning (`evaluate.with_pairs`)."""
    config = with_rope_scaling(runfiles.load_config(workdir), rope_scaling,
                                            max_position_embeddings)  # fmt: skip
    config = with_pairs(config, pairs)
    config = with_answer_tokens(with_data(config, data_name, data_dir), answer_tokens)
    tasks = evals.parse(config.eval.tasks if tasks is None else tasks)
    lengths = parse_seq_lens(lengths) or [checks.trained_length(config), *config.eval.seq_lens]
    examples = config.eval.examples if examples is None else examples
    split = split or config.data.eval_split
    settings = {"split": split, "examples": examples, "seed": 0,
                "num_batches": config.eval.num_batches if num_batches is None else num_batches,
                "template": config.data.task_template, "answer_tokens": config.eval.answer_tokens,
                "rope_scaling": rope_scaling, "max_position_embeddings": max_position_embeddings,
                "rope_pairs": None if pairs is None else config.model.rope.pairs.to_dict(),
                "data": {"name": config.data.name, "data_dir": config.data.data_dir}}  # fmt: skip
    workdir_lib.check_writable(out, "--out")
    distributed.process_0_first(data.ensure_built, config.data)
    runfiles.check_tokenizer(workdir, data.kind(config.data).tokenizer())
    evals.check(config, tasks, split=split, lengths=lengths, examples=examples)
    built = setup.build(config)
    fitted = hostmem.fit_eval(built, config, lengths, decoding=evals.decoding_only(tasks))
    if fitted is not config:  # a kernel or batch that fits (said on stderr)
        config, built = fitted, setup.build(fitted)
    lock = workdir_lib.Lock(out, name=".suite.lock", enabled=jax.process_index() == 0,
                            busy=lambda _, h: f"{out} is being written by another suite "
                            f"({workdir_lib.describe_holder(h)})")  # fmt: skip
    with lock:
        step, state = restore(workdir, built, step, fallback)
        results = _start(out, workdir, step, config, settings, overwrite)
        ctx = evals.Context(built, state["params"], config, split=split,
                            num_batches=settings["num_batches"], examples=examples,
                            progress=progress, step=step)  # fmt: skip
        _cells(ctx, out, results, tasks, lengths, settings)
    console.note(f"suite of step {step} of {workdir}: {out}/{RESULTS}")
    return results


def _start(out: str, workdir: str, step: int, config, settings: dict, overwrite: bool) -> dict:
    """The results so far: DIR's own when made with these settings and step, else a new
    record (`overwrite`), else a ValueError naming the first difference."""
    old = load(out)
    fresh = {"workdir": os.path.abspath(workdir), "step": int(step),
             "train_seq_len": checks.trained_length(config), "settings": settings,
             "cells": {}}  # fmt: skip
    if old is None or overwrite:
        return fresh
    have = {**old.get("settings", {}), "step": old.get("step")}
    want = {**json.loads(json.dumps(settings)), "step": int(step)}
    diffs = [f"{k}: {have.get(k)!r} -> {v!r}" for k, v in want.items() if have.get(k) != v]
    if diffs:
        raise ValueError(
            f"{out}/{RESULTS} was made with other settings ({'; '.join(diffs)}): give "
            "another --out, or --overwrite to start it afresh"
        )
    return old


def _cells(ctx, out: str, results: dict, tasks, lengths, settings: dict) -> None:
    """Scores the cells not in `results`, writing each as it finishes."""
    todo = [(t, n) for t in tasks for n in lengths if str(n) not in results["cells"].get(t, {})]
    done = len(tasks) * len(lengths) - len(todo)
    if done:
        console.note(f"suite: {done} cell(s) already in {out}/{RESULTS}; {len(todo)} to go")
    begin = time.monotonic()
    for k, (name, length) in enumerate(todo, start=1):
        start = time.monotonic()
        cell = evals.TASKS[name].score(ctx, length)
        if ctx.progress is not None:
            ctx.progress.check()  # a signal in the last batch: this cell is not written
        entry = {"score": cell.metrics[evals.TASKS[name].primary],
                 "examples": len(cell.records) or None, "metrics": cell.metrics,
                 "seconds": round(time.monotonic() - start, 2), "settings": settings,
                 "code": provenance.describe(provenance.code_version())}  # fmt: skip
        results["cells"].setdefault(name, {})[str(length)] = entry
        if jax.process_index() == 0:
            _write(out, name, length, cell.records, results)
        spent = time.monotonic() - begin
        eta = console.hms(spent / k * (len(todo) - k))
        console.note(f"suite {name} @{length}: {entry['score']:.3f} ({k}/{len(todo)} cells "
                     f"in {console.hms(spent)}, ETA {eta})")  # fmt: skip


def _write(out: str, name: str, length: int, records, results: dict) -> None:
    """The cell's examples first, then results.json: a cell in results.json always has
    its examples."""
    if records:
        os.makedirs(os.path.join(out, EXAMPLES), exist_ok=True)
        lines = "".join(json.dumps(r) + "\n" for r in records)
        workdir_lib.write_atomic(examples_path(out, name, length), lines)
    workdir_lib.write_atomic(os.path.join(out, RESULTS), json.dumps(results, indent=1))
