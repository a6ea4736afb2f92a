"""Meshes, logical axis rules and activation constraints (MaxText-like, small).

Parameters carry logical axis names in their `out_sharding` metadata (see
`rope_jax.attention.dense_param`); activations are constrained by logical names with
`constrain`. Rules map logical names to mesh axes:

  batch -> ("data", "fsdp")   seq -> None         embed -> "fsdp"
  heads, kv, mlp, vocab -> "tensor"               head_dim -> None

(`heads` = query heads N, `kv` = key/value heads K, `head_dim` = H, `patch` = patch
vector width.) A dimension whose size is not divisible by its mesh axes is left
replicated (e.g. a 259-token vocabulary on tensor=2), so any config runs on any mesh.

Typical use:

  mesh = make_mesh(config.mesh.shape, config.mesh.axes)
  rules = axis_rules(config.mesh.logical_axis_rules)
  model = create_sharded(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, rules)
  with use_mesh(mesh, rules):
    logits = nnx.jit(lambda m, x: m(x))(model, tokens)
"""

from __future__ import annotations

import contextlib
import copy
import math
import queue
import threading
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx
from flax.core import spmd as flax_spmd
from jax.sharding import AxisType, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# (logical name, mesh axes); the first rule naming a logical axis wins.
DEFAULT_RULES = (
    ("batch", ("data", "fsdp")),
    ("seq", None),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("patch", None),
)


def make_mesh(shape: Sequence[int], axes: Sequence[str] = MESH_AXES, *, devices=None):
    """A Mesh with `AxisType.Auto` axes; one entry of `shape` may be -1 (the rest).

    Auto axes are needed by logical rules and `with_sharding_constraint`; jax 0.10's
    `make_mesh` defaults to Explicit.
    """
    shape, axes = tuple(int(s) for s in shape), tuple(axes)
    devices = jax.devices() if devices is None else list(devices)
    if len(shape) != len(axes):
        raise ValueError(f"mesh.shape={shape} has {len(shape)} entries but mesh.axes={axes}")
    if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
        raise ValueError(f"mesh.shape={shape}: entries must be positive, at most one -1")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if len(devices) % known:
            raise ValueError(
                f"mesh.shape={shape}: {len(devices)} devices are not divisible by {known}"
            )
        shape = tuple(len(devices) // known if s == -1 else s for s in shape)
    if math.prod(shape) != len(devices):
        raise ValueError(
            f"mesh.shape={shape} needs {math.prod(shape)} devices but {len(devices)} are present"
        )
    return jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * len(axes), devices=devices)


def axis_rules(overrides: Sequence = ()) -> tuple:
    """DEFAULT_RULES with `overrides` ((logical, mesh axes) pairs) replacing their names."""
    overrides = tuple((str(name), _axes(mesh)) for name, mesh in overrides or ())
    names = {name for name, _ in overrides}
    return overrides + tuple(r for r in DEFAULT_RULES if r[0] not in names)


def _axes(mesh_axes):
    if mesh_axes is None or isinstance(mesh_axes, str):
        return mesh_axes
    return tuple(mesh_axes) or None


def logical_to_spec(
    names: Sequence[str | None] | None,
    rules: Sequence | None = None,
    *,
    shape: Sequence[int] | None = None,
    mesh=None,
) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions have logical `names`.

    A mesh axis is used at most once per array (first dimension wins). With `shape` and
    `mesh`, mesh axes that do not divide a dimension are dropped (that dimension stays
    replicated over them). Unknown logical names are replicated.
    """
    if names is None:
        return PartitionSpec()
    rules = dict(reversed(tuple(DEFAULT_RULES if rules is None else rules)))  # first wins
    sizes = dict(mesh.shape) if mesh is not None else {}
    used: set[str] = set()
    spec = []
    for i, name in enumerate(names):
        mesh_axes = rules.get(name) if name is not None else None
        mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())
        kept = []
        for ax in mesh_axes:
            if ax in used or (sizes and ax not in sizes):
                continue
            if shape is not None and sizes:
                if shape[i] % (math.prod(sizes[a] for a in kept) * sizes[ax]):
                    continue
            kept.append(ax)
        used.update(kept)
        spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return PartitionSpec(*spec)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(state, mesh, rules: Sequence | None = None):
    """NamedShardings for a state tree (Variables or arrays), from each Variable's names.

    Works on `nnx.state(model)`, optimiser state and abstract states from
    `nnx.eval_shape`; the result has the same structure, usable as `jax.jit`
    out_shardings or `jax.device_put` target. Variables without names are replicated.
    """

    def one(x):
        value = x.get_value() if _is_var(x) else x
        names = x.get_metadata().get("out_sharding") if _is_var(x) else None
        shape = getattr(value, "shape", None)
        spec = logical_to_spec(names, rules, shape=shape, mesh=mesh)
        sharding = NamedSharding(mesh, spec)
        return x.replace(sharding) if _is_var(x) else sharding

    return jax.tree.map(one, state, is_leaf=_is_var)


def shard_state(state, mesh, rules: Sequence | None = None):
    """Places a concrete state tree onto `mesh` according to its logical names."""
    return jax.device_put(state, state_shardings(state, mesh, rules))


def shard_model(model: nnx.Module, mesh, rules: Sequence | None = None) -> nnx.Module:
    """Moves a model's variables onto `mesh` in place (and returns the model)."""
    nnx.update(model, shard_state(nnx.state(model), mesh, rules))
    return model


