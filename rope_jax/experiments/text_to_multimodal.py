r"""From a text model to a multimodal one: does a layout let a pretrained text LM take images?

  python -m rope_jax.experiments.text_to_multimodal --workdir=runs/text_to_mm \
      --out=results/research/text_to_multimodal [--rows=flat,rope_tv] [--seeds=2] [--layers=4]

A layout whose text positions and image spans match a text model's 1-D positions (every
layout here places text at t on every axis) should let the text model's weights serve
interleaved image data without relearning positions. Per seed k:
  text/seed_k                  the text LM: configs/lm.py (Shakespeare bytes), --layers
                               layers, --text_steps steps.
  <row>/{scratch,text}/seed_k  the digit-grid tasks (configs/multimodal.py:row=<row>,
                               --layers layers, --steps steps) from a fresh initialisation
                               and from the text LM (`train.init_from`).
Each multimodal run is scored (answer accuracy, exact match) on held-out digits and the
three generalisation splits; its validation accuracy curve gives the first step at
which it reaches --target; and its parameters are scored back on held-out Shakespeare
(nats/token at the text LM's length) to show how much of the text model each keeps.
Training runs in subprocesses and resumes; finished runs are skipped. Writes
<out>.json, <out>.md and <out>.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

import jax

from rope_jax import data, sharding, signals
from rope_jax.experiments import launch, plan, report
from rope_jax.harness import checks, console, runfiles, setup, transfer
from rope_jax.harness import workdir as workdir_lib
from rope_jax.harness.evaluate import evaluate_checkpoint

ROOT = plan.ROOT
LAYOUTS = ("nope", "flat", "mrope", "rope_tie", "rope_tie_frac", "rope_tv")
INITS = ("scratch", "text")


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rope_jax.experiments.text_to_multimodal",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--workdir", required=True)
    p.add_argument("--out", default="", help="results path without extension")
    p.add_argument("--rows", default=",".join(LAYOUTS))
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--text_steps", type=int, default=1000)
    p.add_argument("--steps", type=int, default=600, help="multimodal training steps")
    p.add_argument("--eval_every", type=int, default=50, help="validation curve spacing")
    p.add_argument("--target", type=float, default=0.3, help="validation accuracy to reach")
    p.add_argument("--text_batches", type=int, default=20, help="Shakespeare eval batches")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra overrides of every run (text and multimodal)")  # fmt: skip
    return p.parse_args(argv)


def make_plan(args) -> dict:
    """{"text": [(workdir, flags, steps)], "runs": [(row, init, seed, workdir, flags, steps)]}."""
    rows = plan.pick(args.rows, LAYOUTS, "--rows")
    for name in ("seeds", "layers", "text_steps", "steps", "eval_every", "text_batches"):
        if getattr(args, name) < 1:
            raise plan.SweepError(f"--{name}={getattr(args, name)} must be >= 1")
    if not 0 < args.target <= 1:
        raise plan.SweepError(f"--target={args.target} must lie in (0, 1]")
    sets = [f"--config.{k}={v}" for k, v in plan.split_sets(args.set)]
    text_config = os.path.join(ROOT, "configs", "lm.py") + ":size=tiny"
    mm_config = os.path.join(ROOT, "configs", "multimodal.py") + ":size=tiny,row={}"
    _check(text_config, args, sets, rows, mm_config)
    root = os.path.abspath(args.workdir)
    out = {"text": [], "runs": []}
    for seed in range(args.seeds):
        text_dir = os.path.join(root, "text", f"seed_{seed}")
        out["text"].append((text_dir, (
            f"--config={text_config}", f"--workdir={text_dir}", f"--config.seed={seed}",
            f"--config.model.num_layers={args.layers}",
            f"--config.train.num_steps={args.text_steps}", *sets), args.text_steps))  # fmt: skip
        for row in rows:
            for init in INITS:
                workdir = os.path.join(root, row, init, f"seed_{seed}")
                flags = (f"--config={mm_config.format(row)}", f"--workdir={workdir}",
                         f"--config.seed={seed}", f"--config.model.num_layers={args.layers}",
                         f"--config.train.num_steps={args.steps}",
                         f"--config.train.eval_every_steps={args.eval_every}",
                         f"--config.train.ckpt_every_steps={args.steps}",
                         *([f"--config.train.init_from={text_dir}"] if init == "text" else []),
                         *sets)  # fmt: skip
                out["runs"].append((row, init, seed, workdir, flags, args.steps))
    return out


def _check(text_config: str, args, sets, rows, mm_config: str) -> None:
    """Builds every config the plan will run and checks it (one line on a bad value)."""
    from ml_collections import config_flags  # noqa: F401 (the flag syntax the runs use)

    for path in [text_config, *(mm_config.format(r) for r in rows)]:
        file, _, arg = path.partition(":")
        _, config, _ = plan.load_rows(file, arg)
        overrides = {"model.num_layers": args.layers, **{
            k: plan.parse_value(v, plan.leaves(config).get(k), plan.field_types(config).get(k))
            for k, v in plan.split_sets(args.set)}}  # fmt: skip
        plan.apply(config, overrides, "--set")
        try:
            checks.resolve(config)
        except ValueError as e:
            raise plan.SweepError(f"{os.path.basename(file)}:{arg}: {e}") from None


def run_all(todo: dict, args) -> None:
    env = dict(os.environ, **launch.cache_env(args.workdir))
    os.environ.update(launch.cache_env(args.workdir))
    jobs = [("text", "-", seed, *t) for seed, t in enumerate(todo["text"])] + todo["runs"]
    for k, (row, init, seed, workdir, flags, steps) in enumerate(jobs, 1):
        label = f"[{k}/{len(jobs)}] {row} {init} seed={seed}"
        done = _evaluated(workdir, steps, row)
        print(f"{label}  {'done, skipped' if done else workdir}", flush=True)
        if done:
            continue
        launch.train_until(workdir, flags, steps, env, label)
        if row != "text":
            _evaluate(workdir, steps, todo["text"][seed][0], args.text_batches)
        print(f"    {_summary(workdir, steps, row)}", flush=True)


def _evaluated(workdir: str, step: int, row: str) -> bool:
    if row == "text":
        return launch.latest_checkpoint(workdir) == step
    return os.path.exists(os.path.join(workdir, f"eval_{step}_text.json")) and os.path.exists(
        os.path.join(workdir, f"eval_{step}.json"))  # fmt: skip


def _evaluate(workdir: str, step: int, text_dir: str, text_batches: int) -> None:
    """Held-out splits (eval_<step>.json), then held-out Shakespeare with the text LM's
    config and these parameters (eval_<step>_text.json)."""
    with console.into_log(os.path.join(workdir, "eval.log")):
        evaluate_checkpoint(workdir, step=step, overwrite=True)
        result = text_loss(workdir, step, text_dir, text_batches)
    workdir_lib.write_atomic(os.path.join(workdir, f"eval_{step}_text.json"), json.dumps(result))


def text_loss(workdir: str, step: int, text_dir: str, num_batches: int) -> dict:
    """Held-out Shakespeare metrics of the multimodal run's parameters, placed into the
    text LM's model (the patch embedding has no place there; rotations have no weights)."""
    config = runfiles.load_config(text_dir)
    run = setup.build(config)
    with sharding.use_mesh(run.mesh, run.rules):
        fresh = jax.jit(run.init_fn, out_shardings=run.shardings)()
    _, source = transfer.source_params(f"{workdir}:{step}")
    params, loaded, kept = transfer.merge(fresh["params"], source)
    if kept:
        raise plan.SweepError(f"{workdir}: the text model's {', '.join(kept)} not in the run")
    data.ensure_built(config.data)
    out = setup.evaluate(run, params, config, split=config.data.eval_split,
                         num_batches=num_batches)  # fmt: skip
    return {"step": step, "split": config.data.eval_split, **out}


