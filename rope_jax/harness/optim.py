"""The optimiser: one registry of learning-rate schedules, one of update rules.

`config.optim.schedule` and `config.optim.name` pick an entry of `SCHEDULES` and
`OPTIMIZERS`; `make_optimizer` chains global-norm clipping in front when asked
(`clip_by_global_norm`: optax's formula, without a materialised copy of the gradients).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
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
        tx = optax.chain(clip_by_global_norm(optim_cfg.grad_clip_norm), tx)
    return tx


# optax >= 0.2.5 names it tree.norm (global_norm is deprecated there); older optax, as an
# accelerator image may hold, has only global_norm
_global_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """`optax.clip_by_global_norm`'s clip and state, written so that the clipped gradients
    are never a buffer of their own: each array is multiplied by one scalar, 1 when no
    clipping is needed (t * 1 = t, exactly: optax's numbers bit for bit), else
    max_norm / norm (optax's (t / norm) * max_norm to float rounding, an ulp or so).

    A multiplication by a scalar is cheap, so XLA fuses it into each of its consumers
    (Adam's first and second moments). optax's form, a `select` between each array and
    its scaled copy, and a division by the norm (an expensive op, which XLA does not
    duplicate into two consumers) are both materialised: a second gradient-sized buffer
    per array while the update runs (XLA:CPU's temp bytes of a train step, tested).
    What clipping itself costs stays: every gradient is alive until the global norm is
    known, before the first update."""

    def update(updates, state, params=None):
        del params
        norm = _global_norm(updates)
        # as optax: a NaN norm clips (to NaN); max_norm / norm computed once, in float32
        scale = jnp.where(norm < max_norm, 1.0, max_norm / norm)
        return jax.tree.map(lambda t: t * scale.astype(t.dtype), updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)
