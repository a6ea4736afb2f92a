r"""The retrofit experiment: a model trained with rotation sites qk, continued as another row.

Two sweeps of `rope_jax.experiments.sweep` make it. From scratch, every row for the full
schedule; then each row again, starting from the scratch `qk` run of the same seed
(`train.init_from`, a fresh optimiser and schedule) for a fraction of the steps:

  python -m rope_jax.experiments.sweep --config=configs/lm.py:size=tiny --seeds=2 \
      --rows=qk,vo,qkvo,tied_qkvo --workdir=runs/retrofit/scratch --results=runs/retrofit/scratch
  python -m rope_jax.experiments.sweep --config=configs/lm.py:size=tiny --seeds=2 \
      --rows=qk,vo,qkvo,tied_qkvo --workdir=runs/retrofit/from_qk --results=runs/retrofit/from_qk \
      --set train.init_from=runs/retrofit/scratch/qk/seed_{seed} \
      --set train.num_steps=250,train.eval_every_steps=25
  python -m rope_jax.experiments.retrofit --scratch=runs/retrofit/scratch.json \
      --retrofit=runs/retrofit/from_qk.json --out=results/research/retrofit

Rotation sites carry no parameters, so a qk model's weights load whole into vo or qkvo;
tied K/V replaces the key and value projections by one latent projection, which starts
fresh (the rest loads). The continued `qk` row is the control: what the extra steps
alone give. Per row, at every evaluation of the continued run: the gap to the same row
trained from scratch (mean over seeds, with the combined seed std as its noise), and the
first step at which the continued run is within that noise of (or below) scratch.
Writes <out>.md, <out>.png and <out>.json.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

from rope_jax import signals
from rope_jax.experiments.report import (
    check_out,
    load_results,
    mean_std,
    no_run_word,
    save_figure,
    write_page,
)


def _final(report: dict, row: str) -> list[float]:
    t = report["seq_lens"][0]
    return [run["loss"][t] for run in report["rows"][row]["runs"]]


def _curve(report: dict, row: str) -> dict[int, list[float]]:
    """step -> the runs' held-out losses at that evaluation."""
    out: dict[int, list[float]] = {}
    for run in report["rows"][row]["runs"]:
        for step, loss in run["eval_curve"]:
            out.setdefault(int(step), []).append(float(loss))
    return dict(sorted(out.items()))


def _noise(a, b) -> float | None:
    return None if a is None or b is None else math.hypot(a, b)


def _failed(scratch: dict, retrofit: dict, row: str) -> bool:
    """Whether either sweep has a failed run of `row` (else it is not finished yet)."""
    return any(no_run_word(sweep["rows"][row]) == "failed" for sweep in (scratch, retrofit))


def analyse(scratch: dict, retrofit: dict) -> dict:
    """Per row: scratch loss, the continued run's curve, its gap and when it closes."""
    both = [r for r in retrofit["rows"] if r in scratch["rows"]]
    rows = [r for r in both if scratch["rows"][r]["runs"] and retrofit["rows"][r]["runs"]]
    qk = scratch["rows"].get("qk", {}).get("runs")
    base = mean_std(_final(scratch, "qk")) if qk else None
    out = {"base_qk": base, "steps_scratch": scratch["settings"].get("train.num_steps"),
           "steps_retrofit": retrofit["settings"].get("train.num_steps"), "rows": {},
           "failed": [r for r in both if r not in rows and _failed(scratch, retrofit, r)],
           "not_finished": [r for r in both if r not in rows
                            and not _failed(scratch, retrofit, r)]}  # fmt: skip
    for row in rows:
        s_mean, s_std = mean_std(_final(scratch, row))
        curve = []
        for step, losses in _curve(retrofit, row).items():
            r_mean, r_std = mean_std(losses)
            noise = _noise(r_std, s_std)
            gap = r_mean - s_mean
            curve.append({"step": step, "loss": r_mean, "std": r_std, "gap": gap, "noise": noise,
                          "closed": gap <= (noise or 0.0)})  # fmt: skip
        first = next((c["step"] for c in curve if c["closed"]), None)
        out["rows"][row] = {"scratch": [s_mean, s_std], "curve": curve, "closed_at": first,
                            "seeds": len(retrofit["rows"][row]["runs"])}  # fmt: skip
    control = out["rows"].get("qk")  # the same extra steps without a switch
    for r in out["rows"].values():
        if control:
            a, b = r["curve"][-1], control["curve"][-1]
            r["vs_control"] = [a["loss"] - b["loss"], _noise(a["std"], b["std"])]
    return out


