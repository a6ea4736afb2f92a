r"""Several sweeps side by side: how the rows' order moves with depth, context and size.

  python -m rope_jax.experiments.ladder \
      --sweeps=results/research/vo_rope_ablation.json,results/research/vo_rope_ladder_L4_T128.json \
      --rows=nope,q,k,v,o,qk,vo,qkv,qkvo --out=results/research/vo_rope_scaling

Each sweep (a `<results>.json` written by `rope_jax.experiments.sweep`) is one rung of
the ladder. Per rung: Kendall tau of our order at the training length T against the
reference table (the config's ARTICLE_LOSS), with a 95% bootstrap interval over seeds
(each row's seeds resampled with replacement, the row mean recomputed, tau again; none
for a rung with one seed per row, which has no measure of the seed noise),
NoPE's rank, every row's loss at T, 2T and 4T as mean ± std over seeds, and its growth
from T to 4T. Writes
<out>.md, <out>.png and <out>.json.
"""

from __future__ import annotations

import argparse
import re
import sys

import numpy as np

from rope_jax import signals
from rope_jax.experiments.plan import repeated
from rope_jax.experiments.report import (
    check_out,
    kendall,
    load_results,
    mean_std,
    plus_minus,
    ranks,
    save_figure,
    write_page,
)


def label(report: dict) -> str:
    """A rung's name from its settings: layers, width, context, tokens per run (steps
    where the batch is not recorded), corpus and tokenizer."""
    s = report["settings"]
    steps, t = s.get("train.num_steps"), s.get("data.seq_len")
    batch = s.get("data.global_batch_size")
    n = steps * batch * t if steps and batch and t else None
    size = f"{steps} steps" if n is None else f"{n / 1e6:.1f}M tok" if n >= 1e5 else f"{n} tok"
    return " ".join(x for x in (f"L{s.get('model.num_layers')} D{s.get('model.embed_dim')} T{t}",
                                size, s.get("data.name", ""), tokenizer(report)) if x)  # fmt: skip


def tokenizer(report: dict) -> str:
    """'BPE n' for a rung trained on n subword ids (set by data.tokenizer, or the one its
    runs recorded, as a prepared corpus's); '' for bytes."""
    tok = report["settings"].get("data.tokenizer", "")
    if tok:
        return tok.replace("train:", "BPE ")
    runs = [run for row in report["rows"].values() for run in row["runs"]]
    names = {run.get("tokenizer", "bytes") for run in runs}
    match = re.fullmatch(r"bpe(\d+)-\w+", names.pop()) if len(names) == 1 else None
    return f"BPE {match.group(1)}" if match else ""


def seed_losses(report: dict, rows, length: str) -> dict[str, list[float]]:
    """row -> its runs' held-out losses at `length` (one per seed)."""
    return {r: [run["loss"][length] for run in report["rows"][r]["runs"]] for r in rows}


def bootstrap_tau(losses: dict, reference: dict, *, draws: int = 2000, seed: int = 0):
    """(tau, low, high): tau of the seed means, and the 2.5/97.5 percentiles of tau over
    bootstrap resamples of each row's seeds. A row with one seed says nothing of the seed
    noise (its resamples are all the same): then no interval (None, None)."""
    rng = np.random.default_rng(seed)
    tau = kendall({r: np.mean(v) for r, v in losses.items()}, reference)[0]
    if any(len(v) < 2 for v in losses.values()):
        return tau, None, None
    taus = []
    for _ in range(draws):
        means = {r: float(np.mean(rng.choice(v, size=len(v)))) for r, v in losses.items()}
        taus.append(kendall(means, reference)[0])
    taus = [t for t in taus if t is not None]
    low, high = np.percentile(taus, [2.5, 97.5]) if taus else (None, None)
    return tau, None if low is None else float(low), None if high is None else float(high)


