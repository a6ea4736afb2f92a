"""Safetensors files <-> rope_jax parameters: names, layouts, shards, dtypes.

Read with `safetensors`' NumPy reader (no torch), one tensor at a time; a sharded
checkpoint is read through its `model.safetensors.index.json`. Every tensor's name,
dtype and shape is checked before any is read, and each failure is one `HFError` line
naming the tensor or file: a missing shard, a missing or unexpected tensor, a shape
that the config.json does not imply, a dtype other than the checkpoint's.

Names (rope_jax parameter path -> HF tensor, in block i -> `model.layers.<i>.`):

  embed               model.embed_tokens.weight      [V, D]      same
  head                lm_head.weight                 [V, D]      transposed (absent if tied)
  norm.scale          model.norm.weight              [D]         same
  attn_norm.scale     input_layernorm.weight         [D]         same
  mlp_norm.scale      post_attention_layernorm.weight
  attn.q_proj         self_attn.q_proj.weight        [N*H, D]    ours [D, N, H]
  attn.k_proj, v_proj self_attn.k_proj.weight, ...   [K*H, D]    ours [D, K, H]
  attn.o_proj         self_attn.o_proj.weight        [D, N*H]    ours [N, H, D]
  attn.q_bias, ...    self_attn.q_proj.bias, ...     [N*H]       same (Qwen2)
  attn.q_norm.scale   self_attn.q_norm.weight        [H]         same (Qwen3)
  attn.sinks          self_attn.sinks                [N]         same (GraniteSWA, gpt-oss)
  mlp.gate, up, down  mlp.gate_proj.weight, ...      [F, D]      transposed

Only data moves (transposes and reshapes), so a checkpoint read and written again is
bit-identical. Exporting a model with the `interleaved` pair layout permutes the head
dim of q and k (and their biases and norm scales) so that pair (2i, 2i+1) becomes HF's
(i, i + P): q.k is unchanged, as in HF's Llama conversion script.

Shape legend: V vocab, D embed dim, N heads, K kv heads, H head dim, F mlp dim, P = H/2.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable
from typing import NamedTuple

import ml_dtypes  # also registers bfloat16 with NumPy: safetensors' reader needs it
import numpy as np

from rope_jax.hf.config import HFError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Buffers some older checkpoints saved: recomputed from the config, never read.
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq")
# Safetensors dtype codes -> the NumPy dtype parameters are kept in (float16 is widened:
# rope_jax's models compute in float32 or bfloat16).
DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float32"}


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one tensor's HF layout maps to rope_jax's (`shape` is rope_jax's)."""

    to_ours: Callable[[np.ndarray, tuple], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    hf_shape: Callable[[tuple], tuple]


LAYOUTS = {
    "same": Layout(lambda w, s: w, lambda x: x, lambda s: tuple(s)),
    "transposed": Layout(lambda w, s: w.T, lambda x: x.T, lambda s: tuple(s[::-1])),
    # a projection into heads: HF [N*H, D] <-> ours [D, N, H]
    "into_heads": Layout(
        lambda w, s: w.T.reshape(s),
        lambda x: x.reshape(x.shape[0], -1).T,
        lambda s: (int(np.prod(s[1:])), s[0]),
    ),
    # a projection out of heads: HF [D, N*H] <-> ours [N, H, D]
    "out_of_heads": Layout(
        lambda w, s: w.T.reshape(s),
        lambda x: x.reshape(-1, x.shape[-1]).T,
        lambda s: (s[-1], int(np.prod(s[:-1]))),
    ),
}

GLOBAL_NAMES = {
    "embed": ("model.embed_tokens.weight", "same"),
    "head": ("lm_head.weight", "transposed"),
    "norm.scale": ("model.norm.weight", "same"),
}
BLOCK_NAMES = {
    "attn_norm.scale": ("input_layernorm.weight", "same"),
    "mlp_norm.scale": ("post_attention_layernorm.weight", "same"),
    "attn.q_proj": ("self_attn.q_proj.weight", "into_heads"),
    "attn.k_proj": ("self_attn.k_proj.weight", "into_heads"),
    "attn.v_proj": ("self_attn.v_proj.weight", "into_heads"),
    "attn.o_proj": ("self_attn.o_proj.weight", "out_of_heads"),
    "attn.q_bias": ("self_attn.q_proj.bias", "same"),
    "attn.k_bias": ("self_attn.k_proj.bias", "same"),
    "attn.v_bias": ("self_attn.v_proj.bias", "same"),
    "attn.q_norm.scale": ("self_attn.q_norm.weight", "same"),
    "attn.k_norm.scale": ("self_attn.k_norm.weight", "same"),
    "attn.sinks": ("self_attn.sinks", "same"),
    "mlp.gate": ("mlp.gate_proj.weight", "transposed"),
    "mlp.up": ("mlp.up_proj.weight", "transposed"),
    "mlp.down": ("mlp.down_proj.weight", "transposed"),
}
_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
# Tensors of a mixture-of-experts MLP (gpt-oss, Mixtral, Qwen-MoE, DeepSeek): named as such
_EXPERTS = re.compile(r".*\.(mlp\.(router|experts|gate|shared_experts?)|block_sparse_moe)\..*")
# Parameters whose head dim follows the rotation pairs (permuted for `interleaved`).
_ROTATED = ("attn.q_proj", "attn.k_proj", "attn.q_bias", "attn.k_bias", "attn.q_norm.scale",
            "attn.k_norm.scale")  # fmt: skip


def hf_name(name: str) -> tuple[str, str]:
    """(HF tensor name, layout name) of a rope_jax parameter path ("blocks.0.attn.q_proj")."""
    block = _BLOCK.fullmatch(name)
    table, key = (BLOCK_NAMES, block.group(2)) if block else (GLOBAL_NAMES, name)
    if key not in table:
        raise HFError(f"parameter {name!r} has no Hugging Face tensor (Llama/Qwen classes)")
    hf, layout = table[key]
    return (f"model.layers.{block.group(1)}.{hf}" if block else hf), layout


# ------------------------------------------------------------------------------- read


def tensor_files(directory: str) -> dict[str, str]:
    """HF tensor name -> the safetensors file holding it (from the index when sharded).
    HFError for a directory without weights or an index naming a missing shard."""
    index = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise HFError(f"{index} is not a safetensors index ({type(e).__name__})") from None
        for shard in sorted(set(weight_map.values())):
            if not os.path.isfile(os.path.join(directory, shard)):
                raise HFError(f"{directory}: shard {shard} listed in {INDEX_FILE} is missing")
        return {name: os.path.join(directory, shard) for name, shard in weight_map.items()}
    single = os.path.join(directory, SINGLE_FILE)
    if os.path.isfile(single):
        return dict.fromkeys(_open(single).keys(), single)
    other = [
        f for f in ("pytorch_model.bin", "model.bin") if os.path.exists(os.path.join(directory, f))
    ]
    hint = f" ({other[0]} is not read: save with safe_serialization=True)" if other else ""
    raise HFError(f"{directory} has no {SINGLE_FILE} or {INDEX_FILE}{hint}")


def _open(path: str):
    from safetensors import safe_open

    try:
        return safe_open(path, framework="numpy")
    except Exception as e:  # the Rust reader raises its own types
        raise HFError(f"{path} is not a safetensors file ({type(e).__name__}: {e})") from None


class Entry(NamedTuple):
    """One stored tensor, not yet read: its dtype code, its HF-layout shape, and how to
    read it (an array in HF's layout)."""

    code: str  # a safetensors dtype code ("F32", "BF16", "F16"): what it is read as
    shape: tuple
    load: Callable[[], np.ndarray]


def safetensors_entries(directory: str) -> dict[str, Entry]:
    """HF tensor name -> `Entry` of an HF model directory's safetensors (sharded or not);
    HFError for a directory without weights, a missing shard, or an index naming a
    tensor its shard does not hold."""
    files = tensor_files(directory)
    handles = {path: _open(path) for path in sorted(set(files.values()))}
    entries = {}
    for hf, path in files.items():
        try:
            piece = handles[path].get_slice(hf)
        except Exception:  # noqa: BLE001  (absent from the shard its index names)
            raise HFError(f"{path} does not hold tensor {hf} ({INDEX_FILE} says it does)") from None
        read = lambda handle=handles[path], hf=hf: handle.get_tensor(hf)
        entries[hf] = Entry(piece.get_dtype(), tuple(piece.get_shape()), read)
    return entries


def checkpoint_dtype(entries: dict[str, Entry]) -> str:
    """The dtype parameters of a checkpoint are kept in (of its first tensor; `read`
    checks all)."""
    code = entries[sorted(entries)[0]].code
    return DTYPES.get(code, code)


def read(entries: dict[str, Entry], shapes: dict[str, tuple], *, tied: bool = False,
         where: str, described_by: str = "config.json") -> tuple[dict, str]:  # fmt: skip
    """rope_jax parameter arrays {name: Tensor} for the parameter shapes `shapes`
    {name: shape}, each read when used, and the checkpoint's dtype ("float32" |
    "bfloat16"; float16 becomes float32). `entries`: the stored tensors by HF name
    (`safetensors_entries`, `hf.gguf.entries`); `where` names the checkpoint in errors,
    `described_by` what describes its architecture.
    Every name, shape and dtype is checked here, before any tensor is read. With `tied`,
    an `lm_head.weight` in the files is not read (HF ties it)."""
    wanted = {hf_name(name)[0]: name for name in shapes}
    extra = [n for n in entries if n not in wanted and not _IGNORED.fullmatch(n)
             and not (tied and n == "lm_head.weight")]  # fmt: skip
    moe = [n for n in extra if _EXPERTS.fullmatch(n)]
    if moe:
        raise HFError(f"{where}: tensor {moe[0]} belongs to a mixture-of-experts MLP (router "
                      "and experts), which is not supported: rope_jax's decoder has one dense "
                      "SwiGLU MLP per layer")  # fmt: skip
    if extra:
        raise HFError(f"{where}: tensor {extra[0]} has no place in the model that "
                      f"{described_by} describes (an unsupported feature?)")  # fmt: skip
    missing = [n for n in wanted if n not in entries]
    if missing:
        raise HFError(f"{where}: tensor {missing[0]} is missing ({described_by} implies it)")
    first = None
    for hf, name in wanted.items():  # every check before any tensor is read
        code, shape = entries[hf].code, entries[hf].shape
        want = LAYOUTS[hf_name(name)[1]].hf_shape(shapes[name])
        if code not in DTYPES:
            raise HFError(f"{where}: tensor {hf} has dtype {code}; weights must be "
                          f"{', '.join(DTYPES)}")  # fmt: skip
        first = first or (hf, code)
        if code != first[1]:
            raise HFError(f"{where}: tensor {hf} has dtype {code} but {first[0]} has "
                          f"{first[1]} (one dtype per checkpoint)")  # fmt: skip
        if shape != want:
            raise HFError(f"{where}: tensor {hf} has shape {list(shape)}; "
                          f"{described_by} implies {list(want)}")  # fmt: skip
    dtype = DTYPES[first[1]]
    arrays = {name: Tensor(entries[hf].load, name, tuple(shapes[name]), dtype)
              for hf, name in wanted.items()}  # fmt: skip
    return arrays, dtype


class Tensor:
    """One checkpoint tensor in our layout, read from its file only when asked for
    (`np.asarray(t)`, `t.astype(dtype)`): a model is placed on its devices one tensor at
    a time, never whole in host memory."""

    def __init__(self, load: Callable[[], np.ndarray], name: str, shape: tuple, dtype: str):
        self._load, self._name = load, name
        self.shape = shape
        self.dtype = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)

    def _read(self) -> np.ndarray:
        array = self._load()
        return LAYOUTS[hf_name(self._name)[1]].to_ours(array, self.shape).astype(self.dtype)

    def astype(self, dtype) -> np.ndarray:
        return self._read().astype(dtype)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        array = self._read()
        return array if dtype is None else array.astype(dtype)


