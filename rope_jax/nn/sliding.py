"""Per-layer attention types and the local layers' decoding cache (a ring of W or C slots).

Layer types (`model.attention.layer_types`, HF's `layer_types`), one per layer:

  "full"     causal attention over every earlier key (Llama).
  "sliding"  causal attention over the W latest keys, t - W < s <= t, W =
             `model.attention.window` (HF's `sliding_window`; Mistral: every layer,
             Gemma 2: alternating, Gemma 3: five of six, gpt-oss: alternating).
  "chunked"  causal attention inside fixed chunks of C positions: query t sees keys
             s <= t with s // C == t // C, C = `model.attention.chunk` (HF's
             `attention_chunk_size`; Llama 4's local layers, 8192 there). Chunks start
             at position 0 of the sequence (the cache's slot 0 when decoding): the first
             query of a chunk sees only itself, its last one the whole chunk.

A new type is one entry of LAYER_TYPES plus its rule in `layer_types` (and the per-layer
readers below) and its cache in `Attention.init_cache` / `decode`.

Decoding cache of a sliding or chunked layer: C = min(W or chunk, cache length) slots,
token i at slot i mod C (a ring). A step rolls the ring into token order (oldest first),
appends the T new keys, and attends with query 0 at offset C: a sliding layer with the
kernel's own window (`kernels.mix(window=W)`) while kv segment ids mask the slots no
token has filled yet; a chunked layer with segment ids that are each token's chunk
index (`chunk_segments`), so a query sees only the keys of its own chunk. The last C
keys are kept, rolled back into their slots. Memory: C slots, whatever the length.

Shape legend: B batch, T new tokens, C ring slots, K kv heads, H head dim.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

LAYER_TYPES = {
    "full": "causal attention over every earlier key",
    "sliding": "causal attention over the model.attention.window latest keys",
    "chunked": "causal attention inside chunks of model.attention.chunk positions",
}
# the setting each local type reads (model.attention.<field>)
_SIZE_FIELD = {"sliding": "window", "chunked": "chunk"}


def _fail(field: str, value: Any, allowed: str):
    raise ValueError(f"model.attention.{field}={value!r} is invalid: {allowed}")


def layer_types(attention, num_layers: int, *, train_seq_len: int | None = None):
    """Each layer's type (a key of LAYER_TYPES), checked once.

    `attention` is `config.model.attention`: `window` W and `chunk` C each 0 (none) or
    below train_seq_len (a window or chunk of the whole training sequence would change
    nothing); `layer_types` () = every layer sliding if W > 0 (Mistral), chunked if
    C > 0, else full (not both W and C), or one name of LAYER_TYPES per layer; each of
    W, C set exactly when some layer reads it. `sinks` must be True or False.
    """
    sinks, types = attention.sinks, attention.layer_types
    if not isinstance(sinks, bool):
        _fail("sinks", sinks, "must be True or False (one learned logit per query head)")
    if isinstance(types, str) or not isinstance(types, tuple | list):
        _fail("layer_types", types, f"must be a tuple of {', '.join(LAYER_TYPES)} per layer "
              "(() = all sliding with a window, all chunked with a chunk, else all "
              "full)")  # fmt: skip
    sizes = {kind: _check_size(attention, field, train_seq_len)
             for kind, field in _SIZE_FIELD.items()}  # fmt: skip
    if not types and sizes["sliding"] and sizes["chunked"]:
        _fail("layer_types", types, "must name each layer's type when both "
              "model.attention.window and model.attention.chunk are set")  # fmt: skip
    default = next((kind for kind, size in sizes.items() if size), "full")
    types = tuple(types) or (default,) * num_layers
    bad = [t for t in types if t not in LAYER_TYPES]
    if bad:
        _fail("layer_types", types, f"has {bad[0]!r}: each must be one of "
              f"{', '.join(map(repr, LAYER_TYPES))}")  # fmt: skip
    if len(types) != num_layers:
        _fail("layer_types", types, f"has {len(types)} entries: needs one per layer "
              f"(model.num_layers={num_layers})")  # fmt: skip
    for kind, field in _SIZE_FIELD.items():
        if kind in types and not sizes[kind]:
            _fail("layer_types", types, f"has {kind!r} layers but model.attention.{field}=0: "
                  f"set it")  # fmt: skip
        if sizes[kind] and kind not in types:
            _fail(field, sizes[kind], f"has no {kind} layer to act on (layer_types={types})")
    return types


def _check_size(attention, field: str, train_seq_len: int | None) -> int:
    """`model.attention.window` or `.chunk`: a non-negative int below the training length."""
    size = attention[field]
    reach = "query t sees keys t - W < s <= t" if field == "window" else (
        "query t sees keys s <= t with s // C == t // C")  # fmt: skip
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        _fail(field, size, f"must be a non-negative integer (0 = none; > 0: {reach})")
    if size and train_seq_len is not None and size >= train_seq_len:
        _fail(field, size, f"must be below data.seq_len={train_seq_len}: a {field} of "
              "the whole sequence changes nothing (use 0 for none)")  # fmt: skip
    return size


def layer_windows(attention, num_layers: int, *, train_seq_len: int | None = None):
    """Each layer's sliding window W (None for a layer that is not sliding), checked."""
    types = layer_types(attention, num_layers, train_seq_len=train_seq_len)
    return tuple(attention.window if t == "sliding" else None for t in types)


