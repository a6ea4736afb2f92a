"""Shared config pieces: the arg parser and the model size presets.

Every experiment family (`configs/lm.py`, `configs/multimodal.py`) builds on these:

  python train.py --config=configs/lm.py:size=tiny,row=vo --workdir=runs/x
  python train.py --config=configs/lm.py:size=tiny --config.optim.lr=1e-3 ...
"""

from __future__ import annotations

import ml_collections

from rope_jax import defaults

# Decoder shapes (LLaMA-like: RMSNorm, SwiGLU, grouped-query attention).
#   tiny   trains at several steps/s on 2 CPU cores; tests and quick sweeps.
#   small  a useful CPU/GPU model (9.6M parameters).
#   l8     the CPU ladder's top rung (8 layers, D 256, T 256): ~50 min a run on 2 cores.
#   1b     ~1B parameters (LLaMA-3.2-1B-like body, byte vocabulary): pods only.
SIZES = {
    "tiny": defaults.SHAPE,
    "small": dict(num_layers=6, embed_dim=384, num_heads=6, num_kv_heads=2, head_dim=64,
                  mlp_dim=1024, seq_len=256, global_batch_size=32),
    "l8": dict(num_layers=8, embed_dim=256, num_heads=4, num_kv_heads=2, head_dim=64,
               mlp_dim=768, seq_len=256, global_batch_size=32),
    "1b": dict(num_layers=16, embed_dim=2048, num_heads=32, num_kv_heads=8, head_dim=64,
               mlp_dim=8192, seq_len=2048, global_batch_size=256),
}  # fmt: skip
LR = {"tiny": 3e-3, "small": 1e-3, "l8": 2e-3, "1b": 3e-4}  # peak learning rate per size


def parse_arg(arg: str | None, **fields) -> ml_collections.ConfigDict:
    """Parses `key=value,key=value` (big_vision style) over typed defaults.

    Values take the type of their default (bool accepts true/false/1/0); a key that has
    no default is an error, so a typo in the arg string never passes silently.
    """
    result = ml_collections.ConfigDict(fields)
    for item in filter(None, (arg or "").split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"config arg {item!r} is not key=value (in {arg!r})")
        if key not in fields:
            raise ValueError(f"config arg {key!r} is unknown; allowed: {', '.join(fields)}")
        default = fields[key]
        if isinstance(default, bool):
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"config arg {key}={value!r} must be true or false")
            result[key] = value.lower() in ("true", "1")
        else:
            try:
                result[key] = type(default)(value)
            except ValueError:
                raise ValueError(
                    f"config arg {key}={value!r} is not a {type(default).__name__}"
                ) from None
    return result


def size_preset(size: str) -> dict:
    if size not in SIZES:
        raise ValueError(f"size={size!r} is not one of {', '.join(SIZES)}")
    return dict(SIZES[size])


def base_config(size: str) -> ml_collections.ConfigDict:
    """Every field (`rope_jax.defaults`, where each is commented) at model size `size`."""
    c = defaults.config(size_preset(size))
    c.optim.lr = LR[size]
    c.model.remat = "block" if size == "1b" else "none"  # none | block (recompute in backward)
    return c
