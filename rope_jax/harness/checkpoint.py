"""Orbax checkpoints of a training run, verified on restore, with the config beside them.

A workdir holds:
  config.json        the run's config, written once the run has started (first step
                     done or checkpoint restored); a resume must agree on the model,
                     and on `RESUME_FIELDS` unless the change is allowed, in which
                     case the old one is kept as config.<step>.json
  tokenizer/         the data's tokenizer, written with config.json: evaluation and
                     generation decode with it, and data with another tokenizer is
                     refused (a run without one was byte-level)
  checkpoints/<step>/state   model parameters + optimiser state (sharded arrays)
  checkpoints/<step>/extra   JSON: data-iterator state, step
  checkpoints/<step>/checksums.process_<i>.json   crc32 of the host bytes of every
                     array process i saved, written once the step is complete on disk

Saving checks the free space first (against the previous step's size), waits for
Orbax to finish, flushes the step to disk and only then writes its checksums; a
failure is a `SaveError` naming the step, the directory and the free space, and
leaves the earlier steps as they were. Only then are the oldest steps beyond `keep`
deleted, except those a reader has pinned: a read-only manager (eval.py) holds a
shared `flock` on <workdir>/checkpoint_pins/<step>.lock from choosing a step until
it closes, and the writer deletes a step only under the exclusive lock (a pinned
step goes at a later save), so evaluating a live run never reads a step that
rotation is deleting. Restoring goes into an abstract target
(`jax.ShapeDtypeStruct`s carrying shardings), so arrays land directly on their
devices; then every array is compared with its checksum and non-finite parameters
are rejected. Every failure a user can cause (no checkpoint, a different model
shape, a damaged or incomplete step, a full disk) is a `CheckpointError` with one
readable line that names the step.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import glob
import json
import os
import shutil
import sys
import warnings
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from rope_jax import defaults
from rope_jax.data import tokenizers
from rope_jax.harness import console
from rope_jax.harness import workdir as workdir_lib

CONFIG_FILE = "config.json"
TOKENIZER_DIR = "tokenizer"
CKPT_DIR = "checkpoints"
DAMAGED_DIR = "damaged_checkpoints"  # where train.py --fallback moves damaged steps
CHECKSUMS_FILE = "checksums.process_{}.json"  # one per process: its own shards
PINS_DIR = "checkpoint_pins"  # <step>.lock: readers hold it shared, rotation exclusive


class CheckpointError(ValueError):
    """A checkpoint that is missing, damaged, or does not match the model."""


class SaveError(CheckpointError):
    """A checkpoint that could not be written (disk full, permissions); earlier ones kept."""


class StepGone(CheckpointError):
    """A step that was listed but no longer exists (deleted by a running trainer's
    rotation before it could be pinned): not damage."""


# ------------------------------------------------------------------------------ config


def save_config(workdir: str, config, *, keep_old_as: int | None = None) -> str | None:
    """Writes config.json (process 0, atomically). With `keep_old_as`, an existing
    config.json is first copied to config.<keep_old_as>.json; returns that path."""
    path = os.path.join(workdir, CONFIG_FILE)
    kept = None
    if jax.process_index() != 0:
        return kept
    if keep_old_as is not None and os.path.exists(path):
        kept = os.path.join(workdir, f"config.{keep_old_as}.json")
        n = 1
        while os.path.exists(kept):
            kept, n = os.path.join(workdir, f"config.{keep_old_as}.{n}.json"), n + 1
        shutil.copy2(path, kept)
    workdir_lib.write_atomic(path, config.to_json_best_effort(indent=2, sort_keys=True))
    return kept


def load_config(workdir: str) -> ml_collections.ConfigDict:
    """The run config saved in `workdir`, in today's layout with every field filled
    (`rope_jax.defaults`: fields added since the run was saved take their defaults,
    the values it used); unresolved, as a config file gives it."""
    path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.exists(path):
        raise CheckpointError(f"no {CONFIG_FILE} in {workdir!r}: not a training workdir")
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    try:
        return defaults.fill(defaults.migrate(_tuples(raw)))
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


def save_tokenizer(workdir: str, tok: tokenizers.Tokenizer) -> None:
    """Writes <workdir>/tokenizer (process 0; once: a resume checked it is the same)."""
    path = os.path.join(workdir, TOKENIZER_DIR)
    if jax.process_index() != 0 or os.path.isdir(path):
        return
    tmp = f"{path}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tok.save(tmp)
    os.replace(tmp, path)


def load_tokenizer(workdir: str) -> tokenizers.Tokenizer:
    """The run's tokenizer: <workdir>/tokenizer, or bytes for a run saved without one."""
    path = os.path.join(workdir, TOKENIZER_DIR)
    if not os.path.isdir(path):
        return tokenizers.ByteTokenizer()
    try:
        return tokenizers.load(path)
    except ValueError as e:
        raise CheckpointError(f"the tokenizer of {workdir!r}: {e}") from None


