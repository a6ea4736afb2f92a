"""Whether a workdir's checkpoints can continue under a config: the model must match
(all of it but how it is computed), and `RESUME_FIELDS` unless the change is allowed.
"""

from __future__ import annotations

import os

from rope_jax import defaults
from rope_jax.harness.checkpoint import CheckpointError
from rope_jax.harness.runfiles import CONFIG_FILE, load_config

# Model fields that choose how the same parameters are computed, not what they are.
_COMPUTE_ONLY = ("dtype", "attention.impl")


def check_same_model(saved, config, *, where: str) -> None:
    """The model section decides parameter shapes and meaning: it must match to restore
    (all of it but the compute choices, `_COMPUTE_ONLY`). `where` is the saved
    config.json."""
    old = _flatten(defaults.fill_model(saved.model).to_dict())
    new = _flatten(defaults.fill_model(config.model).to_dict())
    diffs = [
        f"model.{k}: {old.get(k)!r} -> {new.get(k)!r}"
        for k in sorted(set(old) | set(new))
        if k not in _COMPUTE_ONLY and _norm(old.get(k)) != _norm(new.get(k))
    ]
    if diffs:
        raise CheckpointError(
            f"{where} was written for a different model ({'; '.join(diffs)}); "
            f"use a new --workdir, or the saved config: {_saved_config_flag(where)}"
        )


def _saved_config_flag(path: str) -> str:
    """The --config flag that reads the config.json at `path` (configs/saved.py)."""
    return f"--config=configs/saved.py:{os.path.dirname(path) or '.'}"


def _norm(value):
    if isinstance(value, dict):
        return {k: _norm(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return tuple(_norm(v) for v in value)
    return value


# Besides the model (which must match exactly), the fields whose change alters what a
# run's checkpoints mean: the data stream and its order (seed), the optimiser and its
# schedule, whose length is train.num_steps (a longer run has a different cosine), and
# the compute dtype. Where the data lives and which split is evaluated do not count.
RESUME_FIELDS = ("seed", "data", "optim", "train.num_steps", "model.dtype")


_NOT_COMPARED = ("data.data_dir", "data.eval_split")


def config_changes(saved, config) -> list[str]:
    """`field: old -> new` for every RESUME_FIELDS field that differs (fields missing
    on either side, from older or newer versions, are not compared)."""
    old, new = _flatten(saved.to_dict()), _flatten(config.to_dict())
    return [
        f"{k}: {old[k]!r} -> {new[k]!r}"
        for k in sorted(set(old) & set(new))
        if _resume_field(k) and _norm(old[k]) != _norm(new[k])
    ]


def _resume_field(key: str) -> bool:
    covered = any(key == f or key.startswith(f + ".") for f in RESUME_FIELDS)
    return covered and key not in _NOT_COMPARED


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check_resume(workdir: str, config, *, allow_change: bool = False) -> list[str]:
    """Compares `config` with the workdir's config.json, if any, before anything is
    restored: another model is an error; other RESUME_FIELDS changes are an error
    unless `allow_change`. Returns the changes (`field: old -> new`)."""
    path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.exists(path):
        return []
    saved = load_config(workdir)
    check_same_model(saved, config, where=path)
    changes = config_changes(saved, config)
    if changes and not allow_change:
        raise CheckpointError(
            f"{path} was written with other settings ({'; '.join(changes)}), which would "
            "change what its checkpoints mean: rerun with the saved values "
            f"({_saved_config_flag(path)}), use a new --workdir, or pass "
            "--allow_config_change to continue with the new ones"
        )
    return changes
