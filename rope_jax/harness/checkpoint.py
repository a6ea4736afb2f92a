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
readable line that names the step. A trainer starting in a workdir removes what a
save killed part way left (`remove_unfinished`): up to a whole state's size on disk.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import glob
import json
import os
import re
import shutil
import sys
import threading
import time
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from rope_jax.harness import checksums, console
from rope_jax.harness import workdir as workdir_lib

CKPT_DIR = "checkpoints"
DAMAGED_DIR = "damaged_checkpoints"  # where train.py --fallback moves damaged steps
CHECKSUMS_FILE = "checksums.process_{}.json"  # one per process: its own shards
PINS_DIR = "checkpoint_pins"  # <step>.lock: readers hold it shared, rotation exclusive
_TMP_SUFFIX = ".orbax-checkpoint-tmp"  # a step being written (renamed once complete)


class CheckpointError(ValueError):
    """A checkpoint that is missing, damaged, or does not match the model."""


def _join_orbax_writers(timeout_s: float = 60.0) -> None:
    """Waits (at most `timeout_s` in all) for the threads Orbax started to write a save:
    after a failed save some may still be writing its other files."""
    deadline = time.monotonic() + timeout_s
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and type(thread).__module__.startswith("orbax"):
            thread.join(max(deadline - time.monotonic(), 0))


class SaveError(CheckpointError):
    """A checkpoint that could not be written (disk full, permissions); earlier ones kept."""


class StepGone(CheckpointError):
    """A step that was listed but no longer exists (deleted by a running trainer's
    rotation before it could be pinned): not damage."""


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
        for _ in range(20):
            try:
                return sorted(self._manager().all_steps())
            except FileNotFoundError:  # a live run's rotation removed a step Orbax was listing
                self._reset()
        raise CheckpointError(f"the checkpoints in {self.directory} change too fast to list")

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
            try:
                if self._mngr is not None:
                    self._manager().reload()  # the directory changes under a live run
                step = self.latest_step(complete=complete)
            except FileNotFoundError:  # a step removed while Orbax read the directory
                self._reset()
                continue
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
        sums = checksums.array_checksums(state)  # the host bytes of the arrays being saved
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
            need, of = checksums.nbytes(state), "the state's size in memory"
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
        """Removes what a failed save of `step` left (never an earlier, complete step).
        Orbax's writer threads of that save end first: one still writing when the first
        failed would otherwise put a file back into the removed directory."""
        self._reset()
        _join_orbax_writers()
        if jax.process_index() == 0:
            for tmp in glob.glob(os.path.join(self.directory, f"{step}{_TMP_SUFFIX}*")):
                shutil.rmtree(tmp, ignore_errors=True)
            if not existed:
                shutil.rmtree(self.step_dir(step), ignore_errors=True)

    def _save_failed(self, step: int, error: Exception) -> str:
        free = workdir_lib.format_bytes(workdir_lib.free_bytes(self.directory))
        return (
            f"saving checkpoint step {step} to {self.directory} failed: {_reason(error)} "
            f"({free} free there); {self._kept()}"
        )

    def remove_unfinished(self) -> list[tuple[str, int]]:
        """Removes what saves killed part way left: Orbax's `<step>.orbax-checkpoint-tmp*`
        directories, never renamed into a step, never read and never cleaned by Orbax.
        Only the run's trainer calls this, holding the workdir's lock, before its first
        save: no save of its own is under way. Returns (name, bytes) of each, on process 0
        (the others return [])."""
        if self.read_only or jax.process_index() != 0:
            return []
        removed = []
        for tmp in sorted(glob.glob(os.path.join(self.directory, f"*{_TMP_SUFFIX}*"))):
            size = workdir_lib.tree_bytes(tmp)
            shutil.rmtree(tmp, ignore_errors=True)
            if not os.path.exists(tmp):
                removed.append((os.path.basename(tmp), size))
        if removed:
            self._reset()
        return removed

    def wait(self) -> None:
        if self._mngr is not None:
            self._mngr.wait_until_finished()

    # --------------------------------------------------------------------- restore

    def check_step(self, step: int) -> None:
        """CheckpointError naming the steps there are, when `step` is not one of them."""
        steps = self.steps()
        if step not in steps:
            there = f"steps there: {', '.join(map(str, steps))}" if steps else "none there"
            raise CheckpointError(f"no checkpoint at step {step} in {self.directory} ({there})")

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restores `step` into `abstract_state` (ShapeDtypeStructs with shardings) and
        verifies it: shapes, checksums, finite parameters."""
        self.check_step(step)
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
        bad = checksums.non_finite_params(restored.state)
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
        actual = checksums.array_checksums(state)
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


# TensorStore's words for a stored array it could not read (bytes damaged inside a
# compressed chunk or a chunk's header, a file cut short): the key names the array.
_KEY_UNREADABLE = re.compile(r'Error reading "([^"/]+)/[^"]*"[^"]*"[^"]*": ([^;]*)')


def _unreadable_array(error: BaseException | None) -> tuple[str, str] | None:
    """(array name, reason) where `error`'s chain names the array TensorStore could not
    read, as `checksums.leaf_name` writes it; None where it names none."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        found = _KEY_UNREADABLE.search(" ".join(str(error).split()))
        if found:
            name = found.group(1).removesuffix(".value")  # nnx's leaf: as checksums names it
            return name, found.group(2).strip().rstrip(" .")
        error = error.__cause__ or error.__context__
    return None


def _explain(step: int, directory: str, error: Exception) -> str:
    unreadable = _unreadable_array(error)
    if unreadable:
        name, reason = unreadable
        return (f"checkpoint step {step} in {directory} is damaged: array {name} cannot be "
                f"read ({reason})")  # fmt: skip
    text = " ".join(str(error).split())
    if "See full TensorStore details" in text:
        text = text.split("See full TensorStore details")[0].strip()
    if len(text) > 300:
        text = text[:300] + "..."
    text = text.rstrip(" .")
    kind = "does not match the model" if "shape" in text.lower() else "cannot be read"
    return f"checkpoint step {step} in {directory} {kind}: {type(error).__name__}: {text}"
