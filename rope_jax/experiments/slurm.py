r"""The SLURM launcher of the sweep: every run (row x seed) that is not done is one batch job.

  python -m rope_jax.experiments.sweep --config=configs/lm.py:size=small --workdir=/shared/abl \
      --seeds=3 --launcher=slurm --nodes=1 --tasks_per_node=4 --gpus_per_task=1 \
      --cpus_per_task=8 --partition=gpu --time=12:00:00 [--account=A] [--wait]
  python -m rope_jax.experiments.sweep ... --launcher=slurm --status   # one line per run

Each run gets a generated batch script, <workdir>/<row>/seed_<k>/job.sbatch, its output
going to slurm.log beside it (appended across requeues). The script runs `srun python
train.py <flags>` (skipped once the final checkpoint exists), then `srun python eval.py
<flags>`: the commands of the local launcher (`launch.train_command`, `eval_command`).
It asks for `--requeue` and `--signal=TERM@<grace>`: before the time limit every task
gets SIGTERM, the processes agree on a step, save it and exit 0; the script sees that
training stopped short of its final step and requeues its own job (`scontrol requeue`),
which resumes from that checkpoint; so it does when a step died of the signal (eval.py,
or train.py before its handler was installed), unless the job is being cancelled. A
preempted job is requeued by SLURM itself and resumes the same way. The signal must
reach the tasks, not srun, which answers its own SIGTERM by killing them (`scancel
--full`): then the job fails and the next sweep command resubmits it. Submissions go
to <workdir>/slurm_jobs.json (row, seed, job id, submit time, script).

The same command again looks at every run: done -> skipped; its job still pending or
running (squeue, else sacct) -> left alone; never submitted -> submitted; its job
failed, was cancelled, timed out, was preempted for good, or is gone -> recorded as a
failure of the run (`failures`: the reason from its slurm.log) and submitted again,
resuming from its checkpoint, while it has failed at most --retries times (1); after
that it is reported as failed and left alone. Once no job is queued or running it
writes the table and plot of the local launcher from the finished runs, naming the
failed ones (the exit status is then 1). By default it submits and returns: a sweep
of long jobs should not depend on a process staying alive on a login node. --wait
polls (every --poll seconds) until every job has ended, then writes the table.

Generated sbatch scripts, not submitit: a job here is two shell commands that the
harness already makes resumable (train.py saves on SIGTERM and resumes by itself), so
what submitit adds (pickled Python callables run by `python -m submitit...` on the
nodes, its own USR2 checkpoint-and-requeue protocol) would duplicate the harness's
signal handling and add a dependency the compute nodes must have. A script is plain
text: it can be read, edited and resubmitted by hand (`sbatch job.sbatch`), and the
tests on a local cluster run exactly what a user submits.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

from rope_jax.experiments import failures
from rope_jax.experiments.launch import cache_env, eval_command, latest_checkpoint, train_command
from rope_jax.experiments.plan import ROOT, Job, SweepError, status

JOBS_FILE = "slurm_jobs.json"
SCRIPT, LOG = "job.sbatch", "slurm.log"
# The job still holds (or waits for) resources: not resubmitted. Every other state is
# final (COMPLETED, FAILED, CANCELLED, TIMEOUT, PREEMPTED, NODE_FAIL, OUT_OF_MEMORY, ...).
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_FED",
          "REQUEUE_HOLD", "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT",
          "RESV_DEL_HOLD", "SPECIAL_EXIT"}  # fmt: skip
SETUP_HINT = "no SLURM client here (a local test cluster: sudo scripts/local_slurm.sh up)"


# name, type, help of the valued SLURM flags (None: left to the cluster or defaulted).
VALUE_FLAGS = [
    ("nodes", int, "nodes per job (default 1)"),
    ("tasks_per_node", int, "processes per node (default 1): one per GPU"),
    ("gpus_per_task", int, "GPUs per process"),
    ("cpus_per_task", int, "CPUs per process"),
    ("partition", str, "SLURM partition"),
    ("time", str, "time limit per job, e.g. 12:00:00 or 1-00:00:00"),
    ("account", str, "SLURM account to charge"),
    ("signal_grace", int, "seconds before the time limit that train.py gets SIGTERM (120)"),
    ("poll", float, "--wait: seconds between checks (30)"),
]
# sbatch's spelling of the flags passed through as they are.
SBATCH_NAMES = {"cpus_per_task": "cpus-per-task", "gpus_per_task": "gpus-per-task",
                "partition": "partition", "time": "time", "account": "account"}  # fmt: skip


def add_flags(p) -> None:
    """The --launcher flag and the SLURM flags of the sweep's argument parser."""
    p.add_argument("--launcher", choices=("local", "slurm"), default="local",
                   help="local: one run after another; slurm: a batch job per run")  # fmt: skip
    g = p.add_argument_group("--launcher=slurm")
    for name, kind, text in VALUE_FLAGS:
        g.add_argument(f"--{name}", type=kind, default=None, help=text)
    g.add_argument("--slurm_extra", action="append", default=None, metavar="OPTION",
                   help="a raw sbatch option of every job, e.g. --qos=high")  # fmt: skip
    g.add_argument("--wait", action="store_true", default=None,
                   help="wait until every job has ended, then write the table")  # fmt: skip


