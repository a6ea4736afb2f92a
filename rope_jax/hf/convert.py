"""A Hugging Face model directory <-> a rope_jax `Decoder` (no harness, no torch).

    from rope_jax import hf
    model, model_cfg, tok = hf.load("path/to/Llama-3.2-1B")   # Decoder, config.model, tokenizer
    model, model_cfg, tok = hf.load("path/to/model.Q4_1.gguf") # a GGUF file (`hf.gguf`)
    logits = model(tokens)                                      # [B, T, V] float32
    hf.save("out/", model, model_cfg, max_position_embeddings=8192, tokenizer=tok)

`load` reads config.json (`hf.config`), the safetensors (`hf.weights`) and, when there
is one, tokenizer.json (`rope_jax.data.tokenizers`); parameters keep the checkpoint's
dtype (bfloat16 stays bfloat16) unless `param_dtype` is given. `save` writes
config.json, model.safetensors and tokenizer.json that `transformers`
`AutoModelForCausalLM.from_pretrained` loads as the same model (a byte-level run's
tokenizer.json: `ByteTokenizer.to_hf`, the same 259 ids).
"""

from __future__ import annotations

import contextlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rope_jax import defaults
from rope_jax import pairs as pairs_lib
from rope_jax.data import gguf_file, tokenizers
from rope_jax.harness import workdir
from rope_jax.hf import config as hf_config
from rope_jax.hf import gguf, published, weights
from rope_jax.nn import model as model_lib

TOKENIZER_FILE = tokenizers.HF_FILE  # tokenizer.json
# The special tokens by name, so transformers' tokenizer knows them (eos, pad, bos)
TOKENIZER_CONFIG = "tokenizer_config.json"


def param_name(path) -> str:
    """ "blocks.0.attn.q_proj" for an NNX state path."""
    return ".".join(str(getattr(key, "key", key)) for key in path)


def abstract_model(model_cfg):
    """The Decoder of `model_cfg` as ShapeDtypeStructs (nothing allocated)."""
    return nnx.eval_shape(lambda: model_lib.Decoder(model_cfg, rngs=nnx.Rngs(0)))


def param_shapes(model_cfg) -> dict[str, tuple]:
    """{parameter name: shape} of the Decoder of `model_cfg`."""
    state = nnx.state(abstract_model(model_cfg), nnx.Param)
    return {param_name(path): tuple(var.shape) for path, var in nnx.to_flat_state(state)}


def read_config(path: str) -> dict:
    """The config.json (a dict) of a checkpoint: an HF model directory's own, or the one
    a GGUF file's metadata describes (`hf.gguf.config`), or a published name's."""
    path = published.resolve(path)
    return gguf.config(path) if gguf.is_gguf(path) else hf_config.read(path)


def entries(path: str, *, rope_layout: str = "half") -> tuple[dict[str, weights.Entry], str]:
    """(HF tensor name -> `weights.Entry`, what describes the architecture) of a
    checkpoint: safetensors of a directory, or a GGUF file's tensors in `rope_layout`."""
    path = published.resolve(path)
    if gguf.is_gguf(path):
        return gguf.entries(path, rope_layout=rope_layout), gguf.DESCRIBED_BY
    if rope_layout != "half":
        raise hf_config.HFError(f"{path}: an HF directory stores q/k in half-pair order; "
                                f"rope_layout={rope_layout!r} is for GGUF files")  # fmt: skip
    return weights.safetensors_entries(path), hf_config.CONFIG_FILE


def checkpoint_dtype(path: str) -> str:
    """The dtype a checkpoint's parameters are kept in ("float32" for GGUF: dequantized)."""
    return weights.checkpoint_dtype(entries(path)[0])


def read_params(path: str, model_cfg=None) -> tuple[dict[str, np.ndarray], str]:
    """({parameter name: array}, the checkpoint's dtype) of an HF directory or GGUF file;
    `model_cfg` defaults to the one its config describes. Its `rope.layout` picks a GGUF
    file's q/k row order (`hf.gguf`)."""
    path = published.resolve(path)
    if model_cfg is None:
        model_cfg = hf_config.model_config(read_config(path))
    shapes = param_shapes(model_cfg)
    layout = model_cfg.rope.layout if gguf.is_gguf(path) else "half"
    stored, described_by = entries(path, rope_layout=layout)
    return weights.read(stored, shapes, tied=model_cfg.tie_embeddings, where=path,
                        described_by=described_by)  # fmt: skip


def tokenizer_path(path: str) -> str | None:
    """What `data.tokenizer` names for a checkpoint's own tokenizer: a directory's
    tokenizer.json, a GGUF file itself when it holds one; None when it has none."""
    path = published.resolve(path)
    if gguf.is_gguf(path):
        meta = gguf_file.read(path)[1]
        return os.path.abspath(path) if gguf_file.has_tokenizer(meta) else None
    file = os.path.abspath(os.path.join(path, TOKENIZER_FILE))
    return file if os.path.isfile(file) else None


def load_tokenizer(path: str) -> tokenizers.Tokenizer | None:
    """The checkpoint's tokenizer as a rope_jax tokenizer, or None when it has none."""
    file = tokenizer_path(path)
    return None if file is None else tokenizers.load(file)


