"""GGUF checkpoints (llama.cpp's format) read as Hugging Face models: config, tensors.

    hf.load("SmolLM2-135M-Instruct.Q4_1.gguf")            # as any HF directory
    hf.load(path, rope_layout="interleaved")               # llama.cpp's own q/k rows

`config(path)` maps the metadata to the config.json that an HF directory of the same
model holds, so `hf.config` checks and maps it as any import; `entries(path)` gives the
tensors by HF name, each dequantized to float32 by ggml-org's `gguf` package when read
(F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q2_K ... Q6_K, and every
other type that package dequantizes). The tokenizer is `rope_jax.data.gguf_file`'s.

Metadata read ({a} = `general.architecture`, one of `ARCHITECTURES`):
  {a}.block_count, embedding_length, feed_forward_length   num_hidden_layers, hidden_size,
                                                            intermediate_size
  {a}.attention.head_count, head_count_kv, key_length       num_attention_heads,
                                                            num_key_value_heads, head_dim
  {a}.attention.layer_norm_rms_epsilon, context_length      rms_norm_eps,
                                                            max_position_embeddings
  {a}.rope.freq_base, vocab_size                            rope_theta, vocab_size
  {a}.rope.scaling.type/factor/original_context_length      rope_scaling (linear, yarn)
  {a}.rope.scaling.yarn_beta_fast / yarn_beta_slow          yarn's beta_fast / beta_slow
  no output.weight tensor                                   tie_word_embeddings
Checked to agree: {a}.rope.dimension_count and attention.value_length (= head_dim: the
decoder rotates the whole head), expert counts (0). Any other {a}.* key changes the
model in a way this decoder may not compute, and is refused in one line naming it.

The pair layout: llama.cpp's converter permutes the rows of each head of Q and K of a
`llama` model, HF row (h * P + i) to (2i + h) (P = H/2, h = 0, 1), so that its
adjacent-pair rotation computes HF's rotate-half scores. `rope_layout="half"` (the
default) undoes it (rows back to HF's order, `rope.layout=half`); "interleaved" keeps
the file's rows and rotates adjacent pairs (`rope.layout=interleaved`): q.k is the same
either way, which tests/gguf_test.py checks on the published model. Qwen2/3 files are
stored in HF's order (llama.cpp rotates them NeoX-style) and import as `half` only.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np

from rope_jax.data import gguf_file
from rope_jax.hf.config import HFError
from rope_jax.hf.weights import Entry

DESCRIBED_BY = "its GGUF metadata"
LAYOUTS = ("half", "interleaved")


@dataclasses.dataclass(frozen=True)
class Architecture:
    """A GGUF `general.architecture` this decoder runs: its HF class, and whether the
    file's q/k rows are in llama.cpp's adjacent-pair order."""

    hf_class: str
    permuted: bool


ARCHITECTURES = {
    "llama": Architecture("LlamaForCausalLM", permuted=True),  # Llama, Mistral 7B, SmolLM
    "qwen2": Architecture("Qwen2ForCausalLM", permuted=False),
    "qwen3": Architecture("Qwen3ForCausalLM", permuted=False),
}

# {arch}.KEY -> the config.json key it becomes
KEYS = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "context_length": "max_position_embeddings",
    "vocab_size": "vocab_size",
    "rope.freq_base": "rope_theta",
}
# {arch}.KEY read as part of rope_scaling, and its HF key
ROPE_SCALING_KEYS = {
    "rope.scaling.type": "rope_type",
    "rope.scaling.factor": "factor",
    "rope.scaling.original_context_length": "original_max_position_embeddings",
    "rope.scaling.yarn_beta_fast": "beta_fast",
    "rope.scaling.yarn_beta_slow": "beta_slow",
}
# {arch}.KEY that changes nothing at these values (checked), or says nothing of the maths
NEUTRAL = {
    "expert_count": (0,),
    "expert_used_count": (0,),
    "rope.scaling.finetuned": None,
    "rope.scaling.attn_factor": (1.0,),
    "rope.scaling.yarn_log_multiplier": (0.0,),
}
# {arch}.KEY that must equal the head dim (`_check_head`)
CHECKED = ("rope.dimension_count", "attention.value_length")
# GGUF rope scaling types -> HF rope_type
ROPE_TYPES = {"none": "default", "linear": "linear", "yarn": "yarn"}

# GGUF tensor name -> HF tensor name
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
_EXPERTS = re.compile(r"blk\.\d+\.ffn_\w*(exps|shexp|inp)\.\w+")
# the q/k projections whose rows llama.cpp permutes (with the head count they use)
_PERMUTED = {"attn_q.weight": "num_attention_heads", "attn_k.weight": "num_key_value_heads"}


def is_gguf(path: str) -> bool:
    return gguf_file.is_gguf(path)


def _open(path: str) -> tuple[tuple, dict]:
    """(readers of every part, the first part's metadata) (`gguf_file.read`, opened once),
    as HFError for a bad file."""
    try:
        return gguf_file.read(path)
    except gguf_file.GGUFError as e:
        raise HFError(str(e)) from None


def architecture(path: str) -> tuple[str, Architecture]:
    arch = _open(path)[1].get("general.architecture")
    if arch not in ARCHITECTURES:
        raise HFError(f"{path}: general.architecture={arch!r} is not supported; supported: "
                      f"{', '.join(ARCHITECTURES)}")  # fmt: skip
    return arch, ARCHITECTURES[arch]


def config(path: str) -> dict:
    """The config.json (a dict) of the HF model the GGUF file `path` holds; HFError naming
    the first key the decoder cannot compute as the file means it."""
    arch, spec = architecture(path)
    meta, prefix = _open(path)[1], f"{arch}."
    hf = {"architectures": [spec.hf_class], "model_type": arch}
    scaling = {}
    for key, value in meta.items():
        if not key.startswith(prefix):
            continue
        short = key[len(prefix) :]
        if isinstance(value, list):
            raise HFError(f"{path}: {key}={value[:4]!r}... is per layer; rope_jax's decoder "
                          "has one value for every layer")  # fmt: skip
        if short in KEYS:
            hf[KEYS[short]] = value
        elif short in ROPE_SCALING_KEYS:
            scaling[ROPE_SCALING_KEYS[short]] = value
        elif short in CHECKED or (short in NEUTRAL and (NEUTRAL[short] is None
                                                          or value in NEUTRAL[short])):  # fmt: skip
            continue
        else:
            raise HFError(f"{path}: {key}={value!r} is not supported: rope_jax's decoder "
                          "does not compute what it sets")  # fmt: skip
    _check_head(path, meta, prefix, hf)
    hf.setdefault("vocab_size", len(meta.get("tokenizer.ggml.tokens") or []) or None)
    hf["tie_word_embeddings"] = "output.weight" not in _tensor_infos(path)
    if "rope_freqs.weight" in _tensor_infos(path):
        raise HFError(f"{path}: tensor rope_freqs.weight (per-pair frequency factors, as "
                      "llama.cpp stores Llama 3.1's rope scaling) is not supported")  # fmt: skip
    if scaling:
        hf["rope_scaling"] = _rope_scaling(path, prefix, scaling)
    return hf


def _check_head(path: str, meta: dict, prefix: str, hf: dict) -> None:
    """head_dim (key_length, else D / N) must be rotated whole and equal value_length."""
    heads, embed = hf.get("num_attention_heads"), hf.get("hidden_size")
    head_dim = hf.get("head_dim") or (embed // heads if heads and embed else None)
    why = {"rope.dimension_count": "the model rotates only part of each head",
           "attention.value_length": "the model's value heads have another size"}  # fmt: skip
    for key, what in why.items():
        value = meta.get(prefix + key)
        if value is not None and head_dim is not None and value != head_dim:
            raise HFError(f"{path}: {prefix}{key}={value} with head_dim={head_dim}: {what}, "
                          f"which {hf['architectures'][0]} does not compute")  # fmt: skip


def _rope_scaling(path: str, prefix: str, scaling: dict) -> dict:
    kind = scaling.get("rope_type", "none")
    if kind not in ROPE_TYPES:
        raise HFError(f"{path}: {prefix}rope.scaling.type={kind!r} is not supported; "
                      f"supported: {', '.join(ROPE_TYPES)}")  # fmt: skip
    return {**scaling, "rope_type": ROPE_TYPES[kind]}


def _tensor_infos(path: str) -> dict:
    """GGUF tensor name -> its `gguf.ReaderTensor`, over every part."""
    return {t.name: t for reader in _open(path)[0] for t in reader.tensors}


def hf_tensor(name: str) -> str | None:
    """The HF name of a GGUF tensor, or None for one the decoder has no place for."""
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    block = _BLOCK.fullmatch(name)
    if block and block.group(2) in BLOCK_TENSORS:
        return f"model.layers.{block.group(1)}.{BLOCK_TENSORS[block.group(2)]}"
    return None


@functools.cache
def dequantizable(qtype) -> bool:
    """Whether the `gguf` package dequantizes tensors of GGML type `qtype`."""
    import gguf

    size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros(type_size, np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def entries(path: str, *, rope_layout: str = "half") -> dict[str, Entry]:
    """HF tensor name -> `weights.Entry` (float32, HF's [out, in] shape) of a GGUF file;
    q/k rows in HF's order (`rope_layout="half"`) or the file's adjacent pairs
    ("interleaved"). HFError naming a tensor that has no place in the decoder or a type
    the `gguf` package cannot dequantize, before any tensor is read."""
    if rope_layout not in LAYOUTS:
        raise HFError(f"rope_layout={rope_layout!r} must be one of {', '.join(LAYOUTS)}")
    arch, spec = architecture(path)
    hf = config(path)
    if rope_layout == "interleaved" and not spec.permuted:
        raise HFError(f"{path}: general.architecture={arch!r} stores q/k in HF's half-pair "
                      "order; import it with rope_layout='half'")  # fmt: skip
    out = {}
    for name, tensor in _tensor_infos(path).items():
        target = hf_tensor(name)
        if target is None:
            moe = " (a mixture-of-experts MLP)" if _EXPERTS.fullmatch(name) else ""
            raise HFError(f"{path}: tensor {name}{moe} has no place in rope_jax's decoder")
        if not dequantizable(tensor.tensor_type):
            raise HFError(f"{path}: tensor {name} has type {tensor.tensor_type.name}, which the "
                          "installed `gguf` package cannot dequantize")  # fmt: skip
        block = _BLOCK.fullmatch(name)
        heads = None
        if spec.permuted and rope_layout == "half" and block and block.group(2) in _PERMUTED:
            heads = hf.get(_PERMUTED[block.group(2)]) or hf["num_attention_heads"]
        shape = tuple(int(n) for n in reversed(tensor.shape))
        out[target] = Entry("F32", shape, functools.partial(_load, tensor, shape, heads))
    return out


def _load(tensor, shape: tuple, heads: int | None) -> np.ndarray:
    import gguf

    w = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    w = w.astype(np.float32, copy=False)
    return w if heads is None else unpermute(w, heads)


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (pair i of a head at rows 2i, 2i + 1) back to HF's
    (rows i, i + H/2): the inverse of its converter's `permute`."""
    return w.reshape(heads, -1, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's q/k rows to llama.cpp's (its converter's `permute`; tests and writers)."""
    return w.reshape(heads, 2, -1, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
