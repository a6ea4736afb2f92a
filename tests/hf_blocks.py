"""What the tests of one attention block against a committed Hugging Face fixture share
(`tests/data/hf/<name>/`, made by `scripts/make_hf_fixtures.py`): the fixture's config
and arrays, the kernels each runs on, and decoding token by token through the cache."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

FIXTURES = os.path.join(os.path.dirname(__file__), "data", "hf")
# xla in the quick loop, the other kernels in the full suite
IMPLS = ["xla"] + [pytest.param(i, marks=pytest.mark.slow) for i in ("chunked", "dot_product")]


def config(name: str) -> dict:
    """The HF config fields the fixture `name` was made with."""
    with open(os.path.join(FIXTURES, name, "config.json")) as f:
        return json.load(f)


def shape(hf: dict) -> dict:
    """The decoder's shape fields (`config.model`) of an HF config's."""
    return {
        "vocab_size": hf["vocab_size"],
        "num_layers": hf["num_hidden_layers"],
        "embed_dim": hf["hidden_size"],
        "num_heads": hf["num_attention_heads"],
        "num_kv_heads": hf["num_key_value_heads"],
        "head_dim": hf["head_dim"],
        "norm_eps": hf["rms_norm_eps"],
    }


def arrays(name: str, kind: str) -> dict:
    """{input, output, cotangent, every weight and gradient} of one block of `name`."""
    return dict(np.load(os.path.join(FIXTURES, name, f"{kind}.npz")))


def stepwise_logits(model, tokens, prompt: int) -> np.ndarray:
    """Logits [B, T, V] of `tokens` [B, T] decoded through a fresh cache: the first
    `prompt` tokens in one call, then one token a call (text positions)."""
    b, t = tokens.shape
    cache = model.init_cache(b, t)
    positions = lambda a, z: jnp.broadcast_to(jnp.arange(a, z)[None, :, None], (b, z - a, 1))
    decode = nnx.jit(lambda model, *args: model.decode(*args))  # one compile per length
    logits, cache = decode(model, tokens[:, :prompt], positions(0, prompt), cache)
    got = [logits]
    for i in range(prompt, t):
        logits, cache = decode(model, tokens[:, i : i + 1], positions(i, i + 1), cache)
        got.append(logits)
    return np.concatenate(got, 1)
