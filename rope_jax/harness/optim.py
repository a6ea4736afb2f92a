"""The optimiser: one registry of learning-rate schedules, one of update rules.

`config.optim.schedule` and `config.optim.name` pick an entry of `SCHEDULES` and
`OPTIMIZERS`; `make_optimizer` chains global-norm clipping in front when asked.
"""

from __future__ import annotations

import jax
import optax

from rope_jax.learned import PARAM_NAMES

SCHEDULES = {
    "cosine": lambda lr, warmup, total: optax.warmup_cosine_decay_schedule(
        0.0, lr, warmup, max(total, warmup + 1), end_value=0.1 * lr
    ),
    "linear": lambda lr, warmup, total: optax.join_schedules(
        [
            optax.linear_schedule(0.0, lr, warmup),
            optax.linear_schedule(lr, 0.0, max(total - warmup, 1)),
        ],
        [warmup],
    ),  # fmt: skip
    "constant": lambda lr, warmup, total: optax.join_schedules(
        [optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr)], [warmup]
    ),
}


def _decay_mask(params):
    """Weight decay on matrices only: not norms' scales, nor a learned rotation's
    frequencies and basis (`learned.PARAM_NAMES`: decay would pull them towards NoPE and
    the fixed basis, not bound a weight's size)."""
    rotation = lambda path: any(getattr(key, "key", None) in PARAM_NAMES for key in path)
    return jax.tree_util.tree_map_with_path(
        lambda path, p: p.ndim >= 2 and not rotation(path), params
    )


OPTIMIZERS = {
    "adamw": lambda c, lr: optax.adamw(lr, c.b1, c.b2, weight_decay=c.weight_decay,
                                       mask=_decay_mask),
    "adam": lambda c, lr: optax.adam(lr, c.b1, c.b2),
    "sgd": lambda c, lr: optax.sgd(lr, momentum=c.b1),
}  # fmt: skip


def make_optimizer(optim_cfg, num_steps: int) -> optax.GradientTransformation:
    lr = SCHEDULES[optim_cfg.schedule](optim_cfg.lr, optim_cfg.warmup_steps, num_steps)
    tx = OPTIMIZERS[optim_cfg.name](optim_cfg, lr)
    if optim_cfg.grad_clip_norm:
        tx = optax.chain(optax.clip_by_global_norm(optim_cfg.grad_clip_norm), tx)
    return tx
