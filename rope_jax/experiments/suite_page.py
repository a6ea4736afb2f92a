"""The page of an evaluation suite's directory (eval.py --out=DIR): DIR/results.md, a
task x length table with each task's average over lengths and each length's over tasks,
and DIR/heatmap.png: task x length, then for each needle task depth x length (the
needle-in-a-haystack heatmap: the mean score of the examples whose first needle lies in
each tenth of the haystack). Pure functions of results.json and examples/*.jsonl, so
the page can be made again from the files alone: `write(DIR)`.
"""

from __future__ import annotations

import io
import json
import os

import numpy as np

from rope_jax.harness import suite
from rope_jax.harness import workdir as workdir_lib

DEPTH_BINS = 10  # rows of a depth x length panel


def table(results: dict) -> list[str]:
    """Markdown lines: one row per task, one column per length, scores 0..1 to 3
    decimals ("-" for a cell not yet scored), the row and column averages."""
    cells = results["cells"]
    tasks = list(cells)
    lengths = sorted({int(n) for t in tasks for n in cells[t]})
    grid = np.array([[cells[t].get(str(n), {}).get("score", np.nan) for n in lengths]
                     for t in tasks], dtype=float)  # fmt: skip
    fmt = lambda v: "-" if np.isnan(v) else f"{v:.3f}"  # noqa: E731
    lines = ["| task | " + " | ".join(str(n) for n in lengths) + " | average |",
             "|---|" + "---:|" * (len(lengths) + 1)]  # fmt: skip
    for t, row in zip(tasks, grid, strict=True):
        lines.append(f"| {t} | " + " | ".join(map(fmt, row)) + f" | {fmt(_mean(row))} |")
    columns = [_mean(grid[:, j]) for j in range(len(lengths))]
    lines.append("| **average** | " + " | ".join(map(fmt, columns)) + f" | {fmt(_mean(grid))} |")
    return lines


def _mean(values) -> float:
    values = np.asarray(values, float)
    return float(np.nanmean(values)) if np.isfinite(values).any() else float("nan")


def markdown(results: dict) -> str:
    s = results["settings"]
    head = [
        "# Evaluation suite",
        "",
        f"Step {results['step']} of `{results['workdir']}` (trained at "
        f"{results['train_seq_len']} tokens); {s['examples']} examples per cell from the "
        f"`{s['split']}` split, template `{s['template']}`, seed {s['seed']}"
        + (f", rope_scaling {json.dumps(s['rope_scaling'])}" if s.get("rope_scaling") else "")
        + ". Scores are RULER's (string_match_all: the share of reference answers found in "
        "the greedy answer), 0..1; loss rows are nats/token.",
        "",
    ]
    return "\n".join(head + table(results)) + "\n"


def depth_grid(out: str, task: str, lengths) -> np.ndarray:
    """[DEPTH_BINS, len(lengths)] mean score by the first needle's depth (nan: none)."""
    grid = np.full((DEPTH_BINS, len(lengths)), np.nan)
    for j, n in enumerate(lengths):
        path = suite.examples_path(out, task, n)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            rows = [json.loads(line) for line in f]
        bins = [[] for _ in range(DEPTH_BINS)]
        for r in rows:
            if r.get("depths"):
                bins[min(int(r["depths"][0] * DEPTH_BINS), DEPTH_BINS - 1)].append(r["score"])
        grid[:, j] = [np.mean(b) if b else np.nan for b in bins]
    return grid


def heatmap(out: str, results: dict) -> bytes:
    """PNG bytes: task x length, then depth x length for every task with needle depths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = results["cells"]
    tasks = [t for t in cells if any("score" in c for c in cells[t].values())]
    lengths = sorted({int(n) for t in tasks for n in cells[t]})
    needle = [t for t in tasks if np.isfinite(depth_grid(out, t, lengths)).any()]
    panels = 1 + len(needle)
    cols = min(panels, 3)
    rows = -(-panels // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    grid = np.array([[cells[t].get(str(n), {}).get("score", np.nan) for n in lengths]
                     for t in tasks])  # fmt: skip
    _panel(axes.flat[0], grid, tasks, lengths, "score by task and length")
    for ax, t in zip(list(axes.flat)[1:], needle, strict=False):
        labels = [f"{100 * k // DEPTH_BINS}%" for k in range(DEPTH_BINS)]
        _panel(ax, depth_grid(out, t, lengths), labels, lengths, f"{t}: needle depth")
    for ax in list(axes.flat)[panels:]:
        ax.axis("off")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def _panel(ax, grid, rows, lengths, title) -> None:
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(rows)), rows, fontsize=7)
    ax.set_xlabel("context length (tokens)")
    ax.set_title(title, fontsize=9)
    for (i, j), v in np.ndenumerate(grid):
        if np.isfinite(v):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6)
    ax.figure.colorbar(image, ax=ax, fraction=0.046)


def write(out: str) -> tuple[str, str]:
    """Writes DIR/results.md and DIR/heatmap.png from DIR's files; returns their paths."""
    results = suite.load(out)
    if results is None:
        raise ValueError(f"{out} holds no {suite.RESULTS}: run the suite first")
    md, png = os.path.join(out, "results.md"), os.path.join(out, "heatmap.png")
    workdir_lib.write_atomic(md, markdown(results))
    workdir_lib.write_atomic(png, heatmap(out, results))
    return md, png
