"""Sweep reports: collecting finished jobs, seed statistics, ranks against a reference
table, markdown and plot.

`write_report` collects every job into <results>.json; the rest are pure functions over
that report dict, so a table can be rebuilt from the json alone:
`render_markdown(json.load(f))`.
"""

from __future__ import annotations

import datetime
import io
import json
import math
import os
import statistics

from rope_jax import provenance
from rope_jax.experiments.plan import Job, columns, format_command


def mean_std(values) -> tuple[float, float | None]:
    """Mean and sample std (ddof=1) over seeds; std is None for a single seed."""
    values = [float(v) for v in values]
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def plus_minus(stat, sign: bool = False) -> str:
    """(mean, std) as "mean ± std" to 3 decimals; the mean alone when std is None (one
    seed); a leading + on positive means with `sign`."""
    mean, std = stat
    return f"{mean:{'+' if sign else ''}.3f}" + ("" if std is None else f" ± {std:.3f}")


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval (95% at z = 1.96) of a rate of `successes` in `n`
    trials: never outside [0, 1], and not of width 0 at 0 or n successes."""
    if n < 1:
        raise ValueError(f"an interval needs at least one trial, got n={n}")
    rate = successes / n
    centre = (rate + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * (rate * (1 - rate) / n + z * z / (4 * n * n)) ** 0.5
    return max(0.0, centre - half), min(1.0, centre + half)


def rate_line(successes: float, n: int) -> str:
    """A rate with its example count and 95% interval: "0.85 [0.64, 0.95] (n=20)"."""
    low, high = wilson(successes, n)
    return f"{successes / n:.2f} [{low:.2f}, {high:.2f}] (n={n})"


def evaluated(path: str, lengths) -> bool:
    """Whether the eval file at `path` exists and holds every length of `lengths`."""
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return False
    return all(str(n) in saved for n in lengths)


def ranks(losses: dict) -> dict:
    """name -> rank, 1 = lowest loss; ties share the better rank."""
    ordered = sorted(losses.values())
    return {name: ordered.index(loss) + 1 for name, loss in losses.items()}


def kendall(ours: dict, theirs: dict) -> tuple[float | None, float | None, int]:
    """Kendall tau, its p-value (None when undefined) and the count of names in both."""
    from scipy import stats

    common = [name for name in ours if name in theirs]
    if len(common) < 2:
        return None, None, len(common)
    res = stats.kendalltau([ours[n] for n in common], [theirs[n] for n in common])
    nan_none = lambda x: None if math.isnan(x) else float(x)
    return nan_none(res.statistic), nan_none(res.pvalue), len(common)


def resolved_pairs(means: dict, stds: dict) -> list[dict]:
    """Adjacent pairs of our ranking; resolved = gap > sqrt(std_a^2 + std_b^2), or None
    when a std is None (one seed: the noise is unknown)."""
    order, out = sorted(means, key=means.get), []
    for a, b in zip(order, order[1:], strict=False):
        known = stds.get(a) is not None and stds.get(b) is not None
        gap, noise = means[b] - means[a], math.hypot(stds[a], stds[b]) if known else None
        out.append({"better": a, "worse": b, "gap": gap, "noise": noise,
                    "resolved": gap > noise if known else None})  # fmt: skip
    return out


def tokenizers_differ(report: dict) -> bool:
    """Whether the runs used more than one tokenizer (then nats/token do not compare)."""
    runs = [r for row in report["rows"].values() for r in row["runs"]]
    return len({r.get("tokenizer", "bytes") for r in runs}) > 1


def summarize(report: dict) -> list[dict]:
    """Rows sorted by our rank: mean/std per length, our rank, the article's loss/rank,
    and "degrade": mean/std over seeds of each run's loss @longest - loss @T.

    The rank is by loss @T, or by bits/byte @T when rows differ in tokenizer ("bpb":
    mean/std of bits per byte @T, None where a run has no byte counts)."""
    t = report["seq_lens"][0]
    has_bytes = lambda runs: all(r.get("bits_per_byte", {}).get(t) for r in runs)
    bpb = lambda runs: mean_std([r["bits_per_byte"][t] for r in runs]) if has_bytes(runs) else None
    last = report["seq_lens"][-1]
    rows = [{"name": name, "overrides": row["overrides"], "bpb": bpb(row["runs"]),
             "stats": {t: mean_std([r["loss"][t] for r in row["runs"]])
                       for t in report["seq_lens"]},
             "degrade": mean_std([r["loss"][last] - r["loss"][t] for r in row["runs"]])}
            for name, row in finished_rows(report).items()]  # fmt: skip
    by_bytes = tokenizers_differ(report) and all(r["bpb"] for r in rows)
    ours = ranks({r["name"]: (r["bpb"] if by_bytes else r["stats"][t])[0] for r in rows})
    article = {k: v for k, v in (report["article_loss"] or {}).items() if k in ours}
    theirs = ranks(article) if article else {}
    for r in rows:
        r.update(rank=ours[r["name"]], article=article.get(r["name"]),
                 article_rank=theirs.get(r["name"]))  # fmt: skip
    return sorted(rows, key=lambda r: r["rank"])


def provenance_of(workdirs, launched_on: str | None = None) -> dict:
    """{"code": [...], "device": "..."}: the code and devices the runs in `workdirs`
    recorded in their provenance.jsonl, each once, in the order met (a run from before
    runs recorded them: "not recorded"); `launched_on` (how a launcher ran them, e.g.
    SLURM) first. With no device recorded: this process's devices."""
    code = [c for w in workdirs for c in provenance.seen(w, "code") or ["not recorded"]]
    devices = [d for w in workdirs for d in provenance.seen(w, "devices")]
    device = "; ".join(filter(None, (launched_on, ", ".join(dict.fromkeys(devices)))))
    return {"code": list(dict.fromkeys(code)), "device": device or provenance.devices()}


