"""Language model on text (bytes or subwords); ROWS = the VO-RoPE rotation-site ablation.

  python train.py --config=configs/lm.py:size=tiny,row=vo --workdir=runs/vo
  python -m rope_jax.experiments.sweep --config=configs/lm.py:size=tiny --workdir=runs/vo_ablation

Arg keys: size (tiny | small | 1b), row (a key of ROWS or EXTRA_ROWS), data (shakespeare |
python_stdlib | any TFDS text dataset name), steps (0 = the preset's num_steps).
"""

from __future__ import annotations

import ml_collections

from configs import common

# Rotation sites per ablation row (docs/maths.md#rotation-sites-vo-rope):
# q_i -> R_i q_i, k_j -> R_j k_j,
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

# Tied key/value ablation (docs/maths.md#the-tied-keyvalue-cache):
# row -> (size preset -> dotted overrides),
# after ROWS. The matched widths depend on the preset `p`:
#   tied_qkvo           one latent per kv head, rotated once, is key and value (qkvo).
#   separate_qk_params  standard qk at tied_qkvo's parameter count: tying drops D*K*H
#                       weights per layer and SwiGLU holds 3*D per unit of mlp_dim, so
#                       mlp_dim shrinks by round(K*H/3) (totals match within 0.1%).
#   separate_qk_cache   standard qk at tied_qkvo's cache bytes per token: half the kv heads.
# and Llama 4's iRoPE (rope_jax/nn/irope.py), rotating qk everywhere but the NoPE layers:
#   irope               every 4th layer NoPE (the last of 2 in `tiny`): full attention with
#                       the query temperature; the others rotate interleaved pairs, L2-norm
#                       q and k and attend in chunks of T/4 tokens (floor_scale = the chunk,
#                       as Llama 4's 8192 and 8192). T is the size preset's data.seq_len
#                       (32-token chunks at `tiny`); a run that sets data.seq_len keeps them.
# and DeepSeek-V4's attention (rope_jax/nn/v4.py) at the preset's size, V4-Flash's ratios:
#   v4                  one shared kv head tied as key and value (qkvo), an interleaved
#                       rotation of H/8 dims, sinks, queries from a D/4 latent with every
#                       head at unit RMS, the latent's RMSNorm, the output in max(2, N/8)
#                       groups of rank D/4; every layer V4's sliding branch over T/4 keys, T
#                       the size preset's (32 at `tiny`, whatever data.seq_len a run sets;
#                       its compressed layers, which carry the long range, are out of scope).
EXTRA_ROWS = {
    "tied_qkvo": lambda p: {"model.attention.kv": "tied", "model.rope.sites": "qkvo"},
    "separate_qk_params": lambda p: {
        "model.attention.kv": "separate",
        "model.rope.sites": "qk",
        "model.mlp_dim": p["mlp_dim"] - round(p["num_kv_heads"] * p["head_dim"] / 3),
    },
    "separate_qk_cache": lambda p: {
        "model.attention.kv": "separate",
        "model.rope.sites": "qk",
        "model.num_kv_heads": _half(p["num_kv_heads"]),
    },
    "irope": lambda p: _irope(p["num_layers"], p["seq_len"] // 4),
    "v4": lambda p: _v4(p),
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


def _irope(num_layers: int, chunk: int) -> dict:
    """The irope row's overrides: NoPE every min(4, L) layers, the others chunked."""
    every = min(4, num_layers)
    types = tuple("full" if (i + 1) % every == 0 else "chunked" for i in range(num_layers))
    return {
        "model.rope.sites": "qk",
        "model.rope.layout": "interleaved",
        "model.rope.nope_every": every,
        "model.rope.nope_attn_scale": 0.1,
        "model.rope.nope_floor_scale": float(chunk),
        "model.attention.layer_types": types,
        "model.attention.chunk": chunk,
        "model.attention.qk_l2_norm": True,
    }


def _v4(p: dict) -> dict:
    """The v4 row's overrides at size preset `p` (V4-Flash: D 4096, N 64, H 512, rope 64,
    q_lora_rank 1024, 8 output groups of rank 1024, window 128)."""
    return {
        "model.num_kv_heads": 1,
        "model.attention.kv": "tied",
        "model.rope.sites": "qkvo",
        "model.rope.layout": "interleaved",
        "model.rope.pairs.rule": "first",
        "model.rope.pairs.fraction": 0.125,
        "model.attention.sinks": True,
        "model.attention.window": p["seq_len"] // 4,
        "model.attention.q_lora_rank": p["embed_dim"] // 4,
        "model.attention.q_l2_norm": True,
        "model.attention.kv_norm": True,
        "model.attention.o_groups": max(2, p["num_heads"] // 8),
        "model.attention.o_lora_rank": p["embed_dim"] // 4,
    }


def _half(num_kv_heads: int) -> int:
    if num_kv_heads % 2:
        raise ValueError(f"num_kv_heads={num_kv_heads} is odd: separate_qk_cache halves it")
    return num_kv_heads // 2


def row_overrides(row: str, size: str = "tiny") -> dict:
    """Dotted config overrides of ablation `row` at size preset `size`."""
    if row in ROWS:
        return {"model.rope.sites": ROWS[row]}
    if row in EXTRA_ROWS:
        return EXTRA_ROWS[row](common.size_preset(size))
    raise ValueError(f"row={row!r} is not one of {', '.join([*ROWS, *EXTRA_ROWS])}")


def _parse(arg: str | None):
    return common.parse_arg(arg, size="tiny", row="qk", data="shakespeare", steps=0)


def get_config(arg: str | None = None):
    arg = _parse(arg)
    overrides = row_overrides(arg.row, arg.size)
    config = common.base_config(arg.size)
    config.update_from_flattened_dict(overrides)
    config.data.name = arg.data
    if arg.steps:
        config.train.num_steps = arg.steps
    return config


def sweep(add, arg: str | None = None):
    """One run per ablation row (ROWS, then EXTRA_ROWS); the sweep tool adds seeds.

    `arg` is the config arg (`size=small,...`): its size sizes the matched rows.
    """
    add_rows(add, arg, [*ROWS, *EXTRA_ROWS], row_overrides)


def config_of_rows(arg: str | None, overrides_of) -> ml_collections.ConfigDict:
    """The config of a rows file built on this one (configs/attention.py, positions.py):
    lm's at the arg's size, data and steps, then `overrides_of(row, size)`."""
    a = _parse(arg)
    config = get_config(f"size={a.size},data={a.data},steps={a.steps}")
    config.update_from_flattened_dict(overrides_of(a.row, a.size))
    return config


def add_rows(add, arg: str | None, rows, overrides_of) -> None:
    """A rows file's sweep: one `add` per row, at the arg's size."""
    size = _parse(arg).size
    for row in rows:
        add(name=row, **overrides_of(row, size))
