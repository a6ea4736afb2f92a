"""Per-layer attention types and the sliding layers' decoding cache (a ring of W slots).

Layer types (`model.attention.layer_types`, HF's `layer_types`), one per layer:

  "full"     causal attention over every earlier key (Llama).
  "sliding"  causal attention over the W latest keys, t - W < s <= t, W =
             `model.attention.window` (HF's `sliding_window`; Mistral: every layer,
             Gemma 2: alternating, Gemma 3: five of six, gpt-oss: alternating).

A new type is one entry of LAYER_TYPES plus its window rule in `layer_windows` and its
cache in `Attention.init_cache` / `decode`: Llama 4's "chunked" (keys in the same chunk
of C tokens) goes here.

Decoding cache of a sliding layer: C = min(W, cache length) slots, token i at slot
i mod C (a ring). A step rolls the ring into token order (oldest first), appends the T
new keys, attends with the kernel's own window (`kernels.mix(window=W)`, query 0 at
offset C) while kv segment ids mask the slots no token has filled yet, and keeps the
last C keys, rolled back into their slots. Memory: C slots, whatever the length.

Shape legend: B batch, T new tokens, C ring slots, K kv heads, H head dim.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

LAYER_TYPES = {
    "full": "causal attention over every earlier key",
    "sliding": "causal attention over the model.attention.window latest keys",
}


def _fail(field: str, value: Any, allowed: str):
    raise ValueError(f"model.attention.{field}={value!r} is invalid: {allowed}")


def layer_windows(attention, num_layers: int, *, train_seq_len: int | None = None):
    """Each layer's sliding window W (None for a full layer), checked once.

    `attention` is `config.model.attention`: `window` 0 (none) or W with
    1 <= W < train_seq_len (a window of the whole training sequence would change
    nothing); `layer_types` () = every layer sliding if W > 0 (Mistral) else every
    layer full, or one name of LAYER_TYPES per layer. `sinks` must be True or False.
    """
    sinks, window, types = attention.sinks, attention.window, attention.layer_types
    if not isinstance(sinks, bool):
        _fail("sinks", sinks, "must be True or False (one learned logit per query head)")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        _fail("window", window, "must be a non-negative integer (0 = none; W > 0: query t "
              "sees keys t - W < s <= t)")  # fmt: skip
    if window and train_seq_len is not None and window >= train_seq_len:
        _fail("window", window, f"must be below data.seq_len={train_seq_len}: a window of "
              "the whole sequence changes nothing (use 0 for none)")  # fmt: skip
    if isinstance(types, str) or not isinstance(types, tuple | list):
        _fail("layer_types", types, f"must be a tuple of {', '.join(LAYER_TYPES)} per layer "
              "(() = all sliding with a window, else all full)")  # fmt: skip
    types = tuple(types) or (("sliding" if window else "full"),) * num_layers
    bad = [t for t in types if t not in LAYER_TYPES]
    if bad:
        _fail("layer_types", types, f"has {bad[0]!r}: each must be one of "
              f"{', '.join(map(repr, LAYER_TYPES))}")  # fmt: skip
    if len(types) != num_layers:
        _fail("layer_types", types, f"has {len(types)} entries: needs one per layer "
              f"(model.num_layers={num_layers})")  # fmt: skip
    if "sliding" in types and not window:
        _fail("layer_types", types, "has 'sliding' layers but model.attention.window=0: "
              "set the window W")  # fmt: skip
    if window and "sliding" not in types:
        _fail("window", window, f"has no sliding layer to act on (layer_types={types})")
    return tuple(window if t == "sliding" else None for t in types)


def ring_slots(window: int, max_len: int) -> int:
    """C: the slots of a sliding layer's cache for `max_len` tokens."""
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


def ring_store(keys, slots: int, index):
    """The next ring [B, C, K, H] from `ring_keys`' [B, C + T, K, H]: the C latest tokens,
    token i at slot i mod C."""
    new = keys.shape[1] - slots
    latest = keys[:, new:]  # tokens index + T - C .. index + T - 1, oldest first
    return jnp.roll(latest, (index + new) % slots, axis=1)
