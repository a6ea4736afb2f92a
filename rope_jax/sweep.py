r"""Runs a config's sweep(): every row x seed is one training run; then a table and a plot.

  python -m rope_jax.sweep --config=configs/lm.py:size=tiny --workdir=runs/vo_ablation \
      --seeds=3 --results=results/vo_rope_ablation [--rows=qk,vo] [--set train.num_steps=200]

The config module's `sweep(add)` calls `add(name="vo", **{"model.rope.sites": "vo"})` per
row (dotted config paths -> values). Run (row, seed k) is `python train.py` in
<workdir>/<row>/seed_<k> (its own process: isolated, resumable, killable), then
`python eval.py --seq_lens=T,2T,4T` (or, when the config sets eval.splits, eval.py at T
on each of those splits, reported as answer accuracy per split). The same command
again skips finished runs and resumes unfinished ones. Runs share the compilation
cache <workdir>/jax_cache unless JAX_COMPILATION_CACHE_DIR is set. Writes <results>.md
(table), <results>.png (bars + validation curves) and <results>.json (all numbers;
render_markdown(json) rebuilds the table).
"""

from __future__ import annotations

import argparse
import ast
import collections
import datetime
import difflib
import importlib.util
import inspect
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

from rope_jax.sweep_report import (  # noqa: F401 (re-exported)
    kendall,
    mean_std,
    plot,
    plot_splits,
    ranks,
    render_markdown,
    render_splits_markdown,
    resolved_pairs,
    split_summary,
    summarize,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # holds train.py
SETTINGS = ("model.num_layers", "model.embed_dim", "model.num_heads", "model.num_kv_heads",
            "model.head_dim", "model.mlp_dim", "data.name", "data.seq_len",
            "data.global_batch_size", "train.num_steps", "optim.lr")  # fmt: skip
# One training run: train.py arguments, the step it ends at, eval lengths (T first).
# splits: held-out splits eval.py scores at T (config eval.splits; multimodal data).
Run = collections.namedtuple("Run", "row seed workdir flags final_step seq_lens splits")


class SweepError(ValueError):
    """A bad sweep request or a failed run; one readable line."""


def format_command(argv) -> str:
    """The shell command that reproduces this invocation."""
    return shlex.join(["python", "-m", "rope_jax.sweep", *argv])


def parse_value(text: str, like):
    """Parses `text` as the type of the existing field value `like`."""
    if isinstance(like, bool):
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{text!r} is not true or false")
        return text.lower() in ("true", "1")
    if isinstance(like, int | float):
        return type(like)(text)
    if isinstance(like, tuple):
        try:
            value = ast.literal_eval(text) if text.strip() else ()
        except (ValueError, SyntaxError):
            value = tuple(filter(None, text.strip("()").split(",")))
        return tuple(value) if isinstance(value, list | tuple) else (value,)
    return text


def flag_value(value) -> str:
    """`value` as ml_collections config_flags parses it back (`--config.x=<this>`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(tuple(value)) if isinstance(value, tuple | list) else str(value)


def split_sets(items) -> list[tuple[str, str]]:
    """`--set a.b=1,c.d=(1,2)` items -> [(key, text)]; commas split before `key=`."""
    out = []
    for part in (p for item in items for p in re.split(r",(?=[A-Za-z_][\w.]*=)", item)):
        key, sep, text = part.partition("=")
        if not sep or not key.strip():
            raise SweepError(f"--set {part!r} is not key=value (e.g. train.num_steps=200)")
        out.append((key.strip(), text))
    return out


def leaves(config, prefix="") -> dict:
    """Dotted path -> value for every leaf field."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        out.update(leaves(value, name + ".") if hasattr(value, "items") else {name: value})
    return out


def apply(config, overrides: dict, where: str) -> None:
    """Sets dotted fields; unknown fields and wrong types are SweepErrors."""
    fields = leaves(config)
    for dotted, value in overrides.items():
        if dotted not in fields:
            close = difflib.get_close_matches(dotted, fields, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise SweepError(f"{where}: no config field {dotted!r}{hint}")
        try:
            config.update_from_flattened_dict({dotted: value})
        except (TypeError, ValueError) as e:
            raise SweepError(f"{where}: {dotted}={value!r}: {e}") from None


def load_rows(path: str, arg: str):
    """(module, base config, rows) from a config file with get_config(arg) and sweep(add)."""
    if not os.path.isfile(path):
        raise SweepError(f"--config: no file {path!r}")
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)  # config modules import `configs.common`
    spec = importlib.util.spec_from_file_location("sweep_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "sweep", None)):
        raise SweepError(f"{path} defines no sweep(add); add one that calls "
                         "add(name='vo', **{'model.rope.sites': 'vo'}) per row")  # fmt: skip
    try:
        base = module.get_config(arg) if arg else module.get_config()
    except (TypeError, ValueError) as e:
        raise SweepError(f"--config={path}:{arg}: {e}") from None
    rows = {}

    def add(name, **overrides):
        if not re.fullmatch(r"[\w.+-]+", name or "") or name in rows:
            raise SweepError(f"{path}: sweep() row name {name!r} is repeated or not a plain "
                             "directory name")  # fmt: skip
        rows[name] = overrides

    takes_arg = "arg" in inspect.signature(module.sweep).parameters
    module.sweep(add, arg=arg) if takes_arg else module.sweep(add)  # arg: the size etc.
    if not rows:
        raise SweepError(f"{path}: sweep(add) added no rows")
    return module, base, rows


def plan(args) -> tuple[list[Run], dict]:
    """Checks everything a user can get wrong, then lists the runs; runs nothing."""
    path, _, arg = args.config.partition(":")
    module, base, rows = load_rows(path, arg)
    if args.rows:
        wanted = [r.strip() for r in args.rows.split(",") if r.strip()]
        unknown = [r for r in wanted if r not in rows]
        if unknown:
            raise SweepError(f"--rows: unknown row(s) {', '.join(unknown)}; "
                             f"known rows: {', '.join(rows)}")  # fmt: skip
        rows = {r: rows[r] for r in wanted}
    sets, fields = {}, leaves(base)
    for key, text in split_sets(args.set):
        try:  # an unknown key stays text here; apply() below names it
            sets[key] = parse_value(text, fields.get(key))
        except ValueError as e:
            raise SweepError(f"--set {key}={text}: {e}") from None
    if "seed" in sets:
        raise SweepError("--set seed: the sweep sets each run's seed (--seeds=N runs 0..N-1)")
    for key in sets:
        setters = [r for r, o in rows.items() if key in o]
        if setters:
            raise SweepError(f"--set {key}: set per run by {', '.join(setters)} (leave those "
                             "rows out with --rows, or change the config arg instead)")  # fmt: skip
    apply(base, sets, "--set")
    if args.seeds < 1:
        raise SweepError(f"--seeds={args.seeds} must be >= 1")
    try:
        mults = [int(m) for m in args.extrapolate.split(",") if m.strip()]
    except ValueError:
        raise SweepError(f"--extrapolate={args.extrapolate!r} is not integers like 2,4") from None
    from rope_jax import model, training  # imports jax: only once the cheap checks passed

    config_arg, runs = os.path.abspath(path) + (f":{arg}" if arg else ""), []
    kv_bytes = {}
    for row, overrides in rows.items():
        config = base.copy_and_resolve_references()
        apply(config, overrides, f"{path}: row {row}")
        try:
            training.check_config(config)
        except ValueError as e:
            raise SweepError(f"row {row}: {e}") from None
        kv_bytes[row] = model.kv_cache_bytes_per_token(config.model)
        t, splits = int(config.data.seq_len), tuple(config.eval.get("splits", ()))
        lens = [t] if splits else [t, *sorted({t * m for m in mults if m > 1})]
        flags = [f"--config.{k}={flag_value(v)}" for k, v in {**sets, **overrides}.items()]
        for seed in range(args.seeds):
            workdir = os.path.abspath(os.path.join(args.workdir, row, f"seed_{seed}"))
            head = [f"--config={config_arg}", f"--workdir={workdir}", f"--config.seed={seed}"]
            runs.append(Run(row, seed, workdir, head + flags, config.train.num_steps, lens,
                            splits))  # fmt: skip
    if len({run.seq_lens[0] for run in runs}) > 1:
        raise SweepError("rows set different data.seq_len; the table compares them at one T")
    fields = leaves(base)
    return runs, {
        "config": args.config, "title": (module.__doc__ or "").strip().split("\n")[0],
        "overrides": {r: {k: flag_value(v) for k, v in o.items()} for r, o in rows.items()},
        "settings": {k: fields[k] for k in SETTINGS if k in fields},
        "article_loss": getattr(module, "ARTICLE_LOSS", None), "seeds": list(range(args.seeds)),
        "eval_split": fields.get("data.eval_split", "validation"), "kv_bytes": kv_bytes,
    }  # fmt: skip


def status(run: Run) -> str:
    """done: eval json of the final step with every length; partial: started; new."""
    path = os.path.join(run.workdir, f"eval_{run.final_step}.json")
    try:
        with open(path) as f:
            saved = json.load(f)
        if all(key in saved for key in columns(run)):
            return "done"
    except (OSError, ValueError):  # missing, or cut short by a kill
        pass
    return "partial" if os.path.isdir(run.workdir) else "new"


def columns(run: Run) -> list[str]:
    """Keys of a run's eval json the report reads: context lengths, then splits."""
    return [*map(str, run.seq_lens), *run.splits]


def latest_checkpoint(workdir: str) -> int | None:
    ckpts = os.path.join(workdir, "checkpoints")  # orbax renames a step dir once complete
    steps = os.listdir(ckpts) if os.path.isdir(ckpts) else []
    return max((int(d) for d in steps if d.isdigit()), default=None)


def launch(cmd: list, log_path: str, env: dict) -> None:
    """Runs `cmd` from the repo root into `log_path`. Ctrl-C reaches only the sweep (the
    child is in a new process group), which sends SIGTERM: train.py saves a checkpoint."""
    with open(log_path, "a") as log:
        log.write(f"\n=== {datetime.datetime.now():%Y-%m-%d %H:%M:%S} {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGTERM)
            proc.wait()
            raise
    if rc != 0:
        raise SweepError(f"{cmd[1]} exited with status {rc}")


def execute(run: Run, env: dict) -> None:
    """train.py (unless its final checkpoint exists), then eval.py at T, 2T, 4T."""
    os.makedirs(run.workdir, exist_ok=True)
    log = os.path.join(run.workdir, "train.log")
    try:
        if latest_checkpoint(run.workdir) != run.final_step:
            launch([sys.executable, "train.py", *run.flags], log, env)
            if latest_checkpoint(run.workdir) != run.final_step:
                raise SweepError(f"train.py stopped before step {run.final_step}")
        launch([sys.executable, "eval.py", f"--workdir={run.workdir}", f"--step={run.final_step}",
                "--seq_lens=" + ",".join(map(str, run.seq_lens)),
                *(["--splits=" + ",".join(run.splits)] if run.splits else [])],
               log, env)  # fmt: skip
    except SweepError as e:
        with open(log) as f:
            print("".join("    " + line for line in f.readlines()[-25:]), end="", file=sys.stderr)
        raise SweepError(f"run row={run.row} seed={run.seed} failed: {e}; log: {log}") from None


def run_all(runs: list[Run], workdir: str) -> None:
    """Runs what is not done, in order, with progress and an ETA on stdout."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if "JAX_COMPILATION_CACHE_DIR" not in env:
        env.update(JAX_COMPILATION_CACHE_DIR=os.path.abspath(os.path.join(workdir, "jax_cache")),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")  # fmt: skip
    left, durations = sum(status(r) != "done" for r in runs), []
    for k, run in enumerate(runs, 1):
        state, head = status(run), f"[{k}/{len(runs)}] row={run.row} seed={run.seed}"
        if state == "done":
            print(f"{head}  done, skipped", flush=True)
            continue
        eta = sum(durations) / len(durations) * left if durations else None
        eta = "n/a" if eta is None else datetime.timedelta(seconds=round(eta))
        print(f"{head}  {state}  {run.workdir}  ETA {eta}", flush=True)
        start = time.time()
        execute(run, env)
        durations.append(time.time() - start)
        left, rec = left - 1, collect(run)
        train = f"train loss {rec['train_curve'][-1][1]:.4f}, " if rec["train_curve"] else ""
        evals = ", ".join(f"{rec['loss'][str(t)]:.4f} @{t}" for t in run.seq_lens)
        accs = ", ".join(f"{s} {rec['accuracy'][s]:.3f}" for s in run.splits)
        accs = f"; answer accuracy {accs}" if accs else ""
        print(f"    {durations[-1]:.0f}s  {train}held-out loss {evals}{accs}", flush=True)


def collect(run: Run) -> dict:
    """One run's numbers: final eval losses per length and its metric curves."""
    from rope_jax.metrics import read_jsonl

    with open(os.path.join(run.workdir, f"eval_{run.final_step}.json")) as f:
        saved = json.load(f)
    records = read_jsonl(run.workdir)
    # A resumed run logs again the steps after its checkpoint: keep the last value.
    curve = lambda key: sorted({r["step"]: r[key] for r in records if key in r}.items())
    return {"seed": run.seed, "workdir": run.workdir, "step": saved["step"],
            "loss": {key: saved[key]["loss"] for key in columns(run)},
            "accuracy": {s: saved[s].get("answer_accuracy") for s in run.splits},
            "metrics": {s: saved[s] for s in run.splits},
            "eval_curve": curve("eval/loss"), "train_curve": curve("loss")}  # fmt: skip


def write_report(runs: list[Run], context: dict, argv, results: str) -> dict:
    """Collects every run into <results>.json, then writes <results>.md and .png."""
    import jax

    dev, rows = jax.devices()[0], {}
    for run in runs:
        rows.setdefault(run.row, {"overrides": context["overrides"][run.row], "runs": []})
        rows[run.row]["runs"].append(collect(run))
    report = dict(context, command=format_command(argv), jax=jax.__version__, rows=rows,
                  date=datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
                  device=f"{dev.platform} ({dev.device_kind}) x{jax.device_count()}",
                  seq_lens=[str(t) for t in runs[0].seq_lens],
                  splits=list(runs[0].splits))  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(results)), exist_ok=True)
    with open(results + ".json", "w") as f:
        json.dump(report, f, indent=1)
    splits = bool(report["splits"])
    with open(results + ".md", "w") as f:
        f.write(render_splits_markdown(report) if splits else render_markdown(report))
    (plot_splits if splits else plot)(report, results + ".png")
    return report


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m rope_jax.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--config", required=True, help="file[:arg], e.g. configs/lm.py:size=tiny")
    p.add_argument("--workdir", required=True, help="runs go to <workdir>/<row>/seed_<k>")
    p.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1 for every row")
    p.add_argument("--rows", default="", help="comma-separated rows to run (default: all)")
    p.add_argument("--dry_run", action="store_true", help="list the runs and their status only")
    p.add_argument("--results", default="", help="output prefix (default: <workdir>/results)")
    p.add_argument("--extrapolate", default="2,4", help="extra eval lengths as multiples of T")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every run; repeatable or comma-separated")  # fmt: skip
    return p.parse_args(argv)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # as Ctrl-C
    try:
        runs, context = plan(args)
        if args.dry_run:
            width = max(len(run.row) for run in runs)
            for run in runs:
                print(f"{run.row:>{width}}  seed {run.seed}  {status(run):>7}  {run.workdir}")
            counts = [sum(status(r) == s for r in runs) for s in ("done", "partial", "new")]
            print("{} runs: {} done, {} partial, {} new".format(len(runs), *counts))
            return
        run_all(runs, args.workdir)
        results = args.results or os.path.join(args.workdir, "results")
        write_report(runs, context, argv, results)
        print(f"wrote {results}.md, {results}.png, {results}.json")
    except SweepError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit("interrupted (train.py saves a checkpoint on SIGTERM); rerun to resume")
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    main()
