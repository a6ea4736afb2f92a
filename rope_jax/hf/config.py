"""Hugging Face `config.json` <-> rope_jax's `config.model`.

`ARCHITECTURES` is the one registry of what is read and written: an HF class name and
the model features its checkpoints carry (q/k/v biases, q/k RMSNorm per head). Import
(`model_fields`) maps a config.json to dotted `config.model` fields; export (`to_hf`)
writes a config.json that `transformers` reads as the same model, after
`check_exportable` has refused (one line naming the setting) what its classes cannot
express. Sliding windows and sinks: Mistral (every layer sliding over `sliding_window`)
and GraniteSWA (gpt-oss's attention, sinks and per-layer `layer_types`, with a dense
SwiGLU MLP) are read and written; gpt-oss itself and every mixture-of-experts checkpoint
are refused (its MLP is experts).

Field mapping (HF -> rope_jax `config.model`):
  vocab_size, num_hidden_layers, hidden_size,          vocab_size, num_layers, embed_dim,
  num_attention_heads, num_key_value_heads, head_dim,  num_heads, num_kv_heads, head_dim,
  intermediate_size, rms_norm_eps, tie_word_embeddings mlp_dim, norm_eps, tie_embeddings
  rope_parameters.rope_theta (or rope_theta)           rope.base
  rope_parameters (or rope_scaling), other keys        rope.scaling.* (the same key names)
  partial_rotary_factor, rope_type "proportional"      rope.pairs (`rope_jax.pairs.from_hf`)
  max_position_embeddings                              rope.max_position_embeddings
  (the architecture)                                   attention.qkv_bias, attention.qk_norm,
                                                       attention.sinks
  sliding_window, layer_types                          attention.window, attention.layer_types
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
from rope_jax import pairs as pairs_lib
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
    sinks: bool = False  # one sink logit per query head, `self_attn.sinks` [N]
    # which layers slide over `sliding_window` keys: "none" (every layer full),
    # "every" (all of them when sliding_window is set: Mistral), "layer_types" (HF's
    # per-layer `layer_types`, missing = `default_types`)
    windows: str = "none"
    default_types: tuple[str, int] = ("full_attention", 1)  # (type, every k-th) else sliding


ARCHITECTURES = {
    "LlamaForCausalLM": Architecture("llama", qkv_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": Architecture("qwen2", qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": Architecture("qwen3", qkv_bias=False, qk_norm=True),
    "MistralForCausalLM": Architecture("mistral", qkv_bias=False, qk_norm=False, windows="every"),
    # Granite with sliding windows and sinks: gpt-oss's attention (sinks, sliding/full
    # layers, any rope rule) around a dense SwiGLU MLP; layer i full when i % 4 == 0
    "GraniteSWAForCausalLM": Architecture("granite_swa", qkv_bias=False, qk_norm=False,
                                          sinks=True, windows="layer_types",
                                          default_types=("full_attention", 4)),
}  # fmt: skip
# HF layer types -> rope_jax's (`model.attention.layer_types`)
LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}
# Config keys that count experts: any above 1 is a mixture-of-experts MLP
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
# Classes whose MLP is experts whatever their count (what import says is missing)
_MOE_ONLY = {"GptOssForCausalLM": "gpt-oss"}

# Dotted `config.model` fields that a checkpoint decides (`model_fields` sets them all);
# the others (sites, dtypes, remat, attention.impl, ...) stay the run's.
ARCH_FIELDS = (
    "vocab_size", "num_layers", "embed_dim", "num_heads", "num_kv_heads", "head_dim",
    "mlp_dim", "norm_eps", "tie_embeddings", "attention.qkv_bias", "attention.qk_norm",
    "attention.sinks", "attention.window", "attention.layer_types", "rope.base", "rope.layout",
    "rope.max_position_embeddings", "rope.pairs", "rope.scaling",
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
    """(class name, its `Architecture`) of a config.json; HFError if not in the registry
    or if its MLP is a mixture of experts (rope_jax's decoder has one dense MLP a layer)."""
    names = hf.get("architectures") or []
    name = names[0] if isinstance(names, list) and len(names) == 1 else names
    experts = {k: hf[k] for k in _EXPERT_KEYS if isinstance(hf.get(k), int) and hf[k] > 1}
    if experts or name in _MOE_ONLY:
        key, count = next(iter(experts.items()), ("num_local_experts", hf.get("num_local_experts")))
        raise HFError(f"config.json architectures={names!r} {key}={count!r}: a mixture-of-experts "
                      "MLP (router and experts) is not supported: rope_jax's decoder has one "
                      "dense SwiGLU MLP per layer")  # fmt: skip
    if name not in ARCHITECTURES:
        raise HFError(f"config.json architectures={names!r} is not supported; supported: "
                      f"{', '.join(ARCHITECTURES)}")  # fmt: skip
    return name, ARCHITECTURES[name]


def model_fields(hf: dict) -> dict:
    """Dotted `config.model` fields (`ARCH_FIELDS`) of a config.json; `rope.scaling` is a
    dict of HF keys with defaults filled, `rope.pairs` the pairs section. HFError (one
    line) for what rope_jax's decoder cannot run the way `transformers` does."""
    name, arch = architecture(hf)
    _refuse_features(hf, name)
    heads = _int(hf, "num_attention_heads")
    embed = _int(hf, "hidden_size")
    head_dim = _int(hf, "head_dim") if hf.get("head_dim") else embed // heads
    base, pairs, scaling = rope_parameters(hf, name, head_dim)
    _check_multipliers(hf, name, head_dim, base)
    window, types = layer_types(hf, name, arch)
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
        "attention.sinks": arch.sinks,
        "attention.window": window,
        "attention.layer_types": types,
        "rope.base": base,
        "rope.layout": "half",
        "rope.max_position_embeddings": hf.get("max_position_embeddings"),
        "rope.pairs": pairs.config(),
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


def layer_types(hf: dict, name: str, arch: Architecture) -> tuple[int, tuple[str, ...]]:
    """(`attention.window` W or 0, `attention.layer_types`) of a config.json: () when every
    layer is full (W = 0) or every layer slides (W > 0, Mistral); one line for a layer
    type or window rope_jax's layers cannot run."""
    num_layers = _int(hf, "num_hidden_layers")
    window = hf.get("sliding_window")
    given = hf.get("layer_types")
    if arch.windows == "none":  # Llama, Qwen2/3: every layer full
        types = list(given or ["full_attention"])
        if set(types) != {"full_attention"} or hf.get("use_sliding_window"):
            raise HFError(f"config.json layer_types={sorted(set(types))!r} / use_sliding_window="
                          f"{hf.get('use_sliding_window')!r}: {name}'s sliding-window layers are "
                          "not supported (every layer must be full_attention; Mistral and "
                          "GraniteSWA checkpoints slide)")  # fmt: skip
        return 0, ()
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):  # fmt: skip
        raise HFError(f"config.json sliding_window={window!r} must be a positive integer or null")
    if arch.windows == "every":  # Mistral: sliding_window decides, layer_types is ignored
        types = ["sliding_attention" if window else "full_attention"] * num_layers
        if given is not None and list(given) != types:
            raise HFError(f"config.json layer_types={given!r}: {name} slides every layer when "
                          f"sliding_window={window!r} is set and ignores layer_types "
                          "(MinistralForCausalLM mixes them; not supported)")  # fmt: skip
    else:
        kind, every = arch.default_types
        other = "sliding_attention" if kind == "full_attention" else "full_attention"
        types = given if given is not None else [
            kind if i % every == 0 else other for i in range(num_layers)]  # fmt: skip
    if not isinstance(types, list) or len(types) != num_layers:
        raise HFError(f"config.json layer_types={types!r} must list one type per layer "
                      f"(num_hidden_layers={num_layers})")  # fmt: skip
    bad = [(i, t) for i, t in enumerate(types) if t not in LAYER_TYPES]
    if bad:
        raise HFError(f"config.json layer_types[{bad[0][0]}]={bad[0][1]!r} is not supported: "
                      f"rope_jax's layers are {' or '.join(LAYER_TYPES)}")  # fmt: skip
    ours = tuple(LAYER_TYPES[t] for t in types)
    if "sliding" not in ours:
        return 0, ()
    if window is None:
        raise HFError("config.json sliding_window=None: layer_types has sliding_attention "
                      "layers, which need the window")  # fmt: skip
    return window, (() if set(ours) == {"sliding"} else ours)