def adopt(config, directory: str, *, param_dtype: str | None = None):
    """A copy of the run config `config` holding DIR's architecture
    (`hf.config.ARCH_FIELDS`: shapes, norm epsilon, tied embeddings, biases, q/k norms,
    rope base, scaling rule, L), with `param_dtype` replacing model.param_dtype when
    given, and DIR's tokenizer.json as `data.tokenizer` when that is "" (the model's
    ids). The run keeps its other model choices (sites, dtypes, attention kernel, ...).
    HFError when DIR's sliding window is not below the run's `data.seq_len`."""
    fields = hf_config.model_fields(read_config(directory))
    config = defaults.fill(config)  # a full, mutable copy
    hf_config.set_fields(config.model, fields)
    if param_dtype is not None:
        config.model.param_dtype = param_dtype
    window, seq_len = config.model.attention.window, config.data.get("seq_len")
    if window and isinstance(seq_len, int) and window >= seq_len:  # the decoder's rule, for DIR
        raise hf_config.HFError(
            f"{directory}: sliding_window={window} is not below data.seq_len={seq_len}, and a "
            f"run's window must be: pass --config.data.seq_len above {window} (hf.load takes "
            "the model at any length)"
        )
    tokenizer = tokenizer_path(directory)
    if not config.data.tokenizer and tokenizer is not None:
        config.data.tokenizer = tokenizer
    return config


def load(directory: str, *, dtype: str = "float32", param_dtype: str | None = None,
         rope_layout: str = "half"):  # fmt: skip
    """(Decoder, its config.model, tokenizer or None) of an HF model directory or a GGUF
    file.

    `dtype` is the compute dtype; `param_dtype` None keeps the checkpoint's (float16
    checkpoints become float32; GGUF tensors are dequantized to float32). `rope_layout`
    "interleaved" keeps a llama GGUF file's own q/k rows (`hf.gguf`). HFError (one line)
    for what cannot be read.
    """
    hf = read_config(directory)
    model_cfg = hf_config.model_config(hf, dtype=dtype)
    model_cfg.rope.layout = rope_layout
    arrays, stored = read_params(directory, model_cfg)
    model_cfg.param_dtype = param_dtype or stored
    graphdef, state = nnx.split(abstract_model(model_cfg), nnx.Param)
    put = lambda path, var: jnp.asarray(arrays[param_name(path)], var.dtype)
    flat = [(path, var.replace(put(path, var))) for path, var in nnx.to_flat_state(state)]
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    return model, model_cfg, load_tokenizer(directory)


def flat_params(params) -> dict[str, np.ndarray]:
    """{parameter name: host array} of a Decoder or its `nnx.State` of parameters."""
    if isinstance(params, nnx.Module):
        params = nnx.state(params, nnx.Param)
    flat = nnx.to_flat_state(params)
    host = jax.device_get([var.get_value() for _, var in flat])
    return {param_name(path): np.asarray(x) for (path, _), x in zip(flat, host, strict=True)}


def rotated_dims(model_cfg) -> int:
    """The head numbers the rotation pairs live in: the pair selection's block (H, or the
    leading D numbers when the rest pass unrotated)."""
    return pairs_lib.PairSpec.of(model_cfg.rope.pairs).block(model_cfg.head_dim)


def save(directory: str, params, model_cfg, *, max_position_embeddings: int, tokenizer=None,
         num_axes: int = 1) -> list[str]:  # fmt: skip
    """Writes model.safetensors, (a tokenizer given: an HF one, or bytes as
    `ByteTokenizer.to_hf`) tokenizer.json and tokenizer_config.json (its bos/eos/pad
    tokens by name), then config.json:
    written last, it marks a complete model (removed first when a model is replaced).

    `params`: a Decoder or its parameter state; `max_position_embeddings`: L of the
    config.json (rope_jax's `model.rope.max_position_embeddings`, else the training
    length). HFError naming the setting when HF's classes cannot express the model
    (`hf.config.check_exportable`). Returns the files written.
    """
    hf_config.check_exportable(model_cfg, num_axes=num_axes)
    arrays = flat_params(params)
    if model_cfg.rope.layout == "interleaved":  # to HF's rotate_half pairs
        h, rotated = model_cfg.head_dim, rotated_dims(model_cfg)
        arrays = {name: weights.to_half(name, x, h, rotated) for name, x in arrays.items()}
    dtypes = {str(x.dtype) for x in arrays.values()}
    dtype = "bfloat16" if dtypes == {"bfloat16"} else "float32"
    arrays = {name: x.astype(dtype) for name, x in arrays.items()}
    special = {}
    if tokenizer is not None:
        special = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
                   "pad_token_id": tokenizer.pad_id}  # fmt: skip
    hf = hf_config.to_hf(model_cfg, max_position_embeddings=max_position_embeddings,
                         dtype=dtype, special_ids=special)  # fmt: skip
    os.makedirs(directory, exist_ok=True)
    config_path = os.path.join(directory, hf_config.CONFIG_FILE)
    tokenizer_path = os.path.join(directory, TOKENIZER_FILE)
    specials_path = os.path.join(directory, TOKENIZER_CONFIG)
    # config.json marks a complete model: gone until everything else is written, so an
    # export stopped part way (Ctrl-C, a full disk) is never loaded, and is not refused
    # as a finished model the next time; a replaced model's tokenizer.json goes too
    for stale in (config_path, tokenizer_path, specials_path):
        with contextlib.suppress(FileNotFoundError):
            os.remove(stale)
    files = [weights.write(directory, arrays), config_path]
    if tokenizer is not None and tokenizer.kind == "bytes":  # the same ids, as tokenizer.json
        tokenizer = tokenizer.to_hf()
    if tokenizer is not None and tokenizer.kind == "hf":
        workdir.write_atomic(tokenizer_path, tokenizer.to_str())
        names = {f"{k}_token": tokenizer.tok.id_to_token(getattr(tokenizer, f"{k}_id"))
                 for k in ("bos", "eos", "pad")}  # fmt: skip
        workdir.write_atomic(specials_path, json.dumps(names, indent=2, sort_keys=True) + "\n")
        files += [tokenizer_path, specials_path]
    workdir.write_atomic(config_path, json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return files
