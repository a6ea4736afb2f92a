"""Autoregressive decoding with a key/value cache: prefill the prompt, then one token a step.

  from rope_jax import data
  from rope_jax.nn import generate
  new = generate.generate(model, data.encode("ROMEO:")[None], max_new_tokens=64)
  print(data.decode(new[0]))

The cache holds every layer's keys and values after their rotation (k rotated if "k"
is a site, v if "v" is; the tied latent c always), so a step rotates only the new
token's query, key and value, and the output if "o" is a site. A learned rotation
(`model.rope.learned`) is cached the same way: R_j depends on its trained parameters,
which decoding does not change, and on token j's position alone. Generated tokens are
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
    return _generate(
        graphdef,
        state,
        prompt_tokens,
        positions,
        patches,
        None if is_patch is None else jnp.asarray(is_patch, bool),
        next_position,
        jnp.asarray(temperature, jnp.float32),
        jax.random.key(seed),
        max_new_tokens=int(max_new_tokens),
        greedy=temperature == 0,
    )


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "greedy"))
def _generate(
    graphdef,
    state,
    tokens,
    positions,
    patches,
    is_patch,
    next_position,
    temperature,
    key,
    *,
    max_new_tokens: int,
    greedy: bool,
):
    # jax.jit, not nnx.jit: nnx.jit would return the model's state, a second copy of every
    # weight; decoding changes none of them
    model = nnx.merge(graphdef, state)
    b, t = tokens.shape
    keys = jax.random.split(key, max_new_tokens)

    def sample(logits, key):  # [B, V] -> [B]
        if greedy:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)

    cache = model.init_cache(b, t + max_new_tokens)
    logits, cache = model.decode(tokens, positions, cache, patches=patches, is_patch=is_patch)
    first = sample(logits[:, -1], keys[0])

    def step(carry, inputs):
        cache, token = carry
        k, key = inputs
        pos = layouts.text_positions(next_position + k, 1, model.num_axes, xp=jnp)  # [B, 1, A]
        logits, cache = model.decode(token[:, None], pos, cache)
        token = sample(logits[:, -1], key)
        return (cache, token), token

    steps = (jnp.arange(max_new_tokens - 1, dtype=jnp.float32), keys[1:])
    _, rest = jax.lax.scan(step, (cache, first), steps)  # [M - 1, B]
    return jnp.concatenate([first[:, None], rest.T], axis=1)