def rung(report: dict, rows) -> dict:
    """One rung's numbers: tau with its interval, ranks, NoPE's rank, mean ± std per length,
    over each row's finished seeds. A row with no finished run is in `failed` (with its
    failed seeds: none for a row not finished yet), out of the order and the numbers."""
    failed = {r: [f["seed"] for f in report["rows"][r].get("failed", [])]
              for r in rows if r in report["rows"] and not report["rows"][r]["runs"]}  # fmt: skip
    rows = [r for r in rows if r in report["rows"] and r not in failed]
    if len(rows) < 2:  # one row has no order, no tau
        raise ValueError(f"holds {len(rows)} of the rows compared (--rows) with a finished "
                         "run: a rung orders two or more")  # fmt: skip
    t = report["seq_lens"][0]
    reference = {r: v for r, v in (report.get("article_loss") or {}).items() if r in rows}
    reference_all = report.get("article_loss") or {}  # failed rows keep their reference rank
    at_t = seed_losses(report, rows, t)
    tau, low, high = bootstrap_tau(at_t, reference)
    order = ranks({r: float(np.mean(v)) for r, v in at_t.items()})
    stats = {length: {r: mean_std(v) for r, v in seed_losses(report, rows, length).items()}
             for length in report["seq_lens"]}  # fmt: skip
    longest = report["seq_lens"][-1]
    at_longest = seed_losses(report, rows, longest)
    growth = (
        {r: mean_std(np.subtract(at_longest[r], at_t[r])) for r in rows} if longest != t else {}
    )
    bpb = {}  # bits/byte at T, for rungs whose runs recorded it (any tokenizer compares)
    for r in rows:
        values = [run.get("bits_per_byte", {}).get(t) for run in report["rows"][r]["runs"]]
        bpb[r] = mean_std(values) if values and all(values) else None
    return {"label": label(report), "command": report.get("command", ""), "rows": rows,
            "device": report.get("device"),
            "seeds": len(report["seeds"]), "fewest_seeds": min(map(len, at_t.values())),
            "seq_lens": report["seq_lens"], "tau": tau,
            "tau_p": kendall({r: np.mean(v) for r, v in at_t.items()}, reference)[1],
            "tau_ci": [low, high], "ranks": order, "nope_rank": order.get("nope"),
            "reference_ranks": ranks({r: v for r, v in reference_all.items()
                                      if r in rows or r in failed}),
            "stats": stats, "bits_per_byte": bpb,
            "growth": growth, "failed": failed,
            "failed_runs": sum(len(report["rows"][r].get("failed", [])) for r in report["rows"])
            }  # fmt: skip


def _rung(path: str, report: dict, rows) -> dict:
    """`rung` of the sweep `report` (read from `path`); its problems name the file."""
    try:
        return rung(report, rows)
    except ValueError as e:
        raise ValueError(f"--sweeps: {path} {e}") from None


def all_rows(rungs: list[dict]) -> list[str]:
    """Every row of any rung (failed ones too), in the order they were asked for."""
    return list(dict.fromkeys(r for g in rungs for r in [*g["rows"], *g.get("failed", {})]))


def cell(g: dict, r: str, value) -> str:
    """A rung's cell of row `r`: `value(g, r)` where the row finished, `failed` where
    every run of it failed, `not finished` where none has yet (a partial sweep page), a
    dash where the rung lacks it."""
    if r in g.get("failed", {}):
        return unfinished_word(g, r)
    return value(g, r) if r in g["rows"] else "—"


def unfinished_word(g: dict, r: str) -> str:
    """`failed` for a row with failed runs and none finished, else `not finished`."""
    return "failed" if g["failed"][r] else "not finished"


def render(rungs: list[dict], command: str) -> str:
    """The ladder's page: one line per rung, then ranks and losses per row per rung (a
    rung without a row, e.g. one cut short, shows a dash)."""
    rows = all_rows(rungs)
    out = ["# The VO-RoPE site ablation up a ladder of scale", "", f"Command: `{command}`", "",
           "Kendall tau of our order at T against the reference table, with a 95% bootstrap "
           "interval over seeds; NoPE's rank (1 = best).", "",
           "| rung | device | seeds | tau | 95% interval | p | NoPE rank |",
           "|---|---|---|---|---|---|---|"]  # fmt: skip
    for g in rungs:
        lo, hi = g["tau_ci"]
        ci = "—" if lo is None else f"[{lo:.2f}, {hi:.2f}]"
        few, most = g["fewest_seeds"], g["seeds"]
        ci += "" if few > 1 else " (one seed)" if most == 1 else " (rows with one seed)"
        seeds = most if few == most else f"{few}-{most} (by row)"
        p = "—" if g["tau_p"] is None else f"{g['tau_p']:.3f}"
        nope = "—" if g["nope_rank"] is None else f"{g['nope_rank']} of {len(g['rows'])}"
        tau = "—" if g["tau"] is None else f"{g['tau']:.3f}"  # no article losses to order
        out.append(f"| {g['label']} | {g.get('device') or '—'} | {seeds} | "
                   f"{tau} | {ci} | {p} | {nope} |")  # fmt: skip
    ref = max(rungs, key=lambda g: len(g["rows"]))["reference_ranks"]  # of the most rows
    out += ["", "Rank of each row at T per rung (reference rank in brackets):", "",
            "| row | " + " | ".join(g["label"] for g in rungs) + " |",
            "|---|" + "---|" * len(rungs)]  # fmt: skip
    for r in sorted(rows, key=lambda r: ref.get(r, 99)):
        out.append(f"| {r} ({ref.get(r, '—')}) | " + " | ".join(
            cell(g, r, lambda g, r: str(g["ranks"][r])) for g in rungs) + " |")  # fmt: skip
    grown = [g for g in rungs if g.get("growth")]
    if grown:
        out += ["", "Growth of the held-out loss from T to the longest length evaluated "
                "(4T; nats/token, mean ± std over seeds; 0 = no worse at longer context):", "",
                "| row | " + " | ".join(g["label"] for g in grown) + " |",
                "|---|" + "---|" * len(grown)]  # fmt: skip
        for r in sorted(rows, key=lambda r: ref.get(r, 99)):
            cells = [cell(g, r, lambda g, r: plus_minus(g["growth"][r], sign=True)) for g in grown]
            out.append(f"| {r} | " + " | ".join(cells) + " |")
    for g in rungs:
        lens = g["seq_lens"]
        bpb = g.get("bits_per_byte") or {}
        bpb = bpb if any(bpb.values()) else {}
        out += ["", f"Held-out loss (nats/token), mean ± std over seeds, {g['label']}:", "",
                "| row | " + " | ".join(f"@{t}" for t in lens)
                + (f" | bits/byte @{lens[0]}" if bpb else "") + " |",
                "|---|" + "---|" * (len(lens) + bool(bpb))]  # fmt: skip
        for r in sorted(g["rows"], key=lambda r: g["ranks"].get(r, 99)):
            cells = [plus_minus(g["stats"][t][r]) for t in lens]
            cells += [plus_minus(bpb[r]) if bpb.get(r) else "—"] if bpb else []
            out.append(f"| {r} | " + " | ".join(cells) + " |")
        for r in g.get("failed", {}):  # never a number
            word = unfinished_word(g, r)
            out.append(f"| {r} | " + " | ".join([word] * (len(lens) + bool(bpb))) + " |")
    return "\n".join(out + failed_note(rungs)) + "\n"