def _check_multipliers(hf: dict, name: str, head_dim: int, base: float) -> None:
    """GraniteSWA's multipliers must be Llama's (rope_jax's block has none), and its
    per-layer bases (`layer_rope_theta`, 0 = NoPE) one base."""
    if name != "GraniteSWAForCausalLM":
        return
    fixed = {"embedding_multiplier": 1.0, "residual_multiplier": 1.0, "logits_scaling": 1.0,
             "attention_multiplier": head_dim**-0.5}  # fmt: skip
    for key, want in fixed.items():
        value = hf.get(key, 1.0)
        if not isinstance(value, (int, float)) or abs(value - want) > 1e-6 * want:
            scale = " (head_dim ** -0.5)" if key == "attention_multiplier" else ""
            raise HFError(f"config.json {key}={value!r} is not supported: rope_jax's decoder "
                          f"has {key}={want:.6g}{scale} fixed")  # fmt: skip
    thetas = hf.get("layer_rope_theta")
    if thetas is not None and (not isinstance(thetas, list) or set(thetas) != {base}):
        raise HFError(
            f"config.json layer_rope_theta={thetas!r}: per-layer bases and NoPE "
            f"layers (0) are not supported; every layer must use rope_theta={base:g}"
        )


def rope_parameters(hf: dict, name: str, head_dim: int) -> tuple[float, pairs_lib.PairSpec, dict]:
    """(base, pairs, context rule dict) from `rope_parameters` (transformers >= 5) or the
    older `rope_theta` + `rope_scaling`, with top-level `partial_rotary_factor` and
    `original_max_position_embeddings` (Phi-3 style) folded in, checked against the head;
    which pairs turn is read by `pairs.from_hf`."""
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
    try:
        pairs, params = pairs_lib.from_hf(params)
    except ValueError as e:
        partial = params.get("partial_rotary_factor")
        raise HFError(f"config.json {source}.partial_rotary_factor={partial!r}: {e}") from None
    if not pairs.selection.whole_head:  # a block rotating alone: Llama/Qwen's rotate the head
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise HFError(f"config.json {source}.partial_rotary_factor={pairs.fraction!r} with "
                          f"rope_type={rope_type!r}: {name} rotates the whole head (only "
                          "'proportional' freezes the other pairs)")  # fmt: skip
        pairs = pairs_lib.PairSpec()  # transformers' default rule rotates every pair
    try:
        scaling = scaling_lib.check_scaling(
            params, dim=pairs.select(head_dim)[1],
            max_position_embeddings=hf.get("max_position_embeddings"),
        )  # fmt: skip
        if not (isinstance(base, (int, float)) and base > 1):
            raise ValueError(f"scaling['rope_theta']={base!r} must be a number > 1")
    except ValueError as e:
        message = str(e).replace("scaling[", f"{source}[").replace("scaling ", f"{source} ")
        raise HFError(f"config.json {message}") from None
    return float(base), pairs, scaling


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
    pairs = fields.pop("rope.pairs", None)
    with model_cfg.ignore_type():
        if pairs is not None:
            model_cfg.rope.pairs = defaults.fill_model({"rope": {"pairs": pairs}}).rope.pairs
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
    pairs = pairs_lib.PairSpec.of(rope.pairs)
    rule = {k: v for k, v in rope.scaling.items() if v is not None}
    v4 = "is DeepSeek-V4's, whose HF class also holds compressed attention and experts"
    rules = [
        ("model.attention.kv_norm", m.attention.kv_norm, not m.attention.kv_norm,
         f"the tied latent's RMSNorm {v4}"),
        ("model.attention.kv", m.attention.kv, m.attention.kv == "separate",
         "tied K/V has no HF class"),
        ("model.attention.bias", m.attention.bias, m.attention.bias == "none",
         "position biases on the logits have no Llama/Qwen class"),
        ("model.rope.sites", rope.sites, sorted(rope.sites) == ["k", "q"],
         "transformers rotates exactly q and k (sites v/o and NoPE have no HF class)"),
        ("model.rope.learned", m.rope.learned, m.rope.learned == "none",
         "learned rotations have no HF class"),
        ("model.rope.xpos_scale_base", rope.xpos_scale_base, not rope.xpos_scale_base,
         "xPos's decay has no HF class"),
        ("model.rope.key_offset", rope.key_offset, not rope.key_offset,
         "the partial key offset has no HF class"),
        ("model.attention.stick_breaking", m.attention.stick_breaking,
         not m.attention.stick_breaking, "stick-breaking attention has no HF class"),
        ("model.rope.nope_every", rope.nope_every, not rope.nope_every,
         "NoPE layers have no HF class"),
        ("model.rope.global_every", rope.global_every, not rope.global_every,
         "local/global bases per layer have no Llama/Qwen class"),
        ("model.attention.sinks", m.attention.sinks,
         not (m.attention.sinks and (m.attention.qkv_bias or m.attention.qk_norm)),
         "GraniteSWA, the HF class with sinks, has no q/k/v biases or q/k norms"),
        ("model.attention.window", m.attention.window,
         not (m.attention.window and (m.attention.qkv_bias or m.attention.qk_norm)),
         "Mistral and GraniteSWA, the HF classes with sliding windows, have no q/k/v biases "
         "or q/k norms"),
        ("model.attention.chunk", m.attention.chunk, not m.attention.chunk,
         "chunked attention is Llama 4's, whose HF class holds a mixture of experts"),
        ("model.attention.qk_l2_norm", m.attention.qk_l2_norm, not m.attention.qk_l2_norm,
         "the weightless q/k L2 norm is Llama 4's, whose HF class holds a mixture of experts"),
        ("model.attention.q_lora_rank", m.attention.q_lora_rank, not m.attention.q_lora_rank,
         f"the low-rank query {v4}"),
        ("model.attention.q_l2_norm", m.attention.q_l2_norm, not m.attention.q_l2_norm,
         f"the weightless query head norm {v4}"),
        ("model.attention.o_groups", m.attention.o_groups, not m.attention.o_groups,
         f"the grouped low-rank output {v4}"),
        ("model.rope.ladder", rope.ladder, rope.ladder == "standard",
         "transformers' ladder is base ** (-2i / H)"),
        ("data (position axes)", num_axes, num_axes == 1,
         "N-D (image/video) positions have no Llama/Qwen class"),
        ("model.patch_dim", m.patch_dim, not m.patch_dim,
         "patch embeddings have no Llama/Qwen class"),
        ("model.attention.qkv_bias", True,
         not (m.attention.qkv_bias and m.attention.qk_norm),
         "with qk_norm it needs Qwen3's attention_bias, which also biases o_proj"),
        ("model.rope.pairs.rule", pairs.rule,
         pairs.selection.whole_head and pairs_lib.to_hf(pairs, rule) is not None,
         "Llama/Qwen rotate every pair of the whole head, or with rope_type='proportional' "
         "the first ones (under no rule or a linear one)"),
    ]  # fmt: skip
    for field, value, ok, why in rules:
        if not ok:
            raise HFError(f"cannot export to Hugging Face: {field}={value!r}: {why}")