def layer_chunks(attention, num_layers: int, *, train_seq_len: int | None = None):
    """Each layer's chunk C (None for a layer that is not chunked), checked."""
    types = layer_types(attention, num_layers, train_seq_len=train_seq_len)
    return tuple(attention.chunk if t == "chunked" else None for t in types)


def ring_slots(window: int, max_len: int) -> int:
    """C: the slots of a sliding (or chunked) layer's cache for `max_len` tokens, from its
    window W (or chunk)."""
    return min(window, max_len)


def ring_keys(ring, new, index):
    """The ring [B, C, K, H] in token order (oldest first) followed by the T new entries
    [B, T, K, H]: [B, C + T, K, H], entry s holding token index - C + s."""
    c = ring.shape[1]
    return jnp.concatenate([jnp.roll(ring, -(index % c), axis=1), new], axis=1)


def ring_segments(batch: int, slots: int, new: int, index):
    """(q ids [B, T] ones, kv ids [B, C + T]): 0 on slots before token 0 (never filled)."""
    filled = jnp.arange(slots + new) >= slots - index  # token index - C + s >= 0
    kv = jnp.broadcast_to(filled.astype(jnp.int32), (batch, slots + new))
    return jnp.ones((batch, new), jnp.int32), kv


def chunk_segments(batch: int, slots: int, new: int, index, chunk: int):
    """(q ids [B, T], kv ids [B, C + T]) of a chunked layer's step: each token's chunk
    index (token // chunk), -1 on slots before token 0 (never filled), over `ring_keys`'
    entries (entry s holds token index - C + s; query t is token index + t)."""
    tokens = index - slots + jnp.arange(slots + new)
    kv = jnp.where(tokens >= 0, tokens // chunk, -1).astype(jnp.int32)
    q = ((index + jnp.arange(new)) // chunk).astype(jnp.int32)
    return jnp.broadcast_to(q, (batch, new)), jnp.broadcast_to(kv, (batch, slots + new))


def ring_store(keys, slots: int, index):
    """The next ring [B, C, K, H] from `ring_keys`' [B, C + T, K, H]: the C latest tokens,
    token i at slot i mod C."""
    new = keys.shape[1] - slots
    latest = keys[:, new:]  # tokens index + T - C .. index + T - 1, oldest first
    return jnp.roll(latest, (index + new) % slots, axis=1)
