"""Hugging Face `config.json` <-> rope_jax's `config.model`.

`ARCHITECTURES` is the one registry of what is read and written: an HF class name and
the model features its checkpoints carry (q/k/v biases, q/k RMSNorm per head). Import
(`model_fields`) maps a config.json to dotted `config.model` fields; export (`to_hf`)
writes a config.json that `transformers` reads as the same model, after
`check_exportable` has refused (one line naming the setting) what its classes cannot
express.

Field mapping (HF -> rope_jax `config.model`):
  vocab_size, num_hidden_layers, hidden_size,          vocab_size, num_layers, embed_dim,
  num_attention_heads, num_key_value_heads, head_dim,  num_heads, num_kv_heads, head_dim,
  intermediate_size, rms_norm_eps, tie_word_embeddings mlp_dim, norm_eps, tie_embeddings
  rope_parameters.rope_theta (or rope_theta)           rope.base
  rope_parameters (or rope_scaling), other keys        rope.scaling.* (the same key names)
  max_position_embeddings                              rope.max_position_embeddings
  (the architecture)                                   attention.qkv_bias, attention.qk_norm
and `rope.layout = "half"`: HF's Llama and Qwen code rotates pairs (i, i + H/2)
(`rotate_half`); an `interleaved` model is exported by permuting its q/k rows
(`weights.py`), so the scores are the same.
"""

from __future__ import annotations

import dataclasses
import json
import os

import ml_collections

from rope_jax import defaults
from rope_jax import scaling as scaling_lib

CONFIG_FILE = "config.json"


class HFError(ValueError):
    """A Hugging Face directory or a run that cannot be converted (one line)."""


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What an HF causal-LM class adds to the Llama block (`config.model.attention.*`)."""

    model_type: str
    qkv_bias: bool  # q/k/v projections carry biases (o does not)
    qk_norm: bool  # RMSNorm of scale [H] on every q and k head, before the rotation


ARCHITECTURES = {
    "LlamaForCausalLM": Architecture("llama", qkv_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": Architecture("qwen2", qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": Architecture("qwen3", qkv_bias=False, qk_norm=True),
}

# Dotted `config.model` fields that a checkpoint decides (`model_fields` sets them all);
# the others (sites, dtypes, remat, attention.impl, ...) stay the run's.
ARCH_FIELDS = (
    "vocab_size", "num_layers", "embed_dim", "num_heads", "num_kv_heads", "head_dim",
    "mlp_dim", "norm_eps", "tie_embeddings", "attention.qkv_bias", "attention.qk_norm",
    "rope.base", "rope.layout", "rope.max_position_embeddings", "rope.scaling",
)  # fmt: skip

# The rope keys of a config.json that are not context-scaling keys.
_ROPE_BASE = "rope_theta"


def read(directory: str) -> dict:
    """The parsed `config.json` of an HF model directory (HFError if absent or bad)."""
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isdir(directory):
        raise HFError(f"{directory!r} is not a directory (an HF model directory holds "
                      f"{CONFIG_FILE} and *.safetensors)")  # fmt: skip
    if not os.path.isfile(path):
        raise HFError(f"{directory!r} has no {CONFIG_FILE}: not a Hugging Face model directory")
    try:
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise HFError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise HFError(f"{path} holds {type(hf).__name__}, not a JSON object")
    return hf


def architecture(hf: dict) -> tuple[str, Architecture]:
    """(class name, its `Architecture`) of a config.json; HFError if not in the registry."""
    names = hf.get("architectures") or []
    name = names[0] if isinstance(names, list) and len(names) == 1 else names
    if name not in ARCHITECTURES:
        raise HFError(f"config.json architectures={names!r} is not supported; supported: "
                      f"{', '.join(ARCHITECTURES)}")  # fmt: skip
    return name, ARCHITECTURES[name]


def model_fields(hf: dict) -> dict:
    """Dotted `config.model` fields (`ARCH_FIELDS`) of a config.json; `rope.scaling` is a
    dict of HF keys with defaults filled. HFError (one line) for what rope_jax's decoder
    cannot run the way `transformers` does."""
    name, arch = architecture(hf)
    _refuse_features(hf, name)
    heads = _int(hf, "num_attention_heads")
    embed = _int(hf, "hidden_size")
    head_dim = _int(hf, "head_dim") if hf.get("head_dim") else embed // heads
    base, scaling = rope_parameters(hf, name, head_dim)
    return {
        "vocab_size": _int(hf, "vocab_size"),
        "num_layers": _int(hf, "num_hidden_layers"),
        "embed_dim": embed,
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": head_dim,
        "mlp_dim": _int(hf, "intermediate_size"),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "attention.qkv_bias": arch.qkv_bias,
        "attention.qk_norm": arch.qk_norm,
        "rope.base": base,
        "rope.layout": "half",
        "rope.max_position_embeddings": hf.get("max_position_embeddings"),
        "rope.scaling": scaling,
    }


def _int(hf: dict, key: str) -> int:
    value = hf.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HFError(f"config.json {key}={value!r} must be a positive integer")
    return value


def _refuse_features(hf: dict, name: str) -> None:
    """Settings of the registered classes that rope_jax's decoder does not have."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise HFError(f"config.json hidden_act={act!r}: rope_jax's MLP is SwiGLU (silu)")
    if hf.get("attention_bias") and name != "Qwen2ForCausalLM":
        raise HFError(f"config.json attention_bias=true: {name} then biases o_proj too, and "
                      "rope_jax's attention has no output bias")  # fmt: skip
    if hf.get("mlp_bias"):
        raise HFError("config.json mlp_bias=true: rope_jax's MLP has no biases")
    types = set(hf.get("layer_types") or ["full_attention"])
    if types != {"full_attention"} or hf.get("use_sliding_window"):
        raise HFError(f"config.json layer_types={sorted(types)!r} / use_sliding_window="
                      f"{hf.get('use_sliding_window')!r}: sliding-window attention is not "
                      "supported (every layer must be full_attention)")  # fmt: skip


