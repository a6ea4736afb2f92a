r"""Context extension: train at T, then evaluate at T, 2T, 4T and 8T under each scaling rule,
without fine-tuning and after a short fine-tune at 4T; held-out loss and passkey retrieval.

  python -m rope_jax.experiments.context_extension --config=configs/lm.py:size=tiny \
      --workdir=runs/context_extension --out=results/research/context_extension \
      [--rows=qk,vo] [--rules=none,yarn] [--seeds=2] [--finetune_steps=100] [--set k=v,...]

Rows: the rows of --config's `sweep(add)` (configs/lm.py: the rotation sites qk, vo,
qkvo, k, nope, ...), and this experiment's own axis, the learned rotations (`LEARNED`:
freqs, commuting, on the qk sites); default `DEFAULT_ROWS`. Rules (`RULES`,
docs/maths.md#context-scaling): none (the model as trained), linear (position
interpolation), dynamic (NTK-aware, at each length), yarn and llama3, each with factor
f = --factor (4) from L0 = T. A rule applies to a row with a fixed rotation; NoPE and
the learned rotations have only `none`.

Per (row, seed), in <workdir>/<row>/seed_<k>/:
  base/          train.py at T (`data.passkey_rate` of the config, default --passkey_rate),
                 then one evaluation per rule: eval_<step>_<rule>.json.
  finetune_<rule>/  train.py at 4T from base (`train.init_from`) for --finetune_steps
                 under the rule (max_position_embeddings = T), then eval_<step>.json.
Every evaluation scores --num_batches batches of the validation split at each length
and --passkey examples of passkey retrieval (`data.passkey`), and with --tasks (RULER's
tasks, `harness.evals`: e.g. niah_single_1,vt, answered by greedy decoding) --examples
examples of each; train them with `--set data.synthetic_tasks=...` (docs/evaluation.md).
Training runs in subprocesses (resumable, killable); a finished stage is skipped, so the
same command continues an interrupted experiment. Writes <out>.json (every number), <out>.md (the
table, the command, and verdicts on the published claims) and <out>.png; --report_only
writes them from the cells evaluated so far, while the experiment goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shlex
import sys
import time

import numpy as np

from rope_jax import signals
from rope_jax.experiments import launch, plan, report

# The experiment's own axis beside the config's rows: RoPE's rotation learned.
LEARNED = {
    "freqs": {"model.rope.sites": "qk", "model.rope.learned": "freqs"},
    "commuting": {"model.rope.sites": "qk", "model.rope.learned": "commuting"},
}
DEFAULT_ROWS = ("qk", "vo", "qkvo", "nope", *LEARNED)
RULES = ("none", "linear", "dynamic", "yarn", "llama3")
MULTIPLES = (1, 2, 4, 8)  # evaluation lengths, in units of T
FINETUNE_MULTIPLE = 4  # fine-tuning length, in units of T
# Per length: held-out loss; passkey digits right (chance 0.1); passkey keys right.
METRICS = ("loss", "digits", "passkey")
LEARNED_AT = 0.9  # a run has learned a RULER task: its score at T, as trained, at least this


def rule_scaling(rule: str, factor: float, train_len: int) -> dict | None:
    """`model.rope.scaling` of a rule (HF rope_parameters keys); None = as trained."""
    if rule not in RULES:
        raise plan.SweepError(f"--rules: {rule!r} is not one of {', '.join(RULES)}")
    original = {"original_max_position_embeddings": train_len}
    return {
        "none": None,
        "linear": {"rope_type": "linear", "factor": factor},
        "dynamic": {"rope_type": "dynamic", "factor": factor},
        "yarn": {"rope_type": "yarn", "factor": factor, **original},
        "llama3": {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            **original,
        },  # fmt: skip
    }[rule]


def rules_for(config, rules) -> list[str]:
    """A fixed, non-empty rotation takes every rule; NoPE and learned rotations `none`
    (`config` the row's resolved config)."""
    fixed = config.model.rope.learned == "none"
    return list(rules) if fixed and config.model.rope.sites else ["none"]


def rows_of(config_rows: dict) -> dict:
    """Every row this experiment can run: the config's rows, then `LEARNED`."""
    clash = sorted(set(config_rows) & set(LEARNED))
    if clash:
        raise plan.SweepError(f"--config: its rows {clash} repeat this experiment's own "
                              f"learned-rotation rows; rename them")  # fmt: skip
    return {**config_rows, **LEARNED}


@dataclasses.dataclass(frozen=True)
class Case:
    """One (row, seed, rule, fine-tuned?) cell: how it is trained and how evaluated."""

    row: str
    seed: int
    rule: str
    finetuned: bool
    workdir: str  # the run that is evaluated
    train_flags: tuple  # train.py flags of that run
    final_step: int
    scaling: dict | None  # eval-time rule (base runs); None for fine-tuned runs
    tag: str  # eval_<step>_<tag>.json ("" for fine-tuned runs)

    @property
    def eval_path(self) -> str:
        return os.path.join(
            self.workdir, f"eval_{self.final_step}{'_' + self.tag if self.tag else ''}.json"
        )


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rope_jax.experiments.context_extension",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--config", default="configs/lm.py:size=tiny")
    p.add_argument("--workdir", required=True)
    p.add_argument("--out", default="", help="results path without extension")
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                   help="rows of --config's sweep(add), or of LEARNED")  # fmt: skip
    p.add_argument("--rules", default=",".join(RULES))
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--factor", type=float, default=float(FINETUNE_MULTIPLE))
    p.add_argument("--finetune_steps", type=int, default=100)
    p.add_argument("--finetune_lr", type=float, default=1e-3)
    p.add_argument("--passkey_rate", type=float, default=0.5,
                   help="data.passkey_rate of every run (unless --set sets it)")  # fmt: skip
    p.add_argument("--passkey_weight", type=float, default=10.0,
                   help="data.passkey_weight of every run (unless --set sets it)")  # fmt: skip
    p.add_argument("--passkey", type=int, default=100, help="passkey examples per length")
    p.add_argument("--num_batches", type=int, default=8, help="eval batches per length")
    p.add_argument("--tasks", default="", help="RULER tasks scored at every length, e.g. "
                   "niah_single_1,vt ('ruler': all)")  # fmt: skip
    p.add_argument("--examples", type=int, default=None,
                   help="examples per length of --tasks (default --passkey's, or 50)")  # fmt: skip
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--report_only", action="store_true",
                   help="write --out now from the cells evaluated so far (the others listed "
                        "as not done), then exit: trains and evaluates nothing")  # fmt: skip
    return p.parse_args(argv)


