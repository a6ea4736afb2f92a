r"""Trains a decoder; one config flag picks the positional scheme.

  python train.py --config=configs/lm.py:size=tiny,row=vo --workdir=runs/vo
  python train.py --config=configs/lm.py:size=1b --dry_run      # sizes, no allocation

Restarting the same command resumes from the newest checkpoint (parameters, optimiser,
data position). SIGTERM saves a checkpoint and exits cleanly; a non-finite loss stops
the run at that step and keeps the last good checkpoint.
"""

from __future__ import annotations

import os
import sys

import jax
from absl import app, flags
from ml_collections import config_flags

from rope_jax.harness.loop import NonFiniteLoss, print_dry_run, train_and_evaluate

FLAGS = flags.FLAGS


def define_flags():
    config_flags.DEFINE_config_file("config", None, "Config file (path:arg).")
    flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics).")
    flags.DEFINE_bool("dry_run", False, "Print parameter count and memory; no run.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        jax.distributed.initialize()  # multi-host: the environment names the coordinator
    config = FLAGS.config
    if config is None:
        sys.exit("error: --config is required, e.g. --config=configs/lm.py:size=tiny")
    try:
        if FLAGS.dry_run:
            print_dry_run(config)
            return
        if not FLAGS.workdir:
            sys.exit("error: --workdir is required")
        train_and_evaluate(config, FLAGS.workdir)
    except (ValueError, NonFiniteLoss) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