def provenance_line(result: dict) -> str:
    """'; code: ...' for a page's header ('' for results made before runs recorded it)."""
    code = result.get("code")
    if not code:
        return ""
    span = " (the runs span these; each run's are in its provenance.jsonl)" if len(code) > 1 else ""
    return f"; code: {', '.join(code)}{span}"


def header(report: dict) -> list[str]:
    """Title, command, date/versions/device/code and settings lines of a results page."""
    settings = ", ".join(f"{k}={v}" for k, v in report["settings"].items())
    seeds = ", ".join(map(str, report["seeds"]))
    code = provenance_line(report)
    return [f"# Sweep: {report['config']}", "", *([report["title"], ""] if report["title"] else []),
            f"Command: `{provenance.portable(report['command'])}`", "",
            f"Date: {report['date']}; jax {report['jax']}; device: {report['device']}{code}.", "",
            f"Settings: {settings}; seeds: {seeds}.", "", *partial_line(report)]  # fmt: skip


def partial_line(report: dict) -> list[str]:
    """A page written while its sweep goes on says so at the top."""
    pending = pending_runs(report)
    if not pending:
        return []
    done = sum(len(row["runs"]) for row in report["rows"].values())
    return [
        f"**Partial:** written while the sweep goes on, from the {done} runs finished; "
        f"{len(pending)} not finished are listed at the end.",
        "",
    ]


