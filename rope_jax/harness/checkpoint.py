"""Orbax checkpoints of a training run, with the config saved beside them.

A workdir holds:
  config.json        the run's config (written once; a restart must agree on the model)
  checkpoints/<step>/state   model parameters + optimiser state (sharded arrays)
  checkpoints/<step>/extra   JSON: data-iterator state, step, metrics at save time

Restoring goes into an abstract target (`jax.ShapeDtypeStruct`s carrying shardings),
so arrays land directly on their devices. Every failure a user can cause (no
checkpoint, a different model shape, a damaged step) is a `CheckpointError` with one
readable line.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp

CONFIG_FILE = "config.json"
CKPT_DIR = "checkpoints"


class CheckpointError(ValueError):
    """A checkpoint that is missing, damaged, or does not match the model."""


def save_config(workdir: str, config: ml_collections.ConfigDict) -> None:
    """Writes config.json; a restart with a different model in the same workdir fails."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, CONFIG_FILE)
    if os.path.exists(path):
        check_same_model(load_config(workdir), config, where=path)
    if jax.process_index() == 0:
        with open(path, "w") as f:
            f.write(config.to_json_best_effort(indent=2, sort_keys=True))


def load_config(workdir: str) -> ml_collections.ConfigDict:
    path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.exists(path):
        raise CheckpointError(f"no {CONFIG_FILE} in {workdir!r}: not a training workdir")
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    return ml_collections.ConfigDict(_upgrade(_tuples(raw)))


def _upgrade(raw: dict) -> dict:
    """A config saved before the layout scheme moved to `data.scheme` and the number of
    position axes became the data's: moves `model.rope.scheme`, drops `num_axes`."""
    rope = raw.get("model", {}).get("rope", {})
    scheme = rope.pop("scheme", None)
    rope.pop("num_axes", None)
    if scheme is not None and "data" in raw:
        raw["data"].setdefault("scheme", scheme)
    return raw


def _tuples(tree):
    """JSON lists back to tuples (configs hold tuples: sections, mesh shape, ...)."""
    if isinstance(tree, dict):
        return {k: _tuples(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return tuple(_tuples(v) for v in tree)
    return tree


# Model fields added after some runs were saved, with the value those runs used.
_MODEL_DEFAULTS = {"attention": {"kv": "separate"}}


def check_same_model(saved, config, *, where: str) -> None:
    """The model section decides parameter shapes: it must match to restore."""
    old = {**_MODEL_DEFAULTS, **saved.model.to_dict()}
    new = {**_MODEL_DEFAULTS, **config.model.to_dict()}
    diffs = [
        f"model.{k}: {old.get(k)!r} -> {new.get(k)!r}"
        for k in sorted(set(old) | set(new))
        if k != "dtype" and _norm(old.get(k)) != _norm(new.get(k))
    ]
    if diffs:
        raise CheckpointError(
            f"{where} was written for a different model ({'; '.join(diffs)}); "
            "use a new --workdir or the saved config"
        )


def _norm(value):
    if isinstance(value, dict):
        return {k: _norm(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return tuple(_norm(v) for v in value)
    return value


class Manager:
    """Keep-last-N Orbax CheckpointManager over (state pytree, JSON extras)."""

    def __init__(self, workdir: str, *, keep: int = 3, read_only: bool = False):
        self.directory = os.path.abspath(os.path.join(workdir, CKPT_DIR))
        if read_only and not os.path.isdir(self.directory):
            raise CheckpointError(f"no checkpoints in {workdir!r} (looked in {self.directory})")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=not read_only, read_only=read_only
        )
        self._mngr = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "extra")
        )

    def steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def save(self, step: int, state: Any, extra: dict, *, force: bool = False) -> None:
        self._mngr.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), extra=ocp.args.JsonSave(extra)
            ),
            force=force,
        )

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restores `step` into `abstract_state` (ShapeDtypeStructs with shardings)."""
        if step not in self._mngr.all_steps():
            raise CheckpointError(f"no checkpoint at step {step} in {self.directory}")
        try:
            restored = self._mngr.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state),
                    extra=ocp.args.JsonRestore(),
                ),
            )
        except Exception as e:  # orbax raises many types; one line for the user
            raise CheckpointError(_explain(step, self.directory, e)) from e
        _check_shapes(restored.state, abstract_state, step)
        return restored.state, dict(restored.extra or {})

    def restore_latest_good(self, abstract_state: Any) -> tuple[int, Any, dict]:
        """Newest step that restores cleanly, skipping damaged ones (with a warning)."""
        errors = []
        for step in reversed(self.steps()):
            try:
                return (step, *self.restore(step, abstract_state))
            except CheckpointError as e:
                logging.warning("skipping damaged checkpoint: %s", e)
                errors.append(str(e))
        raise CheckpointError(
            f"no restorable checkpoint in {self.directory}"
            + (f" (newest error: {errors[0]})" if errors else "")
        )

    def close(self) -> None:
        self._mngr.close()


def _check_shapes(restored, abstract, step: int) -> None:
    paths_r = dict(jax.tree_util.tree_leaves_with_path(restored))
    for path, want in jax.tree_util.tree_leaves_with_path(abstract):
        got = paths_r.get(path)
        if got is None or tuple(got.shape) != tuple(want.shape):
            name = jax.tree_util.keystr(path)
            have = None if got is None else tuple(got.shape)
            raise CheckpointError(
                f"checkpoint step {step} does not match the model: {name} has shape "
                f"{have}, the model expects {tuple(want.shape)}"
            )


def _explain(step: int, directory: str, error: Exception) -> str:
    text = " ".join(str(error).split())
    if len(text) > 300:
        text = text[:300] + "..."
    kind = "does not match the model" if "shape" in text.lower() else "cannot be read"
    return f"checkpoint step {step} in {directory} {kind}: {type(error).__name__}: {text}"
