"""Questions about grids of handwritten digits; ROWS = the multimodal layout ablation.

  python train.py --config=configs/multimodal.py:row=rope_tv --workdir=runs/mm
  python -m rope_jax.experiments.sweep --config=configs/multimodal.py --workdir=runs/layouts \
      --seeds=3
  python -m rope_jax.experiments.sweep --config=configs/multimodal.py:video=true \
      --workdir=runs/video

Arg keys: size (tiny | small | 1b), row (a key of ROWS, or of VIDEO_ROWS with video=true),
video (false: images on 2 axes (h, w); true: videos on 3 axes (t, h, w)), steps (0 = 600).
VIDEO_ROWS add the video-only variants: Qwen3-VL's interleaved M-RoPE, Qwen2.5-VL's
time-aligned temporal ids and VideoRoPE (docs/maths.md#multimodal-rope-variants).
The data (`rope_jax.data.multimodal`) interleaves text with h x w grids of real 8x8
digits; every row of the sweep sees the same examples, and is scored on held-out
digits (`test`) and three generalisation splits (`larger` grids, unseen `aspect`
ratios, `long_prefix` text before the image).
"""

from __future__ import annotations

from configs import common
from rope_jax import rotary


def _sections(head_dim: int, num_axes: int, allocation: str = "sections") -> tuple[int, ...]:
    """Pairs per axis of H/2 pairs scaled from the published splits (`rotary.reference_sections`):
    (1/2, 1/2) on 2 axes; on 3, (1/4, 3/8, 3/8) for sections (Qwen2-VL) and videorope, and
    (3/8, 5/16, 5/16) for mrope_interleaved (Qwen3-VL)."""
    return rotary.reference_sections(allocation, head_dim, num_axes)


# Row -> dotted overrides: the layout (data.scheme, docs/maths.md#multimodal-layouts)
# and the rotation (model.rope). `model.rope.sections` is filled per size for every
# allocation but the default (alternating).
LAYOUT_ROWS = {
    "nope": {"model.rope.sites": "", "data.scheme": "flat"},
    "flat": {"data.scheme": "flat"},
    "mrope": {"data.scheme": "mrope"},
    "rope_tie": {"data.scheme": "rope_tie"},
    "rope_tie_frac": {"data.scheme": "rope_tie_frac"},
    "rope_tv": {"data.scheme": "rope_tv"},
}
# Axis allocation and frequency ladder for the two unit-spaced 2-D/3-D layouts, chosen
# before the sweep (Qwen2-VL's M-RoPE and RoPE-TV): contiguous sections instead of
# interleaved pairs, and one geometric ladder per axis instead of the shared one.
VARIANT_ROWS = {
    f"{scheme}_{name}": {"data.scheme": scheme, **variant}
    for scheme in ("rope_tv", "mrope")
    for name, variant in (("sections", {"model.rope.allocation": "sections"}),
                          ("per_axis", {"model.rope.ladder": "per_axis"}))
}  # fmt: skip
ROWS = {**LAYOUT_ROWS, **VARIANT_ROWS}
# Variants that need the time axis (on 2 axes mrope_interleaved with half / half sections
# is the interleaved allocation of the mrope row).
VIDEO_ONLY_ROWS = {
    # Qwen3-VL: t, h, w take turns down the ladder, the slowest pairs left to t.
    "mrope_interleaved": {"data.scheme": "mrope", "model.rope.allocation": "mrope_interleaved"},
    # Qwen2.5-VL: frame f at temporal id floor(f s tokens_per_second), here 2 ids a frame.
    "mrope_time": {"data.scheme": "mrope", "data.seconds_per_frame": 1.0,
                   "data.tokens_per_second": 2.0},
    # VideoRoPE: diagonal layout, frames delta = 2 ids apart, t on the slowest pairs.
    "videorope": {"data.scheme": "videorope", "data.delta": 2.0,
                  "model.rope.allocation": "videorope"},
}  # fmt: skip
# 2-D-only layouts (rope_tie, rope_tie_frac) cannot place a video.
VIDEO_ROWS = {
    **{k: v for k, v in ROWS.items() if not k.startswith("rope_tie")},
    **VIDEO_ONLY_ROWS,
}

DATA = {False: ("digit_grids", 2), True: ("digit_videos", 3)}  # video -> (data.name, A)
HELD_OUT = ("test", "larger", "aspect", "long_prefix")


def _parse(arg: str | None):
    return common.parse_arg(arg, size="tiny", row="rope_tv", video=False, steps=0)


def rows(video: bool) -> dict:
    return VIDEO_ROWS if video else ROWS


def row_overrides(row: str, size: str = "tiny", video: bool = False) -> dict:
    """Dotted config overrides of ablation `row`."""
    table = rows(video)
    if row not in table:
        raise ValueError(f"row={row!r} is not one of {', '.join(table)} (video={video})")
    out = dict(table[row])
    allocation = out.get("model.rope.allocation", "alternating")
    if allocation != "alternating":
        head_dim = common.size_preset(size)["head_dim"]
        out["model.rope.sections"] = _sections(head_dim, DATA[video][1], allocation)
    return out


def get_config(arg: str | None = None):
    arg = _parse(arg)
    config = common.base_config(arg.size)
    name, _ = DATA[arg.video]
    config.data.name = name  # rope_jax.data.multimodal.FAMILIES
    config.data.tasks = ()  # () = every task of the dataset, mixed uniformly
    config.data.seq_len = 48  # training pad length (checked); evaluation pads to fit each split
    config.data.global_batch_size = 32  # questions per step
    config.data.eval_split = "validation"  # unseen digits, training grid shapes
    config.model.patch_dim = 64  # one 8x8 digit per patch; positions: (h, w) or (t, h, w)
    config.train.num_steps = arg.steps or 600
    config.train.eval_every_steps = 150
    config.train.ckpt_every_steps = 300
    config.optim.warmup_steps = 30
    config.eval.num_batches = 16  # 16 x 32 = 512 questions per split
    config.eval.batch_size = 32
    config.eval.splits = HELD_OUT  # eval.py scores each at data.seq_len
    config.update_from_flattened_dict(row_overrides(arg.row, arg.size, arg.video))
    return config


def sweep(add, arg: str | None = None):
    """One run per layout row (ROWS, or VIDEO_ROWS with video=true); seeds are added."""
    arg = _parse(arg)
    for row in rows(arg.video):
        add(name=row, **row_overrides(row, arg.size, arg.video))