def make_plan(args) -> tuple[list[Case], dict]:
    """Checks everything a user can get wrong, then lists the cases; runs nothing."""
    path, _, arg = args.config.partition(":")
    _, base, config_rows = plan.load_rows(path, arg)
    table = rows_of(config_rows)
    rows, rules = plan.pick(args.rows, table, "--rows"), plan.pick(args.rules, RULES, "--rules")
    for name, value in (("--seeds", args.seeds), ("--finetune_steps", args.finetune_steps),
                        ("--num_batches", args.num_batches)):  # fmt: skip
        if value < 1:
            raise plan.SweepError(f"{name}={value} must be >= 1")
    if not args.factor > 1:
        raise plan.SweepError(f"--factor={args.factor} must be > 1")
    sets = {"data.passkey_rate": args.passkey_rate, "data.passkey_weight": args.passkey_weight}
    fields, types = plan.leaves(base), plan.field_types(base)
    for key, text in plan.split_sets(args.set):
        try:
            sets[key] = plan.parse_value(text, fields.get(key), types.get(key))
        except ValueError as e:
            raise plan.SweepError(f"--set {key}={text}: {e}") from None
    plan.apply(base, sets, "--set")
    from rope_jax.data import passkey  # imports numpy only; jax in `_check`

    t = int(base.data.seq_len)
    lengths = [t * m for m in MULTIPLES]
    if args.passkey:
        passkey.check_length(t)
    tasks = _tasks(args)
    config_arg = os.path.abspath(path) + (f":{arg}" if arg else "")
    cases = []
    for row in rows:
        overrides = {**sets, **table[row]}
        config = _check(base, overrides, f"row {row}")
        if tasks and row == rows[0]:  # the tasks fit every length, before anything trains
            _check_tasks(config, tasks, lengths)
        for seed in range(args.seeds):
            root = plan.run_dir(args.workdir, row, seed)
            head = (f"--config={config_arg}", f"--config.seed={seed}")
            base_dir = os.path.join(root, "base")
            base_flags = (*head, f"--workdir={base_dir}", *_flags(overrides))
            for rule in rules_for(config, rules):
                scaling = rule_scaling(rule, args.factor, t)
                cases.append(Case(row, seed, rule, False, base_dir, base_flags,
                                  int(config.train.num_steps), scaling, rule))  # fmt: skip
                ft_dir = os.path.join(root, f"finetune_{rule}")
                ft = {**overrides, **_finetune(scaling, args, t, base_dir)}
                if seed == 0:  # a fine-tune that cannot run fails now, not after the base
                    _check(base, ft, f"row {row} fine-tuned under {rule}")
                cases.append(Case(row, seed, rule, True, ft_dir,
                                  (*head, f"--workdir={ft_dir}", *_flags(ft)),
                                  args.finetune_steps, None, ""))  # fmt: skip
    meta = {"config": args.config, "train_len": t, "lengths": lengths, "rows": rows,
            "rules": rules, "seeds": args.seeds, "factor": args.factor,
            "finetune_len": FINETUNE_MULTIPLE * t, "finetune_steps": args.finetune_steps,
            "finetune_lr": args.finetune_lr, "passkey_examples": args.passkey,
            "num_batches": args.num_batches, "tasks": tasks, "examples": args.examples,
            "sets": {k: plan.flag_value(v) for k, v in sets.items()},
            "settings": {k: v for k, v in plan.leaves(base).items()
                         if k in plan.SETTINGS}}  # fmt: skip
    return cases, meta