def parse_time(text: str) -> int:
    """Seconds of a SLURM time limit: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S; SweepError else."""
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not match:
        raise SweepError(f"--time={text!r} is not a SLURM time like 90, 4:00:00 or 1-12:00:00")
    days, a, b, c = (int(x) if x else None for x in match.groups())
    if days is not None:  # D-H[:M[:S]]
        return days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    if c is not None:  # H:M:S
        return a * 3600 + b * 60 + c
    return a * 60 + (b or 0)  # M or M:S


def check_options(args) -> None:
    """Bad flag combinations, before the plan is made (one line each); fills in the
    defaults of the SLURM flags for --launcher=slurm."""
    names = [name for name, _, _ in VALUE_FLAGS] + ["slurm_extra", "wait"]
    given = [f"--{name}" for name in names if getattr(args, name, None) is not None]
    if args.launcher != "slurm":
        if given:
            raise SweepError(f"{', '.join(given)} need{'s' * (len(given) == 1)} --launcher=slurm")
        return
    defaults = {"nodes": 1, "tasks_per_node": 1, "slurm_extra": [], "signal_grace": 120,
                "wait": False, "status": False, "poll": 30.0}  # fmt: skip
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("nodes", "tasks_per_node", "gpus_per_task", "cpus_per_task"):
        value, least = getattr(args, name), 0 if name == "gpus_per_task" else 1
        if value is not None and value < least:
            raise SweepError(f"--{name}={value} must be >= {least}")
    if args.poll <= 0 or args.signal_grace < 0:
        raise SweepError("--poll must be > 0 and --signal_grace >= 0")
    if args.status and (args.wait or args.dry_run):
        raise SweepError("--status only prints the runs' states: leave out --wait / --dry_run")
    if args.time is not None and parse_time(args.time) <= args.signal_grace:
        raise SweepError(f"--signal_grace={args.signal_grace} s must be shorter than "
                         f"--time={args.time}")  # fmt: skip
    for option in args.slurm_extra:
        if not option.startswith("-") or "\n" in option:
            raise SweepError(f"--slurm_extra={option!r} must be one sbatch option like --qos=high")


def check_processes(args, context: dict) -> None:
    """A job's processes (--nodes x --tasks_per_node) must divide the global batch."""
    processes = args.nodes * args.tasks_per_node
    batch = context["settings"].get("data.global_batch_size")
    if batch is not None and batch % processes:
        raise SweepError(f"data.global_batch_size={batch} is not divisible by the {processes} "
                         "processes of a job (--nodes x --tasks_per_node)")  # fmt: skip


def describe(args) -> str:
    """Where the runs ran, for the report's `device` (the table is written elsewhere)."""
    out = f"slurm jobs of {args.nodes} node(s) x {args.tasks_per_node} task(s)"
    if args.gpus_per_task:
        out += f", {args.gpus_per_task} GPU(s) per task"
    return out + (f", partition {args.partition}" if args.partition else "")