def render_markdown(report: dict) -> str:
    """The results page: header, table, Kendall tau, which adjacent gaps are resolved."""
    rows, lens, article = summarize(report), report["seq_lens"], report["article_loss"]
    article = article if any(r["article"] is not None for r in rows) else None  # no empty columns
    t, n_seeds = lens[0], len(report["seeds"])
    out = header(report)
    sites_only = lambda over: set(over) == {"model.rope.sites"}
    what = "sites" if all(sites_only(r["overrides"]) for r in rows) else "sites or overrides"
    by_bytes = tokenizers_differ(report) and all(r["bpb"] for r in rows)
    incomplete = failed_runs(report) or pending_runs(report)  # each row's seeds then
    head = ["row", what, *(["seeds"] if incomplete else []), f"loss @{t} (T) mean ± std"]
    head += [f"bits/byte @{t} mean ± std"] if by_bytes else []
    head += [f"loss @{s} ({int(s) // int(t)}T) mean ± std" for s in lens[1:]] + ["rank"]
    # KV-cache bytes per token, shown when rows differ in it (tied vs separate K/V, ...).
    kv = report.get("kv_bytes") or {}
    kv = kv if len({kv.get(r["name"]) for r in rows}) > 1 else {}
    head += ["KV cache B/token"] if kv else []
    head += ["article loss", "article rank"] if article else []
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        mean, std = r["stats"][t]
        what = ", ".join(f"`{k}={v}`" for k, v in r["overrides"].items()) or "(base)"
        if sites_only(r["overrides"]):
            what = f"`{r['overrides']['model.rope.sites']}`".replace("``", "NoPE")
        cells = [r["name"], what, *([seed_count(report, r["name"])] if incomplete else []),
                 _pm((mean, std), "{:.4f}")]  # fmt: skip
        cells += [_pm(r["bpb"], "{:.4f}")] if by_bytes else []
        cells += [_pm(r["stats"][s], "{:.4f}") for s in lens[1:]] + [str(r["rank"])]
        cells += [f"{kv[r['name']]:,}"] if kv else []
        if article:
            has = r["article"] is not None
            cells += [f"{r['article']:.3f}" if has else "—", str(r["article_rank"] or "—")]
        out.append("| " + " | ".join(cells) + " |")
    for name, row in report["rows"].items():  # no finished run: never a number
        if not row["runs"]:
            what = ", ".join(f"`{k}={v}`" for k, v in row["overrides"].items()) or "(base)"
            if sites_only(row["overrides"]):
                what = f"`{row['overrides']['model.rope.sites']}`".replace("``", "NoPE")
            word = no_run_word(row)
            out.append(f"| {name} | {what} | 0 of {n_seeds} | "
                       + " | ".join([word] * (len(head) - 3)) + " |")  # fmt: skip
    step = report["rows"][rows[0]["name"]]["runs"][0]["step"]
    spread = (f"± sample std (ddof=1) over {n_seeds} seeds" if n_seeds > 1 else
              "of one seed, so std is n/a and no gap can be judged against seed noise")  # fmt: skip
    if incomplete:
        spread = ("± sample std (ddof=1) over each row's finished seeds (seeds column; n/a "
                  "for one)")  # fmt: skip
    out += ["", f"Loss: held-out `{report['eval_split']}` cross-entropy (nats/token) after step "
            f"{step}, mean {spread}. T = {t} is the training context; longer contexts measure "
            "extrapolation. "
            + ("Rows differ in tokenizer, so losses per token do not compare: bits/byte "
               "(total nats / (ln 2 x UTF-8 bytes of the scored targets)) do, and rank 1 = "
               "lowest bits/byte @T." if by_bytes else "Rank 1 = lowest loss @T.")]  # fmt: skip
    if article:  # no tau over rows it lacks
        tau, p, n = kendall({r["name"]: r["stats"][t][0] for r in rows}, article)
        value = "n/a" if tau is None else f"{tau:.3f} (p = {'n/a' if p is None else f'{p:.3g}'})"
        out += ["", f"Kendall tau between our mean loss @T and the article's loss, over the {n} "
                f"rows in both: {value}. Article ranks are among the rows shown; its losses are "
                "for ~1B models, so compare orderings, not values."]  # fmt: skip
    key = (lambda r: r["bpb"]) if by_bytes else (lambda r: r["stats"][t])
    pairs = resolved_pairs({r["name"]: key(r)[0] for r in rows},
                           {r["name"]: key(r)[1] for r in rows})  # fmt: skip
    if pairs:
        out += ["", "Adjacent pairs of our ranking (resolved: gap > sqrt(std_a² + std_b²)):"]
    out += pair_lines(pairs, "<", digits=4)
    out += _extrapolation_lines(rows, t, lens[-1]) if len(lens) > 1 else []
    for task in task_names(report):
        out += _task_lines(report, rows, task)
    return "\n".join(out + failed_lines(report) + pending_lines(report)) + "\n"


def task_names(report: dict) -> list[str]:
    """The evaluation tasks besides loss that every finished run was scored on (eval.tasks:
    passkey, RULER's), in the order the first run has them."""
    runs = [r for row in finished_rows(report).values() for r in row["runs"]]
    return [n for n in (runs[0].get("tasks") or {}) if all(n in r.get("tasks", {}) for r in runs)]


