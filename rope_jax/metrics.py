"""Held-out evaluation (the one `evaluate` train.py and eval.py share) and metric logs."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np


def token_losses(logits, targets, weights):
    """Summed cross-entropy and weight over a batch.

    Args:
      logits: [B, T, V] (any float dtype; reduced in float32).
      targets: [B, T] int.
      weights: [B, T] float, 0 for padding.

    Returns:
      (sum of weighted losses, sum of weights), float32 scalars.
    """
    logits = logits.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    gold = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.sum((logz - gold) * weights), jnp.sum(weights)


def summarize(loss_sum: float, weight_sum: float) -> dict:
    """loss (nats/token), perplexity, bits per byte (byte tokens) and token count."""
    loss = loss_sum / max(weight_sum, 1.0)
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 50.0)),
        "bits_per_byte": loss / math.log(2.0),
        "tokens": int(weight_sum),
    }


def evaluate(eval_step: Callable, params, batches: Iterable[dict]) -> dict:
    """Runs `eval_step(params, batch) -> (loss_sum, weight_sum)` over `batches`."""
    loss_sum, weight_sum = 0.0, 0.0
    for batch in batches:
        l_sum, w_sum = eval_step(params, batch)
        loss_sum += float(l_sum)
        weight_sum += float(w_sum)
    if weight_sum == 0:
        raise ValueError("evaluation saw no tokens: the split is empty or num_batches is 0")
    return summarize(loss_sum, weight_sum)


class MetricWriter:
    """Appends metrics to <workdir>/metrics.jsonl and TensorBoard event files."""

    def __init__(self, workdir: str, *, enabled: bool = True):
        self.enabled = enabled and jax.process_index() == 0
        self._tb = None
        if self.enabled:
            os.makedirs(workdir, exist_ok=True)
            self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")  # noqa: SIM115
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(workdir, "tb"))

    def write(self, step: int, metrics: dict, *, prefix: str = "") -> None:
        if not self.enabled:
            return
        scalars = {f"{prefix}{k}": _scalar(v) for k, v in metrics.items()}
        record = {"step": int(step), "time": time.time(), **scalars}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for key, value in scalars.items():
            self._tb.add_scalar(key, value, step)
        self._tb.flush()

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
