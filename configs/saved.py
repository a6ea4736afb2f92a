"""The config a run saved: resume, extend or copy a run as it was configured, whatever
the config files and their presets say today.

  python train.py --config=configs/saved.py:runs/vo --workdir=runs/vo        # resume it
  python train.py --config=configs/saved.py:runs/vo --workdir=runs/vo \
      --config.train.num_steps=4000 --allow_config_change                  # train it on
  python train.py --config=configs/saved.py:runs/vo --workdir=runs/vo_s1 --config.seed=1

The arg is a workdir (or its config.json). The config comes in today's layout: fields
added since the run was saved take their defaults, the values it used
(`rope_jax.defaults`). `--config.<field>=...` overrides apply as to any config file.
"""

from __future__ import annotations

import os

from rope_jax.harness import runfiles


def get_config(arg: str | None = None):
    if not arg:
        raise ValueError("configs/saved.py reads a run's config: --config=configs/saved.py:WORKDIR")
    workdir = os.path.dirname(arg) if os.path.basename(arg) == runfiles.CONFIG_FILE else arg
    return runfiles.load_config(workdir or ".")