def check_tokenizer(workdir: str, tok: tokenizers.Tokenizer) -> None:
    """The data's tokenizer `tok` must be the one the workdir's checkpoints were made with."""
    if not os.path.exists(os.path.join(workdir, CONFIG_FILE)):
        return  # nothing trained here yet
    saved = load_tokenizer(workdir)
    if saved.name != tok.name or saved.vocab_size != tok.vocab_size:
        raise CheckpointError(
            f"{workdir!r} was trained with tokenizer {saved.name} ({saved.vocab_size} ids) "
            f"but the data's is {tok.name} ({tok.vocab_size} ids)"
        )


def _tuples(tree):
    """JSON lists back to tuples (configs hold tuples: sections, mesh shape, ...)."""
    if isinstance(tree, dict):
        return {k: _tuples(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return tuple(_tuples(v) for v in tree)
    return tree


# Model fields that choose how the same parameters are computed, not what they are.
_COMPUTE_ONLY = ("dtype", "attention.impl")


def check_same_model(saved, config, *, where: str) -> None:
    """The model section decides parameter shapes and meaning: it must match to restore
    (all of it but the compute choices, `_COMPUTE_ONLY`)."""
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
            "use a new --workdir or the saved config"
        )


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
            "change what its checkpoints mean: rerun with the saved values, use a new "
            "--workdir, or pass --allow_config_change to continue with the new ones"
        )
    return changes


# --------------------------------------------------------------------------- checksums


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


def _nbytes(tree) -> int:
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


# ----------------------------------------------------------------------------- manager