def _task_lines(report: dict, rows: list[dict], task: str) -> list[str]:
    """A table of `task`'s headline score per row and length (mean ± std over seeds, rows in
    the loss ranking's order) and which adjacent pairs of its order at T the noise resolves."""
    lens, t = report["seq_lens"], report["seq_lens"][0]
    runs = {r["name"]: report["rows"][r["name"]]["runs"] for r in rows}

    def stat(name: str, n: str) -> tuple | None:  # None where a run was not scored at n
        values = [run["tasks"][task].get(n) for run in runs[name]]
        return None if None in values else mean_std(values)

    stats = {name: {n: stat(name, n) for n in lens} for name in runs}
    bar = learned_bar(task)
    seeds_at_t = {name: [run["tasks"][task].get(t) for run in runs[name]] for name in runs}
    learned = {name: sum(v is not None and v >= bar for v in values)
               for name, values in seeds_at_t.items()}  # fmt: skip
    head = ["row", *(f"{task} @{n} ({int(n) // int(t)}T)" for n in lens),
            f"seeds @T (n = {_examples(runs, task)})", f"learned (>= {bar:g} @T)"]  # fmt: skip
    out = ["", f"`{task}` per length (its headline score, higher is better; mean ± std over "
           "seeds), each seed's score at T and how many seeds learned it; a row that no "
           "seed learned is outside the order below:", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]  # fmt: skip
    for name, by_len in stats.items():
        cells = [_pm(by_len[n], "{:.2f}") if by_len[n] else "-" for n in lens]
        each = ", ".join("-" if v is None else f"{v:.2f}" for v in seeds_at_t[name])
        count = f"{learned[name]} of {len(runs[name])}" if learned[name] else "not learned"
        out.append("| " + " | ".join([name, *cells, each, count]) + " |")
    at_t = {name: by_len[t] for name, by_len in stats.items() if by_len[t] and learned[name]}
    # on negated scores: the pair's "better" is the higher score, its gap positive
    pairs = resolved_pairs({n: -m for n, (m, _) in at_t.items()},
                           {n: sd for n, (_, sd) in at_t.items()})  # fmt: skip
    out += ["", f"Adjacent pairs by `{task}` @{t} (resolved: gap > sqrt(std_a² + std_b²)):"]
    return out + pair_lines(pairs, ">", digits=2)


# The score at T from which a run counts as having learned a task (the goal the training
# mix was set: results/research/synthetic_mix.md): 0.9 for retrieval, 0.7 for vt.
LEARNED_BARS = {"vt": 0.7}
LEARNED_DEFAULT = 0.9


def learned_bar(task: str) -> float:
    return LEARNED_BARS.get(task, LEARNED_DEFAULT)


def _examples(runs: dict, task: str) -> str:
    """The examples a length of `task` was scored on, as the runs recorded it ("?" for
    runs collected before the count was kept)."""
    counts = {run.get("examples", {}).get(task) for rows in runs.values() for run in rows}
    return str(counts.pop()) if len(counts) == 1 and None not in counts else "?"


def _extrapolation_lines(rows: list[dict], t: str, last: str) -> list[str]:
    """How much each row's loss grows from T to the longest length, mean ± std over
    seeds (each run's own difference), least first, and which adjacent gaps the seed
    noise resolves: extrapolation varies across seeds far more than loss @T does."""
    means = {r["name"]: r["degrade"][0] for r in rows}
    stds = {r["name"]: r["degrade"][1] for r in rows}
    factor = int(last) // int(t)
    out = ["", f"Extrapolation: loss @{last} ({factor}T) - loss @{t} (T) per run, mean ± std "
           "over seeds, least growth first:", ""]  # fmt: skip
    spread = lambda sd: "n/a" if sd is None else f"{sd:.4f}"
    out += [f"- {name}: {means[name]:+.4f} ± {spread(stds[name])}"
            for name in sorted(means, key=means.get)]  # fmt: skip
    out += ["", "Adjacent pairs (resolved: gap > sqrt(std_a² + std_b²)):"]
    return out + pair_lines(resolved_pairs(means, stds), "<", digits=4)


def pair_lines(pairs: list[dict], relation: str, digits: int) -> list[str]:
    """Markdown bullets of `resolved_pairs`: `- a < b: gap ..., resolved (noise ...)`."""
    out = []
    for q in pairs:
        verdict = ("n/a (one seed)" if q["resolved"] is None else
                   f"{'resolved' if q['resolved'] else 'within seed noise'} "
                   f"(noise {q['noise']:.{digits}f})")  # fmt: skip
        out.append(f"- {q['better']} {relation} {q['worse']}: gap {q['gap']:.{digits}f}, {verdict}")
    return out


def row_colours(n: int) -> list:
    """n distinct colours: tab10 up to 10 rows, tab20 (paired hues) up to 20, then a
    continuous map."""
    import matplotlib

    if n <= 10:
        return [matplotlib.colormaps["tab10"](i) for i in range(n)]
    if n <= 20:
        return [matplotlib.colormaps["tab20"](i) for i in range(n)]
    return [matplotlib.colormaps["turbo"](i / max(n - 1, 1)) for i in range(n)]