# ------------------------------------------------------------------- the batch script


def sbatch_options(args, run: Job, sweep_workdir: str) -> list[str]:
    """The #SBATCH options of one run's job (None-valued flags are left to the cluster)."""
    name = f"{os.path.basename(os.path.abspath(sweep_workdir))}.{run.row}.s{run.seed}"
    out = [f"--job-name={name}", f"--output={os.path.join(run.workdir, LOG)}",
           "--open-mode=append", "--requeue", f"--signal=TERM@{args.signal_grace}",
           f"--nodes={args.nodes}", f"--ntasks-per-node={args.tasks_per_node}"]  # fmt: skip
    for key, flag in SBATCH_NAMES.items():
        if getattr(args, key) is not None:
            out.append(f"--{flag}={getattr(args, key)}")
    return out + list(args.slurm_extra)


def srun_prefix(args) -> list[str]:
    """`srun` of a step over every task of the job; the step ends when one task fails.
    Each task of a --gpus_per_task job sees only its own GPUs (numbered from 0)."""
    out = ["srun", "--kill-on-bad-exit=1"]
    if args.cpus_per_task is not None:  # srun of SLURM 22.05 does not inherit it
        out.append(f"--cpus-per-task={args.cpus_per_task}")
    if args.gpus_per_task:
        out.append(f"--gpu-bind=per_task:{args.gpus_per_task}")
    return out


# Requeues the job (it resumes from the run's newest checkpoint), unless it is being
# cancelled or timed out: then it ends with status $2.
REQUEUE = """requeue() {
  local state
  state=$(squeue --noheader --jobs="$SLURM_JOB_ID" --format=%T)
  echo "$1; job $SLURM_JOB_ID is ${state:-gone}"
  [[ $state == RUNNING ]] && exec scontrol requeue "$SLURM_JOB_ID"
  exit "$2"
}"""
TERMINATED = 143  # srun's status when its tasks died of SIGTERM (no handler yet, eval.py)


def script_text(args, run: Job, sweep_workdir: str, command: str, python: str = sys.executable,
                environ=os.environ) -> str:  # fmt: skip
    """The batch script of one run (pure): trains or resumes, then evaluates the final
    step. After SIGTERM (the time limit's --signal, a preemption notice) it requeues
    its own job: when train.py saved and exited 0 short of its final step, or a step
    died of the signal (train.py before its handler was installed, eval.py)."""
    q, srun = shlex.quote, shlex.join(srun_prefix(args))
    env = dict(cache_env(sweep_workdir, environ))
    if args.gpus_per_task:  # JAX would pick GPU SLURM_LOCALID, which the task cannot see
        env["JAX_LOCAL_DEVICE_IDS"] = ",".join(map(str, range(args.gpus_per_task)))
    lines = ["#!/bin/bash",
             f"# Run row={run.row} seed={run.seed} of: {command}",
             "# Trains (or resumes) the run, then evaluates its final step. Written by the sweep",
             "# with --launcher=slurm; `sbatch` this file to run it again by hand.",
             *(f"#SBATCH {option}" for option in sbatch_options(args, run, sweep_workdir)),
             "",
             f"RUN={q(run.workdir)}",
             f"FINAL={run.final_step}",
             REQUEUE,
             "# The shell waits for the running step when it gets SIGTERM itself (scancel --full).",
             "trap 'echo \"job.sbatch: SIGTERM\"' TERM",
             f"cd {q(ROOT)} || exit 1",
             *(f"export {k}={q(v)}" for k, v in env.items()),
             'echo "=== $(date \'+%F %T\') job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0})'
             ' on $SLURM_JOB_NODELIST"',
             'if [[ ! -d $RUN/checkpoints/$FINAL ]]; then',
             f"  {srun} {shlex.join(train_command(run, python))}",
             "  status=$?",
             f'  (( status == {TERMINATED} )) && requeue "train.py ended by SIGTERM" $status',
             "  (( status == 0 )) || exit $status",
             "  [[ -d $RUN/checkpoints/$FINAL ]] || "
             'requeue "train.py stopped before step $FINAL" 0',
             "fi",
             f"{srun} {shlex.join(eval_command(run, python))}",
             "status=$?",
             f'(( status == {TERMINATED} )) && requeue "eval.py ended by SIGTERM" $status',
             "exit $status",
             ]  # fmt: skip
    return "\n".join(lines) + "\n"