def rope_parameters(hf: dict, name: str, head_dim: int) -> tuple[float, dict]:
    """(base, scaling dict) from `rope_parameters` (transformers >= 5) or the older
    `rope_theta` + `rope_scaling`, with top-level `partial_rotary_factor` and
    `original_max_position_embeddings` (Phi-3 style) folded in, checked against the head."""
    source = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    if not isinstance(hf.get(source) or {}, dict):
        raise HFError(f"config.json {source}={hf.get(source)!r} must be a JSON object")
    params = dict(hf.get(source) or {})
    base = params.pop(_ROPE_BASE, None) or hf.get(_ROPE_BASE) or 10000.0
    for key in ("partial_rotary_factor", "original_max_position_embeddings"):
        if hf.get(key) is not None:  # top level: transformers gives it priority
            params[key] = hf[key]
    if "rope_type" in params:  # the old spelling beside it is ignored, as transformers does
        params.pop("type", None)
    rope_type = params.get("rope_type", params.get("type", "default"))  # errors name `type
    partial = params.get("partial_rotary_factor", 1.0)
    if partial != 1.0 and rope_type == "default":
        params.pop("partial_rotary_factor")  # transformers' default rule rotates every pair
    elif partial != 1.0 and rope_type != "proportional":
        raise HFError(f"config.json {source}.partial_rotary_factor={partial!r} with rope_type="
                      f"{rope_type!r}: {name} rotates the whole head (only 'proportional' "
                      "zeroes the other pairs)")  # fmt: skip
    try:
        scaling = scaling_lib.check_scaling(
            params, head_dim=head_dim, max_position_embeddings=hf.get("max_position_embeddings")
        )
        if not (isinstance(base, (int, float)) and base > 1):
            raise ValueError(f"scaling['rope_theta']={base!r} must be a number > 1")
    except ValueError as e:
        message = str(e).replace("scaling[", f"{source}[").replace("scaling ", f"{source} ")
        raise HFError(f"config.json {message}") from None
    return float(base), scaling


def model_config(hf: dict, *, dtype: str = "float32", param_dtype: str = "float32"):
    """A complete `config.model` (ConfigDict) for the checkpoint: `model_fields` plus
    the defaults' choices (`rope_jax.defaults`: sites "qk", separate K/V, xla attention,
    no learned rotation)."""
    fields = model_fields(hf)
    cfg = defaults.fill_model({"dtype": dtype, "param_dtype": param_dtype})
    set_fields(cfg, fields)
    return cfg


def set_fields(model_cfg, fields: dict) -> None:
    """Writes `model_fields` into a `config.model` in place (the scaling section replaced
    as a whole: keys the checkpoint does not set become None)."""
    fields = dict(fields)
    scaling = fields.pop("rope.scaling")
    with model_cfg.ignore_type():
        for dotted, value in fields.items():
            *parents, leaf = dotted.split(".")
            node = model_cfg
            for part in parents:
                node = node[part]
            node[leaf] = value
        new = {key: None for key in model_cfg.rope.scaling}
        new.update({k: tuple(v) if isinstance(v, list) else v for k, v in scaling.items()})
        model_cfg.rope.scaling = ml_collections.ConfigDict(new)


