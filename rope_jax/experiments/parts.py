r"""A sweep's runs scored on other datasets that share their tokenizer: the rows' order on
each part of a corpus.

  python -m rope_jax.experiments.parts \
      --sweep=results/research/vo_rope_ladder_L8_D256_linux8k.json \
      --data=linux8k_tables,linux8k_docs,linux8k_code --data_dir=~/rope_data \
      --out=results/research/vo_rope_ladder_L8_D256_linux8k_parts

Every run of the sweep (its <results>.json names each run's workdir and final step, or
--workdir=DIR, the sweep's --workdir where its runs are on this machine, names them) is
evaluated on each --data dataset (`eval.py --data`: the same checkpoint on another
prepared dataset with the run's tokenizer, e.g. one part of the training corpus
prepared from a selection of its source, docs/data.md) at --seq_lens (default T and 4T),
writing <workdir>/eval_<step>_<data>.json; one written already at those lengths is kept,
so the same command continues where it stopped (one made at other lengths is refused in
one line, as eval.py refuses it). Per dataset: each row's held-out loss (mean ± std
over seeds), its rank at T, Kendall tau of that order against the sweep's reference
order, and NoPE's rank; the sweep's own evaluation comes first for comparison. Writes
<out>.md and <out>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from rope_jax import signals
from rope_jax.experiments.plan import repeated, run_dir
from rope_jax.experiments.report import (
    check_out,
    evaluated,
    kendall,
    load_results,
    mean_std,
    no_run_word,
    plus_minus,
    ranks,
    write_page,
)


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rope_jax.experiments.parts",
                                description=" ".join(__doc__.split("\n\n")[0].split()))  # fmt: skip
    p.add_argument("--sweep", required=True, help="a sweep's <results>.json")
    p.add_argument("--data", required=True, help="comma-separated prepared dataset names")
    p.add_argument("--data_dir", default=None, help="their parent directory (default: the runs')")
    p.add_argument("--workdir", default=None,
                   help="the sweep's --workdir where its runs are on this machine "
                        "(default: the run directories its results file names)")  # fmt: skip
    p.add_argument("--seq_lens", default="", help="lengths to score (default: T and 4T)")
    p.add_argument("--num_batches", type=int, default=None, help="default: the runs' own")
    p.add_argument("--out", required=True, help="output prefix: <out>.md, <out>.json")
    return p.parse_args(argv)


def runs_of(report: dict, workdir: str | None = None) -> list[dict]:
    """[{row, seed, workdir, step}] of every run in a sweep report; with `workdir` (the
    sweep's --workdir, wherever its runs are now) each run is looked for where that sweep
    trains it, not at the directory the results file recorded."""
    return [{"row": row, "seed": run["seed"], "step": run["step"],
             "workdir": run["workdir"] if workdir is None else run_dir(workdir, row, run["seed"])}
            for row, entry in report["rows"].items() for run in entry["runs"]]  # fmt: skip


def check_flags(args, names: list[str], lengths: list[int]) -> str | None:
    """One line naming a flag that cannot be used, or None."""
    if not names:
        return f"--data={args.data}: give one or more prepared dataset names"
    if (twice := repeated(names)) is not None:
        return f"--data lists {twice} twice"
    if min(lengths) <= 0:
        return f"--seq_lens={args.seq_lens}: give positive integers, e.g. 256,1024"
    if args.num_batches is not None and args.num_batches < 0:
        return f"--num_batches={args.num_batches} must be >= 0 (0: the whole split)"
    return None


def problem(
    report: dict, names: list[str], data_dir: str | None, workdir: str | None = None
) -> str | None:
    """One line naming what would stop the evaluations, before any starts, or None."""
    runs = runs_of(report, workdir)
    missing = [r["workdir"] for r in runs if not os.path.isdir(r["workdir"])]
    if missing:
        hint = "" if workdir else "; --workdir=DIR names the sweep's --workdir on this machine"
        return f"the sweep's run {missing[0]} is not there ({len(missing)} missing){hint}"
    if data_dir is None:  # the runs' own, as eval.py --data reads it
        from rope_jax.data import sources
        from rope_jax.harness import runfiles

        data_dir = sources.root_dir(runfiles.load_config(runs[0]["workdir"]).data)
    for name in names:
        if not os.path.isfile(os.path.join(os.path.expanduser(data_dir), name, "metadata.json")):
            return (f"--data={name}: no prepared dataset {name} in {data_dir} "
                    "(python -m rope_jax.data.prepare --name=...)")  # fmt: skip
    return None


def eval_file(run: dict, name: str) -> str:
    return os.path.join(run["workdir"], f"eval_{run['step']}_{name}.json")


def evaluate(runs: list[dict], names: list[str], args, lengths: list[int]) -> None:
    """Every (run, dataset) without its eval file, in this process, with progress."""
    from rope_jax.harness import console
    from rope_jax.harness.evaluate import evaluate_checkpoint  # imports jax

    todo = [(r, n) for r in runs for n in names if not evaluated(eval_file(r, n), lengths)]
    start = time.time()
    for k, (run, name) in enumerate(todo, 1):
        with console.into_log(os.path.join(run["workdir"], "eval.log")):
            result = evaluate_checkpoint(run["workdir"], step=run["step"], seq_lens=lengths,
                                         num_batches=args.num_batches, tag=name,
                                         data_name=name, data_dir=args.data_dir)  # fmt: skip
        eta = (time.time() - start) / k * (len(todo) - k)
        print(f"[{k}/{len(todo)}] row={run['row']} seed={run['seed']} {name}: loss "
              + ", ".join(f"@{n} {result[str(n)]['loss']:.4f}" for n in lengths)
              + f"  ETA {eta / 60:.0f} min", flush=True)  # fmt: skip


def table(report: dict, runs: list[dict], names: list[str], lengths: list[int]) -> dict:
    """{dataset: {row: {length: (mean, std)}, tokens}}, the sweep's own evaluation first
    (as "all")."""
    empty = {row: no_run_word(entry) for row, entry in report["rows"].items() if not entry["runs"]}
    failed = [row for row, word in empty.items() if word == "failed"]
    unfinished = [row for row, word in empty.items() if word != "failed"]  # a partial page's
    out = {"all": {"rows": {}, "tokens": None}}
    for row, entry in report["rows"].items():
        if not entry["runs"]:  # no run of it finished: no number, shown as failed or not
            continue
        out["all"]["rows"][row] = {
            str(n): mean_std([r["loss"][str(n)] for r in entry["runs"]])
            for n in lengths if all(str(n) in r["loss"] for r in entry["runs"])}  # fmt: skip
    for name in names:
        per_row, tokens = {}, None
        for run in runs:
            with open(eval_file(run, name)) as f:
                saved = json.load(f)
            tokens = saved[str(lengths[0])].get("tokens")
            for n in lengths:
                per_row.setdefault(run["row"], {}).setdefault(str(n), []).append(
                    saved[str(n)]["loss"])  # fmt: skip
        out[name] = {"rows": {r: {n: mean_std(v) for n, v in by_len.items()}
                              for r, by_len in per_row.items()}, "tokens": tokens}  # fmt: skip
    reference = report.get("article_loss") or {}
    for entry in out.values():
        at_t = {r: v[str(lengths[0])][0] for r, v in entry["rows"].items() if str(lengths[0]) in v}
        entry["ranks"] = ranks(at_t)
        entry["tau"], entry["tau_p"], _ = kendall(at_t, reference)
        entry["failed"], entry["not_finished"] = failed, unfinished
    return out


def render(parts: dict, lengths: list[int], reference: dict, command: str, seeds: int) -> str:
    t = str(lengths[0])
    ref_rank = ranks(reference)
    out = ["# A sweep's rows on each part of its corpus", "", f"Command: `{command}`", "",
           f"Held-out loss (nats/token) at T = {t}, mean over {seeds} seed(s) per row; "
           "tau = Kendall tau of the order at T against the reference table; "
           "\"all\" = the sweep's own evaluation.", "",
           "| dataset | tokens scored at T | tau | p | NoPE rank | order at T (best first) |",
           "|---|---|---|---|---|---|"]  # fmt: skip
    for name, entry in parts.items():
        order = " < ".join(sorted(entry["ranks"], key=entry["ranks"].get))
        tau = "—" if entry["tau"] is None else f"{entry['tau']:.3f}"
        p = "—" if entry["tau_p"] is None else f"{entry['tau_p']:.3f}"
        tokens = "—" if entry["tokens"] is None else f"{entry['tokens']:,}"
        out.append(f"| {name} | {tokens} | {tau} | {p} | {entry['ranks'].get('nope', '—')} | "
                   f"{order} |")  # fmt: skip
    for name, entry in parts.items():
        out += ["", f"`{name}`:", "", "| row (reference rank) | rank at T | "
                + " | ".join(f"@{n}" for n in lengths) + " |",
                "|---|---|" + "---|" * len(lengths)]  # fmt: skip
        for r in sorted(entry["rows"], key=lambda r: entry["ranks"].get(r, 99)):
            cells = [plus_minus(entry["rows"][r][str(n)]) if str(n) in entry["rows"][r] else "—"
                     for n in lengths]  # fmt: skip
            out.append(f"| {r} ({ref_rank.get(r, '—')}) | {entry['ranks'].get(r, '—')} | "
                       + " | ".join(cells) + " |")  # fmt: skip
        missing = [(r, "failed") for r in entry.get("failed", [])]
        missing += [(r, "not finished") for r in entry.get("not_finished", [])]
        for r, word in missing:  # a row of the sweep with no finished run
            out.append(f"| {r} ({ref_rank.get(r, '—')}) | {word} | "
                       + " | ".join([word] * len(lengths)) + " |")  # fmt: skip
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    signals.release_signals()  # one that came while the modules imported: stops it here
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    try:
        report = load_results(args.sweep, "--sweep")
        check_out(args.out)
    except ValueError as e:
        sys.exit(f"error: {e}")
    names = [n for n in args.data.split(",") if n]
    t = int(report["seq_lens"][0])
    try:
        lengths = [int(n) for n in args.seq_lens.split(",") if n] or [t, 4 * t]
    except ValueError:
        lengths = [0]
    why = check_flags(args, names, lengths) or problem(report, names, args.data_dir, args.workdir)
    if why:
        sys.exit(f"error: {why}")
    runs = runs_of(report, args.workdir)
    try:
        evaluate(runs, names, args, lengths)
    except ValueError as e:  # a tokenizer that is not the runs', a damaged checkpoint, ...
        sys.exit(f"error: {e}")
    parts = table(report, runs, names, lengths)
    command = "python -m rope_jax.experiments.parts " + " ".join(argv)
    page = render(parts, lengths, report.get("article_loss") or {}, command, len(report["seeds"]))
    write_page(args.out, {"command": command, "lengths": lengths, "parts": parts}, page)
    print(f"wrote {args.out}.md, {args.out}.json")


if __name__ == "__main__":
    main()
