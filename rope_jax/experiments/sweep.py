r"""Runs a config's sweep(): every row x seed is one training run; then a table and a plot.

  python -m rope_jax.experiments.sweep --config=configs/lm.py:size=tiny --workdir=runs/vo_ablation \
      --seeds=3 --results=results/research/vo_rope_ablation \
      [--rows=qk,vo] [--set train.num_steps=200]

The config module's `sweep(add)` calls `add(name="vo", **{"model.rope.sites": "vo"})` per
row (dotted config paths -> values). Run (row, seed k) is `python train.py` in
<workdir>/<row>/seed_<k> (its own process: isolated, resumable, killable), then
`python eval.py --seq_lens=T,2T,4T` (or, when the config sets eval.splits, eval.py at T
on each of those splits, reported as answer accuracy per split). `--config.a.b=v` is
`--set a.b=v`. The same command again skips finished runs and resumes unfinished ones.

A run that fails (a non-finite loss, a crash, the out-of-memory killer, a SLURM job
that failed or was cancelled) does not stop the sweep: it is recorded in
<workdir>/<row>/seed_<k>/failed.json (`rope_jax.experiments.failures`: the reason in one
line, its log) and the next run starts. The table is written from the finished runs,
each row's mean over its finished seeds, every failed run named with its reason and
log; then the sweep exits 1, its last line saying how many failed. The same command
again runs a failed run again while it has failed at most --retries times (1);
--skip_failed runs none; --status lists every run with each failure's reason.
--report_only writes the table of the runs finished so far, while a sweep goes on.

Runs share the compilation cache <workdir>/jax_cache unless JAX_COMPILATION_CACHE_DIR
is set. Writes <results>.md (table), <results>.png (bars + validation curves, or the
training loss when the runs were too short for those) and <results>.json (all numbers;
render_markdown(json) rebuilds the table).

With --launcher=slurm (--nodes, --tasks_per_node, --gpus_per_task, --partition, --time,
...) every run that is not done is one SLURM batch job instead, a generated
<workdir>/<row>/seed_<k>/job.sbatch (`rope_jax.experiments.slurm`, docs/cluster.md).
The command submits and returns; --status prints every job's state, --wait waits for
them; the same command again resubmits runs whose job ended unfinished (a failure,
retried as above) and writes the table once no job is queued or running. One sweep at
a time holds a workdir: a second one on it stops at once with one line naming the
first (host, PID, start time).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from rope_jax import signals
from rope_jax.experiments import failures, slurm
from rope_jax.experiments.launch import run_all
from rope_jax.experiments.plan import SweepError, format_command, plan, status
from rope_jax.experiments.report import check_out, write_report
from rope_jax.harness import workdir as workdir_lib


def plan_of(rows: dict, seeds, settings: dict) -> dict:
    """What a results file was made by: rows with their overrides, seeds, settings."""
    return {"rows": {r: dict(o) for r, o in rows.items()}, "seeds": list(seeds),
            "settings": dict(settings)}  # fmt: skip


def _same(a, b) -> bool:
    """Equal as JSON (key order ignored): how a plan read back compares with a new one."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def extends(old: dict, new: dict) -> bool:
    """Whether plan `new` only adds seeds or rows to `old` (the same settings, every old
    row with its overrides, every old seed): its report keeps all the old one held."""
    rows_kept = all(r in new["rows"] and _same(o, new["rows"][r]) for r, o in old["rows"].items())
    return (
        _same(old["settings"], new["settings"])
        and set(old["seeds"]) <= set(new["seeds"])
        and rows_kept
    )


