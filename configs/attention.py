"""The attention of today's open models beside the rotation-site ablation; ROWS = the rows.

  python -m rope_jax.experiments.sweep --config=configs/attention.py:size=tiny \
      --workdir=runs/attention --seeds=2 --results=results/research/attention_variants
  python train.py --config=configs/attention.py:size=tiny,row=qkvo_sinks --workdir=runs/x

Questions: does an attention sink (one learnable logit per query head in every softmax
denominator, gpt-oss / DeepSeek-V4) change the site ablation's order or its growth past
T; where do Llama 4's iRoPE and DeepSeek-V4's attention land beside qk, qkvo and tied
qkvo; does V4's small rotated slice (H/8) keep qkvo's loss at T. Every row is
`configs/lm.py` at the same size and data, with:

  <sites>             the site ablation's row (lm.ROWS): qk, vo, qkvo, nope
  tied_qkvo           one latent per kv head is key and value, rotated once (lm.EXTRA_ROWS)
  <row>_sinks         the same with model.attention.sinks = True
  irope, v4           Llama 4's and DeepSeek-V4's attention at this size (lm.EXTRA_ROWS)
  v4_whole_head       v4 rotating the whole head instead of H/8
  tied_qkvo_h8        tied_qkvo rotating H/8 interleaved pairs, as v4 (nothing else of v4)

and which of iRoPE's changes to qk carries its loss: irope with one undone each, and the
L2 norm alone (its interleaved pairs are qk's pairs in another order of the head's dims,
which learned weights absorb, so they are not a row):

  irope_no_l2         irope without the L2 norm of q and k
  irope_no_chunks     irope with every layer full (no chunked attention)
  irope_no_nope       irope rotating every layer (no NoPE layer, so no query temperature)
  qk_l2               qk with the L2 norm of q and k, nothing else of irope

Arg keys: size, row, data, steps (as configs/lm.py).
"""

from __future__ import annotations

from configs import common, lm

SITE_ROWS = ("qk", "vo", "qkvo", "nope", "tied_qkvo")  # each with and without a sink
OPEN_ROWS = ("irope", "v4")  # open models' attention, from lm.EXTRA_ROWS
SLICE = {"model.rope.layout": "interleaved", "model.rope.pairs.rule": "first",
         "model.rope.pairs.fraction": 0.125}  # fmt: skip
NO_NOPE = {"model.rope.nope_every": 0, "model.rope.nope_attn_scale": 0.0}
# row -> (the row it changes, size preset -> the changes): the rotated slice alone, then
# iRoPE's parts
CHANGED_ROWS = {
    "v4_whole_head": (
        "v4",
        lambda p: {"model.rope.pairs.rule": "all", "model.rope.pairs.fraction": None},
    ),
    "tied_qkvo_h8": ("tied_qkvo", lambda p: SLICE),
    "irope_no_l2": ("irope", lambda p: {"model.attention.qk_l2_norm": False}),
    "irope_no_chunks": (
        "irope",
        lambda p: {
            "model.attention.layer_types": ("full",) * p["num_layers"],
            "model.attention.chunk": 0,
        },
    ),  # fmt: skip
    "irope_no_nope": ("irope", lambda p: NO_NOPE),
    "qk_l2": ("qk", lambda p: {"model.attention.qk_l2_norm": True}),
}


def row_overrides(row: str, size: str = "tiny") -> dict:
    """Dotted overrides of `row` (module docstring) at size preset `size`."""
    if row in CHANGED_ROWS:
        base, changes = CHANGED_ROWS[row]
        return {**lm.row_overrides(base, size), **changes(common.size_preset(size))}
    base, sinks = (row[: -len("_sinks")], True) if row.endswith("_sinks") else (row, False)
    if base not in (*SITE_ROWS, *OPEN_ROWS) or (sinks and base not in SITE_ROWS):
        raise ValueError(f"row={row!r} is not one of {', '.join(rows())}")
    return {**lm.row_overrides(base, size), **({"model.attention.sinks": True} if sinks else {})}


def rows() -> list[str]:
    return [*SITE_ROWS, *(f"{r}_sinks" for r in SITE_ROWS), *OPEN_ROWS, *CHANGED_ROWS]


def get_config(arg: str | None = None):
    return lm.config_of_rows(arg, row_overrides)


def sweep(add, arg: str | None = None):
    """One run per row of `rows()`; the sweep tool adds seeds."""
    lm.add_rows(add, arg, rows(), row_overrides)
