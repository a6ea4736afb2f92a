"""The position schemes RoPE is compared against, beside the rotation-site rows; ROWS.

  python -m rope_jax.experiments.sweep --config=configs/positions.py:size=tiny \
      --workdir=runs/positions --seeds=3 --results=results/research/position_schemes
  python train.py --config=configs/positions.py:size=tiny,row=alibi --workdir=runs/x

Questions: does any scheme beat QK-RoPE at T at this size; which keep their loss past T
(the sweep evaluates T, 2T, 4T) without a scaling rule; where VO-RoPE lands among them.
Every row is `configs/lm.py` at the same size and data, with:

  qk, qkvo, vo, nope  the rotation-site rows (lm.ROWS)
  alibi               no rotation, ALiBi's bias (model.attention.bias, nn/biases.py)
  fire                no rotation, FIRE's learned bias
  qk_fire             QK-RoPE with FIRE's bias beside it
  fox                 no rotation, the Forgetting Transformer's forget gate (bias "forget")
  stick_breaking      no rotation, stick-breaking attention weights instead of softmax
  xpos                QK-RoPE with xPos's decay (model.rope.xpos_scale_base = 512, the
                      reference's gamma; docs/maths.md#xpos)
  half_truncated      QK-RoPE turning half its pairs (modded-nanogpt's half-truncated RoPE)
  half_truncated_ko   the same with the partial key offset (model.rope.key_offset)

Arg keys: size, row, data, steps (as configs/lm.py).
"""

from __future__ import annotations

from configs import lm

SITE_ROWS = ("qk", "qkvo", "vo", "nope")
BIAS_ROWS = {  # row -> (the site row it starts from, model.attention.bias)
    "alibi": ("nope", "alibi"),
    "fire": ("nope", "fire"),
    "qk_fire": ("qk", "fire"),
    "fox": ("nope", "forget"),
}
ROTATION_ROWS = {  # row -> (the site row it starts from, its rotation settings)
    "xpos": ("qk", {"model.rope.xpos_scale_base": 512.0}),
    "half_truncated": ("qk", {"model.rope.pairs.rule": "half_truncated"}),
    "stick_breaking": ("nope", {"model.attention.stick_breaking": True}),
    "half_truncated_ko": (
        "qk",
        {"model.rope.pairs.rule": "half_truncated", "model.rope.key_offset": True},
    ),
}
ROWS = (*SITE_ROWS, *BIAS_ROWS, *ROTATION_ROWS)


def row_overrides(row: str, size: str = "tiny") -> dict:
    """Dotted overrides of `row` (module docstring) at size preset `size`."""
    if row in SITE_ROWS:
        return lm.row_overrides(row, size)
    if row in ROTATION_ROWS:
        base, settings = ROTATION_ROWS[row]
        return {**lm.row_overrides(base, size), **settings}
    if row not in BIAS_ROWS:
        raise ValueError(f"row={row!r} is not one of {', '.join(ROWS)}")
    base, bias = BIAS_ROWS[row]
    return {**lm.row_overrides(base, size), "model.attention.bias": bias}


def get_config(arg: str | None = None):
    return lm.config_of_rows(arg, row_overrides)


def sweep(add, arg: str | None = None):
    """One run per row of ROWS; the sweep tool adds seeds."""
    lm.add_rows(add, arg, ROWS, row_overrides)