def plot(report: dict, path: str) -> None:
    """Left: mean loss @T with std bars, sorted; right: validation curves (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, t = summarize(report), report["seq_lens"][0]
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(12, 4.5))
    means, errs = [r["stats"][t][0] for r in rows], [r["stats"][t][1] or 0.0 for r in rows]
    one_seed = len(report["seeds"]) < 2  # no spread to draw: bars without error bars
    colours = row_colours(len(rows))
    bars.bar([r["name"] for r in rows], means, yerr=None if one_seed else errs, capsize=4,
             color=colours)  # fmt: skip
    low = min(m - e for m, e in zip(means, errs, strict=True))
    high = max(m + e for m, e in zip(means, errs, strict=True))
    pad = max(high - low, 1e-3) * 0.5  # zoom in: the differences are small
    title = (
        "one seed (no error bars)" if one_seed else f"mean ± std over {len(report['seeds'])} seeds"
    )
    bars.set(ylim=(low - pad, high + pad), ylabel=f"held-out loss @T={t} (nats/token)",
             title=title)  # fmt: skip
    bars.tick_params(axis="x", labelrotation=30, labelsize=8)
    failed = [name for name, row in report["rows"].items() if not row["runs"]]
    if failed:
        bars.set_xlabel(f"no finished run: {', '.join(failed)}", color="tab:red")
    draw_curves(curves, report, rows, colours)
    fig.suptitle(report["config"])
    fig.tight_layout()
    save_figure(fig, path, 120)


def curves_of(report: dict, names) -> tuple[str, dict]:
    """What the curves panel draws: (label, {row: (steps, mean over its seeds)}) of the
    validation loss where a row has it at two or more steps, else of the training loss;
    ("", {}) when neither has two points (runs shorter than their logging intervals)."""
    for key, label in (("eval_curve", "validation loss"), ("train_curve", "training loss")):
        drawn = {}
        for name in names:
            runs = [dict(run.get(key) or []) for run in report["rows"][name]["runs"]]
            steps = sorted(set.intersection(*(set(c) for c in runs)))
            drawn[name] = (steps, [sum(c[s] for c in runs) / len(runs) for s in steps])
        if any(len(steps) > 1 for steps, _ in drawn.values()):
            return label, drawn
    return "", {}


def draw_curves(ax, report: dict, rows: list[dict], colours) -> None:
    """The right panel: validation curves, the training loss when the runs were too
    short for validation curves (said in the title), or a note that they were too short
    for either."""
    label, drawn = curves_of(report, [r["name"] for r in rows])
    if not label:
        ax.text(0.5, 0.5, "runs too short for curves:\nloss logged at fewer than 2 steps\n"
                "(train.log_every_steps, train.eval_every_steps)", ha="center", va="center",
                transform=ax.transAxes)  # fmt: skip
        ax.set(xticks=[], yticks=[], title="no curves: runs too short")
        return
    for colour, r in zip(colours, rows, strict=True):
        steps, values = drawn[r["name"]]
        ax.plot(steps, values, marker=".", label=r["name"], color=colour)
    title = f"{label} during training"
    if label == "training loss":
        title += "\n(runs too short for validation curves: < 2 evaluations)"
    ax.set(xlabel="step", ylabel=f"{label} (mean over seeds)", title=title)
    ax.legend(fontsize=8)


# ------------------------------------------------------------ held-out splits (accuracy)


def split_summary(report: dict) -> list[dict]:
    """Rows sorted by mean answer accuracy on the first split (best first), with mean/std
    accuracy and loss per split, per-task accuracy per split, and the mean accuracy over
    the generalisation splits (every split after the first)."""
    splits, rows = report["splits"], []
    for name, row in finished_rows(report).items():
        runs = row["runs"]
        acc = {s: mean_std([r["accuracy"][s] for r in runs]) for s in splits}
        general = mean_std([sum(r["accuracy"][s] for s in splits[1:]) / max(len(splits) - 1, 1)
                            for r in runs])  # fmt: skip
        tasks = {}
        for s in splits:
            keys = [k for k in runs[0]["metrics"][s] if k.startswith("answer_accuracy/")]
            tasks[s] = {k.split("/", 1)[1]: mean_std([r["metrics"][s][k] for r in runs])[0]
                        for k in keys}  # fmt: skip
        rows.append({"name": name, "overrides": row["overrides"], "acc": acc, "general": general,
                     "loss": {s: mean_std([r["loss"][s] for r in runs]) for s in splits},
                     "tasks": tasks})  # fmt: skip
    ordered = sorted(rows, key=lambda r: -r["acc"][splits[0]][0])
    for rank, r in enumerate(ordered, 1):
        r["rank"] = rank
    return ordered


def _pm(stat, fmt="{:.3f}") -> str:
    mean, std = stat
    return fmt.format(mean) + " ± " + ("n/a" if std is None else fmt.format(std))


def _what(overrides: dict) -> str:
    short = {k.removeprefix("model.rope."): v for k, v in overrides.items()}
    return ", ".join(f"`{k}={v}`" for k, v in short.items()) or "(base)"


def render_splits_markdown(report: dict) -> str:
    """Results page of a sweep scored by answer accuracy on held-out splits."""
    rows, splits, n_seeds = split_summary(report), report["splits"], len(report["seeds"])
    out = header(report)
    general = f"mean of {', '.join(splits[1:])}"
    head = ["row", "overrides", *[f"{s} acc" for s in splits], general, "rank"]
    out += ["## Answer accuracy (exact match per question), mean ± std over seeds", "",
            "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]  # fmt: skip
    for r in rows:
        cells = [r["name"], _what(r["overrides"]), *[_pm(r["acc"][s]) for s in splits],
                 _pm(r["general"]), str(r["rank"])]  # fmt: skip
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "## Answer loss (nats per answer token), mean over seeds", "",
            "| row | " + " | ".join(splits) + " |", "|" + "---|" * (len(splits) + 1)]  # fmt: skip
    for r in rows:
        out.append(f"| {r['name']} | " + " | ".join(f"{r['loss'][s][0]:.3f}" for s in splits)
                   + " |")  # fmt: skip
    tasks = list(rows[0]["tasks"][splits[0]])
    if tasks:
        out += ["", "## Answer accuracy per task, mean over seeds", "",
                "Each cell: " + " / ".join(splits) + ".", "",
                "| row | " + " | ".join(tasks) + " |", "|" + "---|" * (len(tasks) + 1)]  # fmt: skip
        for r in rows:
            cells = [" / ".join(f"{r['tasks'][s][t]:.2f}" for s in splits) for t in tasks]
            out.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    step = report["rows"][rows[0]["name"]]["runs"][0]["step"]
    spread = (f"± sample std (ddof=1) over {n_seeds} seeds" if n_seeds > 1 else
              "one seed, so std is n/a")  # fmt: skip
    out += ["", f"After step {step}; {spread}. Each split is the same fixed set of questions "
            f"for every run; `{splits[0]}` has the training grid shapes on unseen digits, the "
            "others change one thing each. Rank 1 = highest accuracy on "
            f"`{splits[0]}`."]  # fmt: skip
    out += failed_lines(report) + pending_lines(report)
    for label, key in (
        (splits[0], lambda r: r["acc"][splits[0]]),
        (general, lambda r: r["general"]),
    ):
        pairs = resolved_pairs({r["name"]: -key(r)[0] for r in rows},
                               {r["name"]: key(r)[1] for r in rows})  # fmt: skip
        out += ["", f"Adjacent pairs by accuracy on {label} (resolved: gap > "
                "sqrt(std_a² + std_b²)):"]  # fmt: skip
        out += pair_lines(pairs, ">", digits=3)
    return "\n".join(out) + "\n"


def plot_splits(report: dict, path: str) -> None:
    """Left: answer accuracy per split, one bar per row (std bars); right: validation loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows, splits = split_summary(report), report["splits"]
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(14, 4.8), width_ratios=(1.6, 1))
    width = 0.8 / len(rows)
    x = np.arange(len(splits))
    for k, r in enumerate(rows):
        means = [r["acc"][s][0] for s in splits]
        errs = [r["acc"][s][1] or 0.0 for s in splits]
        bars.bar(x + (k - (len(rows) - 1) / 2) * width, means, width, yerr=errs, capsize=2,
                 label=r["name"], color=plt.cm.tab10(k % 10))  # fmt: skip
    bars.set_xticks(x, splits)
    title = f"held-out questions, mean ± std over {len(report['seeds'])} seed(s)"
    bars.set(ylim=(0, 1), ylabel="answer accuracy (exact match)", title=title)
    bars.legend(fontsize=7, ncol=2)
    for k, r in enumerate(rows):
        runs = [dict(run["eval_curve"]) for run in report["rows"][r["name"]]["runs"]]
        steps = sorted(set.intersection(*(set(c) for c in runs)))
        curves.plot(steps, [sum(c[s] for c in runs) / len(runs) for s in steps], marker=".",
                    label=r["name"], color=plt.cm.tab10(k % 10))  # fmt: skip
    curves.set(xlabel="step", ylabel="validation answer loss (mean over seeds)",
               title="validation loss during training")  # fmt: skip
    fig.suptitle(report["config"])
    fig.tight_layout()
    save_figure(fig, path, 120)


