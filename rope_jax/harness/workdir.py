"""A run's workdir: one writer at a time, writable, with room for the next checkpoint.

  with workdir.Lock(path) as lock:      # a second run fails at once, naming this one
      workdir.check_writable(path)      # before anything compiles
      ...
      workdir.check_free_space(path, need, what="checkpoint step 500")

The lock is `<workdir>/run.lock`, held with `fcntl.flock` on an open file: the kernel
releases it when the holder exits, however it exits, so a lock file left by a process
that died is taken over (and reported) by the next run. The file names its holder
(host, PID, start time) for the message of a run that finds it taken. Only process 0
of a multi-process run takes it. Every failure is a `WorkdirError` (a `ValueError`)
with one line.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import tempfile
import time

LOCK_FILE = "run.lock"


class WorkdirError(ValueError):
    """A workdir that cannot be used: held by another run, not writable, or full."""


class Lock:
    """Exclusive hold on a workdir for one run (a context manager).

    `stale` is the holder record left by a process that died while holding the lock
    (None when the lock was free and clean). On release the lock file is removed, and
    so is the workdir if this lock created it and nothing else was written there.
    """

    def __init__(self, workdir: str, *, enabled: bool = True, name: str = LOCK_FILE,
                 busy=None, wait: str | None = None):  # fmt: skip
        """`name`: the lock file in the workdir (another name locks something else, e.g.
        one result file); `busy(workdir, holder record)`: the refusal's message; `wait`:
        instead of refusing, print this line once and wait for the holder to finish."""
        self.workdir = os.path.abspath(workdir)
        self.path = os.path.join(self.workdir, name)
        self.enabled = enabled
        self.busy = busy or busy_message
        self.wait = wait
        self.stale: dict | None = None
        self._fd: int | None = None
        self._created = False

    def __enter__(self) -> Lock:
        if self.enabled:
            self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        self._created = not os.path.isdir(self.workdir)
        try:
            os.makedirs(self.workdir, exist_ok=True)
        except OSError as e:
            exists = os.path.exists(self.workdir)  # a file or device: makedirs says EEXIST
            reason = "it exists and is not a directory" if exists else e.strerror
            raise WorkdirError(f"cannot create workdir {self.workdir}: {reason}") from None
        while self._fd is None:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if self.wait is not None:
                    print(self.wait, flush=True)
                    fcntl.flock(fd, fcntl.LOCK_EX)
                else:
                    holder = _read_record(fd)
                    os.close(fd)
                    self._remove_created_dir()
                    raise WorkdirError(self.busy(self.workdir, holder)) from None
            if is_current(fd, self.path):  # not unlinked by a holder releasing meanwhile
                self._fd = fd
            else:
                os.close(fd)
        self.stale = _read_record(self._fd)
        _write_record(self._fd, holder_record())

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)  # while still held: a waiting opener sees a new file
        os.close(self._fd)
        self._fd = None
        self._remove_created_dir()

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            self._remove_created_dir()
            raise WorkdirError(not_writable_message(self.workdir, e)) from None

    def _remove_created_dir(self) -> None:
        if self._created:
            with contextlib.suppress(OSError):
                os.rmdir(self.workdir)  # only if empty: nothing was written there


def holder_record() -> dict:
    """Who holds a lock: host, PID, start time (written into the lock file)."""
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip


def running_holder(workdir: str) -> dict | None:
    """The holder record of a run that is training in `workdir` now (its lock file is
    there and its process alive; a holder on another host counts as alive), else None.
    Reads the record without locking: a run starting meanwhile is never refused."""
    try:
        fd = os.open(os.path.join(workdir, LOCK_FILE), os.O_RDONLY)
    except OSError:
        return None
    try:
        record = _read_record(fd)
    finally:
        os.close(fd)
    if not record or record.get("host") != socket.gethostname():
        return record
    try:
        pid = int(record.get("pid", 0))
        if pid > 0:
            os.kill(pid, 0)
    except ProcessLookupError:
        return None  # a stale lock: the run is gone
    except (PermissionError, ValueError, TypeError, OverflowError):
        pass
    return record


def describe_holder(record: dict | None) -> str:
    if not record:
        return "holder unknown: it has just started"
    return f"host {record.get('host')}, pid {record.get('pid')}, since {record.get('since')}"


def busy_message(workdir: str, holder: dict | None) -> str:
    return (
        f"workdir {workdir} is in use by another run ({describe_holder(holder)}): wait "
        "for it to finish, stop it, or use another --workdir"
    )


def is_current(fd: int, path: str) -> bool:
    """Whether the open file `fd` is still the file at `path` (not unlinked meanwhile)."""
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _read_record(fd: int) -> dict | None:
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", errors="replace")
        return json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return None


def _write_record(fd: int, record: dict) -> None:
    data = json.dumps(record).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def check_writable(workdir: str, what: str = "workdir") -> None:
    """Creates the workdir if needed and writes (then removes) a probe file in it; the
    error names it as `what` (e.g. an export's `--out=DIR`).

    Permission bits do not stop root, and a full or read-only filesystem only shows
    when something is written, so this writes rather than asks `os.access`.
    """
    try:
        if os.path.exists(workdir) and not os.path.isdir(workdir):  # makedirs: "File exists"
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), workdir)
        os.makedirs(workdir, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write_probe_", dir=workdir)
        try:
            os.write(fd, b"ok")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        raise WorkdirError(not_writable_message(workdir, e, what)) from None


def check_can_write(path: str, what: str) -> None:
    """WorkdirError naming `what` unless a file can be written at `path`: the nearest
    folder above it that exists must be a directory that takes a file (probed; nothing is
    made)."""
    existing = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    check_writable(existing, what=what)


def not_writable_message(workdir: str, error: OSError, what: str = "workdir") -> str:
    reason = error.strerror or str(error)
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        reason += f" ({format_bytes(free_bytes(workdir))} free)"
    name = f"{what} {os.path.abspath(workdir)}" if what == "workdir" else what
    return f"{name} is not writable: {reason}"


def free_bytes(path: str) -> int:
    """Bytes free to this user on the filesystem holding `path` (or its nearest parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def tree_bytes(path: str) -> int:
    """Bytes on disk under `path` (files only; 0 if it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def check_free_space(path: str, need: int, *, what: str, hint: str = "") -> None:
    """Fails with one line when the filesystem of `path` has less than `need` bytes free."""
    free = free_bytes(path)
    if free < need:
        raise WorkdirError(
            f"not enough free space for {what} in {os.path.abspath(path)}: "
            f"{format_bytes(free)} free, {format_bytes(need)} needed{hint}"
        )


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def fsync_tree(path: str) -> None:
    """Flushes every file and directory under `path` to disk (so a step is durable)."""
    for root, _, files in os.walk(path):
        for name in files:
            _fsync(os.path.join(root, name), os.O_RDONLY)
        _fsync(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def _fsync(path: str, flags: int) -> None:
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def rename_target(path: str) -> str | None:
    """The file an atomic write of `path` renames its temporary file over: `path`, or
    the file a symlink there points to (the link stays a link); None where that exists
    and is not a regular file (/dev/null, a FIFO, /dev/stdout), which must not be
    replaced by one and is written in place."""
    real = os.path.realpath(path)
    return None if os.path.exists(real) and not os.path.isfile(real) else real


def write_atomic(path: str, data: str | bytes) -> None:
    """Writes `data` (text as UTF-8, or bytes) to `path` through a temporary file, fsync
    and rename: never half-written (`rename_target`: a symlink's file, a device or FIFO
    written in place)."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    target = rename_target(path)
    if target is None:
        with open(path, "wb") as f:
            f.write(raw)
        return
    directory = os.path.dirname(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", dir=directory)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the file from other users
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