def _summary(workdir: str, step: int, row: str) -> str:
    if row == "text":
        return "text LM trained"
    rec = _record(workdir, step)
    accs = ", ".join(f"{s} {rec['accuracy'][s]:.3f}" for s in rec["accuracy"])
    return f"answer accuracy {accs}; Shakespeare loss {rec['text_loss']:.3f}"


def _record(workdir: str, step: int) -> dict:
    with open(os.path.join(workdir, f"eval_{step}.json")) as f:
        saved = json.load(f)
    with open(os.path.join(workdir, f"eval_{step}_text.json")) as f:
        text = json.load(f)
    splits = saved["settings"]["splits"]
    curve = []
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            m = json.loads(line)
            if "eval/answer_accuracy" in m:
                curve.append((m["step"], m["eval/answer_accuracy"]))
    return {"accuracy": {s: saved[s]["answer_accuracy"] for s in splits},
            "curve": curve, "text_loss": text["loss"]}  # fmt: skip


def first_step(curve, target: float) -> int | None:
    """The first evaluated step whose validation accuracy reaches `target` (None: never)."""
    return next((step for step, acc in curve if acc >= target), None)


def collect(todo: dict, args) -> dict:
    runs = []
    for row, init, seed, workdir, _, steps in todo["runs"]:
        rec = _record(workdir, steps)
        runs.append({"row": row, "init": init, "seed": seed, **rec,
                     "steps_to_target": first_step(rec["curve"], args.target)})  # fmt: skip
    text = []
    for text_dir, _, _ in todo["text"]:
        with open(os.path.join(text_dir, "metrics.jsonl")) as f:
            evals = [json.loads(line) for line in f if '"eval/loss"' in line]
        text.append(evals[-1]["eval/loss"])
    splits = list(runs[0]["accuracy"]) if runs else []
    cells = []
    for row in dict.fromkeys(r["row"] for r in runs):
        for init in INITS:
            group = [r for r in runs if (r["row"], r["init"]) == (row, init)]
            reached = [r["steps_to_target"] for r in group]
            cells.append({
                "row": row, "init": init, "seeds": len(group),
                "accuracy": {s: report.mean_std([r["accuracy"][s] for r in group]) for s in splits},
                "text_loss": report.mean_std([r["text_loss"] for r in group]),
                "steps_to_target": reached,
            })  # fmt: skip
    workdirs = [t[0] for t in todo["text"]] + [r[3] for r in todo["runs"]]
    return {"target": args.target, "layers": args.layers, "text_steps": args.text_steps,
            "steps": args.steps, "eval_every": args.eval_every, "splits": splits,
            "text_lm_loss": report.mean_std(text), "runs": runs, "cells": cells,
            **report.provenance_of(workdirs)}  # fmt: skip


