"""The training harness: everything between a config and a trained, evaluated run.

  checks      resolve(config): filled from rope_jax.defaults, every rule checked, frozen
  optim       schedules and optimisers (one registry each)
  steps       the state pytree, the pure train and eval steps
  setup       build(config) -> Setup (mesh, shardings, jitted steps); train_iterator;
              evaluate; dry_run
  feed        batches onto devices: placement, prefetch thread, abstract batches
  loop        train_and_evaluate(config, workdir): the training loop
  evaluate    evaluate_checkpoint / generate_text from a workdir
  evals/      the evaluation tasks, one registry (loss, passkey, RULER's), named by eval.tasks
  suite       every task at every length into a directory, resumable (eval.py --out)
  progress    progress lines of long evaluations and continuations
  checkpoint  Orbax checkpoints, verified on restore (checksums: their crc32 sums)
  runfiles    config.json and tokenizer/ of a workdir; resume: what may change on resume
  metrics     losses, evaluation sums, metric files
  flops       parameters, model FLOPs per token and per budget (full and causal), MFU
  cpuspeed    whether this CPU's bfloat16 products are slower than float32's (measured)
  cost        the cost plan of a token budget (python -m rope_jax.harness.cost)
  workdir     one writer per workdir (lock), writability, free space, atomic writes
  console     quiet logs and the run's progress lines
  cli         flag parsing for train.py / eval.py with one-line errors
  distributed process start-up of multi-process runs (SLURM, TPU pods, explicit flags)

The names most callers need are re-exported here (`harness.build(config)`).
"""

from rope_jax.harness.checks import check_batch_fits_mesh, check_config, resolve, settle_vocab
from rope_jax.harness.evaluate import evaluate_checkpoint, generate_text
from rope_jax.harness.feed import Prefetch, abstract_batch, put_batch
from rope_jax.harness.loop import NonFiniteLoss, print_dry_run, train_and_evaluate
from rope_jax.harness.optim import OPTIMIZERS, SCHEDULES, make_optimizer
from rope_jax.harness.setup import (
    Setup,
    build,
    bytes_per_device,
    dry_run,
    evaluate,
    num_elements,
    train_iterator,
)
from rope_jax.harness.steps import create_model, init_state, make_eval_step, make_train_step

__all__ = [
    "OPTIMIZERS",
    "SCHEDULES",
    "NonFiniteLoss",
    "Prefetch",
    "Setup",
    "abstract_batch",
    "build",
    "bytes_per_device",
    "check_batch_fits_mesh",
    "check_config",
    "create_model",
    "dry_run",
    "evaluate",
    "evaluate_checkpoint",
    "generate_text",
    "init_state",
    "make_eval_step",
    "make_optimizer",
    "make_train_step",
    "num_elements",
    "print_dry_run",
    "put_batch",
    "resolve",
    "settle_vocab",
    "train_and_evaluate",
    "train_iterator",
]
