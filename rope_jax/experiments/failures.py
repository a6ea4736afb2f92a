"""Failed runs of a sweep: one record per run, <workdir>/<row>/seed_<k>/failed.json.

A run fails when train.py or eval.py exits non-zero or is killed (a non-finite loss, a
crash, the out-of-memory killer, a SLURM job that failed, was cancelled or timed out).
The sweep then records why, in one line (the log's last `error: ...` line, else how
the process ended), with the log and how many times the run has failed, and goes on
with the other runs. The table is written from the runs that finished and names each
failed one. The same command again retries a failed run while it has failed at most
`--retries` times (1: once, for a crash that does not come back); a run that finishes
removes its record.
"""

from __future__ import annotations

import datetime
import json
import os
import signal

FILE = "failed.json"
RETRIES = 1  # how many times the same command runs a failed run again, by default


def path(workdir: str) -> str:
    return os.path.join(workdir, FILE)


def read(workdir: str) -> dict | None:
    """The run's failure record, or None (never failed, or finished since)."""
    try:
        with open(path(workdir)) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and "reason" in rec else None


def record(workdir: str, reason: str, log: str, job_id: str | None = None) -> dict:
    """Writes (whole or not at all) the run's record with one more failure, unless
    `job_id` is the SLURM job already recorded (a failure is counted once)."""
    old = read(workdir) or {}
    if job_id is not None and old.get("job_id") == job_id:
        return old
    rec = {"reason": " ".join(reason.split()), "log": log, "failures": old.get("failures", 0) + 1,
           "when": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}  # fmt: skip
    if job_id is not None:
        rec["job_id"] = job_id
    os.makedirs(workdir, exist_ok=True)
    with open(path(workdir) + ".tmp", "w") as f:
        json.dump(rec, f, indent=1)
    os.replace(path(workdir) + ".tmp", path(workdir))
    return rec


def clear(workdir: str) -> None:
    """Removes the record of a run that has finished."""
    try:
        os.remove(path(workdir))
    except FileNotFoundError:
        pass


def retried(rec: dict, retries: int, skip_failed: bool) -> bool:
    """Whether a run with failure record `rec` runs again: not with --skip_failed, nor
    once it has failed more than `retries` times (a failure that comes back)."""
    return not skip_failed and rec["failures"] <= retries


def why_not_retried(rec: dict, skip_failed: bool) -> str:
    if skip_failed:
        return "--skip_failed"
    times = "once" if rec["failures"] == 1 else f"{rec['failures']} times"
    return f"failed {times}; --retries={rec['failures']} runs it again"


def ended(program: str, returncode: int) -> str:
    """How a process ended, in words: `train.py exited with status 1`, `train.py was
    killed by SIGKILL (the out-of-memory killer, or kill -9)`."""
    if returncode >= 0:
        return f"{program} exited with status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    oom = " (the out-of-memory killer, or kill -9)" if -returncode == signal.SIGKILL else ""
    return f"{program} was killed by {name}{oom}"


def tail_lines(path: str, size: int) -> list[str] | None:
    """The lines of the last `size` bytes of the file at `path` (None if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(os.fstat(f.fileno()).st_size - size, 0))
            return f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return None


def last_error(log: str) -> str | None:
    """The last `error: ...` line (without `error: `) written to `log` by its newest
    command (after the last `=== ` header line the launchers write), or None."""
    lines = tail_lines(log, 65536)
    if lines is None:
        return None
    start = max((i for i, x in enumerate(lines) if x.startswith("=== ")), default=-1)
    errors = [x.strip() for x in lines[start + 1 :] if x.strip().startswith("error: ")]
    return errors[-1].removeprefix("error: ") if errors else None


def reason(what: str, log: str) -> str:
    """`what` (how the step ended) with the log's error line, as one line."""
    error = last_error(log)
    return f"{what}: {error}" if error else what


def describe(failed: list[dict]) -> str:
    """`row=vo seed=1` for each failed run, comma-separated."""
    return ", ".join(f"row={f['row']} seed={f['seed']}" for f in failed)
