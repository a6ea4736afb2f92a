"""Decoding a model token by token through its cache, for tests that compare it with the
full forward pass."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx


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
