"""The local launcher: each job is `python train.py` then `python eval.py` in a subprocess.

Jobs run one after another from the repository root, each with its own workdir and
log, sharing one compilation cache. A finished job is skipped, an unfinished one
resumes from its checkpoint; a failed one is recorded (`failures`) and the next one
starts. Ctrl-C (or SIGTERM) reaches the sweep, which passes SIGTERM to the child so
train.py saves before exiting. `train_command`, `eval_command`
and `cache_env` are the commands and environment of a job for every launcher (the
SLURM launcher writes the same into its batch scripts).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import os
import shlex
import signal
import subprocess
import sys
import time
import warnings

from rope_jax.experiments import failures
from rope_jax.experiments.plan import ROOT, Job, SweepError, status
from rope_jax.experiments.report import collect


def latest_checkpoint(workdir: str) -> int | None:
    ckpts = os.path.join(workdir, "checkpoints")  # orbax renames a step dir once complete
    steps = os.listdir(ckpts) if os.path.isdir(ckpts) else []
    return max((int(d) for d in steps if d.isdigit()), default=None)


def _prctl():
    """libc's prctl, looked up in the parent (the child runs no loader code between fork
    and exec); None where there is none (not Linux)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _end_with_parent(prctl):
    """A preexec_fn: the child gets SIGTERM when the sweep dies, even by kill -9 (Linux
    PR_SET_PDEATHSIG = 1), so train.py saves and exits instead of running on."""
    return None if prctl is None else (lambda: prctl(1, signal.SIGTERM))


def start(cmd: list, **kwargs) -> subprocess.Popen:
    """`subprocess.Popen(cmd, **kwargs)` in a new session whose child ends with this
    process (`_end_with_parent`). The fork before the exec runs only that prctl call in
    the child, so JAX's warning that forking a multithreaded process may deadlock (given
    when a tool that already imported jax starts a job) does not apply and is not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"os\.fork\(\) was called", RuntimeWarning)
        return subprocess.Popen(cmd, start_new_session=True,
                                preexec_fn=_end_with_parent(_prctl()), **kwargs)  # fmt: skip


HEARTBEAT_S = 300.0  # how often a long run's newest progress line is echoed


def launch(cmd: list, log_path: str, env: dict, heartbeat_s: float = HEARTBEAT_S) -> None:
    """Runs `cmd` from the repo root into `log_path`, echoing the log's newest `step ...`
    progress line every `heartbeat_s` seconds (indented) when it has changed. Ctrl-C
    reaches only the sweep (the child is in a new process group), which sends SIGTERM:
    train.py saves a checkpoint. If the sweep is killed outright the child gets SIGTERM
    too (`_end_with_parent`)."""
    with open(log_path, "a") as log:
        log.write(f"\n=== {datetime.datetime.now():%Y-%m-%d %H:%M:%S} {shlex.join(cmd)}\n")
        log.flush()
        proc, shown = start(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env), None
        try:
            while True:
                try:
                    rc = proc.wait(timeout=heartbeat_s)
                    break
                except subprocess.TimeoutExpired:
                    line = last_progress_line(log_path)
                    if line and line != shown:
                        print(f"    {line}", flush=True)
                        shown = line
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGTERM)
            proc.wait()
            raise
    if rc != 0:
        raise SweepError(failures.ended(cmd[1], rc))


def last_progress_line(log_path: str) -> str | None:
    """The newest line of train.py's log that starts with `step ` (its progress), or None."""
    lines = failures.tail_lines(log_path, 8192)
    if lines is None:
        return None
    return next((x.strip() for x in reversed(lines) if x.startswith("step ")), None)


def train_command(run: Job, python: str = sys.executable) -> list[str]:
    """`python train.py <flags>` of one job, run from the repository root (ROOT)."""
    return [python, "train.py", *run.flags]


def eval_command(run: Job, python: str = sys.executable) -> list[str]:
    """`python eval.py` of one job's final step: at T, 2T, 4T, or at T on each split."""
    return [python, "eval.py", f"--workdir={run.workdir}", f"--step={run.final_step}",
            "--seq_lens=" + ",".join(map(str, run.seq_lens)),
            *(["--splits=" + ",".join(run.splits)] if run.splits else [])]  # fmt: skip