def export_architecture(model_cfg) -> str:
    """The HF class a model exports as: GraniteSWA with sinks or sliding and full layers
    mixed, Mistral with every layer sliding, Qwen3 with q/k norms, Qwen2 with q/k/v
    biases, else Llama."""
    if model_cfg.attention.sinks or len(set(_layer_types(model_cfg))) > 1:
        return "GraniteSWAForCausalLM"
    if model_cfg.attention.window:
        return "MistralForCausalLM"
    if model_cfg.attention.qk_norm:
        return "Qwen3ForCausalLM"
    if model_cfg.attention.qkv_bias:
        return "Qwen2ForCausalLM"
    return "LlamaForCausalLM"


def _layer_types(model_cfg) -> tuple[str, ...]:
    """HF's `layer_types` of a model (`model.attention.layer_types`, () spelled out)."""
    attention = model_cfg.attention
    types = tuple(attention.layer_types) or ("sliding" if attention.window else "full",) * (
        model_cfg.num_layers
    )
    hf_names = {ours: hf for hf, ours in LAYER_TYPES.items()}
    return tuple(hf_names[t] for t in types)


def to_hf(model_cfg, *, max_position_embeddings: int, dtype: str, special_ids=None) -> dict:
    """The config.json of `model_cfg` (a checked, exportable `config.model`), for
    transformers >= 5 (`rope_parameters`). `special_ids`: {bos, eos, pad}_token_id."""

    name = export_architecture(model_cfg)
    rope = model_cfg.rope
    pairs = pairs_lib.PairSpec.of(rope.pairs)
    scaling = {k: v for k, v in rope.scaling.items() if v is not None}
    scaling = scaling_lib.check_scaling(
        scaling or None,
        dim=pairs.select(model_cfg.head_dim)[1],
        max_position_embeddings=max_position_embeddings,
    )
    scaling = pairs_lib.to_hf(pairs, scaling)  # exportable: check_exportable said so
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
    window = model_cfg.attention.window or None
    if name in ("LlamaForCausalLM", "GraniteSWAForCausalLM"):
        hf["mlp_bias"] = False
    if name == "MistralForCausalLM":
        hf["sliding_window"] = window
    elif name == "GraniteSWAForCausalLM":  # its multipliers at Llama's values
        hf.update(sliding_window=window, layer_types=list(_layer_types(model_cfg)),
                  layer_rope_theta=[float(rope.base)] * model_cfg.num_layers,
                  attention_multiplier=model_cfg.head_dim**-0.5, embedding_multiplier=1.0,
                  residual_multiplier=1.0, logits_scaling=1.0)  # fmt: skip
        for key in ("bos_token_id", "eos_token_id"):  # its defaults name ids past a small V
            hf.setdefault(key, None)
    elif name != "LlamaForCausalLM":
        hf["use_sliding_window"] = False
        hf["layer_types"] = ["full_attention"] * model_cfg.num_layers
    return hf
