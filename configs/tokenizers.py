"""One model, one corpus, several tokenizers: compare them in bits per byte.

  python -m rope_jax.experiments.sweep --config=configs/tokenizers.py:size=tiny \
      --workdir=runs/tokenizers --results=results/research/tokenizers_tiny

Rows: `bytes` (the byte-level tokens) and byte-level BPEs of 1k, 4k and 8k ids trained
on the train split (`data.tokenizer=train:V`: the corpus is prepared once, on first
use, into <data_dir>/prepared/). Every row trains the same decoder body for the same
steps at the same T tokens per window, so a BPE row sees ~3-4x the text per step; the
sweep report ranks the rows by bits/byte (nats per token do not compare across
tokenizers). Arg keys: size, data (shakespeare | python_stdlib), steps, rope (sites).
"""

from __future__ import annotations

from configs import common

ROWS = {"bytes": "", "bpe1k": "train:1000", "bpe4k": "train:4000", "bpe8k": "train:8000"}


def _parse(arg: str | None):
    return common.parse_arg(arg, size="tiny", data="python_stdlib", steps=0, rope="qk")


def get_config(arg: str | None = None):
    arg = _parse(arg)
    config = common.base_config(arg.size)
    config.data.name = arg.data
    config.model.rope.sites = arg.rope
    if arg.steps:
        config.train.num_steps = arg.steps
    return config


def sweep(add, arg: str | None = None):
    """One run per tokenizer; the sweep tool adds seeds."""
    for row, spec in ROWS.items():
        add(name=row, **{"data.tokenizer": spec})