# ------------------------------------------------------------------------------ export


def check_exportable(model_cfg, *, num_axes: int = 1) -> None:
    """HFError naming the first setting of a model (`config.model`, with the data's
    number of position axes) that HF's Llama and Qwen classes cannot express; nothing
    when the model exports as one of them."""

    m, rope = model_cfg, model_cfg.rope
    scaling = rope.scaling
    rules = [
        ("model.attention.kv", m.attention.kv, m.attention.kv == "separate",
         "tied K/V has no HF class"),
        ("model.rope.sites", rope.sites, sorted(rope.sites) == ["k", "q"],
         "transformers rotates exactly q and k (sites v/o and NoPE have no HF class)"),
        ("model.rope.learned", m.rope.learned, m.rope.learned == "none",
         "learned rotations have no HF class"),
        ("model.rope.nope_every", rope.nope_every, not rope.nope_every,
         "NoPE layers have no HF class"),
        ("model.rope.global_every", rope.global_every, not rope.global_every,
         "local/global bases per layer have no Llama/Qwen class"),
        ("model.attention.sinks", m.attention.sinks, not m.attention.sinks,
         "attention sinks have no Llama/Qwen class"),
        ("model.attention.window", m.attention.window, not m.attention.window,
         "sliding-window layers have no Llama/Qwen class"),
        ("model.rope.ladder", rope.ladder, rope.ladder == "standard",
         "transformers' ladder is base ** (-2i / H)"),
        ("data (position axes)", num_axes, num_axes == 1,
         "N-D (image/video) positions have no Llama/Qwen class"),
        ("model.patch_dim", m.patch_dim, not m.patch_dim,
         "patch embeddings have no Llama/Qwen class"),
        ("model.attention.qkv_bias", True,
         not (m.attention.qkv_bias and m.attention.qk_norm),
         "with qk_norm it needs Qwen3's attention_bias, which also biases o_proj"),
        ("model.rope.scaling.partial_rotary_factor", scaling.partial_rotary_factor,
         scaling.partial_rotary_factor in (None, 1.0) or scaling.rope_type == "proportional",
         "Llama/Qwen rotate the whole head unless rope_type='proportional'"),
    ]  # fmt: skip
    for field, value, ok, why in rules:
        if not ok:
            raise HFError(f"cannot export to Hugging Face: {field}={value!r}: {why}")


def export_architecture(model_cfg) -> str:
    """The HF class a model exports as: Qwen3 with q/k norms, Qwen2 with q/k/v biases,
    else Llama."""
    if model_cfg.attention.qk_norm:
        return "Qwen3ForCausalLM"
    if model_cfg.attention.qkv_bias:
        return "Qwen2ForCausalLM"
    return "LlamaForCausalLM"


def to_hf(model_cfg, *, max_position_embeddings: int, dtype: str, special_ids=None) -> dict:
    """The config.json of `model_cfg` (a checked, exportable `config.model`), for
    transformers >= 5 (`rope_parameters`). `special_ids`: {bos, eos, pad}_token_id."""

    name = export_architecture(model_cfg)
    rope = model_cfg.rope
    scaling = {k: v for k, v in rope.scaling.items() if v is not None}
    scaling = scaling_lib.check_scaling(
        scaling or None,
        head_dim=model_cfg.head_dim,
        max_position_embeddings=max_position_embeddings,
    )
    if scaling.get("partial_rotary_factor") == 1.0:
        scaling.pop("partial_rotary_factor")
    scaling = {k: list(v) if isinstance(v, tuple) else v for k, v in scaling.items()}
    hf = {
        "architectures": [name],
        "model_type": ARCHITECTURES[name].model_type,
        "vocab_size": model_cfg.vocab_size,
        "num_hidden_layers": model_cfg.num_layers,
        "hidden_size": model_cfg.embed_dim,
        "num_attention_heads": model_cfg.num_heads,
        "num_key_value_heads": model_cfg.num_kv_heads,
        "head_dim": model_cfg.head_dim,
        "intermediate_size": model_cfg.mlp_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(model_cfg.norm_eps),
        "tie_word_embeddings": bool(model_cfg.tie_embeddings),
        "max_position_embeddings": int(max_position_embeddings),
        "rope_theta": float(rope.base),
        "rope_parameters": {"rope_theta": float(rope.base), **scaling},
        "attention_bias": False,
        "dtype": dtype,
        **(special_ids or {}),
    }
    if name == "LlamaForCausalLM":
        hf["mlp_bias"] = False
    else:
        hf["use_sliding_window"] = False
        hf["layer_types"] = ["full_attention"] * model_cfg.num_layers
    return hf