def check_results(results: str, runs, context: dict) -> None:
    """Refuses (one line) to write over <results>.json made by a different plan; a plan
    that only adds seeds or rows to it (a second seed later, say) goes on."""
    path = results + ".json"
    if not os.path.exists(path):
        return
    try:
        with open(path) as f:
            old = json.load(f)
        old_plan = plan_of({r: v["overrides"] for r, v in old["rows"].items()}, old["seeds"],
                           old["settings"])  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError):
        raise SweepError(f"{path} exists and is not a sweep report: choose another "
                         "--results or pass --overwrite") from None  # fmt: skip
    rows = {run.row: context["overrides"][run.row] for run in runs}
    new_plan = plan_of(rows, context["seeds"], context["settings"])
    changed = [key for key in new_plan if not _same(new_plan[key], old_plan[key])]
    if changed and not extends(old_plan, new_plan):
        raise SweepError(f"{path} holds results of another plan (different "
                         f"{', '.join(changed)}): choose another --results, or pass "
                         "--overwrite to replace them")  # fmt: skip


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m rope_jax.experiments.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--config", required=True, help="file[:arg], e.g. configs/lm.py:size=tiny")
    p.add_argument("--workdir", required=True, help="runs go to <workdir>/<row>/seed_<k>")
    p.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1 for every row")
    p.add_argument("--rows", default="", help="comma-separated rows to run (default: all)")
    p.add_argument("--dry_run", action="store_true", help="list the runs and their status only")
    p.add_argument("--results", default="", help="output prefix (default: <workdir>/results)")
    p.add_argument("--extrapolate", default="2,4", help="extra eval lengths as multiples of T")
    p.add_argument("--overwrite", action="store_true",
                   help="replace <results>.* even if they were made by another plan")  # fmt: skip
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every run; repeatable or comma-separated; "
                        "{seed} in a value is the run's seed; --config.KEY=VALUE is the "
                        "same")  # fmt: skip
    p.add_argument("--retries", type=int, default=failures.RETRIES,
                   help="a failed run is run again by the same command while it has failed "
                        "at most this many times (default %(default)s)")  # fmt: skip
    p.add_argument(
        "--skip_failed",
        action="store_true",
        help="run no failed run again: write the table from the finished runs",
    )
    p.add_argument("--report_only", action="store_true",
                   help="write <results>.* now from the runs finished so far (the others "
                        "listed as not finished), then exit: trains nothing, and a sweep "
                        "running on the workdir goes on")  # fmt: skip
    p.add_argument("--status", action="store_true", default=None,
                   help="print every run's status (failed runs with their reason and log), "
                        "then exit")  # fmt: skip
    slurm.add_flags(p)
    # --config.a.b=v, as train.py takes it, is --set a.b=v
    argv = [f"--set={a.removeprefix('--config.')}" if re.match(r"--config\.[^=]+=", a) else a
            for a in argv]  # fmt: skip
    args = p.parse_args(argv)
    if args.retries < 0:
        p.error(f"--retries={args.retries} must be >= 0")
    return args


def main(argv=None) -> None:
    signals.release_signals()  # one that came while the modules imported: stops it here
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    try:
        slurm.check_options(args)
        runs, context = plan(args)
        if args.launcher == "slurm":
            slurm.check_processes(args, context)
        if args.dry_run:
            print_plan(runs)
        elif args.launcher == "slurm" and args.status:
            slurm.print_status(runs, args)
        elif args.status:
            print_plan(runs)
        elif args.report_only:
            report_so_far(runs, context, args, argv)
        else:
            sweep(runs, context, args, argv)
    except SweepError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt as e:
        if args.launcher == "slurm":
            sys.exit(signals.interrupted(e, "submitted jobs keep running: --status shows "
                                         "them, the same command writes the table once all "
                                         "are done"))  # fmt: skip
        sys.exit(signals.interrupted(e, "the same command resumes"))  # train.py saved its step


def print_plan(runs) -> None:
    """--dry_run, --status: every run with its status (done, partial, new, failed: with
    its reason and log), then the counts."""
    width = max(len(run.row) for run in runs)
    for run in runs:
        state = status(run)
        print(f"{run.row:>{width}}  seed {run.seed}  {state:>7}  {run.workdir}")
        if state == "failed":
            rec = failures.read(run.workdir)
            times = "" if rec["failures"] == 1 else f" ({rec['failures']} times)"
            print(f"{'':>{width}}  failed{times}: {rec['reason']}; log: {rec['log']}")
    counts = [sum(status(r) == s for r in runs) for s in ("done", "partial", "new", "failed")]
    print("{} runs: {} done, {} partial, {} new, {} failed".format(len(runs), *counts))