def failed_note(rungs: list[dict]) -> list[str]:
    """A line per rung with failed runs: how many, and which rows failed outright."""
    out = []
    for g in rungs:
        if g.get("failed_runs"):
            rows = ", ".join(g["failed"]) or "none"
            out.append(
                f"- {g['label']}: {g['failed_runs']} failed run(s) (out of every number; "
                f"its sweep's table names them); rows with no finished run: {rows}"
            )
    return ["", "Failed runs:", "", *out] if out else []


def plot(rungs: list[dict], path: str) -> None:
    """Left: tau with its interval per rung. Right: each row's rank per rung."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    x = np.arange(len(rungs))
    taus = [g["tau"] for g in rungs]
    lows = [
        t if g["tau_ci"][0] is None else g["tau_ci"][0] for t, g in zip(taus, rungs, strict=True)
    ]
    highs = [
        t if g["tau_ci"][1] is None else g["tau_ci"][1] for t, g in zip(taus, rungs, strict=True)
    ]
    err = [np.subtract(taus, lows), np.subtract(highs, taus)]
    left.errorbar(x, taus, yerr=err, fmt="o-", capsize=4)
    left.axhline(0, color="0.7", lw=0.8)
    left.set(xticks=x, ylabel="Kendall tau vs reference", ylim=(-1, 1), title="agreement")
    left.set_xticklabels([g["label"] for g in rungs], rotation=15, fontsize=8)
    rows = all_rows(rungs)
    colours = plt.get_cmap("tab20")(np.linspace(0, 1, max(len(rows), 2)))
    for colour, r in zip(colours, rows, strict=False):
        right.plot(x, [g["ranks"].get(r, np.nan) for g in rungs], "o-", color=colour, label=r)
    right.set(xticks=x, ylabel="rank at T (1 = best)", title="rank of each row")
    right.set_xticklabels([g["label"] for g in rungs], rotation=15, fontsize=8)
    right.invert_yaxis()
    right.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # off the lines
    fig.tight_layout()
    save_figure(fig, path, 110)


def main(argv=None) -> None:
    signals.release_signals()  # one that came while the modules imported: stops it here
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m rope_jax.experiments.ladder",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--sweeps", required=True, help="comma-separated sweep <results>.json files")
    p.add_argument("--rows", default="nope,q,k,v,o,qk,vo,qkv,qkvo", help="rows to compare")
    p.add_argument("--out", required=True, help="output prefix: <out>.md, .png, .json")
    args = p.parse_args(argv)
    paths = [s for s in args.sweeps.split(",") if s]
    rows = [r for r in args.rows.split(",") if r]
    try:
        if not paths:
            raise ValueError("--sweeps: give one or more sweep <results>.json files")
        if (twice := repeated(paths)) is not None:
            raise ValueError(f"--sweeps lists {twice} twice: each rung is one sweep")
        if len(rows) < 2:
            raise ValueError(f"--rows={args.rows}: a rung orders two or more rows")
        check_out(args.out)
        reports = [load_results(s, "--sweeps") for s in paths]  # its errors name the file
        unknown = [r for r in rows if not any(r in report["rows"] for report in reports)]
        if unknown:
            there = sorted({r for report in reports for r in report["rows"]})
            raise ValueError(f"--rows: {', '.join(unknown)} in none of the sweeps (their "
                             f"rows: {', '.join(there)})")  # fmt: skip
        rungs = [_rung(s, report, rows) for s, report in zip(paths, reports, strict=True)]
    except ValueError as e:
        sys.exit(f"error: {e}")
    command = "python -m rope_jax.experiments.ladder " + " ".join(argv)
    write_page(args.out, {"command": command, "rungs": rungs}, render(rungs, command))
    plot(rungs, args.out + ".png")
    print(f"wrote {args.out}.md, {args.out}.png, {args.out}.json")


if __name__ == "__main__":
    main()
