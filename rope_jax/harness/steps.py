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

from rope_jax import data, sharding
from rope_jax.harness import metrics
from rope_jax.nn import model


def create_model(config, seed: int) -> model.Decoder:
    """The decoder of `config`, with the data's number of position axes."""
    num_axes = data.kind(config.data).num_axes
    return model.Decoder(
        config.model, num_axes=num_axes, train_seq_len=config.data.seq_len, rngs=nnx.Rngs(seed)
    )


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
        segments=batch.get("segments"),  # packed documents (data.packing='documents')
    )


def make_train_step(graphdef, tx: optax.GradientTransformation, *, microbatches: int = 1,
                    z_loss: float = 0.0):  # fmt: skip
    """(state, batch) -> (state, {"loss", "grad_norm"[, "z_loss"]}); pure, for jax.jit.

    The objective is the token-weighted mean over the whole batch,

      loss = (sum_t w_t ce_t + z_loss * sum_t w_t logz_t^2) / max(sum_t w_t, 1),

    logz_t = logsumexp of token t's logits (PaLM's z-loss; the term is left out, not
    multiplied by 0, when z_loss == 0, so the loss is then exactly the cross-entropy).
    "z_loss" in the metrics is the added term, reported only when z_loss > 0
    ("loss" includes it).

    Args:
      graphdef: the model's NNX graphdef (`init_state`).
      tx: the optimiser.
      microbatches: k; the batch is split into k microbatches of B/k rows
        (`split_microbatches`: microbatch j holds rows j, j + k, j + 2k, ...) run one
        after another in a `lax.scan`, their gradients summed in float32, then ONE
        optimiser update. Every microbatch's sums are divided by the whole batch's
        weight, so loss, gradient and update equal k = 1's to float32 rounding (not a
        mean of microbatch means when microbatches hold different numbers of tokens).
        Activation memory is that of B/k rows; B must be divisible by k.
      z_loss: weight of the z-loss term, >= 0.
    """
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches={microbatches!r} must be a positive integer")
    if not z_loss >= 0:
        raise ValueError(f"z_loss={z_loss!r} must be >= 0")

    def loss_fn(params, batch, denominator):
        """This batch's share of the objective: its weighted sums over the whole batch's
        weight. Returns (objective share, its z-loss term)."""
        logits = _forward(graphdef, params, batch)
        sums = metrics.loss_sums(logits, batch["targets"], batch["weights"])
        if not z_loss:
            return sums["loss_sum"] / denominator, jnp.zeros((), jnp.float32)
        z_term = z_loss * sums["z_sum"] / denominator
        return sums["loss_sum"] / denominator + z_term, z_term

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def accumulate(params, batch, denominator):
        """(loss, z term, grads) summed over the microbatches in float32."""
        f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)

        def body(carry, micro):
            loss, z_term, grads = carry
            (loss_m, z_m), grads_m = grad_fn(params, micro, denominator)
            grads = jax.tree.map(jnp.add, grads, f32(grads_m))
            return (loss + loss_m, z_term + z_m, grads), None

        zero = jnp.zeros((), jnp.float32)
        init = (zero, zero, jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
        micro = split_microbatches(batch, microbatches)
        (loss, z_term, grads), _ = jax.lax.scan(body, init, micro)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        return loss, z_term, grads

    def train_step(state, batch):
        params = state["params"]
        denominator = jnp.maximum(jnp.sum(batch["weights"]), 1.0)  # the whole batch's
        if microbatches == 1:
            (loss, z_term), grads = grad_fn(params, batch, denominator)
        else:
            loss, z_term, grads = accumulate(params, batch, denominator)
        updates, opt = tx.update(grads, state["opt"], params)
        new_state = {"params": optax.apply_updates(params, updates), "opt": opt,
                     "step": state["step"] + 1}  # fmt: skip
        out = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        if z_loss:
            out["z_loss"] = z_term
        return new_state, out

    return train_step


def split_microbatches(batch: dict, microbatches: int) -> dict:
    """Every field [B, ...] -> [k, B/k, ...]: microbatch j holds rows j, j + k, j + 2k, ...

    The split takes every k-th row (reshape to [B/k, k, ...], then swap the two axes)
    rather than k contiguous blocks: with the rows sharded over the data-parallel
    devices in contiguous blocks of B/devices, each device's slice of every microbatch is
    then made of its own rows (B/devices divisible by k), so the split moves no data
    between devices; the [k, B/k, ...] result keeps `batch` sharding on its second axis.
    """
    k = microbatches

    def split(x):
        b = x.shape[0]
        if b % k:
            raise ValueError(f"a batch of {b} rows does not split into microbatches={k}")
        x = jnp.swapaxes(x.reshape(b // k, k, *x.shape[1:]), 0, 1)
        return sharding.constrain(x, (None, "batch", *([None] * (x.ndim - 2))))

    return jax.tree.map(split, batch)


def make_eval_step(graphdef, num_tasks: int = 0):
    """(params, batch) -> `metrics.eval_sums` dict; pure, for jax.jit."""

    def eval_step(params, batch):
        logits = _forward(graphdef, params, batch)
        return metrics.eval_sums(logits, batch["targets"], batch["weights"],
                                 batch.get("task"), num_tasks=num_tasks,
                                 target_bytes=batch.get("target_bytes"))  # fmt: skip

    return eval_step


# ------------------------------------------------------------------ a run's pieces