class Manager:
    """Keep-last-N Orbax CheckpointManager over (state pytree, JSON extras), with
    checksums written after each save and verified on each restore.

    Nothing is created on disk before the first save.
    """

    def __init__(self, workdir: str, *, keep: int = 3, read_only: bool = False):
        self.workdir = os.path.abspath(workdir)
        self.directory = os.path.join(self.workdir, CKPT_DIR)
        self.keep, self.read_only = keep, read_only
        if read_only and not os.path.isdir(self.directory):
            raise CheckpointError(f"no checkpoints in {workdir!r} (looked in {self.directory})")
        self._mngr = None
        self._pins: dict[int, int] = {}  # step -> fd holding its shared pin (readers)

    def _manager(self) -> ocp.CheckpointManager:
        if self._mngr is None:  # rotation is ours (`_rotate`): after checksums, around pins
            options = ocp.CheckpointManagerOptions(
                max_to_keep=None, create=not self.read_only, read_only=self.read_only
            )
            self._mngr = ocp.CheckpointManager(
                self.directory, options=options, item_names=("state", "extra")
            )
        return self._mngr

    def _reset(self) -> None:
        """Forgets Orbax's view of the directory (after steps were moved or removed)."""
        if self._mngr is not None:
            with contextlib.suppress(Exception), _orbax_leftovers_dropped():
                self._mngr.close()
            self._mngr = None

    def steps(self) -> list[int]:
        if self._mngr is None and not os.path.isdir(self.directory):
            return []
        return sorted(self._manager().all_steps())

    def latest_step(self, *, complete: bool = False) -> int | None:
        """The newest step; with `complete`, the newest whose save has finished (its
        checksums written): on a live run, the one being saved is left alone."""
        steps = [s for s in self.steps() if not complete or self.is_complete(s)]
        return steps[-1] if steps else None

    def is_complete(self, step: int) -> bool:
        """Whether `step`'s save finished: every process's checksums are there (a step
        saved before checksums existed counts as complete)."""
        try:
            with open(os.path.join(self.step_dir(step), "extra", "metadata")) as f:
                extra = json.load(f)
        except (OSError, ValueError):
            return False
        if not isinstance(extra, dict) or "checksums" not in extra:
            return isinstance(extra, dict)
        count = int(extra.get("checksum_processes", 1))
        return all(os.path.exists(os.path.join(self.step_dir(step), CHECKSUMS_FILE.format(i)))
                   for i in range(count))  # fmt: skip

    # ------------------------------------------------------------------------ pins

    def _pin_path(self, step: int) -> str:
        return os.path.join(self.workdir, PINS_DIR, f"{step}.lock")

    def pin(self, step: int) -> None:
        """Holds `step` (read-only managers): a running trainer's rotation leaves it until
        `close`. StepGone if it was deleted before the pin took hold."""
        if step in self._pins or not self.read_only:
            return
        path = self._pin_path(step)
        while True:
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError:  # a workdir we cannot write to: nobody rotates it meanwhile
                break
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits out a deletion in progress
            if workdir_lib.is_current(fd, path):
                self._pins[step] = fd
                break
            os.close(fd)  # deleted with its step while we waited: look again
        if not os.path.isdir(self.step_dir(step)):
            self._unpin(step)
            self._reset()  # Orbax's cached step list still has it
            raise StepGone(
                f"checkpoint step {step} in {self.directory} was deleted by the running "
                "trainer's rotation before it could be read"
            )

    def pin_newest(self, *, complete: bool = False) -> int | None:
        """The newest step (with `complete`, the newest whose save finished), pinned (a
        reader): rotation leaves it until `close`. Looks again when rotation deleted it
        first; None when there is no step."""
        for _ in range(100):
            if self._mngr is not None:
                self._manager().reload()  # the directory changes under a live run
            step = self.latest_step(complete=complete)
            if step is None:
                return None
            try:
                self.pin(step)
                return step
            except StepGone:
                continue
        raise CheckpointError(f"the checkpoints in {self.directory} change too fast to pin one")

    def _unpin(self, step: int) -> None:
        """Releases a pin; its lock file goes too unless another reader holds it."""
        fd = self._pins.pop(step, None)
        if fd is None:
            return
        path = self._pin_path(step)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if workdir_lib.is_current(fd, path):
                os.unlink(path)
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.dirname(path))  # only if empty
        except OSError:  # BlockingIOError: another reader holds it
            pass
        finally:
            os.close(fd)

    def _rotate(self) -> None:
        """Deletes the oldest steps beyond `keep` (the newest is complete, with its
        checksums), except pinned ones: those go at a later save. Process 0 decides
        (it holds the exclusive locks), every process deletes the same steps (Orbax)."""
        old = self.steps()[: -self.keep]
        if not old:
            return
        held = [_try_exclusive(self._pin_path(step)) if jax.process_index() == 0 else None
                for step in old]  # fmt: skip
        try:
            free = np.asarray([fd is not None for fd in held], np.int32)
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils

                free = np.asarray(multihost_utils.broadcast_one_to_all(free))
            for step, ok in zip(old, free, strict=True):
                if ok:
                    self._manager().delete(step)
        finally:
            for step, fd in zip(old, held, strict=True):
                if fd is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(self._pin_path(step))  # while held: readers look again
                    os.close(fd)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(self.workdir, PINS_DIR))  # only if empty

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    # ------------------------------------------------------------------------ save

    def save(self, step: int, state: Any, extra: dict, *, force: bool = False) -> None:
        """Saves `step` and returns once it is on disk with its checksums.

        Raises SaveError (one line: the step, where, the free space) if there is less
        free space than the previous step took, or if writing fails; the earlier steps
        are kept and the half-written one is removed.
        """
        self._check_space(step, state)
        sums = array_checksums(state)  # the host bytes of the arrays being saved
        extra = {**extra, "checksums": CHECKSUMS_FILE, "checksum_processes": jax.process_count()}
        existed = os.path.exists(self.step_dir(step))
        try:
            mngr = self._manager()
            mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                   extra=ocp.args.JsonSave(extra)),
                      force=force)  # fmt: skip
            mngr.wait_until_finished()  # Orbax has renamed the step: it is complete
            workdir_lib.fsync_tree(self.step_dir(step))  # ... and now on disk
            name = CHECKSUMS_FILE.format(jax.process_index())
            record = {"step": step, "algorithm": "crc32", "arrays": sums}
            workdir_lib.write_atomic(os.path.join(self.step_dir(step), name), json.dumps(record))
        except Exception as e:  # Orbax raises many types; one line for the user
            self._discard(step, existed)
            raise SaveError(self._save_failed(step, e)) from e
        self._rotate()

    def _check_space(self, step: int, state) -> None:
        previous = self.latest_step()
        if previous is not None:
            need, of = workdir_lib.tree_bytes(self.step_dir(previous)), f"step {previous}'s size"
        else:
            need, of = _nbytes(state), "the state's size in memory"
        try:
            workdir_lib.check_free_space(
                self.directory, need, what=f"checkpoint step {step}",
                hint=f" ({of}); free some space or use another --workdir ({self._kept()})",
            )  # fmt: skip
        except workdir_lib.WorkdirError as e:
            raise SaveError(str(e)) from None

    def _kept(self) -> str:
        step = self.latest_step()
        if step is None:
            return "no checkpoint saved yet"
        return f"the newest checkpoint, step {step}, is kept"

    def _discard(self, step: int, existed: bool) -> None:
        """Removes what a failed save of `step` left (never an earlier, complete step)."""
        if jax.process_index() == 0:
            for tmp in glob.glob(os.path.join(self.directory, f"{step}.orbax-checkpoint-tmp*")):
                shutil.rmtree(tmp, ignore_errors=True)
            if not existed:
                shutil.rmtree(self.step_dir(step), ignore_errors=True)
        self._reset()

    def _save_failed(self, step: int, error: Exception) -> str:
        free = workdir_lib.format_bytes(workdir_lib.free_bytes(self.directory))
        return (
            f"saving checkpoint step {step} to {self.directory} failed: {_reason(error)} "
            f"({free} free there); {self._kept()}"
        )

    def wait(self) -> None:
        if self._mngr is not None:
            self._mngr.wait_until_finished()

    # --------------------------------------------------------------------- restore

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restores `step` into `abstract_state` (ShapeDtypeStructs with shardings) and
        verifies it: shapes, checksums, finite parameters."""
        if step not in self.steps():
            raise CheckpointError(f"no checkpoint at step {step} in {self.directory}")
        self.pin(step)  # a reader: rotation leaves the step alone until `close`
        try:
            with _orbax_leftovers_dropped():
                restored = self._manager().restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract_state),
                        extra=ocp.args.JsonRestore(),
                    ),
                )
        except Exception as e:  # orbax raises many types; one line for the user
            raise CheckpointError(_explain(step, self.directory, e)) from e
        _check_shapes(restored.state, abstract_state, step)
        extra = dict(restored.extra or {})
        self._verify(step, restored.state, extra)
        bad = non_finite_params(restored.state)
        if bad:
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} is damaged: parameter {bad} "
                "holds NaN or inf"
            )
        return restored.state, extra

    def _verify(self, step: int, state, extra: dict) -> None:
        expected = self._read_checksums(step, extra)
        if expected is None:
            return  # saved before checksums existed: nothing to compare with
        actual = array_checksums(state)
        for name, sums in expected.items():  # in tree order: the first bad array
            got = actual.get(name, {})
            for shard, crc in sums.items():
                if shard in got and got[shard] != crc:
                    raise CheckpointError(
                        f"checkpoint step {step} in {self.directory} is damaged: array "
                        f"{name} does not match its checksum (crc32 {got[shard]:08x}, saved "
                        f"{crc:08x})"
                    )

    def _read_checksums(self, step: int, extra: dict) -> dict | None:
        index, count = jax.process_index(), int(extra.get("checksum_processes", 1))
        if "checksums" not in extra:
            return None
        names = [CHECKSUMS_FILE.format(i) for i in range(count)]  # every process's: all
        missing = [n for n in names if not os.path.exists(os.path.join(self.step_dir(step), n))]
        if missing:  # processes agree on an incomplete step (each verifies only its own)
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} is incomplete: {missing[0]} is "
                "missing (the run stopped while saving it, or is saving it now)"
            )
        if index >= count:
            return None
        name = CHECKSUMS_FILE.format(index)
        path = os.path.join(self.step_dir(step), name)
        try:
            with open(path) as f:
                return json.load(f)["arrays"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} is damaged: {name} cannot be "
                f"read ({type(e).__name__})"
            ) from None

    def restore_latest_good(self, abstract_state: Any) -> tuple[int, Any, dict, list]:
        """The newest step that restores and verifies: (step, state, extra, skipped),
        `skipped` being (step, error line) of every newer, damaged step."""
        skipped = []
        for step in reversed(self.steps()):
            try:
                return (step, *self.restore(step, abstract_state), skipped)
            except StepGone:
                continue  # rotated away by a running trainer: not damage
            except CheckpointError as e:
                skipped.append((step, str(e)))
        raise CheckpointError(
            f"no intact checkpoint in {self.directory}"
            + (f" (newest error: {skipped[0][1]})" if skipped else "")
        )

    def newest_intact(self, abstract_state: Any) -> int | None:
        """The newest step that restores and verifies, or None (restores each to check)."""
        try:
            return self.restore_latest_good(abstract_state)[0]
        except CheckpointError:
            return None

    def set_aside(self, step: int) -> str:
        """Moves a damaged step to <workdir>/damaged_checkpoints/<step>, so that a run
        resumed from an earlier step can save that step again; returns where it went."""
        target = os.path.join(self.workdir, DAMAGED_DIR, str(step))
        if jax.process_index() == 0:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            n = 1
            while os.path.exists(target):
                target, n = os.path.join(self.workdir, DAMAGED_DIR, f"{step}.{n}"), n + 1
            os.replace(self.step_dir(step), target)
        self._reset()
        return target

    def close(self) -> None:
        """Closes Orbax's manager and releases the pins."""
        try:
            if self._mngr is not None:
                with _orbax_leftovers_dropped():
                    self._mngr.close()
                self._mngr = None
        finally:
            for step in list(self._pins):
                self._unpin(step)