def _pm(ms, fmt="{:.3f}") -> str:
    mean, std = ms
    return fmt.format(mean) + ("" if std is None else " ± " + fmt.format(std))


def _reached(steps: list) -> str:
    return ", ".join("never" if s is None else str(s) for s in steps)


def render_markdown(result: dict, command: str = "") -> str:
    splits = result["splits"]
    lines = ["# From a text model to a multimodal one", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    if result.get("code"):  # results from before runs recorded it have none
        lines += [f"Device: {result['device']}{report.provenance_line(result)}.", ""]
    lines += [
        f"A {result['layers']}-layer text LM trained {result['text_steps']} steps on Shakespeare "
        f"bytes (held-out loss {_pm(result['text_lm_loss'])} nats/token) starts the digit-grid "
        f"tasks (`text`) under each layout, against the same from a fresh initialisation "
        f"(`scratch`), {result['steps']} steps each. Answer accuracy (exact match) per held-out "
        f"split; the step at which validation accuracy first reaches {result['target']} "
        f"(evaluated every {result['eval_every']} steps, one entry per seed); and the held-out "
        "Shakespeare loss of the final parameters in the text model. Mean ± std over seeds.",
        "",
        "| layout | init | "
        + " | ".join(f"{s} acc" for s in splits)
        + f" | steps to {result['target']} | Shakespeare loss |",
        "|---|---|" + "---|" * (len(splits) + 2),
    ]
    for c in result["cells"]:
        accs = [_pm(c["accuracy"][s]) for s in splits]
        tail = f" | {_reached(c['steps_to_target'])} | {_pm(c['text_loss'])} |"
        lines.append(f"| {c['row']} | {c['init']} | " + " | ".join(accs) + tail)
    lines += ["", "## Reading", ""] + [f"- {line}" for line in reading(result)]
    return "\n".join(lines) + "\n"


def _gain(result: dict, row: str, split: str):
    cells = {c["init"]: c for c in result["cells"] if c["row"] == row}
    if set(cells) != set(INITS):
        return None
    (a, sa), (b, sb) = cells["text"]["accuracy"][split], cells["scratch"]["accuracy"][split]
    noise = ((sa or 0) ** 2 + (sb or 0) ** 2) ** 0.5
    return a - b, noise, sa is not None and sb is not None


def reading(result: dict) -> list[str]:
    """Per layout: the test-accuracy gain of starting from text, resolved or not."""
    out = []
    for row in dict.fromkeys(c["row"] for c in result["cells"]):
        got = _gain(result, row, "test")
        if got is None:
            continue
        gain, noise, seeds = got
        if not seeds:
            verdict = "one seed, no noise estimate"
        else:
            verdict = "resolved" if abs(gain) > noise else "within seed noise"
        out.append(f"{row}: starting from the text LM changes test accuracy by {gain:+.3f} "
                   f"({verdict}).")  # fmt: skip
    return out


def _cell(result: dict, row: str, init: str) -> dict:
    return next(c for c in result["cells"] if (c["row"], c["init"]) == (row, init))


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, kept) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = list(dict.fromkeys(c["row"] for c in result["cells"]))
    colours = report.row_colours(len(rows))
    for i, row in enumerate(rows):
        for init, style in (("scratch", "--"), ("text", "-")):
            runs = [r for r in result["runs"] if (r["row"], r["init"]) == (row, init)]
            if not runs:
                continue
            steps = [s for s, _ in runs[0]["curve"]]
            mean = [sum(r["curve"][j][1] for r in runs) / len(runs) for j in range(len(steps))]
            curves.plot(steps, mean, style, color=colours[i], label=f"{row} {init}")
    curves.axhline(result["target"], color="grey", lw=0.8)
    curves.set(xlabel="step", ylabel="validation answer accuracy",
               title="digit-grid tasks: from text (solid) vs scratch (dashed)")  # fmt: skip
    curves.legend(fontsize=7, ncol=2)
    width = 0.4
    for j, init in enumerate(INITS):
        cells = [_cell(result, r, init) for r in rows]
        kept.bar([i + (j - 0.5) * width for i in range(len(rows))],
                 [c["text_loss"][0] for c in cells], width, label=init)  # fmt: skip
    kept.axhline(result["text_lm_loss"][0], color="black", lw=0.8, label="text LM")
    kept.set_xticks(range(len(rows)), rows, rotation=30)
    kept.set(ylabel="held-out Shakespeare loss (nats/token)", title="text kept after the tasks")
    kept.legend(fontsize=8)
    fig.tight_layout()
    report.save_figure(fig, path, 110)


def main(argv=None) -> int:
    signals.release_signals()  # one that came while the modules imported: stops it here
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command = shlex.join(["python", "-m", "rope_jax.experiments.text_to_multimodal", *argv])
    try:
        if args.out:
            report.check_out(args.out)  # before hours of runs
        todo = make_plan(args)
        run_all(todo, args)
        result = collect(todo, args)
    except (plan.SweepError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        return signals.interrupted(e, "the same command resumes")
    if args.out:
        report.write_page(args.out, {**result, "command": command},
                          render_markdown(result, command))  # fmt: skip
        plot(result, args.out + ".png")
        print(f"wrote {args.out}.md, .json, .png")
    else:
        print(render_markdown(result, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
