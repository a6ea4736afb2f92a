"""Float32 vs bfloat16 compute for the language model; ROWS = the precision check.

  python -m rope_jax.experiments.sweep --config=configs/precision.py:size=tiny \
      --workdir=runs/precision \
      --seeds=3 --results=results/research/precision
  python train.py --config=configs/precision.py:row=bfloat16 --workdir=runs/bf16

`bfloat16` multiplies bfloat16 matrices with float32 accumulation and keeps float32
master weights and Adam state (`model.param_dtype`), norms, softmax, logits and the loss
(`rope_jax/model.py`); `float32` is the default model. Everything else is
`configs/lm.py` at the same size (rotation at q and k). Arg keys: size, row, data, steps
(0 = the size's default).
"""

from __future__ import annotations

from configs import common, lm

ROWS = {
    "float32": {"model.dtype": "float32"},
    "bfloat16": {"model.dtype": "bfloat16"},
}


def _parse(arg: str | None):
    return common.parse_arg(arg, size="tiny", row="float32", data="shakespeare", steps=0)


def get_config(arg: str | None = None):
    arg = _parse(arg)
    if arg.row not in ROWS:
        raise ValueError(f"row={arg.row!r} is not one of {', '.join(ROWS)}")
    config = lm.get_config(f"size={arg.size},data={arg.data},steps={arg.steps}")
    config.update_from_flattened_dict(ROWS[arg.row])
    return config


def sweep(add):
    for row, overrides in ROWS.items():
        add(name=row, **overrides)
