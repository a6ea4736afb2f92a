"""Diagnostics read off a decoder's forward pass.

`max_attention_logits(model, tokens)`: per layer, the largest attention logit, the score
q_t . k_s x scale (after the layer's rotations and its rule's attention factor, before
the softmax) over the pairs the layer may attend (s <= t, and inside its window or chunk).
It is the number that grows when attention collapses onto single keys (logit growth), so
a training curve of it separates an unstable row from a slowly learning one. Sinks are
not keys and are left out. Dense: [B, N, T, T] logits per layer, for diagnostics at
training lengths, not for long contexts.

`pair_norms(model, tokens)`: per layer, the mean length of each rotation pair of every
query and key head before the rotation (which keeps lengths): what MHA2MLA's 2-norm
criterion ranks pairs by (`pair_scores`), and Barbero et al.'s (2024) reading of which
frequencies a model uses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rope_jax import layouts, rotary
from rope_jax.nn import attention


def max_attention_logits(model, tokens) -> jax.Array:
    """float32 [L]: the largest attention logit of each layer of `model` (a `Decoder` of
    text) on `tokens` int [B, T] at text positions 0..T-1."""
    b, t = tokens.shape
    positions = layouts.text_positions(jnp.zeros((b,)), t, model.num_axes, xp=jnp)
    x = model._embed(tokens, positions, None, None)
    out = []
    for block in model.blocks:
        out.append(_layer_max(block.attn, block.attn_norm(x), positions))
        x = block(x, positions)
    return jnp.stack(out)


def pair_norms(model, tokens) -> tuple[jax.Array, jax.Array]:
    """(float32 [L, N, P], [L, K, P]): the mean over `tokens` int [B, T] (text positions)
    of |q_i| and |k_i|, the length of pair i of each query and key head of each layer,
    pairs formed by the layer's layout."""
    b, t = tokens.shape
    positions = layouts.text_positions(jnp.zeros((b,)), t, model.num_axes, xp=jnp)
    x = model._embed(tokens, positions, None, None)
    qs, ks = [], []
    for block in model.blocks:
        q, k, _ = block.attn._project(block.attn_norm(x).astype(block.attn.dtype), positions)
        layout = attention.rotation_of(block.attn.rotation(), t)[0].layout
        qs.append(rotary.pair_norms(q, layout).mean((0, 1)))
        ks.append(rotary.pair_norms(k, layout).mean((0, 1)))
        x = block(x, positions)
    return jnp.stack(qs), jnp.stack(ks)


def pair_scores(q_norms, k_norms) -> jax.Array:
    """float32 [L, K, P]: pair i's share of kv head k's logits, as MHA2MLA's 2-norm
    criterion scores it: sum over the kv head's G query heads of mean|q_i| * mean|k_i|
    (|q_i . k_i| <= |q_i| |k_i|: the most a pair can add to a logit, on average)."""
    q_norms, k_norms = jnp.asarray(q_norms), jnp.asarray(k_norms)
    layers, heads, pairs = q_norms.shape
    kv = k_norms.shape[1]
    grouped = q_norms.reshape(layers, kv, heads // kv, pairs)
    return (grouped * k_norms[:, :, None, :]).sum(2)


def _layer_max(attn, h, positions) -> jax.Array:
    """The largest logit of one attention layer on its normed input h [B, T, D]."""
    q, k, _ = attn._project(h.astype(attn.dtype), positions)
    t, sites = k.shape[1], attn.sites
    spec, rot = attention.rotation_of(attn.rotation(), t)
    if "q" in sites:
        q = rot(q, positions)
    if "k" in sites:
        k = rot(k, positions)
    if attn.xpos:
        q = attention.decay(q, positions, attn.xpos, t, spec.layout)
        k = attention.decay(k, positions, attn.xpos, t, spec.layout, key=True)
    scale = attention.logit_scale(spec, sites, head_dim=q.shape[-1], seq_len=t)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)  # kv head n // group for head n
    logits = jnp.einsum("btnh,bsnh->bnts", q.astype(jnp.float32), k.astype(jnp.float32))
    return jnp.max(jnp.where(allowed(t, attn.window, attn.chunk), logits * scale, -jnp.inf))


def allowed(t: int, window: int | None, chunk: int | None) -> jax.Array:
    """bool [T, T]: query t may attend key s (causal; inside a window W: s > t - W; in a
    chunk of C: s // C == t // C)."""
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    ok = j <= i
    if window:
        ok &= j > i - window
    if chunk:
        ok &= j // chunk == i // chunk
    return ok
