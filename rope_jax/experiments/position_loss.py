r"""Loss by position past the trained length, by context-scaling rule, with no training.

  python -m rope_jax.experiments.position_loss --workdir=runs/smollm2 \
      --out=results/research/position_loss_smollm2 --length=16384 --windows=2 \
      --rules=none,linear:2,dynamic:2,yarn:2,llama3:2 [--bucket=1024]

The context-extension papers' curve (PI, Chen et al. 2023; YaRN, Peng et al. 2023): the
next-token loss of long held-out text as a function of the position in the window,
for the run in --workdir (a trained run, or a published model imported by
`eval.py --hf`) under each rule of --rules, evaluated as one pass over --length tokens.

Text: the six held-out plays (the validation and test splits of the shipped Shakespeare
corpus) in a fixed order, joined by blank lines, tokenized with the run's tokenizer; the
first --windows non-overlapping windows of --length tokens. The JSON names the plays and
the token count, so a cell can be recomputed with another implementation.

Rules (`RULES`), each NAME:FACTOR but `none` (as trained): linear (position
interpolation), dynamic (NTK-aware, reading the length), yarn and llama3 (their usual
settings), the original length being the run's trained length T
(`checks.trained_length`). A rule's cell is DIR/cells/<rule>.json, written once it is
scored (a rerun resumes at the first missing cell); DIR/position_loss.md (the mean loss
of each bucket of --bucket positions, per rule) and .png close it. Attention runs
blockwise (`chunked`, the same numbers), and the vocabulary projection a chunk of
positions at a time, so 32k tokens fit a 24 GiB machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import jax
import numpy as np

from rope_jax import signals

RULES = {
    "none": lambda f, t: None,
    "linear": lambda f, t: {"rope_type": "linear", "factor": f},
    "dynamic": lambda f, t: {"rope_type": "dynamic", "factor": f},
    "yarn": lambda f, t: {"rope_type": "yarn", "factor": f, "original_max_position_embeddings": t},
    "llama3": lambda f, t: {"rope_type": "llama3", "factor": f, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": t},
}  # fmt: skip
PLAYS = ("macbeth", "twelfth-night", "richard-ii", "othello", "as-you-like-it", "henry-v")
CHUNK = 512  # positions projected onto the vocabulary at once


def parse_rule(spec: str) -> tuple[str, float | None]:
    """("yarn", 2.0) of "yarn:2"; ("none", None); ValueError naming the spec otherwise."""
    name, _, factor = spec.strip().partition(":")
    if name not in RULES:
        raise ValueError(f"--rules: {spec!r} is not one of {', '.join(RULES)} (NAME:FACTOR)")
    if name == "none":
        if factor:
            raise ValueError(f"--rules: {spec!r}: none takes no factor")
        return name, None
    try:
        value = float(factor)
    except ValueError:
        raise ValueError(f"--rules: {spec!r} needs a factor > 1, e.g. {name}:2") from None
    if not value > 1:
        raise ValueError(f"--rules: {spec!r} needs a factor > 1, e.g. {name}:2")
    return name, value


def cell_name(name: str, factor: float | None) -> str:
    return name if factor is None else f"{name}_{factor:g}"


def text() -> tuple[str, list[str]]:
    """The held-out plays joined by blank lines, and their names in order."""
    from rope_jax.data import corpora

    files = corpora.play_files()
    plays = [corpora.markdown_to_text(files[p].read_text(encoding="utf-8")) for p in PLAYS]
    return "\n\n".join(plays), list(PLAYS)


def windows(tokens: list[int], length: int, count: int) -> np.ndarray:
    """The first `count` non-overlapping windows [count, length]; ValueError if too few."""
    have = len(tokens) // length
    if have < count:
        raise ValueError(f"--windows={count} at --length={length} needs {count * length:,} tokens; "
                         f"the held-out plays have {len(tokens):,} ({have} windows)")  # fmt: skip
    return np.asarray(tokens[: count * length], np.int32).reshape(count, length)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def token_losses(graphdef, state, tokens):
    """Next-token losses [T - 1] of one window `tokens` [1, T] (T a multiple of CHUNK),
    the vocabulary projected CHUNK positions at a time."""
    import jax.numpy as jnp
    from flax import nnx

    model = nnx.merge(graphdef, state)
    h = model.hidden(tokens)[0]  # [T, D]
    targets = jnp.concatenate([tokens[0, 1:], tokens[0, :1]])  # the last is dropped below

    def one(args):
        x, t = args
        logits = model.logits_of(x[None])[0]
        return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, t[:, None], -1)[:, 0]

    losses = jax.lax.map(one, (h.reshape(-1, CHUNK, h.shape[-1]), targets.reshape(-1, CHUNK)))
    return losses.reshape(-1)[:-1]


def score(workdir: str, rule: tuple[str, float | None], batch: np.ndarray, *, step=None) -> dict:
    """The cell of one rule: per window, the losses' bucket means (filled by the caller)."""
    from rope_jax import defaults
    from rope_jax.harness import checks, runfiles, setup
    from rope_jax.harness.evaluate import restore, with_rope_scaling, without_corpus

    config = defaults.fill(runfiles.load_config(workdir))
    config.model.attention.impl = "chunked"
    trained = checks.trained_length(config)
    scaling = RULES[rule[0]](rule[1], trained)
    config = with_rope_scaling(config, scaling, None)
    run = setup.build(without_corpus(config), vocab_from_data=False)
    step, state = restore(workdir, run, step, fallback=False)
    losses = [np.asarray(token_losses(run.graphdef, state["params"], row[None])) for row in batch]
    return {"rule": rule[0], "factor": rule[1], "rope_scaling": scaling, "step": int(step),
            "trained_length": int(trained), "losses": np.stack(losses)}  # fmt: skip


