"""Meshes, logical axis rules and activation constraints (MaxText-like, small).

Parameters carry logical axis names in their `out_sharding` metadata (see
`rope_jax.nn.layers.dense_param`); activations are constrained by logical names with
`constrain`. Rules map logical names to mesh axes:

  batch -> ("data", "fsdp")   seq -> None         embed -> "fsdp"
  heads, kv_heads, mlp, vocab -> "tensor"         head_dim -> None

(`heads` = query heads N, `kv_heads` = key/value heads K, `head_dim` = H, `patch` = patch
vector width.) A dimension whose size is not divisible by its mesh axes is left
replicated (e.g. a 259-token vocabulary on tensor=2), so any config runs on any mesh.

Typical use:

  mesh = make_mesh(config.mesh.shape, config.mesh.axes)
  rules = axis_rules(config.mesh.logical_axis_rules)
  model = create_sharded(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, rules)

Feeding batches to the devices (placement, prefetching) is `rope_jax.harness.feed`.
  with use_mesh(mesh, rules):
    logits = nnx.jit(lambda m, x: m(x))(model, tokens)
"""

from __future__ import annotations

import contextlib
import math
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
    ("kv_heads", "tensor"),
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