def _pm(mean, std) -> str:
    return f"{mean:.3f}" + ("" if std is None else f" ± {std:.3f}")


def _vs(pair) -> str:
    if not pair:
        return "—"
    gap, noise = pair
    return f"{gap:+.3f}" + ("" if noise is None else f" (noise {noise:.3f})")


def render(result: dict, command: str) -> str:
    rows = result["rows"]
    steps = sorted({c["step"] for r in rows.values() for c in r["curve"]})
    shown = [s for s in steps if s in (steps[0], steps[len(steps) // 4], steps[len(steps) // 2],
                                       steps[-1])]  # fmt: skip
    base = result["base_qk"]
    out = ["# Retrofit: a qk model continued as another rotation-site row", "",
           f"Command: `{command}`", "",
           f"From scratch: {result['steps_scratch']} steps per row. Continued: from the "
           f"scratch qk run of the same seed, {result['steps_retrofit']} more steps as the "
           "row (fresh optimiser and schedule). Held-out loss (nats/token) at T, mean ± std "
           "over seeds; gap = continued - scratch of the same row; 'closed' = the gap is at "
           "most the combined seed std (or negative). The continued qk row is the control: "
           "the extra steps alone, so the last column compares each switch with no switch "
           "at equal training."
           + ("" if base is None else f" The qk base itself: {_pm(*base)}."), "",
           "| row | scratch | " + " | ".join(f"continued @{s}" for s in shown)
           + " | gap at the end | closed at step | end - continued qk |",
           "|---|---|" + "---|" * len(shown) + "---|---|---|"]  # fmt: skip
    for row, r in rows.items():
        by_step = {c["step"]: c for c in r["curve"]}
        last = r["curve"][-1]
        noise = "" if last["noise"] is None else f" (noise {last['noise']:.3f})"
        out.append(f"| {row} | {_pm(*r['scratch'])} | "
                   + " | ".join(_pm(by_step[s]["loss"], by_step[s]["std"]) for s in shown)
                   + f" | {last['gap']:+.3f}{noise} | "
                   + f"{r['closed_at'] or 'not within the run'} | "
                   + f"{_vs(r.get('vs_control'))} |")  # fmt: skip
    missing = [(r, "failed") for r in result.get("failed", [])]  # no finished run in one
    missing += [(r, "not finished") for r in result.get("not_finished", [])]  # of the sweeps
    for row, word in missing:
        out.append(f"| {row} | " + " | ".join([word] * (len(shown) + 4)) + " |")
    return "\n".join(out) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    colours = plt.get_cmap("tab10")
    for i, (row, r) in enumerate(result["rows"].items()):
        steps = [c["step"] for c in r["curve"]]
        loss = np.array([c["loss"] for c in r["curve"]])
        std = np.array([c["std"] or 0.0 for c in r["curve"]])
        ax.plot(steps, loss, color=colours(i), label=f"{row} continued from qk")
        ax.fill_between(steps, loss - std, loss + std, color=colours(i), alpha=0.15)
        ax.axhline(r["scratch"][0], color=colours(i), ls="--", lw=1, label=f"{row} from scratch")
    ax.set_xlabel("steps after the switch")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    save_figure(fig, path, 120)


def main(argv=None) -> None:
    signals.release_signals()  # one that came while the modules imported: stops it here
    p = argparse.ArgumentParser(prog="python -m rope_jax.experiments.retrofit",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--scratch", required=True, help="the from-scratch sweep's results .json")
    p.add_argument("--retrofit", required=True, help="the continued sweep's results .json")
    p.add_argument("--out", required=True, help="output prefix: <out>.md, .png, .json")
    args = p.parse_args(argv)
    try:
        scratch, retrofit = (load_results(path, flag) for path, flag in (
            (args.scratch, "--scratch"), (args.retrofit, "--retrofit")))  # fmt: skip
        if os.path.realpath(args.scratch) == os.path.realpath(args.retrofit):
            raise ValueError(f"--retrofit={args.retrofit} is the --scratch sweep: give the "
                             "sweep continued from its qk runs")  # fmt: skip
        check_out(args.out)
    except ValueError as e:
        sys.exit(f"error: {e} (the sweeps are in this module's doc)")
    result = analyse(scratch, retrofit)
    if not result["rows"]:
        sys.exit("retrofit: the two sweeps share no row")
    command = "python -m rope_jax.experiments.retrofit " + " ".join(argv or sys.argv[1:])
    write_page(args.out, result, render(result, command))
    plot(result, args.out + ".png")
    print(f"wrote {args.out}.md, {args.out}.png, {args.out}.json")


if __name__ == "__main__":
    main()