def _try_exclusive(path: str) -> int | None:
    """An fd holding `path` locked exclusively (no reader pins it), or None."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:  # no pins dir: nothing was ever pinned
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def collect_garbage() -> None:
    """`gc.collect()` with the checkpoint library's leftover coroutines dropped quietly,
    as `_orbax_leftovers_dropped` does (a bare collect would print their errors)."""
    with _orbax_leftovers_dropped():
        pass


@contextlib.contextmanager
def _orbax_leftovers_dropped():
    """Runs Orbax with its unfinished coroutines collected before returning, their
    errors dropped (`console.orbax_leftover`) and any other unraisable exception passed
    on (a failed restore's coroutines would print pages of "Exception ignored")."""
    previous = sys.unraisablehook

    def hook(unraisable):
        if not console.orbax_leftover(unraisable):
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        with warnings.catch_warnings():  # ... and those never started say so: not ours
            warnings.filterwarnings("ignore", r"coroutine '.*' was never awaited", RuntimeWarning)
            gc.collect()  # the coroutines of a failed restore end here, under this hook
        sys.unraisablehook = previous


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


_OS_REASONS = ("No space left on device", "Disk quota exceeded", "Read-only file system",
               "Permission denied")  # fmt: skip


def _reason(error: Exception) -> str:
    """The cause of a failed write in a few words (Orbax wraps OS errors in long text)."""
    text = " ".join(str(error).split())
    for reason in _OS_REASONS:
        if reason.lower() in text.lower():
            return reason
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return f"{type(error).__name__}: {text[:200]}"


def _explain(step: int, directory: str, error: Exception) -> str:
    text = " ".join(str(error).split())
    if "See full TensorStore details" in text:
        text = text.split("See full TensorStore details")[0].strip()
    if len(text) > 300:
        text = text[:300] + "..."
    text = text.rstrip(" .")
    kind = "does not match the model" if "shape" in text.lower() else "cannot be read"
    return f"checkpoint step {step} in {directory} {kind}: {type(error).__name__}: {text}"
