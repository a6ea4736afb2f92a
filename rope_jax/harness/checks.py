"""The run config resolved once, and every config rule, checked in one place.

  config = checks.resolve(raw)         # migrated, filled from rope_jax.defaults, checked, frozen
  data.ensure_built(config.data)
  config = checks.settle_vocab(config) # model.vocab_size from the data's tokenizer

Entry points (train, eval, build, dry run) call `resolve`; a resolved config (frozen) is
passed through, so its rules run once. Each section's rules are owned by the code that
reads the section (the model's by `nn.model.check_config`, the data's by its kind, the
optimiser's registries by `harness.optim`); `check_config` runs them all, in order, and
each failure is one `ValueError` line naming the field, its value and what is allowed.
"""

from __future__ import annotations

import ml_collections

from rope_jax import data, defaults, ruler
from rope_jax.harness import optim
from rope_jax.nn import model


def resolve(config) -> ml_collections.FrozenConfigDict:
    """`config` as every module reads it: an older run's layout migrated, every field
    filled from `rope_jax.defaults`, every rule checked (`check_config`), frozen. A
    frozen config is taken as resolved and returned as it is."""
    if isinstance(config, ml_collections.FrozenConfigDict):
        return config
    filled = defaults.fill(defaults.migrate(config))
    check_config(filled)
    return ml_collections.FrozenConfigDict(filled)


def settle_vocab(config) -> ml_collections.FrozenConfigDict:
    """The resolved `config` with `model.vocab_size` from the data's tokenizer, the one
    model field the data decides: the byte default (259) follows the tokenizer; any other
    value must equal it. Needs the data built or prepared (`data.ensure_built`)."""
    config = resolve(config)
    want = int(data.kind(config.data).vocab_size)
    have = config.model.vocab_size
    if have == want:
        return config
    if have != data.VOCAB_SIZE:
        raise ValueError(
            f"model.vocab_size={have} does not match the tokenizer of "
            f"{data.sources.describe(config.data)} ({want} ids); leave it at "
            f"{data.VOCAB_SIZE} to follow the tokenizer"
        )
    settled = defaults.fill(config)
    settled.model.vocab_size = want
    return ml_collections.FrozenConfigDict(settled)


def trained_length(config) -> int:
    """T, the context a run's model was trained at, which pages and default lengths read:
    `data.seq_len`, or for a run from a published checkpoint (`train.init_from=hf:...`)
    the longer of that and the checkpoint's own context (`model.rope.max_position_embeddings`,
    8,192 for SmolLM2), which its pretraining reached."""
    own = config.data.seq_len
    if str(config.train.get("init_from", "")).startswith("hf:"):
        return max(own, config.model.rope.get("max_position_embeddings") or 0)
    return own


def check_config(config: ml_collections.ConfigDict) -> None:
    """Every check that can fail before anything compiles; one ValueError line each."""
    _positive(config, "data.seq_len", "data.global_batch_size", "train.num_steps",
              "train.log_every_steps", "eval.batch_size", "train.ckpt_keep")  # fmt: skip
    _non_negative(config, "train.eval_every_steps", "train.ckpt_every_steps",
                  "eval.num_batches", "optim.warmup_steps", "optim.weight_decay",
                  "optim.grad_clip_norm", "data.max_documents")  # fmt: skip
    kind = data.kind(config.data)  # the model's checks read data.seq_len: checked first
    model.check_config(config.model, kind.num_axes, train_seq_len=config.data.seq_len)
    data.check_scheme(config.data)
    kind.check(config.model, config.eval.splits)
    microbatches = config.train.microbatches
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"train.microbatches={microbatches!r} must be a positive integer")
    _non_negative(config, "optim.z_loss", "train.num_tokens")
    if not config.optim.lr > 0:
        raise ValueError(f"optim.lr={config.optim.lr!r} must be > 0")
    _choice("eval.sample", config.eval.sample, ("first", "spread"))
    if config.eval.sample == "spread" and kind.name == "multimodal":
        raise ValueError("eval.sample='spread' samples windows of text; multimodal "
                         "splits are scored on their first questions (use 'first')")  # fmt: skip
    _choice("optim.name", config.optim.name, optim.OPTIMIZERS)
    _choice("optim.schedule", config.optim.schedule, optim.SCHEDULES)
    for length in config.eval.seq_lens:
        if not (isinstance(length, int) and length > 0):
            raise ValueError(f"eval.seq_lens={tuple(config.eval.seq_lens)} must be positive ints")
    _check_tasks(config)


def _check_tasks(config) -> None:
    """The shape of the evaluation-task fields; their names and what each task needs of
    the data are checked by `harness.evals.check` when a run or an evaluation starts."""
    tasks = config.eval.tasks
    if isinstance(tasks, str) or not all(isinstance(t, str) and t for t in tasks) or not tasks:
        raise ValueError(f"eval.tasks={tasks!r} must be a tuple of task names, e.g. ('loss',)")
    _positive(config, "eval.examples")
    _non_negative(config, "eval.answer_tokens")
    _choice("data.task_template", config.data.task_template, ruler.templates.TEMPLATES)


def check_batch_fits_mesh(config, mesh) -> None:
    """Global and eval batches must split evenly over the data-parallel devices."""
    data_parallel = mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1)
    for field in ("data.global_batch_size", "eval.batch_size"):
        if _get(config, field) % data_parallel:
            raise ValueError(
                f"{field}={_get(config, field)} is not divisible by the data-parallel size "
                f"{data_parallel} (mesh {dict(mesh.shape)})"
            )
    microbatches = config.train.microbatches
    per_device = config.data.global_batch_size // data_parallel
    if per_device % microbatches:
        raise ValueError(
            f"train.microbatches={microbatches} does not divide the per-device batch "
            f"{per_device} (data.global_batch_size={config.data.global_batch_size} over "
            f"{data_parallel} data-parallel devices)"
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