def collect(run: Job) -> dict:
    """One run's numbers: final eval losses per length and its metric curves."""
    from rope_jax.harness import evals, metrics  # imports jax: not at the sweep's start

    with open(os.path.join(run.workdir, f"eval_{run.final_step}.json")) as f:
        saved = json.load(f)
    named = [n for n in saved.get("settings", {}).get("tasks", []) if n != "loss"]
    primary = {n: evals.TASKS[n].primary for n in named if n in evals.TASKS}
    records = metrics.read_jsonl(run.workdir)
    # A resumed run logs again the steps after its checkpoint: keep the last value.
    curve = lambda key: sorted({r["step"]: r[key] for r in records if key in r}.items())
    return {"seed": run.seed, "workdir": run.workdir, "step": saved["step"],
            "loss": {key: saved[key]["loss"] for key in columns(run)},
            "bits_per_byte": {key: saved[key].get("bits_per_byte") for key in columns(run)},
            "tokenizer": _tokenizer_name(run.workdir), "code": provenance.seen(run.workdir, "code"),
            "devices": provenance.seen(run.workdir, "devices"),
            "accuracy": {s: saved[s].get("answer_accuracy") for s in run.splits},
            "metrics": {s: saved[s] for s in run.splits},
            "tasks": {n: {key: saved[key][m] for key in columns(run) if m in saved[key]}
                      for n, m in primary.items()},  # each task's headline score per length
            "examples": {n: saved.get("settings", {}).get("examples") for n in primary},
            "eval_curve": curve("eval/loss"), "train_curve": curve("loss")}  # fmt: skip