def create_sharded(init_fn: Callable[[], nnx.Module], mesh, rules: Sequence | None = None):
    """Builds `init_fn()` with every variable created directly in its sharded place.

    The model is first traced abstractly for its logical names, then initialised inside
    one jit whose outputs are constrained to those shardings (no unsharded copy).
    """
    graphdef, abstract = nnx.split(nnx.eval_shape(init_fn))
    shardings = state_shardings(abstract, mesh, rules)

    @jax.jit
    def init():
        return jax.lax.with_sharding_constraint(nnx.state(init_fn()), shardings)

    with jax.set_mesh(mesh):
        state = init()
    return nnx.merge(graphdef, state)


# ----------------------------------------------------------------------- batches


def batch_sharding(mesh, rules: Sequence | None = None) -> NamedSharding:
    """Sharding of input batches: the leading dimension over the `batch` mesh axes."""
    return NamedSharding(mesh, logical_to_spec(("batch",), rules, mesh=mesh))


def put_batch(batch, sharding: NamedSharding):
    """Process-local numpy batch -> global arrays (each process passes its own rows)."""
    put = lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x))
    return jax.tree.map(put, batch)


class Prefetch:
    """Places the next `size` batches of a Grain iterator on devices in a background thread.

    `next()` returns a batch already placed with `put_batch`, so the training loop never
    waits on the host pipeline while the previous step runs. `get_state()` is the
    wrapped iterator's state just after the last batch returned (not after the batches
    still in the buffer): a checkpoint of it resumes at the next unseen batch. Restore a
    state on the iterator before wrapping it. An error in the pipeline (StopIteration
    included) is raised by the `next()` that would have returned that batch.
    """

    def __init__(self, iterator, sharding: NamedSharding, size: int = 2):
        self._iterator, self._sharding = iterator, sharding
        self._state = copy.deepcopy(iterator.get_state())
        self._queue: queue.Queue = queue.Queue(maxsize=max(int(size), 1))
        self._stop = threading.Event()
        self._error = None
        self._thread = threading.Thread(target=self._fill, name="prefetch", daemon=True)
        self._thread.start()

    def _fill(self):
        try:
            while not self._stop.is_set():
                batch = put_batch(next(self._iterator), self._sharding)
                self._put((batch, copy.deepcopy(self._iterator.get_state()), None))
        except BaseException as e:  # noqa: BLE001  (re-raised in the consumer's thread)
            self._put((None, None, e))

    def _put(self, item):
        while not self._stop.is_set():
            try:
                return self._queue.put(item, timeout=0.1)
            except queue.Full:
                continue

    def __iter__(self):
        return self

    def __next__(self):
        if self._error is not None:
            raise self._error
        batch, state, error = self._queue.get()
        if error is not None:
            self._error = error
            raise error
        self._state = state
        return batch

    def get_state(self):
        return self._state

    def close(self):
        """Stops the thread; the batches in the buffer are dropped."""
        self._stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        self._thread.join()


def abstract_batch(
    global_batch_size: int, seq_len: int, sharding: NamedSharding, extra: dict | None = None
) -> dict:
    """ShapeDtypeStructs of a batch: inputs, targets int32 and weights float32 [B, T],
    plus `extra` fields given as name -> (shape after B, dtype)."""
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(
        (global_batch_size, *shape), dtype, sharding=sharding
    )
    fields = {"inputs": ((seq_len,), np.int32), "targets": ((seq_len,), np.int32),
              "weights": ((seq_len,), np.float32), **(extra or {})}  # fmt: skip
    return {name: spec(shape, dtype) for name, (shape, dtype) in fields.items()}


def num_elements(tree) -> int:
    """Total number of array elements in a tree (arrays or ShapeDtypeStructs)."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def bytes_per_device(tree) -> int:
    """Bytes one device holds for a tree of sharded arrays / ShapeDtypeStructs."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return total


# ------------------------------------------------------------------- activations


@contextlib.contextmanager
def use_mesh(mesh, rules: Sequence | None = None):
    """Sets `mesh` (jax.set_mesh) and the logical rules used by `constrain`."""
    rules = DEFAULT_RULES if rules is None else tuple(rules)
    with jax.set_mesh(mesh), flax_spmd.logical_axis_rules(rules):
        yield mesh


def current_rules() -> tuple:
    """The rules set by `use_mesh` (or flax's logical_axis_rules), else DEFAULT_RULES."""
    return tuple(flax_spmd.get_logical_axis_rules()) or DEFAULT_RULES


def constrain(x, names: Sequence[str | None]):
    """with_sharding_constraint by logical `names`; a no-op when no mesh is set."""
    if np.ndim(x) != len(names):
        raise ValueError(f"logical names {tuple(names)} do not fit an array of shape {x.shape}")
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = logical_to_spec(names, current_rules(), shape=x.shape, mesh=mesh)
    return jax.lax.with_sharding_constraint(x, spec)
