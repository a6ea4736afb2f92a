"""The training state and the pure step functions the harness jits.

State is a plain pytree `{"params": nnx.State, "opt": optax state, "step": int32}` so
it jits, shards and checkpoints without framework glue; the model's structure (the
NNX graphdef) is closed over by the step functions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from rope_jax import data
from rope_jax.harness import metrics
from rope_jax.nn import model


def create_model(config, seed: int) -> model.Decoder:
    """The decoder of `config`, with the data's number of position axes."""
    num_axes = data.kind(config.data).num_axes
    return model.Decoder(config.model, num_axes=num_axes, rngs=nnx.Rngs(seed))


def init_state(config, tx: optax.GradientTransformation):
    """Returns (graphdef, init_fn, abstract state), building the model abstractly once.

    `init_fn() -> state` is to be jitted (with out_shardings) to allocate; the abstract
    state holds ShapeDtypeStructs (no arrays).
    """
    built = {}

    def init_fn():
        net = create_model(config, config.seed)
        built.setdefault("graphdef", nnx.graphdef(net))
        params = nnx.state(net, nnx.Param)
        return {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    abstract = jax.eval_shape(init_fn)
    return built["graphdef"], init_fn, abstract


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
