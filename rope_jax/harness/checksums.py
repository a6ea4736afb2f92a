"""Checksums of a checkpoint's arrays (crc32 of the host bytes of every array a process
saved, per shard) and the first non-finite parameter of a state.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np


def array_checksums(state) -> dict[str, dict[str, int]]:
    """crc32 of the host bytes of every array of `state`: {array name: {shard: crc}}.

    The shard is "all" for an array this process holds entirely (the whole array in
    C order, so any sharding of it gives the same sum), else the index of each of this
    process's shards ("0:16,0:32"; replica 0 only).
    """
    out = {}
    for path, x in jax.tree_util.tree_leaves_with_path(state):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            # one array on the host at a time: a copy of the whole state would double
            # the memory a save needs
            out[leaf_name(path)] = {"all": _crc32(jax.device_get(x))}
        else:
            out[leaf_name(path)] = {
                _shard_key(s.index): _crc32(s.data)
                for s in x.addressable_shards
                if s.replica_id == 0
            }
    return out


def leaf_name(path) -> str:
    """`params.blocks.0.attn.q` for a pytree key path (nnx's trailing `.value` dropped)."""
    parts = []
    for key in path:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    if len(parts) > 1 and parts[-1] == "value":
        parts.pop()
    return ".".join(parts)


def _crc32(array) -> int:
    data = np.ascontiguousarray(np.asarray(array))  # at least 1-d
    return zlib.crc32(data.view(np.uint8).reshape(-1))


def _shard_key(index) -> str:
    return ",".join(f"{s.start or 0}:{'' if s.stop is None else s.stop}" for s in index)


def nbytes(tree) -> int:
    return sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def _first_non_finite(tree) -> str | None:
    """Name of the first floating-point array holding a NaN or inf, or None."""
    leaves = [(p, x) for p, x in jax.tree_util.tree_leaves_with_path(tree)
              if jnp.issubdtype(x.dtype, jnp.floating)]  # fmt: skip
    finite = jax.device_get([jnp.isfinite(x).all() for _, x in leaves])
    return next((leaf_name(p) for (p, _), ok in zip(leaves, finite, strict=True) if not ok), None)


def non_finite_params(state) -> str | None:
    """Name of the first parameter array of `state` that is not finite, or None."""
    return _first_non_finite(state["params"] if isinstance(state, dict) else state)