def _tasks(args) -> list[str]:
    """--tasks as registered task names (the loss and passkey have flags of their own)."""
    from rope_jax.harness import evals  # imports jax

    if not args.tasks:
        return []
    if args.examples is None:  # one count of examples serves passkey and the tasks
        args.examples = args.passkey or 50
    if args.examples < 1:
        raise plan.SweepError(f"--examples={args.examples} must be >= 1")
    if args.passkey and args.passkey != args.examples:
        raise plan.SweepError(f"--passkey={args.passkey} and --examples={args.examples}: "
                              "one count of examples serves both, give the same")  # fmt: skip
    try:
        names = evals.parse(args.tasks)
    except ValueError as e:
        raise plan.SweepError(f"--tasks: {e}") from None
    return [n for n in names if n not in ("loss", "passkey")]


def _check_tasks(config, tasks, lengths) -> None:
    """RULER's tasks fit every length in the run's wording and tokenizer (byte-level text:
    a prepared corpus's tokenizer exists once it is prepared, and is checked when the
    first evaluation starts), before anything trains."""
    from rope_jax import data, ruler

    kind = data.kind(config.data)
    if kind.name != "text":
        return
    tokenizer = kind.tokenizer()
    filler = np.asarray(tokenizer.encode(ruler.templates.NOISE * (max(lengths) // 16 + 1)))
    budget = int(config.eval.answer_tokens) or None
    try:
        for task in tasks:
            for n in lengths:
                ruler.check(task, length=n, tokenizer=tokenizer, haystack=filler,
                            max_new_tokens=budget, template=config.data.task_template)  # fmt: skip
    except ValueError as e:
        raise plan.SweepError(f"--tasks: {e}") from None


def _flags(overrides: dict) -> tuple:
    return tuple(f"--config.{k}={plan.flag_value(v)}" for k, v in overrides.items())


def _check(base, overrides: dict, what: str):
    """`base` with `overrides`, resolved (`checks.resolve`); a SweepError naming `what`
    if that is not a valid run config."""
    from rope_jax.harness import checks

    config = base.copy_and_resolve_references()
    plan.apply(config, overrides, what)
    try:
        return checks.resolve(config)
    except ValueError as e:
        raise plan.SweepError(f"{what}: {e}") from None


def _finetune(scaling: dict | None, args, train_len: int, base_dir: str) -> dict:
    """Overrides of a fine-tune at FINETUNE_MULTIPLE x T from `base_dir` under `scaling`."""
    out = {"data.seq_len": FINETUNE_MULTIPLE * train_len, "train.num_steps": args.finetune_steps,
           "train.init_from": base_dir, "optim.lr": args.finetune_lr,
           "optim.warmup_steps": max(1, args.finetune_steps // 10),
           "train.eval_every_steps": 0, "train.ckpt_every_steps": args.finetune_steps,
           "model.rope.max_position_embeddings": train_len}  # fmt: skip
    out.update({f"model.rope.scaling.{k}": v for k, v in (scaling or {}).items()})
    return out


# ------------------------------------------------------------------------------ running


def run_all(cases: list[Case], meta: dict, workdir: str) -> None:
    """Trains what is not trained (subprocesses), evaluates what is not evaluated
    (in-process), in order, with progress and an ETA."""
    env = dict(os.environ, **launch.cache_env(workdir))
    os.environ.update(launch.cache_env(workdir))  # this process's evaluations share it
    todo = [c for c in cases if not _done(c, meta)]
    eta = launch.Eta()
    for k, case in enumerate(cases, 1):
        head = f"[{k}/{len(cases)}] {case.row} seed={case.seed} {_label(case)}"
        if case not in todo:
            print(f"{head}  done, skipped", flush=True)
            continue
        left = eta.left((c.workdir, c.final_step) for c in todo[todo.index(case) :])
        print(f"{head}  {case.workdir}  ETA {left}", flush=True)
        start, before = time.time(), launch.latest_checkpoint(case.workdir) or 0
        label = f"{case.row} seed={case.seed} {_label(case)}"
        launch.train_until(case.workdir, case.train_flags, case.final_step, env, label)
        _evaluate(case, meta)
        seconds = time.time() - start
        eta.add(seconds, case.final_step - before)
        rec = _record(case, meta.get("tasks", ()))
        print(f"    {_summary(rec)}  ({seconds:.0f}s)", flush=True)


def _summary(rec: dict) -> str:
    key = lambda n: f" passkey digits {rec['digits'][n]:.2f}" if n in rec["digits"] else ""  # noqa: E731
    return ", ".join(f"@{n} loss {rec['loss'][n]:.3f}{key(n)}" for n in rec["loss"])


def _label(case: Case) -> str:
    return f"rule={case.rule} " + ("fine-tuned" if case.finetuned else "as trained")


def _done(case: Case, meta: dict) -> bool:
    """Evaluated at every length, with every task asked for (tasks added to an experiment
    evaluate its finished runs again)."""
    if not report.evaluated(case.eval_path, meta["lengths"]):
        return False
    with open(case.eval_path) as f:
        saved = json.load(f)
    return all(t in saved[str(n)] for t in meta.get("tasks", ()) for n in meta["lengths"])


def _evaluate(case: Case, meta: dict) -> None:
    from rope_jax.harness.evaluate import evaluate_checkpoint  # imports jax

    log = os.path.join(case.workdir, "eval.log")
    with open(log, "a") as f, contextlib.redirect_stdout(f):
        keys, tasks = meta["passkey_examples"], meta.get("tasks", [])
        evaluate_checkpoint(case.workdir, step=case.final_step, seq_lens=meta["lengths"],
                            num_batches=meta["num_batches"], tag=case.tag, overwrite=True,
                            rope_scaling=case.scaling, examples=keys or meta.get("examples"),
                            tasks=("loss", *(["passkey"] if keys else []), *tasks))  # fmt: skip


# ------------------------------------------------------------------------------ results


def _record(case: Case, tasks=()) -> dict:
    """The case's numbers per metric, keyed by length as the eval file (and the JSON) is."""
    with open(case.eval_path) as f:
        saved = json.load(f)
    lengths = sorted((k for k in saved if k.isdigit()), key=int)
    pick = lambda key: {n: saved[n][key] for n in lengths if key in saved[n]}  # noqa: E731
    return {"loss": pick("loss"), "digits": pick("passkey_digit_accuracy"),
            "passkey": pick("passkey_accuracy"), **{t: pick(t) for t in tasks}}  # fmt: skip


def metrics_of(result: dict) -> tuple[str, ...]:
    """The metrics of an experiment: METRICS, then its RULER tasks' scores."""
    return (*METRICS, *result.get("tasks", ()))


def collect(cases: list[Case], meta: dict) -> dict:
    """Every case's numbers, and per (row, rule, fine-tuned) mean and std over seeds."""
    runs, groups = [], {}
    for case in cases:
        rec = _record(case, meta.get("tasks", ()))
        runs.append({"row": case.row, "seed": case.seed, "rule": case.rule,
                     "finetuned": case.finetuned, **rec})  # fmt: skip
        groups.setdefault((case.row, case.rule, case.finetuned), []).append(rec)
    cells = []
    for (row, rule, finetuned), recs in groups.items():
        cell = {"row": row, "rule": rule, "finetuned": finetuned, "seeds": len(recs)}
        for metric in metrics_of(meta):
            per_length = {str(n): [r[metric][str(n)] for r in recs if str(n) in r[metric]]
                          for n in meta["lengths"]}  # fmt: skip
            cell[metric] = {n: _mean_std(v) for n, v in per_length.items() if v}
        cells.append(cell)
    workdirs = list(dict.fromkeys(case.workdir for case in cases))
    return {**meta, "runs": runs, "cells": cells, **report.provenance_of(workdirs)}


def collect_so_far(cases: list[Case], meta: dict) -> dict:
    """--report_only: `collect` of the cases evaluated so far, with "pending" (the others,
    as `row seed=.. rule=.. as trained`) and "planned" (how many cases in all)."""
    done = [_done(case, meta) for case in cases]
    if not any(done):
        raise plan.SweepError(f"none of the {len(cases)} cases is evaluated yet, so there "
                              "is nothing to write")  # fmt: skip
    pending = [f"{c.row} seed={c.seed} {_label(c)}" for c, d in zip(cases, done, strict=True)
               if not d]  # fmt: skip
    result = collect([c for c, d in zip(cases, done, strict=True) if d], meta)
    return {**result, "pending": pending, "planned": len(cases)}


def _mean_std(values: list[float]) -> list:
    return list(report.mean_std(values))  # std None with one seed: no spread to compare


def _cell(result: dict, row: str, rule: str, finetuned: bool) -> dict | None:
    return next((c for c in result["cells"] if (c["row"], c["rule"], c["finetuned"])
                 == (row, rule, finetuned)), None)  # fmt: skip


def _fmt(ms, digits: int = 3) -> str:
    if ms is None:
        return "-"
    mean, std = ms
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if std else "")


def render_markdown(result: dict, command: str = "") -> str:
    t, lengths = result["train_len"], result["lengths"]
    lines = ["# Context extension: scaling rules, with and without a short fine-tune", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    if result.get("code"):  # results from before runs recorded it have none
        lines += [f"Device: {result['device']}{report.provenance_line(result)}.", ""]
    s = result["settings"]
    lines += [
        f"Trained at T = {t} ({s.get('model.num_layers')} layers, D = {s.get('model.embed_dim')}, "
        f"{s.get('train.num_steps')} steps, {s.get('data.name')}, passkey rate "
        f"{result['sets'].get('data.passkey_rate')}, answer weight "
        f"{result['sets'].get('data.passkey_weight')}); evaluated at "
        f"{', '.join(map(str, lengths))} as trained and after {result['finetune_steps']} "
        f"fine-tuning steps at {result['finetune_len']} (lr {result['finetune_lr']}) under the "
        f"same rule. Scaling factor {result['factor']:g} from L0 = T. Loss: held-out "
        f"nats/token over {result['num_batches']} batches per length. "
        + (
            f"Passkey: {result['passkey_examples']} five-digit keys per length; the share of "
            "digits retrieved (chance 0.10) and, below, of whole keys (exact match). "
            if result.get("passkey_examples", 1)
            else ""
        )
        + f"Mean ± std over {result['seeds']} seed(s).",
        "",
    ]
    pending = result.get("pending") or []
    if pending:
        lines += [f"**Partial:** written while the experiment goes on, from "
                  f"{result['planned'] - len(pending)} of {result['planned']} cases evaluated; "
                  "a cell's mean is over the seeds it has so far (the seeds column), and the "
                  "cases not done are listed at the end.", ""]  # fmt: skip
    if result.get("passkey_examples", 1):
        lines += _table(result, ("loss", "digits"), ("loss", "passkey digits"))
        lines += ["", "Whole keys retrieved (exact match):", ""]
        lines += _table(result, ("passkey",), ("passkey",))
    else:  # no passkey asked: no empty columns
        lines += _table(result, ("loss",), ("loss",))
    for task in result.get("tasks", ()):
        lines += ["", f"RULER's `{task}` ({result['examples']} examples per length, greedy "
                  "answers, string_match_all):", ""]  # fmt: skip
        lines += _table(result, (task,), (task,))
    for task in result.get("tasks", ()):
        lines += _learned_section(result, task)
    lines += ["", "## The published claims at this scale", ""]
    lines += [f"- {v}" for v in verdicts(result)]
    if pending:
        lines += ["", f"Not done when this page was written ({len(pending)} cases; the same "
                  "command without --report_only trains and evaluates them):", ""]  # fmt: skip
        lines += [f"- {p}" for p in pending]
    return "\n".join(lines) + "\n"


def learned_seeds(result: dict, task: str, row: str) -> list[int]:
    """The seeds of `row` whose base run, as trained, scores >= LEARNED_AT on `task` at T:
    a small model learns retrieval suddenly or not at all, so a mean over seeds mixes
    runs that retrieve with runs that never did."""
    t = str(result["train_len"])
    return [r["seed"] for r in result["runs"]
            if (r["row"], r["rule"], r["finetuned"]) == (row, "none", False)
            and r[task].get(t, 0.0) >= LEARNED_AT]  # fmt: skip


def learned_cells(result: dict, task: str) -> list[dict]:
    """Per (row, rule, fine-tuned): `task`'s mean ± std at each length over the runs of
    `learned_seeds` only, and how many of the row's seeds those are."""
    out = []
    for c in result["cells"]:
        seeds = learned_seeds(result, task, c["row"])
        runs = [r for r in result["runs"] if (r["row"], r["rule"], r["finetuned"]) ==
                (c["row"], c["rule"], c["finetuned"]) and r["seed"] in seeds]  # fmt: skip
        scores = {}
        for n in map(str, result["lengths"]):
            values = [r[task].get(n) for r in runs]
            if values and None not in values:
                scores[n] = _mean_std(values)
        out.append({"row": c["row"], "rule": c["rule"], "finetuned": c["finetuned"],
                    "learned": len(seeds), "seeds": c["seeds"], task: scores})  # fmt: skip
    return out


def order_pairs(result: dict, task: str, length: int) -> dict[str, list[str]]:
    """Pairs of rows (as trained, no rule) as the held-out loss and `task`'s score at
    `length` order them, each told apart only by more than the seed noise (over every
    seed): {"alike": [...], "opposite": [...], "tied": [...]} of "a > b" (a the better by
    loss, or by score where the loss ties)."""
    cells = {c["row"]: c for c in result["cells"] if (c["rule"], c["finetuned"]) == ("none", False)}
    rows, out = list(cells), {"alike": [], "opposite": [], "tied": []}
    for i, a in enumerate(rows):
        for b in rows[i + 1 :]:
            by_loss = _compare(cells[a]["loss"].get(str(length)), cells[b]["loss"].get(str(length)))
            by_task = _compare(cells[a][task].get(str(length)), cells[b][task].get(str(length)))
            if "n/a" in (by_loss, by_task):
                continue
            a_better = by_loss == "lower" if by_loss != "tied" else by_task == "higher"
            pair = f"{a} > {b}" if a_better else f"{b} > {a}"
            if "tied" in (by_loss, by_task):
                out["tied"].append(pair)
            else:  # a lower loss is better, a higher score is better
                out["alike" if by_loss != by_task else "opposite"].append(pair)
    return out


def _learned_section(result: dict, task: str) -> list[str]:
    t, lengths, cells = result["train_len"], result["lengths"], learned_cells(result, task)
    counts = {c["row"]: (c["learned"], c["seeds"]) for c in cells
              if (c["rule"], c["finetuned"]) == ("none", False)}  # fmt: skip
    lines = ["", f"## `{task}` in the runs that learned it", "",
             f"A run has learned the task when its base model, as trained, scores >= "
             f"{LEARNED_AT} at T = {t}. Runs that learned it, per row: "
             + ", ".join(f"{row} {k} of {n}" for row, (k, n) in counts.items())
             + ". Mean ± std over those runs only (one run: no spread; none: -):", ""]  # fmt: skip
    head = [f"{task} @{n}" for n in lengths]
    lines += ["| row | rule | fine-tuned | runs | " + " | ".join(head) + " |",
              "|---|---|---|---|" + "---|" * len(head)]  # fmt: skip
    for c in cells:
        values = [_fmt(c[task].get(str(n)), 2) for n in lengths]
        tuned = "yes" if c["finetuned"] else "no"
        lines.append(f"| {c['row']} | {c['rule']} | {tuned} | {c['learned']} | "
                     + " | ".join(values) + " |")  # fmt: skip
    lines += ["", f"Pairs of rows as the held-out loss and `{task}` order them (as trained, no "
              "rule, every seed; a pair is ordered when the two means differ by more than the "
              "seed noise):", ""]  # fmt: skip
    for n in lengths:
        pairs = order_pairs(result, task, n)
        lines.append(f"- at {n}: ordered alike {', '.join(pairs['alike']) or 'none'}; "
                     f"oppositely (by loss first) {', '.join(pairs['opposite']) or 'none'}; "
                     f"{len(pairs['tied'])} pair(s) tied by one or both")  # fmt: skip
    return lines


def _table(result: dict, metrics, names) -> list[str]:
    """One row per cell; a partial page (`collect_so_far`) adds each cell's seeds."""
    lengths, partial = result["lengths"], bool(result.get("pending"))
    head = [*(["seeds"] if partial else []), *[f"{name} @{n}" for name in names for n in lengths]]
    lines = ["| row | rule | fine-tuned | " + " | ".join(head) + " |",
             "|---|---|---|" + "---|" * len(head)]  # fmt: skip
    for c in result["cells"]:
        values = [_fmt(c[m].get(str(n)), 3 if m == "loss" else 2) for m in metrics
                  for n in lengths]  # fmt: skip
        values = [f"{c['seeds']} of {result['seeds']}", *values] if partial else values
        tuned = "yes" if c["finetuned"] else "no"
        lines.append(f"| {c['row']} | {c['rule']} | {tuned} | " + " | ".join(values) + " |")
    return lines


def _gap(a, b) -> float:
    """Noise of the difference of two cells' means (std of each; 0 with one seed)."""
    return math.hypot(a[1] or 0.0, b[1] or 0.0)


def _compare(a, b) -> str:
    """'lower' / 'higher' when the means differ by more than the seed noise, else 'tied'."""
    if a is None or b is None:
        return "n/a"
    diff, noise = a[0] - b[0], _gap(a, b)
    return "tied" if abs(diff) <= noise else ("lower" if diff < 0 else "higher")


def verdicts(result: dict) -> list[str]:
    """Plain statements of the published claims this experiment can test, each 'holds',
    'does not hold' or 'not resolved' (the difference is within the spread over seeds)."""
    t, ft = result["train_len"], result["finetune_len"]
    out = []

    def loss(row, rule, finetuned, n):
        cell = _cell(result, row, rule, finetuned)
        return None if cell is None else cell["loss"].get(str(n))

    def key(row, rule, finetuned, n):
        cell = _cell(result, row, rule, finetuned)
        return None if cell is None else cell["digits"].get(str(n))

    def claim(text, a, b, want):
        got = _compare(a, b)
        if got == "n/a":
            return
        verdict = "holds" if got == want else ("not resolved" if got == "tied" else "does not hold")
        seeds = "" if a[1] is not None and b[1] is not None else "; one seed, no noise estimate"
        out.append(f"{text}: **{verdict}** ({_fmt(a)} vs {_fmt(b)}{seeds}).")

    claim(f"RoPE does not extrapolate: qk's loss at 2T = {2 * t} is above its loss at T",
          loss("qk", "none", False, 2 * t), loss("qk", "none", False, t), "higher")  # fmt: skip
    claim(f"Dynamic NTK extends context without training: qk loss at 4T = {4 * t} below no "
          "scaling", loss("qk", "dynamic", False, 4 * t), loss("qk", "none", False, 4 * t),
          "lower")  # fmt: skip
    claim(f"YaRN beats position interpolation without fine-tuning (qk loss at 4T = {4 * t})",
          loss("qk", "yarn", False, 4 * t), loss("qk", "linear", False, 4 * t),
          "lower")  # fmt: skip
    claim(f"Position interpolation needs fine-tuning, then works: qk linear loss at {ft} after "
          "fine-tuning below as trained", loss("qk", "linear", True, ft),
          loss("qk", "linear", False, ft), "lower")  # fmt: skip
    claim(f"Interpolation beats plain fine-tuning at the new length: qk linear vs none at {ft}, "
          "both fine-tuned", loss("qk", "linear", True, ft), loss("qk", "none", True, ft),
          "lower")  # fmt: skip
    claim(f"YaRN extrapolates past its fine-tuning length: qk loss at {2 * ft}, yarn vs linear, "
          "both fine-tuned", loss("qk", "yarn", True, 2 * ft), loss("qk", "linear", True, 2 * ft),
          "lower")  # fmt: skip
    claim(f"NoPE length-generalises better than RoPE: loss at 4T = {4 * t}, nope vs qk, as "
          "trained", loss("nope", "none", False, 4 * t), loss("qk", "none", False, 4 * t),
          "lower")  # fmt: skip
    claim(f"VO-RoPE extrapolates better than RoPE: loss at 4T = {4 * t}, vo vs qk, as trained",
          loss("vo", "none", False, 4 * t), loss("qk", "none", False, 4 * t), "lower")  # fmt: skip
    for rule in ("linear", "yarn"):
        claim(f"After fine-tuning at {ft} with {rule}, passkey digits at {ft} beat the model "
              "as trained", key("qk", rule, True, ft), key("qk", rule, False, ft),
              "higher")  # fmt: skip
    return out


def plot(result: dict, path: str) -> None:
    """Loss and passkey accuracy (without passkey examples: the first RULER task's score
    in the runs that learned it, `learned_cells`) against length: qk under every rule, the
    other rows as trained (`none`); left as trained, right fine-tuned."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    lengths, tasks = result["lengths"], result.get("tasks") or ()
    retrieval = tasks[0] if tasks and not result.get("passkey_examples") else "digits"
    learned = (
        {}
        if retrieval == "digits"
        else {(c["row"], c["rule"], c["finetuned"]): c for c in learned_cells(result, retrieval)}
    )
    lines = [("qk", r) for r in result["rules"]] + [
        (row, "none") for row in result["rows"] if row != "qk"]  # fmt: skip
    for col, finetuned in enumerate((False, True)):
        for row_i, metric in enumerate(("loss", retrieval)):
            ax = axes[row_i][col]
            for row, rule in lines:
                cell = learned.get((row, rule, finetuned)) if metric == retrieval else None
                cell = cell or _cell(result, row, rule, finetuned)
                if cell is None or not cell[metric]:
                    continue
                xs = [n for n in lengths if str(n) in cell[metric]]
                ys = [cell[metric][str(n)][0] for n in xs]
                err = [cell[metric][str(n)][1] or 0.0 for n in xs]  # one seed: no bar
                style = "-" if row == "qk" else "--"
                ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, linestyle=style,
                            label=f"{row} {rule}")  # fmt: skip
            ax.set_xscale("log", base=2)
            ax.set_xticks(lengths, [str(n) for n in lengths])
            ax.axvline(result["train_len"], color="grey", lw=0.8)
            if metric == "digits":
                ax.axhline(0.1, color="black", lw=0.6, ls=":")  # chance
            if finetuned:
                ax.axvline(result["finetune_len"], color="grey", lw=0.8, ls=":")
            what = {"loss": "held-out loss (nats/token)", "digits": "passkey digits right"}.get(
                metric, f"{metric}, runs that learned it"
            )
            when = f"fine-tuned at {result['finetune_len']}" if finetuned else "as trained"
            ax.set_title(f"{what}, {when}")
            ax.set_xlabel("evaluation length")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    report.save_figure(fig, path, 110)


def write_results(result: dict, out: str, command: str) -> None:
    report.write_page(out, {**result, "command": command}, render_markdown(result, command))
    plot(result, out + ".png")


def main(argv=None) -> int:
    signals.release_signals()  # one that came while the modules imported: stops it here
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command = shlex.join(["python", "-m", "rope_jax.experiments.context_extension",
                          *[a for a in argv if a != "--report_only"]])  # fmt: skip
    try:
        if args.out:
            report.check_out(args.out)  # before hours of runs
        cases, meta = make_plan(args)
        print(f"{len(cases)} cells ({len(meta['rows'])} rows x rules x {args.seeds} seed(s), "
              f"as trained and fine-tuned); lengths {meta['lengths']}", flush=True)  # fmt: skip
        if args.report_only:
            result = collect_so_far(cases, meta)
        else:
            run_all(cases, meta, args.workdir)
            result = collect(cases, meta)
    except (plan.SweepError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        return signals.interrupted(e, "the same command resumes")
    if args.out:
        write_results(result, args.out, command)
        print(f"wrote {args.out}.md, .json, .png")
    else:
        print(render_markdown(result, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