def write_text(path: str, text: str) -> None:
    """Writes `path` whole or not at all (a temporary file renamed over it)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


# ------------------------------------------------------------------ the scheduler


def require_client(*programs: str) -> None:
    """SweepError (one line) when a SLURM client program is not on PATH."""
    for program in programs:
        if shutil.which(program) is None:
            raise SweepError(f"{program} not found: {SETUP_HINT}")


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    """A SLURM client command; SweepError (one line) where it is not installed."""
    require_client(cmd[0])
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def one_line(text: str) -> str:
    """SLURM's error output as one line: without `sbatch: error: ` prefixes, joined."""
    lines = [re.sub(r"^\w+: (error: )?", "", ln.strip()) for ln in text.splitlines()]
    return "; ".join(ln for ln in lines if ln) or "no message"


def submit(script: str, run: Job) -> str:
    """`sbatch --parsable script` -> the job id; SweepError with sbatch's message."""
    proc = _run(["sbatch", "--parsable", script])
    job_id = proc.stdout.strip().split(";")[0]
    if proc.returncode != 0 or not job_id.isdigit():
        raise SweepError(f"sbatch refused row={run.row} seed={run.seed}: "
                         f"{one_line(proc.stderr or proc.stdout)} (script: {script})")  # fmt: skip
    return job_id


def parse_table(text: str) -> dict[str, tuple[str, str]]:
    """`id|STATE|reason` lines (squeue or sacct) -> {id: (state, reason)}. sacct's
    `CANCELLED by 0` becomes CANCELLED; a job step line (`12.batch`) is ignored."""
    out = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 2 and parts[0].isdigit():
            reason = parts[2] if len(parts) > 2 and parts[2] not in ("None", "") else ""
            out[parts[0]] = (parts[1].split()[0] if parts[1] else "UNKNOWN", reason)
    return out


def squeue_states(job_ids) -> dict[str, tuple[str, str]]:
    """States squeue still knows (running, pending, and ended within MinJobAge)."""
    proc = _run(["squeue", "--noheader", "--states=all", "--me", "--format=%i|%T|%r"])
    if proc.returncode != 0:
        raise SweepError(f"squeue failed (is the cluster up?): {one_line(proc.stderr)}")
    wanted = set(job_ids)
    return {k: v for k, v in parse_table(proc.stdout).items() if k in wanted}


def sacct_states(job_ids) -> dict[str, tuple[str, str]]:
    """States from SLURM's accounting; {} where there is none (no sacct, or
    accounting storage disabled)."""
    if not job_ids or shutil.which("sacct") is None:
        return {}
    proc = _run(["sacct", "--noheader", "--parsable2", "--allocations",
                 f"--jobs={','.join(job_ids)}", "--format=JobIDRaw,State,Reason"])  # fmt: skip
    if proc.returncode != 0 or "disabled" in proc.stdout + proc.stderr:
        return {}
    return parse_table(proc.stdout)


def scheduler_states(job_ids) -> dict[str, tuple[str, str]]:
    """{job id: (STATE, reason)} from squeue, then sacct for the rest; ids neither
    knows are left out."""
    states = squeue_states(job_ids)
    missing = [j for j in job_ids if j not in states]
    return {**sacct_states(missing), **states}


# ------------------------------------------------------------------ bookkeeping


def load_jobs(sweep_workdir: str) -> list[dict]:
    """Every submission recorded in <workdir>/slurm_jobs.json, oldest first."""
    path = os.path.join(sweep_workdir, JOBS_FILE)
    if not os.path.exists(path):
        return []
    try:
        with open(path) as f:
            return list(json.load(f)["jobs"])
    except (OSError, ValueError, KeyError, TypeError):
        raise SweepError(f"{path} is not a job list of this sweep: move it away") from None