def _tokenizer_name(workdir: str) -> str:
    """The name in <workdir>/tokenizer/tokenizer_info.json ("bytes" for runs without)."""
    path = os.path.join(workdir, "tokenizer", "tokenizer_info.json")
    if not os.path.isfile(path):
        return "bytes"
    with open(path) as f:
        return json.load(f)["name"]


def check_out(out: str, flag: str = "--out") -> None:
    """One line (a WorkdirError, which is a ValueError) when the directory of the page
    `out` cannot be made or written: checked before the work whose page it is, by a probe
    in its nearest folder that exists (nothing is made)."""
    from rope_jax.harness.workdir import check_can_write  # imports jax: not at the start

    check_can_write(out, what=f"{flag}={out}")


def load_results(path: str, flag: str) -> dict:
    """A sweep's <results>.json; a ValueError naming `flag` when there is no such file or
    it is not one."""
    if not os.path.isfile(path):
        raise ValueError(f"{flag}: no file {path}")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{flag}: {path} is not a sweep's results JSON ({e})") from None
    if not isinstance(data, dict) or not {"rows", "seq_lens"} <= data.keys():
        raise ValueError(f"{flag}: {path} is not a sweep's results JSON (no rows, seq_lens)")
    return data


def write_page(out: str, data: dict, markdown: str) -> None:
    """<out>.json and <out>.md of a results page, each whole or not at all (a crash
    mid-write leaves the old file), the directory made first."""
    from rope_jax.harness.workdir import write_atomic  # imports jax: not at the start

    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    write_atomic(out + ".json", json.dumps(data, indent=1))
    write_atomic(out + ".md", markdown)


def figure_format(path: str) -> str:
    """The image format `path`'s suffix names (png without one), as matplotlib writes it."""
    return os.path.splitext(path)[1][1:].lower() or "png"


