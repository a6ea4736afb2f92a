"""Held-out evaluation (the one `evaluate` train.py and eval.py share) and metric logs."""

from __future__ import annotations

import glob
import json
import math
import os
import time
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from rope_jax.harness import workdir as workdir_lib


def token_losses(logits, targets, weights):
    """Summed cross-entropy and weight over a batch.

    Args:
      logits: [B, T, V] (any float dtype; reduced in float32).
      targets: [B, T] int.
      weights: [B, T] float, 0 for padding.

    Returns:
      (sum of weighted losses, sum of weights), float32 scalars.
    """
    sums = loss_sums(logits, targets, weights)
    return sums["loss_sum"], sums["weight_sum"]


def loss_sums(logits, targets, weights) -> dict:
    """The sums a training objective is built from, all over weighted tokens.

    Args:
      logits: [B, T, V] (any float dtype; reduced in float32).
      targets: [B, T] int.
      weights: [B, T] float, 0 for padding.

    Returns:
      {"loss_sum": sum w (logz - logit_gold) (cross-entropy), "z_sum": sum w logz^2
      (PaLM's z-loss before its weight), "weight_sum": sum w}, float32 scalars, where
      logz = logsumexp over V. Sums, not means, so that microbatches add up exactly.
    """
    logits = logits.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    gold = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return {"loss_sum": jnp.sum((logz - gold) * weights),
            "z_sum": jnp.sum(jnp.square(logz) * weights),
            "weight_sum": jnp.sum(weights)}  # fmt: skip


def eval_sums(logits, targets, weights, task=None, *, num_tasks: int = 0,
              target_bytes=None) -> dict:  # fmt: skip
    """Sums one evaluation batch contributes (add them over batches, then `summarize`).

    Args:
      logits: [B, T, V]; targets: [B, T] int; weights: [B, T] float, 0 = not scored.
      task: int [B], the task of each row (-1 = padding row), for question-answer data
        where each row holds one question whose answer is its weighted tokens.
      num_tasks: number of task ids (static).
      target_bytes: int [B, T], UTF-8 bytes of each target (text data), for bits/byte.

    Returns:
      {"loss_sum", "weight_sum", "correct_sum"} float32 scalars (correct = top-1 hit,
      weighted), plus with `task`: "answers" and "answers_correct" [num_tasks] (rows
      with an answer; rows whose every answer token is the top-1 prediction), plus
      with `target_bytes`: "byte_sum", the bytes of the scored targets.
    """
    loss_sum, weight_sum = token_losses(logits, targets, weights)
    hit = jnp.argmax(logits, axis=-1) == targets  # [B, T]
    sums = {"loss_sum": loss_sum, "weight_sum": weight_sum,
            "correct_sum": jnp.sum(hit * weights)}  # fmt: skip
    if target_bytes is not None:
        sums["byte_sum"] = jnp.sum(target_bytes.astype(jnp.float32) * weights)
    if task is not None:
        scored = weights > 0
        answered = jnp.any(scored, axis=-1)  # [B]
        right = jnp.all(hit | ~scored, axis=-1) & answered
        onehot = task[:, None] == jnp.arange(num_tasks)[None, :]  # [B, K]
        sums["answers"] = jnp.sum(onehot & answered[:, None], axis=0, dtype=jnp.float32)
        sums["answers_correct"] = jnp.sum(onehot & right[:, None], axis=0, dtype=jnp.float32)
    return sums