# ------------------------------------------------------------------------------ write


def half_order(head_dim: int, rotated: int | None = None) -> np.ndarray:
    """Indices taking an `interleaved` head to the `half` layout: pair (2i, 2i + 1) of
    the first `rotated` numbers (default all) goes to (i, i + rotated / 2); the rest stay."""
    rotated = head_dim if rotated is None else rotated
    return np.concatenate([np.arange(0, rotated, 2), np.arange(1, rotated, 2),
                           np.arange(rotated, head_dim)])  # fmt: skip


def to_half(name: str, x: np.ndarray, head_dim: int, rotated: int | None = None) -> np.ndarray:
    """`x` (parameter `name`) with its head dim reordered by `half_order` when the
    parameter follows q or k's rotation pairs; else `x`."""
    block = _BLOCK.fullmatch(name)
    if not block or block.group(2) not in _ROTATED:
        return x
    order = half_order(head_dim, rotated)
    if x.ndim == 1 and x.shape[0] != head_dim:  # a flat bias [N*H]
        return x.reshape(-1, head_dim)[:, order].reshape(-1)
    return x[..., order]


def write(directory: str, arrays: dict[str, np.ndarray]) -> str:
    """Writes rope_jax parameter arrays {name: array} (already in the `half` layout) as
    one `model.safetensors` with HF names and layouts; returns its path."""
    from safetensors.numpy import save_file

    tensors = {}
    for name, x in arrays.items():
        hf, layout = hf_name(name)
        tensors[hf] = np.ascontiguousarray(LAYOUTS[layout].to_hf(np.asarray(x)))
    path = os.path.join(directory, SINGLE_FILE)
    save_file(tensors, path, metadata={"format": "pt"})  # transformers checks the format
    os.chmod(path, 0o644)  # safetensors writes 0600: other users could not load the model
    return path
