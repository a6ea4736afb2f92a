"""A run's pieces, built from a config before the first step, and what uses them.

`build(config)` resolves the config (`harness.checks.resolve`), then makes the mesh, the
optimiser, the abstract sharded state and the jitted steps, allocating nothing;
`train_iterator` is the run's training data; `evaluate` scores parameters on a held-out
split; `dry_run` sizes a config without allocating it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from rope_jax import data, sharding
from rope_jax.harness import checks, feed, flops, metrics, optim, steps


class Setup(NamedTuple):
    """Everything built from a config before the first step (nothing allocated yet)."""

    mesh: Any
    rules: tuple
    tx: optax.GradientTransformation
    graphdef: Any
    init_fn: Callable  # () -> state, to jit with out_shardings=shardings
    abstract: Any  # state of ShapeDtypeStructs carrying shardings (restore target)
    shardings: Any
    batch_sharding: Any
    train_step: Callable  # jitted (state, batch) -> (state, metrics); donates state
    eval_step: Callable  # jitted (params, batch) -> metrics.eval_sums dict
    task_names: tuple  # question-answer tasks of multimodal data; () for text


def build(config, *, vocab_from_data: bool = True) -> Setup:
    """Resolves the config (once: a resolved one passes through; with `vocab_from_data`
    `model.vocab_size` follows the data's tokenizer, so the data must be built or
    prepared), then builds mesh, optimiser, abstract sharded state, steps."""
    config = checks.resolve(config)
    if vocab_from_data:
        config = checks.settle_vocab(config)
    mesh = sharding.make_mesh(config.mesh.shape, config.mesh.axes)
    checks.check_batch_fits_mesh(config, mesh)
    rules = sharding.axis_rules(config.mesh.logical_axis_rules)
    tx = optim.make_optimizer(config.optim, config.train.num_steps)
    graphdef, init_fn, abstract = steps.init_state(config, tx)
    shardings = sharding.state_shardings(abstract, mesh, rules)
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    batch_sharding = sharding.batch_sharding(mesh, rules)
    train_step = jax.jit(
        steps.make_train_step(
            graphdef,
            tx,
            microbatches=config.train.microbatches,
            z_loss=config.optim.z_loss,
        ),
        in_shardings=(shardings, batch_sharding),
        out_shardings=(shardings, None),
        donate_argnums=0,
    )
    task_names = data.kind(config.data).task_names
    eval_step = jax.jit(
        steps.make_eval_step(graphdef, len(task_names)),
        in_shardings=(shardings["params"], batch_sharding),
    )
    return Setup(mesh, rules, tx, graphdef, init_fn, abstract, shardings, batch_sharding,
                 train_step, eval_step, task_names)  # fmt: skip


def train_iterator(config):
    """The training batches of a run: `data.make_train_iterator` seeded by `config.seed`,
    this process's rows of each global batch of `data.global_batch_size`."""
    return data.make_train_iterator(
        config.data,
        seed=config.seed,
        batch_size=config.data.global_batch_size // jax.process_count(),
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )


def evaluate(run: Setup, params, config, *, split: str, seq_len: int | None = None,
             num_batches: int = 0, watch=None) -> dict:  # fmt: skip
    """Held-out metrics of `params` on `split` at context `seq_len` (default training's).
    `watch(batches)` wraps the batches (progress lines: `evaluate.Progress.watch`)."""
    batches = data.make_eval_iterator(
        config.data,
        split=split,
        batch_size=config.eval.batch_size // jax.process_count(),  # global batch: eval.batch_size
        seq_len=seq_len,
        num_batches=num_batches or None,
        spread=config.eval.sample == "spread",
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    placed = (feed.put_batch(b, run.batch_sharding) for b in batches)
    if watch is not None:
        placed = watch(placed)
    with sharding.use_mesh(run.mesh, run.rules):
        return metrics.evaluate(run.eval_step, params, placed, run.task_names)


def dry_run(config) -> dict:
    """Parameter count, per-device bytes (eval_shape + XLA memory analysis) and the model
    FLOPs of the run (`harness.flops`: per token, and for the token budget); no arrays."""
    config = checks.settle_vocab(config)  # the FLOPs count the data's vocabulary
    run = build(config)
    extra = data.kind(config.data).batch_fields()
    batch = feed.abstract_batch(
        config.data.global_batch_size, config.data.seq_len, run.batch_sharding, extra
    )
    with sharding.use_mesh(run.mesh, run.rules):
        analysis = run.train_step.lower(run.abstract, batch).compile().memory_analysis()
    return {
        "parameters": num_elements(run.abstract["params"]),
        "devices": jax.device_count(),
        "mesh": dict(run.mesh.shape),
        "params_bytes_per_device": bytes_per_device(run.abstract["params"]),
        "opt_bytes_per_device": bytes_per_device(run.abstract["opt"]),
        "temp_bytes_per_device": int(getattr(analysis, "temp_size_in_bytes", 0) or 0),
        "flops_per_token": flops.flops_per_token(config),
        "total_flops": flops.total_flops(config),
    }


def num_elements(tree) -> int:
    """Total number of array elements in a tree (arrays or ShapeDtypeStructs)."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def bytes_per_device(tree) -> int:
    """Bytes one device holds for a tree of sharded arrays / ShapeDtypeStructs."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return total