def buckets(losses: np.ndarray, size: int) -> list[float]:
    """Mean loss of each `size` positions [ceil((T - 1) / size)], over windows."""
    mean = losses.mean(0)
    return [float(mean[i : i + size].mean()) for i in range(0, len(mean), size)]


def page(cells: list[dict], meta: dict) -> str:
    size = meta["bucket"]
    names = [cell_name(c["rule"], c["factor"]) for c in cells]
    lines = [
        "# Loss by position, by context-scaling rule (no training)", "",
        f"Command: `{meta['command']}`", "",
        f"Run: `{meta['workdir']}` step {cells[0]['step']}, trained at "
        f"{cells[0]['trained_length']:,} tokens. Text: the held-out plays "
        f"({', '.join(meta['plays'])}; {meta['tokens']:,} tokens with the run's tokenizer), "
        f"the first {meta['windows']} windows of {meta['length']:,} tokens, one pass each. "
        f"Mean next-token loss (nats) per {size:,} positions.", "",
        "| positions | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]  # fmt: skip
    rows = zip(*[c["buckets"] for c in cells], strict=True)
    for i, row in enumerate(rows):
        lines.append(f"| {i * size:,}-{min((i + 1) * size, meta['length']) - 1:,} | "
                     + " | ".join(f"{v:.3f}" for v in row) + " |")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(path: str, cells: list[dict], meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    size = meta["bucket"]
    for c in cells:
        x = [(i + 0.5) * size for i in range(len(c["buckets"]))]
        ax.plot(x, c["buckets"], marker=".", label=cell_name(c["rule"], c["factor"]))
    ax.axvline(cells[0]["trained_length"], color="grey", linestyle=":", label="trained length")
    ax.set_xlabel("position in the window")
    ax.set_ylabel(f"mean loss per {size} positions (nats)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    signals.release_signals()  # one that came while the modules imported: stops it here
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--rules", default="none,linear:2,dynamic:2,yarn:2,llama3:2")
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--windows", type=int, default=1)
    p.add_argument("--bucket", type=int, default=1024)
    p.add_argument("--step", type=int, default=None)
    args = p.parse_args(argv)
    try:
        rules = [parse_rule(r) for r in args.rules.split(",")]
        if args.length % CHUNK or args.length < CHUNK:
            raise ValueError(f"--length={args.length} must be a multiple of {CHUNK}")
        if args.bucket < 1 or args.windows < 1:
            raise ValueError("--bucket and --windows must be positive")
        from rope_jax.harness import runfiles

        tok = runfiles.load_tokenizer(args.workdir)
        body, plays = text()
        ids = tok.encode(body)
        batch = windows(ids, args.length, args.windows)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    os.makedirs(os.path.join(args.out, "cells"), exist_ok=True)
    meta = {"command": "python -m rope_jax.experiments.position_loss " + " ".join(
        sys.argv[1:] if argv is None else argv), "workdir": args.workdir, "plays": plays,
        "tokens": len(ids), "length": args.length, "windows": args.windows,
        "bucket": args.bucket}  # fmt: skip
    cells = []
    for rule in rules:
        path = os.path.join(args.out, "cells", cell_name(*rule) + ".json")
        want = {k: meta[k] for k in ("length", "windows", "tokens")}
        if os.path.isfile(path):
            with open(path) as f:
                cell = json.load(f)
            if {k: cell.get(k) for k in want} == want:
                cells.append(cell)
                continue
        start = time.time()
        try:
            cell = score(args.workdir, rule, batch, step=args.step)
        except KeyboardInterrupt as e:  # the cells written so far stay; a rerun resumes
            sys.exit(signals.interrupted(e, "the same command resumes"))
        losses = cell.pop("losses")
        cell.update(want, buckets=buckets(losses, args.bucket), mean=float(losses.mean()),
                    seconds=round(time.time() - start, 1))  # fmt: skip
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(cell, f, indent=1)
        os.replace(tmp, path)  # a cell is whole or absent
        print(f"{cell_name(*rule)}: mean {cell['mean']:.3f} ({cell['seconds']:.0f} s)", flush=True)
        cells.append(cell)
    stem = os.path.join(args.out, "position_loss")
    with open(stem + ".json", "w") as f:
        json.dump({**meta, "cells": cells}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(page(cells, meta))
    plot(stem + ".png", cells, meta)
    print(f"wrote {stem}.md, .json and .png")


if __name__ == "__main__":
    main()