def check_figure_path(path: str, flag: str) -> None:
    """One line (a ValueError) when matplotlib cannot write `path`'s format or its folder
    cannot be written: checked before drawing."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if figure_format(path) not in formats:
        raise ValueError(f"{flag}={path}: matplotlib writes no {figure_format(path)!r} files; "
                         f"use a suffix of {', '.join(sorted(formats))}")  # fmt: skip
    check_out(path, flag)


def save_figure(fig, path: str, dpi: int) -> None:
    """`fig` at `path` in the format its suffix names (PNG without one), made whole in
    memory and written with `write_atomic` (a crash leaves the old file; a device or pipe,
    which may not seek, is written in place; the folder is made), then closed."""
    import matplotlib.pyplot as plt

    from rope_jax.harness.workdir import write_atomic  # imports jax: not at the start

    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, dpi=dpi, format=figure_format(path))
    finally:
        plt.close(fig)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomic(path, buffer.getvalue())


def write_report(runs: list[Job], context: dict, argv, results: str,
                 failed: list[dict] = (), pending: list[dict] = ()) -> dict:  # fmt: skip
    """Collects the finished `runs` into <results>.json, then writes <results>.md and
    .png. Every planned row is in it; a failed run (`failures`) is listed in its row's
    "failed" (seed, reason, log), a run not finished yet (`pending`: row, seed, state;
    a table written while the sweep goes on) in its "pending"; both are left out of the
    means."""
    import jax

    rows = {r: {"overrides": o, "runs": []} for r, o in context["overrides"].items()}
    for run in runs:
        rows[run.row]["runs"].append(collect(run))
    for f in sorted(failed, key=lambda f: (f["seed"], f["row"])):
        rows[f["row"]].setdefault("failed", []).append(
            {"seed": f["seed"], "reason": f["reason"], "log": f["log"],
             "failures": f.get("failures", 1)})  # fmt: skip
    for p in sorted(pending, key=lambda p: (p["seed"], p["row"])):
        rows[p["row"]].setdefault("pending", []).append({"seed": p["seed"], "state": p["state"]})
    report = dict(context, command=format_command(argv), jax=jax.__version__, rows=rows,
                  date=datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
                  **provenance_of([run.workdir for run in runs], context.get("device")),
                  seq_lens=[str(t) for t in runs[0].seq_lens],
                  splits=list(runs[0].splits))  # fmt: skip
    # never half-written: the next sweep reads the .json to tell its plan from another
    splits = bool(report["splits"])
    page = render_splits_markdown(report) if splits else render_markdown(report)
    write_page(results, report, page)
    (plot_splits if splits else plot)(report, results + ".png")
    return report


# ------------------------------------------------------------------ failed runs


def failed_runs(report: dict) -> list[dict]:
    """Every failed run of a report: {row, seed, reason, log, failures}, seed by seed."""
    out = [dict(f, row=name) for name, row in report["rows"].items() for f in row.get("failed", [])]
    return sorted(out, key=lambda f: (f["seed"], f["row"]))


def finished_rows(report: dict) -> dict:
    """The report's rows with at least one finished run (those with none failed)."""
    return {name: row for name, row in report["rows"].items() if row["runs"]}


def failed_lines(report: dict) -> list[str]:
    """The page's list of failed runs (none: no lines)."""
    failed = failed_runs(report)
    if not failed:
        return []
    out = ["", f"Failed runs ({len(failed)}; not in the numbers above: each row's mean is over "
           "its finished seeds; the same command runs a failed run again while it has failed "
           "at most --retries times):", ""]  # fmt: skip
    for f in failed:
        times = "" if f.get("failures", 1) == 1 else f" (failed {f['failures']} times)"
        out.append(f"- {f['row']} seed {f['seed']}{times}: {f['reason']} (log: `{f['log']}`)")
    return out


def no_run_word(row: dict) -> str:
    """What a sweep report's row with no finished run reads in every cell: `failed` when
    a run of it failed, else `not finished` (a page written while the sweep goes on)."""
    return "failed" if row.get("failed") else "not finished"


def pending_runs(report: dict) -> list[dict]:
    """Every run a report was written without because it had not finished yet: {row,
    seed, state}, seed by seed."""
    rows = report.get("rows", {}).items()  # pages without rows (header only) have none
    out = [dict(p, row=name) for name, row in rows for p in row.get("pending", [])]
    return sorted(out, key=lambda p: (p["seed"], p["row"]))


def pending_lines(report: dict) -> list[str]:
    """The page's list of runs not finished when it was written (none: no lines)."""
    pending = pending_runs(report)
    if not pending:
        return []
    total = sum(len(row["runs"]) + len(row.get("failed", [])) + len(row.get("pending", []))
                for row in report["rows"].values())  # fmt: skip
    out = ["", f"Not finished when this page was written ({len(pending)} of {total} runs; not "
           "in the numbers above, each row's mean is over its finished seeds; the sweep's "
           "command trains them and writes the whole table):", ""]  # fmt: skip
    state = {"partial": "started", "new": "not started"}
    out += [f"- {p['row']} seed {p['seed']}: {state.get(p['state'], p['state'])}" for p in pending]
    return out


def seed_count(report: dict, name: str) -> str:
    """`2 of 3`: a row's finished seeds of those planned."""
    return f"{len(report['rows'][name]['runs'])} of {len(report['seeds'])}"
