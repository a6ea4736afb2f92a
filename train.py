r"""Trains a decoder; one config flag picks the positional scheme.

  python train.py --config=configs/lm.py:size=tiny,row=vo --workdir=runs/vo
  python train.py --config=configs/lm.py:size=1b --dry_run      # sizes, no allocation

Restarting the same command resumes from the newest checkpoint (parameters, optimiser,
data position), verified against its checksums; --fallback resumes from the newest
intact one when newer ones are damaged. A resume whose config changes what the
checkpoints mean (data, optimiser, schedule, seed, train.num_steps) stops with the
fields, unless --allow_config_change. SIGTERM or Ctrl-C saves a checkpoint at the end
of the current step and exits 0 (a second Ctrl-C aborts at once); a non-finite loss
or a failed save stops the run at that step and keeps the last good checkpoint. One
run per workdir at a time. Logs of absl/Orbax/TFDS are off unless --verbosity=0 (-v 0).

Several processes (one per host or GPU) run the same command: `srun python train.py
...` on SLURM, the same command on every worker of a TPU pod, or elsewhere with
--coordinator_address=HOST:PORT --num_processes=N --process_id=I
(`harness.distributed`, docs/cluster.md).
"""

from __future__ import annotations

from rope_jax import signals

if __name__ == "__main__":  # first: a Ctrl-C while JAX imports (seconds) waits for main
    signals.hold_signals()

import jax
from absl import app, flags
from ml_collections import config_flags

from rope_jax.harness import cli, console, cpuspeed, distributed
from rope_jax.harness.loop import NonFiniteLoss, print_dry_run, train_and_evaluate
from rope_jax.hf import run as hf_run

FLAGS = flags.FLAGS


def define_flags():
    config_flags.DEFINE_config_file("config", None, "Config file (path:arg).")
    flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics).")
    flags.DEFINE_bool("dry_run", False, "Print parameter count and memory; no run.")
    flags.DEFINE_bool(
        "fallback",
        False,
        "Resume from the newest intact checkpoint if newer ones are "
        "damaged (they are moved to damaged_checkpoints/).",
    )
    flags.DEFINE_bool(
        "allow_config_change",
        False,
        "Resume although data/optimiser/schedule/seed/"
        "num_steps differ from config.json (the old one is kept as config.<step>.json).",
    )
    distributed.define_flags()


def main(argv):
    signals.release_signals()  # one that came while the modules imported: stops it here
    if len(argv) > 1:
        cli.fail(f"unexpected arguments: {argv[1:]}", cli.USAGE_ERROR)
    distributed.start()  # several processes: before anything touches a device
    config = FLAGS.config
    if config is None:
        cli.fail("--config is required, e.g. --config=configs/lm.py:size=tiny", cli.USAGE_ERROR)
    if jax.process_index() == 0 and (line := cpuspeed.bf16_advice(config.model.dtype)):
        console.warn(line)  # once, before anything compiles: bf16 measured slower here
    try:
        if FLAGS.dry_run:
            print_dry_run(config, sources=hf_run.SOURCES)
            return
        if not FLAGS.workdir:
            cli.fail("--workdir is required", cli.USAGE_ERROR)
        train_and_evaluate(config, FLAGS.workdir, fallback=FLAGS.fallback,
                           allow_config_change=FLAGS.allow_config_change,
                           sources=hf_run.SOURCES)  # init_from=hf:DIR  # fmt: skip
    except (ValueError, NonFiniteLoss) as e:
        cli.fail(e)
    except jax.errors.JaxRuntimeError as e:
        if (line := cli.out_of_memory(e)) is None:
            raise
        cli.fail(f"{line} (train.py --dry_run gives XLA's figure for a config)")
    except signals.Aborted:  # any other KeyboardInterrupt: `signals.hold_signals`'s one line
        cli.abort("aborted by a second Ctrl-C; the newest checkpoint is kept", 130)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.parse_flags)