def summarize(sums: dict, task_names=()) -> dict:
    """loss (nats/token), perplexity, token count, top-1 accuracy; with byte counts
    (text) bits_per_byte = total nats / (ln 2 x total UTF-8 bytes of the scored
    targets), comparable across tokenizers, and bytes; with answers: answer_accuracy
    (exact match per question), overall and per task (`answer_accuracy/<task>`), and
    the number of questions."""
    weight_sum = float(sums["weight_sum"])
    loss = float(sums["loss_sum"]) / max(weight_sum, 1.0)
    out = {
        "loss": loss,
        "perplexity": math.exp(min(loss, 50.0)),
        "tokens": int(weight_sum),
        "accuracy": float(sums.get("correct_sum", 0.0)) / max(weight_sum, 1.0),
    }
    if float(sums.get("byte_sum", 0.0)) > 0:
        out["bits_per_byte"] = float(sums["loss_sum"]) / (math.log(2.0) * float(sums["byte_sum"]))
        out["bytes"] = int(sums["byte_sum"])
    if "answers" in sums:
        answers, correct = np.asarray(sums["answers"]), np.asarray(sums["answers_correct"])
        out["answer_accuracy"] = float(correct.sum() / max(answers.sum(), 1.0))
        out["questions"] = int(answers.sum())
        for name, n, c in zip(task_names, answers, correct, strict=True):
            out[f"answer_accuracy/{name}"] = float(c / n) if n else float("nan")
    return out


def evaluate(eval_step: Callable, params, batches: Iterable[dict], task_names=()) -> dict:
    """Runs `eval_step(params, batch) -> eval_sums(...)` over `batches`; `summarize`s."""
    total = None
    for batch in batches:
        sums = jax.tree.map(lambda x: np.asarray(x, np.float64), eval_step(params, batch))
        total = sums if total is None else jax.tree.map(np.add, total, sums)
    if total is None or total["weight_sum"] == 0:
        raise ValueError("evaluation saw no tokens: the split is empty or num_batches is 0")
    return summarize(total, task_names)


class MetricWriter:
    """Appends metrics to <workdir>/metrics.jsonl and TensorBoard event files.

    A run resumed at step `resumed_at` (0: nothing restored) first drops what its
    checkpoint does not cover, the records of later steps (written before a restart),
    so no step is logged twice: metrics.jsonl keeps the rows up to that step, and when
    any were dropped the TensorBoard event files are rewritten from the rows kept.
    """

    def __init__(self, workdir: str, *, enabled: bool = True, resumed_at: int = 0):
        self.enabled = enabled and jax.process_index() == 0
        self._tb = None
        if self.enabled:
            os.makedirs(workdir, exist_ok=True)
            kept = truncate_after(workdir, resumed_at)
            self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")  # noqa: SIM115
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(workdir, "tb"))
            if kept is not None:
                for record in kept:
                    self._add_scalars(record)
                self._tb.flush()

    def write(self, step: int, metrics: dict, *, prefix: str = "") -> None:
        if not self.enabled:
            return
        scalars = {f"{prefix}{k}": _scalar(v) for k, v in metrics.items()}
        record = {"step": int(step), "time": time.time(), **scalars}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        self._add_scalars(record)
        self._tb.flush()

    def _add_scalars(self, record: dict) -> None:
        for key, value in record.items():
            if key not in ("step", "time"):
                self._tb.add_scalar(key, value, record["step"], walltime=record.get("time"))

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tb.close()


def _scalar(value):
    value = np.asarray(value).item()
    return value if isinstance(value, int) else float(value)


def read_jsonl(workdir: str) -> list[dict]:
    """Records of <workdir>/metrics.jsonl, in order (an empty list if none)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def truncate_after(workdir: str, step: int) -> list[dict] | None:
    """Drops the records of steps after `step` from <workdir>/metrics.jsonl (and a last
    line cut short by a kill) and, if any went or nothing was restored (`step` 0), the
    TensorBoard event files under <workdir>/tb. Returns the records kept when the event
    files went (to write them again), else None."""
    path = os.path.join(workdir, "metrics.jsonl")
    lines = []
    if os.path.exists(path):
        with open(path) as f:
            lines = [line for line in f if line.strip()]
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short when the run was killed
        if isinstance(record, dict) and int(record.get("step", 0)) <= step:
            kept.append(record)
    if len(kept) != len(lines):
        workdir_lib.write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
    events = glob.glob(os.path.join(workdir, "tb", "events.out.tfevents.*"))
    if events and (len(kept) != len(lines) or step == 0):
        for event_file in events:
            os.remove(event_file)
        return kept
    return None