def record_job(sweep_workdir: str, run: Job, job_id: str, script: str) -> dict:
    """Appends one submission to <workdir>/slurm_jobs.json; returns its record."""
    entry = {
        "row": run.row,
        "seed": run.seed,
        "job_id": job_id,
        "script": script,
        "submitted": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    jobs = [*load_jobs(sweep_workdir), entry]
    write_text(os.path.join(sweep_workdir, JOBS_FILE), json.dumps({"jobs": jobs}, indent=1))
    return entry


def latest_jobs(jobs: list[dict]) -> dict[tuple[str, int], dict]:
    """(row, seed) -> the newest submission of that run."""
    return {(j["row"], j["seed"]): j for j in jobs}


def scheduler_state(job: dict | None, states: dict, done: bool) -> str:
    """What the scheduler says of a run's newest job: its state (with the reason a
    pending job waits), `-` when never submitted; a job SLURM no longer knows (no
    accounting, purged from squeue) is COMPLETED when the run is done, ENDED else."""
    if job is None:
        return "-"
    if job["job_id"] not in states:
        return "COMPLETED" if done else "ENDED"
    state, reason = states[job["job_id"]]
    return f"{state} ({reason})" if reason and state == "PENDING" else state


def decide(done: bool, state: str) -> str:
    """done: skip it; wait: its job is pending or running; submit: anything else (new,
    or its job failed, was cancelled, timed out, was preempted or is gone)."""
    if done:
        return "done"
    return "wait" if state.split()[0] in ACTIVE else "submit"


def training_status(run: Job) -> str:
    """`done`, `partial (step 10/20)`, `partial (no checkpoint)`, `failed (step 10/20)`
    or `new`: what the run's files say."""
    state, step = status(run), latest_checkpoint(run.workdir)
    if state not in ("partial", "failed"):
        return state
    if state == "failed":
        return f"failed (step {step or 0}/{run.final_step})"
    return f"partial (step {step}/{run.final_step})" if step else "partial (no checkpoint)"


# ------------------------------------------------------------------ the commands


def survey(runs: list[Job], sweep_workdir: str, retries: int = failures.RETRIES,
           skip_failed: bool = False) -> list[tuple[Job, dict | None, str, str]]:  # fmt: skip
    """Per run: (run, newest job record, scheduler state, decision: done, wait, submit,
    failed). A job that ended with its run unfinished is recorded as a failure of the
    run (`failures`, once per job); a failed run is submitted again only while
    `failures.retried` says so, else its decision is `failed`."""
    latest = latest_jobs(load_jobs(sweep_workdir))
    jobs = [latest.get((run.row, run.seed)) for run in runs]
    states = scheduler_states([j["job_id"] for j in jobs if j])
    out = []
    for run, job in zip(runs, jobs, strict=True):
        done = status(run) == "done"
        state = scheduler_state(job, states, done)
        what = decide(done, state)
        if what == "submit" and job is not None:  # its job ended, the run unfinished
            log = os.path.join(run.workdir, LOG)
            why = failures.reason(f"job {job['job_id']} {state}", log)
            failures.record(run.workdir, why, log, job_id=job["job_id"])
        rec = failures.read(run.workdir) if what == "submit" else None
        if rec and not failures.retried(rec, retries, skip_failed):
            what = "failed"
        out.append((run, job, state, what))
    return out


def failure_of(run: Job) -> dict:
    """The failure record of `run` with its row and seed."""
    rec = failures.read(run.workdir) or {"reason": "unfinished", "failures": 1,
                                         "log": os.path.join(run.workdir, LOG)}  # fmt: skip
    return dict(rec, row=run.row, seed=run.seed)


def print_status(runs: list[Job], args) -> None:
    """--status: one line per run (row, seed, job id, scheduler state, training
    status, workdir; a failed run's reason and log below it), then the counts."""
    require_client("squeue")
    rows = survey(runs, args.workdir, args.retries, args.skip_failed)
    width = max(len(run.row) for run in runs)
    for run, job, state, what in rows:
        job_id = job["job_id"] if job else "-"
        print(f"{run.row:>{width}}  seed {run.seed}  job {job_id:>7}  {state:<20}  "
              f"{training_status(run):<22}  {run.workdir}")  # fmt: skip
        rec = failures.read(run.workdir) if what in ("submit", "failed") else None
        if rec:
            again = "to submit again" if what == "submit" else "not retried"
            print(f"{'':>{width}}  failed {rec['failures']} time(s), {again}: {rec['reason']}; "
                  f"log: {rec['log']}")  # fmt: skip
    counts = {d: sum(r[3] == d for r in rows) for d in ("done", "wait", "submit", "failed")}
    print(
        f"{len(runs)} runs: {counts['done']} done, {counts['wait']} queued or running, "
        f"{counts['submit']} to submit, {counts['failed']} failed and not retried (the same "
        "command without --status submits those to submit)"
    )


def submit_pending(runs: list[Job], args, command: str) -> tuple[list, list[dict]]:
    """Submits every run that is neither done, queued/running nor failed and not
    retried; prints one line per run. Returns [(run, job id)] of the runs not done (just
    submitted or still queued) and the failed runs not retried (`failure_of`)."""
    active, failed = [], []
    survey_ = survey(runs, args.workdir, args.retries, args.skip_failed)
    for k, (run, job, state, what) in enumerate(survey_, 1):
        head = f"[{k}/{len(runs)}] row={run.row} seed={run.seed}"
        if what == "done":
            print(f"{head}  done, skipped", flush=True)
            continue
        if what == "wait":
            print(f"{head}  job {job['job_id']} {state}, left alone", flush=True)
            active.append((run, job["job_id"]))
            continue
        if what == "failed":
            failed.append(failure_of(run))
            why = failures.why_not_retried(failed[-1], args.skip_failed)
            print(f"{head}  failed, not retried ({why}): {failed[-1]['reason']}", flush=True)
            continue
        script, before = os.path.join(run.workdir, SCRIPT), training_status(run)
        write_text(script, script_text(args, run, args.workdir, command))
        job_id = submit(script, run)
        record_job(args.workdir, run, job_id, script)
        why = f"job {job['job_id']} {state}, resubmitted" if job else "submitted"
        print(f"{head}  {before}  {why}: job {job_id}  log {run.workdir}/{LOG}",
              flush=True)  # fmt: skip
        active.append((run, job_id))
    return active, failed


def wait_for(active: list[tuple[Job, str]], poll: float) -> None:
    """Polls until none of the jobs is pending or running, printing state changes."""
    seen = {}
    while True:
        states = scheduler_states([job_id for _, job_id in active])
        running = 0
        for run, job_id in active:
            state = scheduler_state({"job_id": job_id}, states, status(run) == "done")
            running += decide(False, state) == "wait"
            if seen.get(job_id) != state:
                print(f"    row={run.row} seed={run.seed} job {job_id}: {state}", flush=True)
                seen[job_id] = state
        if not running:
            return
        time.sleep(poll)


def run_all(runs: list[Job], args, command: str) -> list[dict] | None:
    """--launcher=slurm: submits what is needed; with --wait waits for every job. None
    while jobs are queued or running; else the failed runs (`failure_of`: those not
    retried, and with --wait those whose job ended unfinished now, which the next
    command submits again), and the table can be written from the rest."""
    require_client("sbatch", "squeue")
    active, failed = submit_pending(runs, args, command)
    if not active:
        return failed
    if not args.wait:
        print(f"{len(active)} job(s) queued or running: --status shows them; the same "
              "command writes the table once all are done", flush=True)  # fmt: skip
        return None
    wait_for(active, args.poll)
    ended = survey([run for run, _ in active], args.workdir, args.retries, skip_failed=True)
    return failed + [failure_of(run) for run, _, _, what in ended if what != "done"]