def cache_env(workdir: str, environ=os.environ) -> dict:
    """The variables every job adds to its environment: unbuffered output, and the
    sweep's shared compilation cache <workdir>/jax_cache unless JAX_COMPILATION_CACHE_DIR
    is set already."""
    env = {"PYTHONUNBUFFERED": "1"}
    if "JAX_COMPILATION_CACHE_DIR" not in environ:
        env.update(JAX_COMPILATION_CACHE_DIR=os.path.abspath(os.path.join(workdir, "jax_cache")),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")  # fmt: skip
    return env


def train_until(workdir: str, flags, final_step: int, env: dict, label: str) -> None:
    """`python train.py <flags>` into <workdir>/train.log unless the checkpoint of
    `final_step` exists (an unfinished run resumes); a SweepError naming `label` if it
    fails or stops early."""
    if latest_checkpoint(workdir) == final_step:
        return
    os.makedirs(workdir, exist_ok=True)
    log = os.path.join(workdir, "train.log")
    try:
        launch([sys.executable, "train.py", *flags], log, env)
    except SweepError as e:
        raise SweepError(f"{label}: {e}; log: {log}") from None
    if latest_checkpoint(workdir) != final_step:
        raise SweepError(f"{label}: train.py stopped before step {final_step}; log: {log}")


def execute(run: Job, env: dict) -> None:
    """train.py (unless its final checkpoint exists), then eval.py at T, 2T, 4T. A
    failure is a SweepError whose text is the reason in one line (how the step ended
    and the log's error line); the log's last lines go to stderr."""
    os.makedirs(run.workdir, exist_ok=True)
    log = os.path.join(run.workdir, "train.log")
    try:
        if latest_checkpoint(run.workdir) != run.final_step:
            launch(train_command(run), log, env)
            if latest_checkpoint(run.workdir) != run.final_step:
                raise SweepError(f"train.py stopped before step {run.final_step}")
        launch(eval_command(run), log, env)
    except SweepError as e:
        with open(log) as f:
            print("".join("    " + line for line in f.readlines()[-25:]), end="", file=sys.stderr)
        raise SweepError(failures.reason(str(e), log)) from None


class Eta:
    """The time runs have left, from the seconds per training step of those run in this
    call: a resumed run counts only the steps it trained, so one that had little left
    does not make the others look short (evaluation time is folded into the rate)."""

    def __init__(self):
        self.seconds, self.steps = 0.0, 0

    def add(self, seconds: float, steps: int) -> None:
        self.seconds, self.steps = self.seconds + seconds, self.steps + max(steps, 0)

    def left(self, jobs) -> str:
        """`H:MM:SS` for `jobs`, (workdir, final step) pairs (a workdir counted once), or
        n/a before a step was timed."""
        if not self.steps:
            return "n/a"
        todo = {w: max(final - (latest_checkpoint(w) or 0), 0) for w, final in jobs}
        seconds = self.seconds / self.steps * sum(todo.values())
        return str(datetime.timedelta(seconds=round(seconds)))


def run_all(runs: list[Job], workdir: str, retries: int = failures.RETRIES,
            skip_failed: bool = False) -> list[dict]:  # fmt: skip
    """Runs what is not done, in order, with progress and an ETA on stdout. A run that
    fails is recorded (`failures.record`) and the next one starts; a run that failed
    before runs again unless `failures.retried` says no. Returns the failed runs:
    {row, seed, reason, log, failures}."""
    env = dict(os.environ, **cache_env(workdir))
    eta, failed = Eta(), []
    for k, run in enumerate(runs, 1):
        state, head = status(run), f"[{k}/{len(runs)}] row={run.row} seed={run.seed}"
        if state == "done":
            print(f"{head}  done, skipped", flush=True)
            continue
        rec = failures.read(run.workdir) if state == "failed" else None
        if rec and not failures.retried(rec, retries, skip_failed):
            print(f"{head}  failed, not retried ({failures.why_not_retried(rec, skip_failed)})"
                  f": {rec['reason']}", flush=True)  # fmt: skip
            failed.append(dict(rec, row=run.row, seed=run.seed))
            continue
        left = eta.left((r.workdir, r.final_step) for r in runs[k - 1 :])  # done ones: 0
        state = f"failed before, retried ({rec['reason']})" if rec else state
        print(f"{head}  {state}  {run.workdir}  ETA {left}", flush=True)
        start, before = time.time(), latest_checkpoint(run.workdir) or 0
        try:
            execute(run, env)
        except SweepError as e:
            log = os.path.join(run.workdir, "train.log")
            rec = failures.record(run.workdir, str(e), log)
            print(f"    FAILED: {rec['reason']}; log: {log}", flush=True)
            failed.append(dict(rec, row=run.row, seed=run.seed))
            continue
        failures.clear(run.workdir)
        seconds = time.time() - start
        eta.add(seconds, run.final_step - before)
        print(f"    {seconds:.0f}s  {result_line(run)}", flush=True)
    return failed


def result_line(run: Job) -> str:
    """A finished run's last training loss and held-out losses (answer accuracies)."""
    rec = collect(run)
    train = f"train loss {rec['train_curve'][-1][1]:.4f}, " if rec["train_curve"] else ""
    evals = ", ".join(f"{rec['loss'][str(t)]:.4f} @{t}" for t in run.seq_lens)
    accs = ", ".join(f"{s} {rec['accuracy'][s]:.3f}" for s in run.splits)
    accs = f"; answer accuracy {accs}" if accs else ""
    return f"{train}held-out loss {evals}{accs}"
