"""Training pieces train.py composes: config checks, optimiser, the jitted steps.

State is a plain pytree `{"params": nnx.State, "opt": optax state, "step": int32}` so
it jits, shards and checkpoints without framework glue; the model's structure (the
NNX graphdef) is closed over by the step functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from rope_jax import data, layouts, metrics, model, sharding

# ------------------------------------------------------------------ config checks


def check_config(config: ml_collections.ConfigDict) -> None:
    """Every check that can fail before anything compiles; one ValueError line each."""
    model.check_config(config.model)
    rope = config.model.rope
    if rope.scheme not in layouts.SCHEMES:
        raise ValueError(
            f"model.rope.scheme={rope.scheme!r} is not one of {', '.join(layouts.SCHEMES)}"
        )
    if data.multimodal.is_multimodal(config.data):
        data.multimodal.check_config(config.data, config.model, config.eval.get("splits", ()))
    if config.model.vocab_size < data.VOCAB_SIZE:
        raise ValueError(
            f"model.vocab_size={config.model.vocab_size} is smaller than the tokenizer's "
            f"{data.VOCAB_SIZE}"
        )
    _positive(config, "data.seq_len", "data.global_batch_size", "train.num_steps",
              "train.log_every_steps", "eval.batch_size", "train.ckpt_keep")  # fmt: skip
    _non_negative(config, "train.eval_every_steps", "train.ckpt_every_steps",
                  "eval.num_batches", "optim.warmup_steps", "optim.weight_decay",
                  "optim.grad_clip_norm")  # fmt: skip
    if not config.optim.lr > 0:
        raise ValueError(f"optim.lr={config.optim.lr!r} must be > 0")
    _choice("optim.name", config.optim.name, OPTIMIZERS)
    _choice("optim.schedule", config.optim.schedule, SCHEDULES)
    for length in config.eval.seq_lens:
        if not (isinstance(length, int) and length > 0):
            raise ValueError(f"eval.seq_lens={tuple(config.eval.seq_lens)} must be positive ints")


def check_batch_fits_mesh(config, mesh) -> None:
    """Global and eval batches must split evenly over the data-parallel devices."""
    data_parallel = mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1)
    for field in ("data.global_batch_size", "eval.batch_size"):
        if _get(config, field) % data_parallel:
            raise ValueError(
                f"{field}={_get(config, field)} is not divisible by the data-parallel size "
                f"{data_parallel} (mesh {dict(mesh.shape)})"
            )


def _get(config, dotted):
    node = config
    for part in dotted.split("."):
        node = node[part]
    return node


def _positive(config, *fields):
    for field in fields:
        if not _get(config, field) > 0:
            raise ValueError(f"{field}={_get(config, field)!r} must be > 0")


def _non_negative(config, *fields):
    for field in fields:
        if _get(config, field) < 0:
            raise ValueError(f"{field}={_get(config, field)!r} must be >= 0")


def _choice(field, value, registry):
    if value not in registry:
        raise ValueError(f"{field}={value!r} is not one of {', '.join(registry)}")


# ------------------------------------------------------------------ optimiser

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
    """Weight decay on matrices only (not norms' scales)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


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


# ------------------------------------------------------------------ state and steps


def create_model(config, seed: int) -> model.Decoder:
    return model.Decoder(config.model, rngs=nnx.Rngs(seed))


def init_state(config, tx: optax.GradientTransformation):
    """Returns (graphdef, init_fn) with init_fn() -> state; jit/eval_shape it as needed."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: create_model(config, config.seed)))

    def init_fn():
        params = nnx.state(create_model(config, config.seed), nnx.Param)
        return {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    return graphdef, init_fn


def _forward(graphdef, params, batch):
    net = nnx.merge(graphdef, params)
    return net(
        batch["inputs"],
        batch.get("positions"),
        patches=batch.get("patches"),
        is_patch=batch.get("is_patch"),
    )


def make_train_step(graphdef, tx: optax.GradientTransformation):
    """(state, batch) -> (state, {"loss", "grad_norm"}); pure, for jax.jit."""

    def loss_fn(params, batch):
        logits = _forward(graphdef, params, batch)
        loss_sum, weight_sum = metrics.token_losses(logits, batch["targets"], batch["weights"])
        return loss_sum / jnp.maximum(weight_sum, 1.0)

    def train_step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        new_state = {"params": params, "opt": opt, "step": state["step"] + 1}
        return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    return train_step


def make_eval_step(graphdef, num_tasks: int = 0):
    """(params, batch) -> `metrics.eval_sums` dict; pure, for jax.jit."""

    def eval_step(params, batch):
        logits = _forward(graphdef, params, batch)
        return metrics.eval_sums(logits, batch["targets"], batch["weights"],
                                 batch.get("task"), num_tasks=num_tasks)  # fmt: skip

    return eval_step


# ------------------------------------------------------------------ a run's pieces


class Run(NamedTuple):
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


def build(config) -> Run:
    """Checks the config, then builds mesh, optimiser, abstract sharded state, steps."""
    check_config(config)
    mesh = sharding.make_mesh(config.mesh.shape, config.mesh.axes)
    check_batch_fits_mesh(config, mesh)
    rules = sharding.axis_rules(config.mesh.logical_axis_rules)
    tx = make_optimizer(config.optim, config.train.num_steps)
    graphdef, init_fn = init_state(config, tx)
    abstract = jax.eval_shape(init_fn)
    shardings = sharding.state_shardings(abstract, mesh, rules)
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    batch_sharding = sharding.batch_sharding(mesh, rules)
    train_step = jax.jit(
        make_train_step(graphdef, tx),
        in_shardings=(shardings, batch_sharding),
        out_shardings=(shardings, None),
        donate_argnums=0,
    )
    task_names = task_names_of(config)
    eval_step = jax.jit(
        make_eval_step(graphdef, len(task_names)),
        in_shardings=(shardings["params"], batch_sharding),
    )
    return Run(mesh, rules, tx, graphdef, init_fn, abstract, shardings, batch_sharding,
               train_step, eval_step, task_names)  # fmt: skip


def task_names_of(config) -> tuple:
    """The multimodal data's task names (the eval metrics' per-task keys); () for text."""
    if data.multimodal.is_multimodal(config.data):
        return data.multimodal.tasks(config.data)
    return ()


def evaluate(run: Run, params, config, *, split: str, seq_len: int | None = None,
             num_batches: int = 0) -> dict:  # fmt: skip
    """Held-out metrics of `params` on `split` at context `seq_len` (default training's)."""
    batches = data.make_eval_iterator(
        config.data,
        split=split,
        batch_size=config.eval.batch_size,
        seq_len=seq_len,
        num_batches=num_batches or None,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        rope=config.model.rope,
    )
    placed = (sharding.put_batch(b, run.batch_sharding) for b in batches)
    with sharding.use_mesh(run.mesh, run.rules):
        return metrics.evaluate(run.eval_step, params, placed, run.task_names)


def dry_run(config) -> dict:
    """Parameter count and per-device bytes (eval_shape + XLA memory analysis); no arrays."""
    run = build(config)
    extra = {}
    if data.multimodal.is_multimodal(config.data):
        extra = data.multimodal.batch_fields(config.data)
    batch = sharding.abstract_batch(
        config.data.global_batch_size, config.data.seq_len, run.batch_sharding, extra
    )
    with sharding.use_mesh(run.mesh, run.rules):
        analysis = run.train_step.lower(run.abstract, batch).compile().memory_analysis()
    return {
        "parameters": sharding.num_elements(run.abstract["params"]),
        "devices": jax.device_count(),
        "mesh": dict(run.mesh.shape),
        "params_bytes_per_device": sharding.bytes_per_device(run.abstract["params"]),
        "opt_bytes_per_device": sharding.bytes_per_device(run.abstract["opt"]),
        "temp_bytes_per_device": int(getattr(analysis, "temp_size_in_bytes", 0) or 0),
    }
