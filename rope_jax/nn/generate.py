"""Autoregressive decoding with a key/value cache: prefill the prompt, then one token a step.

  from rope_jax import data
  from rope_jax.nn import generate
  new = generate.generate(model, data.encode("ROMEO:")[None], max_new_tokens=64)
  print(data.decode(new[0]))

The cache holds every layer's keys and values after their rotation (k rotated if "k"
is a site, v if "v" is; the tied latent c always), so a step rotates only the new
token's query, key and value, and the output if "o" is a site. A learned rotation
(`model.rope.learned`) is cached the same way: R_j depends on its trained parameters,
which decoding does not change, and on token j's position alone. A scaling rule that
reads the current length (`dynamic`, `longrope`) reads that of the whole continuation,
prompt + max_new_tokens, for every token (the cached keys keep one rotation; the cache
itself may hold a few spare slots). Generated tokens are
text: token k after the prompt sits at `(s + k, ..., s + k)` on every axis, where `s`
is the prompt's next text position (`layouts.next_position(segments, scheme, A)` for a
multimodal prompt: not the token count).

Shape legend: B batch, T prompt tokens, M new tokens, A position axes, E patch vector
width, V vocab.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rope_jax import layouts

# Decoding steps per compiled call after the prefill: long continuations report progress
# and stop on a signal between calls (one scan of M steps ran minutes without either).
CHUNK = 32


def generate(
    model,
    prompt_tokens,
    *,
    max_new_tokens: int,
    positions=None,
    temperature: float = 0.0,
    seed: int = 0,
    patches=None,
    is_patch=None,
    next_position=None,
    watch=None,
) -> jax.Array:
    """Continues each prompt by `max_new_tokens` tokens.

    Args:
      model: a `model.Decoder`.
      prompt_tokens: int [B, T] (all prompts the same length; ignored where is_patch).
      max_new_tokens: M >= 1.
      positions: [B, T, A] prompt positions; None = text positions 0..T-1.
      temperature: 0 = greedy (argmax); > 0 samples from softmax(logits / temperature).
      seed: sampling seed (the same seed gives the same tokens).
      patches, is_patch: [B, T, E] patch vectors and bool [B, T] mask, as in `Decoder`.
      next_position: position of the first new token, a number or [B]; default T when
        positions is None, else the last prompt position + 1 (right after a text token).
        A prompt that ends with a patch needs it: `layouts.next_position(...)`.
      watch: None, or a function of an iterable that yields its items (progress lines, a
        check for a signal: `evaluate.Progress.watch`); it sees the `chunks(M)` decoding
        calls, CHUNK tokens each, and may stop between them.

    Returns:
      int32 [B, M] new tokens.
    """
    prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
    if prompt_tokens.ndim != 2 or prompt_tokens.shape[1] < 1:
        raise ValueError(f"prompt_tokens {prompt_tokens.shape} must be [B, T] with T >= 1")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer):
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive integer")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive integer")
    if not temperature >= 0:
        raise ValueError(f"temperature={temperature!r} must be >= 0 (0 = greedy)")
    b, t = prompt_tokens.shape
    if positions is None:
        positions = layouts.text_positions(jnp.zeros((b,)), t, model.num_axes, xp=jnp)
        next_position = t if next_position is None else next_position
    positions = jnp.asarray(positions, jnp.float32)
    if next_position is None:
        if is_patch is not None and bool(np.any(np.asarray(is_patch)[:, -1])):
            raise ValueError(
                "the prompt ends with a patch: pass next_position="
                "layouts.next_position(segments, scheme, num_axes), where text resumes"
            )
        next_position = jnp.max(positions[:, -1], axis=-1) + 1.0  # [B]
    next_position = jnp.broadcast_to(jnp.asarray(next_position, jnp.float32), (b,))
    graphdef, state = nnx.split(model)  # the weights go in as an argument, not out again
    greedy, temperature = temperature == 0, jnp.asarray(temperature, jnp.float32)
    m, c = int(max_new_tokens), CHUNK
    n = chunks(m)  # after the first token, which the prefill samples
    keys = jax.random.split(jax.random.key(seed), m)  # token k samples with keys[k]
    rest = jnp.concatenate([keys[1:], jnp.repeat(keys[:1], n * c - (m - 1), axis=0)])
    cache, token = _prefill(graphdef, state, prompt_tokens, positions, patches,
                            None if is_patch is None else jnp.asarray(is_patch, bool),
                            temperature, keys[0], slots=t + 1 + n * c, seq_len=t + m,
                            greedy=greedy)  # fmt: skip
    out = [token[:, None]]
    for i in watch(range(n)) if watch else range(n):
        starts = next_position + jnp.arange(i * c, (i + 1) * c, dtype=jnp.float32)[:, None]
        keys_i = rest[i * c : (i + 1) * c]
        cache, token, new = _decode(graphdef, state, cache, token, starts, keys_i, temperature,
                                    seq_len=t + m, greedy=greedy)  # fmt: skip
        out.append(new.T)
    return jnp.concatenate(out, axis=1)[:, :m]


def chunks(max_new_tokens: int) -> int:
    """The compiled decoding calls `generate` makes after the prefill, CHUNK tokens each."""
    return -(-(int(max_new_tokens) - 1) // CHUNK)


def _sample(logits, key, temperature, greedy: bool):  # [B, V] -> [B]
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


# jax.jit, not nnx.jit: nnx.jit would return the model's state, a second copy of every
# weight; decoding changes none of them
@functools.partial(jax.jit, static_argnames=("graphdef", "slots", "seq_len", "greedy"))
def _prefill(graphdef, state, tokens, positions, patches, is_patch, temperature, key, *,
             slots: int, seq_len: int, greedy: bool):  # fmt: skip
    """(cache of `slots` slots holding the prompt, the first new token [B])."""
    model = nnx.merge(graphdef, state)
    cache = model.init_cache(tokens.shape[0], slots)
    logits, cache = model.decode(tokens, positions, cache, patches=patches, is_patch=is_patch,
                                 seq_len=seq_len, last_only=True)  # fmt: skip
    return cache, _sample(logits[:, -1], key, temperature, greedy)


@functools.partial(jax.jit, static_argnames=("graphdef", "seq_len", "greedy"), donate_argnums=(2,))
def _decode(graphdef, state, cache, token, starts, keys, temperature, *, seq_len: int,
            greedy: bool):  # fmt: skip
    """One call of len(keys) decoding steps: (cache, the last token [B], new tokens [C, B]).
    Step k feeds `token` at text position starts[k] ([B]) and samples with keys[k]."""
    model = nnx.merge(graphdef, state)

    def step(carry, inputs):
        cache, token = carry
        start, key = inputs
        pos = layouts.text_positions(start, 1, model.num_axes, xp=jnp)  # [B, 1, A]
        logits, cache = model.decode(token[:, None], pos, cache, seq_len=seq_len)
        token = _sample(logits[:, -1], key, temperature, greedy)
        return (cache, token), token

    (cache, token), new = jax.lax.scan(step, (cache, token), (starts, keys))
    return cache, token, new
