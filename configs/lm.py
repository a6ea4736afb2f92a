"""Byte-level language model on text; ROWS = the VO-RoPE rotation-site ablation.

  python train.py --config=configs/lm.py:size=tiny,row=vo --workdir=runs/vo
  python -m rope_jax.sweep --config=configs/lm.py:size=tiny --workdir=runs/vo_ablation

Arg keys: size (tiny | small | 1b), row (a key of ROWS), data (shakespeare |
python_stdlib | any TFDS text dataset name), steps (0 = the preset's num_steps).
"""

from __future__ import annotations

from configs import common

# Rotation sites per ablation row (SPEC.md section 2): q_i -> R_i q_i, k_j -> R_j k_j,
# v_j -> R_j v_j, o_i -> R_i^T o_i. The article's ~1B losses, lower is better:
# QK 2.712, QKVO 2.719, K 2.769, VO 2.770, QKV 2.783, NoPE 2.795, O 2.841, Q 2.851, V 2.856.
ROWS = {
    "nope": "",
    "q": "q",
    "k": "k",
    "v": "v",
    "o": "o",
    "qk": "qk",
    "vo": "vo",
    "qkv": "qkv",
    "qkvo": "qkvo",
}

# The article's table, for the sweep report (row -> loss).
ARTICLE_LOSS = {
    "qk": 2.712,
    "qkvo": 2.719,
    "k": 2.769,
    "vo": 2.770,
    "qkv": 2.783,
    "nope": 2.795,
    "o": 2.841,
    "q": 2.851,
    "v": 2.856,
}


def get_config(arg: str | None = None):
    arg = common.parse_arg(arg, size="tiny", row="qk", data="shakespeare", steps=0)
    if arg.row not in ROWS:
        raise ValueError(f"row={arg.row!r} is not one of {', '.join(ROWS)}")
    config = common.base_config(arg.size)
    config.model.rope.sites = ROWS[arg.row]
    config.data.name = arg.data
    if arg.steps:
        config.train.num_steps = arg.steps
    return config


def sweep(add):
    """One run per ablation row; the sweep tool adds seeds."""
    for row, sites in ROWS.items():
        add(name=row, **{"model.rope.sites": sites})