def results_of(runs, context: dict, args) -> str:
    """The --results prefix, once checked: no other plan's report under it (unless
    --overwrite), and a directory that takes the files."""
    results = args.results or os.path.join(args.workdir, "results")
    if not args.overwrite:
        check_results(results, runs, context)  # before any run: nothing is lost
    try:  # the table is written after hours of runs: its directory must take it
        check_out(results, "--results")
    except workdir_lib.WorkdirError as e:
        raise SweepError(str(e)) from None
    return results


def report_so_far(runs, context: dict, args, argv) -> None:
    """--report_only: the table of the runs finished so far, naming each failed one and
    each not finished; no lock (a running sweep holds it and writes the whole table)."""
    results = results_of(runs, context, args)
    states = [(run, status(run)) for run in runs]  # once: a run may finish meanwhile
    finished = [run for run, state in states if state == "done"]
    if not finished:
        raise SweepError(f"no run of the {len(runs)} planned has finished yet, so there is "
                         "no table to write (--status lists them)")  # fmt: skip
    gone = {"reason": "failed (its record was removed meanwhile)", "log": ""}
    failed = [dict(failures.read(run.workdir) or gone, row=run.row, seed=run.seed)
              for run, state in states if state == "failed"]  # fmt: skip
    pending = [{"row": run.row, "seed": run.seed, "state": state} for run, state in states
               if state in ("partial", "new")]  # fmt: skip
    command = [a for a in argv if a != "--report_only"]  # the one that trains the rest
    write_report(finished, context, command, results, failed=failed, pending=pending)
    print(
        f"wrote {results}.md, {results}.png, {results}.json ({len(finished)} of {len(runs)} "
        "runs finished)"
    )


def sweep(runs, context: dict, args, argv) -> None:
    """Runs (local) or submits (slurm) what is not done; writes the table once every
    run is done."""
    results = results_of(runs, context, args)
    lock = workdir_lib.Lock(args.workdir)  # one sweep (or submission) per workdir
    try:
        lock.acquire()
    except workdir_lib.WorkdirError as e:
        raise SweepError(str(e)) from None
    try:
        _run_and_report(runs, context, args, argv, results)
    finally:
        lock.release()


def _run_and_report(runs, context: dict, args, argv, results: str) -> None:
    """Runs (or submits) what is not done, then writes the table from the finished runs,
    naming the failed ones; a SweepError (non-zero exit) when any run failed."""
    if args.launcher == "slurm":
        failed = slurm.run_all(runs, args, format_command(argv))
        if failed is None:
            return  # jobs still queued or running
        context = dict(context, device=slurm.describe(args))
    else:
        failed = run_all(runs, args.workdir, args.retries, args.skip_failed)
    finished = [run for run in runs if status(run) == "done"]
    if finished:
        write_report(finished, context, argv, results, failed=failed)
        print(f"wrote {results}.md, {results}.png, {results}.json")
    if failed:
        raise SweepError(failed_line(failed, len(runs), bool(finished), args))


def failed_line(failed: list[dict], total: int, table: bool, args) -> str:
    """The sweep's last line when runs failed: how many, which, and what happens next."""
    again = sum(failures.retried(f, args.retries, False) for f in failed)
    then = (f"the same command runs {again} of them again (--retries={args.retries}; "
            "--skip_failed: none)" if again else
            f"each failed more than --retries={args.retries} time(s), so the same command "
            "does not run it again")  # fmt: skip
    return (
        f"{len(failed)} of {total} runs failed ({failures.describe(failed)}): "
        f"{'the table names them' if table else 'no run finished, so no table'}; "
        f"--status shows why; {then}"
    )


if __name__ == "__main__":
    main()
