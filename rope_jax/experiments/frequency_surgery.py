r"""Which frequency pairs carry the logits, and rotation taken off some of them, no training.

  python -m rope_jax.experiments.frequency_surgery --workdir=runs/smollm2 \
      --out=results/research/frequency_surgery_smollm2 --keep=4,8,16 \
      --strategies=high,low,uniform,2norm --p=0.75 --length=8192 \
      --needle_lengths=2048,8192 --examples=20

For the run in --workdir (a trained run, or a published model imported by `eval.py
--hf`), three steps, each resumable:

1. Pair scores (`probe.pair_norms`, `probe.pair_scores`): per layer, kv head and pair i,
   sum over its query heads of mean|q_i| * mean|k_i| before the rotation, on the first
   --calibration tokens of the corpus's training plays (not the held-out text):
   MHA2MLA's 2-norm criterion (Ji et al. 2025), and the reading of which frequencies a
   model uses of Barbero et al. (2024). DIR/scores.json.
2. Loss by position (`position_loss.token_losses`) of the first --length tokens of the
   held-out plays, as trained and under each variant, bucketed per --bucket positions:
   DIR/cells/<variant>.json.
3. Needle retrieval (the suite's niah_single_1, --examples per length) at each of
   --needle_lengths under each variant (or those of --needle_variants):
   DIR/needle/<variant>/ (a suite directory).

Variants (`VARIANTS`): the run as trained ("full"); for each strategy of --strategies
(MHA2MLA's four partial-RoPE choices) and each r of --keep, only r of the P pairs of
every head keep turning, the others frozen at frequency 0 (their numbers still meet in
q . k, unrotated):
  high     the r fastest pairs (0 .. r-1);
  low      the r slowest (P-r .. P-1);
  uniform  every (P/r)-th pair from 0;
  2norm    per layer and kv head, its r pairs of highest score (step 1; rule "heads");
and p-RoPE (Barbero et al. 2024; Gemma's "proportional") for each p of --p: the first
floor(p P) pairs turn (the same mask as high at r = p P, said so on the page), and
"nope", no pair turning (the floor). DIR/frequency_surgery.md, .json and .png close it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import numpy as np

from rope_jax import signals

STRATEGIES = ("high", "low", "uniform", "2norm")
NEEDLE = "niah_single_1"


def strategy_pairs(strategy: str, keep: int, pairs: int, scores=None):
    """The `model.rope.pairs` fields of one partial-RoPE choice: `keep` of `pairs` pairs
    turn in every head (high, low, uniform) or per layer and kv head by `scores` float
    [L, K, P] (2norm)."""
    if not 0 < keep <= pairs:
        raise ValueError(f"--keep: {keep} must be in 1..{pairs} (the pairs of a head)")
    if strategy == "high":
        return {"rule": "index", "index": tuple(range(keep))}
    if strategy == "low":
        return {"rule": "index", "index": tuple(range(pairs - keep, pairs))}
    if strategy == "uniform":
        if pairs % keep:
            raise ValueError(f"--keep: uniform needs r dividing P={pairs}, got r={keep}")
        return {"rule": "index", "index": tuple(range(0, pairs, pairs // keep))}
    if strategy == "2norm":
        top = np.argsort(-np.asarray(scores), axis=-1, kind="stable")[..., :keep]
        return {
            "rule": "heads",
            "index": tuple(
                tuple(tuple(sorted(int(i) for i in head)) for head in layer) for layer in top
            ),
        }
    raise ValueError(f"--strategies: {strategy!r} is not one of {', '.join(STRATEGIES)}")


def variant_names(strategies, keeps, ps) -> list[str]:
    """The variants' names in page order: full, <strategy>_<r>, p_<p>, nope."""
    chosen = [f"{s}_{keep}" for keep in keeps for s in strategies]
    return ["full", *chosen, *(f"p_{p:g}" for p in ps), "nope"]


def variants(strategies, keeps, ps, pairs: int, scores) -> dict[str, dict | None]:
    """Variant name -> its `model.rope.pairs` fields (None: as trained), in page order."""
    fields = [None, *(strategy_pairs(s, keep, pairs, scores) for keep in keeps
                      for s in strategies),
              *({"rule": "proportional", "fraction": float(p)} for p in ps),
              {"rule": "proportional", "fraction": 0.0}]  # fmt: skip
    return dict(zip(variant_names(strategies, keeps, ps), fields, strict=True))


def turning(fields: dict | None, head_dim: int, layers: int, kv_heads: int) -> np.ndarray:
    """bool [L, K, P]: which pairs of each head turn under a variant."""
    from rope_jax import pairs as pairs_lib

    spec = pairs_lib.PairSpec.of(fields)
    if spec.selection.per_head:
        return np.stack([spec.layer(i, layers).heads(head_dim) for i in range(layers)])
    mask = spec.select(head_dim)[2]
    mask = np.ones(head_dim // 2, bool) if mask is None else mask
    return np.broadcast_to(mask, (layers, kv_heads, head_dim // 2))


def _load(workdir: str, pairs=None, *, step=None):
    """(run, params, config, step) of the run under `pairs` (None: as trained)."""
    from rope_jax import defaults
    from rope_jax.harness import runfiles, setup
    from rope_jax.harness.evaluate import restore, with_pairs, without_corpus

    config = defaults.fill(runfiles.load_config(workdir))
    config.model.attention.impl = "chunked"  # the same numbers, blockwise: long windows fit
    config = with_pairs(config, pairs)
    run = setup.build(without_corpus(config), vocab_from_data=False)
    step, state = restore(workdir, run, step, fallback=False)
    return run, state["params"], config, int(step)


def calibration_text() -> tuple[str, list[str]]:
    """The corpus's training plays joined by blank lines (never the held-out ones)."""
    from rope_jax.data import corpora

    files = corpora.play_files()
    names = [n for n in files if corpora.play_split(n) == "train"]
    body = [corpora.markdown_to_text(files[n].read_text(encoding="utf-8")) for n in names]
    return "\n\n".join(body), names


def pair_scores(workdir: str, tokens: np.ndarray, *, step=None) -> dict:
    """Step 1: MHA2MLA's scores [L, K, P] and the mean pair lengths of q and k."""
    import jax
    from flax import nnx

    from rope_jax.nn import probe

    run, params, config, step = _load(workdir, step=step)

    @jax.jit
    def norms(state, batch):
        return probe.pair_norms(nnx.merge(run.graphdef, state), batch)

    q, k = (np.asarray(a) for a in norms(params, tokens))
    scores = np.asarray(probe.pair_scores(q, k))
    return {"step": step, "scores": scores.tolist(), "q_norms": q.tolist(),
            "k_norms": k.tolist(), "head_dim": int(config.model.head_dim),
            "base": float(config.model.rope.base)}  # fmt: skip


def loss_cell(workdir: str, fields, batch: np.ndarray, size: int, *, step=None) -> dict:
    """Step 2 for one variant: bucket means of the held-out window's token losses."""
    from rope_jax.experiments import position_loss

    run, params, config, step = _load(workdir, fields, step=step)
    losses = np.stack([np.asarray(position_loss.token_losses(run.graphdef, params, row[None]))
                       for row in batch])  # fmt: skip
    return {"pairs": fields, "step": step, "buckets": position_loss.buckets(losses, size),
            "mean": float(losses.mean())}  # fmt: skip


def _write_json(path: str, value) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)  # whole or absent


def _cached(path: str, want: dict, make):
    """The JSON at `path` if it was made with `want`'s settings, else make() written there."""
    want = json.loads(json.dumps(want))  # tuples as the file holds them, lists
    if os.path.isfile(path):
        with open(path) as f:
            old = json.load(f)
        if {k: old.get(k) for k in want} == want:
            return old
    value = {**make(), **want}
    _write_json(path, value)
    return value


def band_shares(scores: np.ndarray, bands: int = 4) -> list[float]:
    """Each band of P / bands consecutive pairs' share of the total score, averaged over
    layers and kv heads (band 0: the fastest)."""
    s = np.asarray(scores, np.float64)
    share = s / s.sum(-1, keepdims=True)
    return [float(b.sum(-1).mean()) for b in np.split(share, bands, axis=-1)]


def page(meta: dict, scores: dict, cells: dict, needles: dict, masks: dict) -> str:
    from rope_jax.experiments.report import rate_line

    p = scores["head_dim"] // 2
    shares = band_shares(np.asarray(scores["scores"]))
    quarter = p // 4
    lengths = meta["needle_lengths"]
    full = cells["full"]["buckets"]
    size = meta["bucket"]
    lines = [
        "# Frequency surgery without training: which pairs carry the logits, and what "
        "freezing the others costs", "",
        f"Command: `{meta['command']}`", "",
        f"Run: `{meta['workdir']}` step {cells['full']['step']}, trained at "
        f"{meta['trained_length']:,} tokens, {meta['layers']} layers x {meta['kv_heads']} kv "
        f"heads x {p} pairs (base {scores['base']:g}).", "",
        "## Pair scores", "",
        f"MHA2MLA's 2-norm score of pair i in kv head k (the sum over its query heads of "
        f"mean|q_i| x mean|k_i|, before rotation) on {meta['calibration']:,} tokens of the "
        f"training plays. Share of each head's total score by band of {quarter} pairs, "
        "mean over layers and heads:", "",
        "| pairs | " + " | ".join(f"{b * quarter}-{(b + 1) * quarter - 1}" for b in range(4))
        + " |",
        "|---|" + "---:|" * 4,
        "| share | " + " | ".join(f"{v:.3f}" for v in shares) + " |", "",
        "Pair 0 turns fastest (theta_0 = 1 rad/token); pair "
        f"{p - 1} slowest (base^(-{p - 1}/{p}) rad/token).", "",
        "## Loss and retrieval under each variant", "",
        f"Loss: mean next-token loss (nats) of the first {meta['length']:,} tokens of the "
        f"held-out plays ({meta['tokens']:,} tokens in all), one pass, per {size:,} "
        f"positions (columns)." + (f" Needle: {NEEDLE} with {meta['examples']} examples a "
        "length, the rate with its 95% Wilson interval." if lengths else " No needle was "
        "scored (--needle_lengths empty)."), "",
    ]  # fmt: skip
    heads = [f"loss {i * size // 1024}k-{(i + 1) * size // 1024}k" for i in range(len(full))]
    lines += ["| variant | pairs turning | loss (all) | Δ vs full | " + " | ".join(heads)
              + "".join(f" | needle @{n:,}" for n in lengths) + " |",
              "|---|---:|---:|---:|" + "---:|" * (len(heads) + len(lengths))]  # fmt: skip
    for name, cell in cells.items():
        needle = needles.get(name, {})
        hits = [rate_line(needle[str(n)]["score"] * needle[str(n)]["examples"],
                          needle[str(n)]["examples"]) if str(n) in needle else "not run"
                for n in lengths]  # fmt: skip
        delta = cell["mean"] - cells["full"]["mean"]
        cells_of_row = [f"{v:.3f}" for v in cell["buckets"]] + hits
        lines.append(f"| {name} | {masks[name]:.0%} | {cell['mean']:.3f} | {delta:+.3f} | "
                     + " | ".join(cells_of_row) + " |")  # fmt: skip
    lines += ["", "p-RoPE at p turns the first floor(p P) pairs: p = r / P is the mask of "
              "high at r (the same numbers)."]  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(path: str, scores: dict, cells: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = np.asarray(scores["scores"], np.float64)
    share = (s / s.sum(-1, keepdims=True)).mean(1)  # [L, P]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    im = a.imshow(share, aspect="auto", cmap="viridis")
    a.set_xlabel("pair (0 = fastest)")
    a.set_ylabel("layer")
    a.set_title("2-norm score share, mean over kv heads")
    fig.colorbar(im, ax=a)
    names = list(cells)
    b.barh(names, [cells[n]["mean"] for n in names], color="tab:blue")
    b.axvline(cells["full"]["mean"], color="grey", linestyle=":")
    b.set_xlabel("held-out loss (nats), no training")
    b.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_list(text: str, kind, flag: str) -> list:
    try:
        return [kind(v) for v in text.split(",") if v.strip()] if text else []
    except ValueError:
        raise ValueError(f"{flag}={text!r} must be a comma-separated list") from None


def main(argv=None) -> None:
    signals.release_signals()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--keep", default="4,8,16")
    p.add_argument("--p", default="0.75")
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--bucket", type=int, default=1024)
    p.add_argument("--calibration", type=int, default=2048)
    p.add_argument("--needle_lengths", default="2048,8192")
    p.add_argument("--examples", type=int, default=20)
    p.add_argument(
        "--needle_variants", default="", help="the variants whose needle is scored (default: all)"
    )
    p.add_argument("--step", type=int, default=None)
    args = p.parse_args(argv)
    try:
        asked, meta, batch, calib, m = _inputs(args, argv)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    strategies, keeps, ps, lengths, needled = asked
    os.makedirs(os.path.join(args.out, "cells"), exist_ok=True)
    try:
        make = lambda: pair_scores(args.workdir, calib[None], step=args.step)
        scores = _cached(os.path.join(args.out, "scores.json"), {"calibration": args.calibration},
                         make)  # fmt: skip
        todo = variants(strategies, keeps, ps, m.head_dim // 2, np.asarray(scores["scores"]))
        cells, needles, masks = {}, {}, {}
        for name, fields in todo.items():
            masks[name] = float(turning(fields, m.head_dim, m.num_layers, m.num_kv_heads).mean())
            start = time.time()
            make = functools.partial(loss_cell, args.workdir, fields, batch, args.bucket,
                                     step=args.step)  # fmt: skip
            want = {"length": args.length, "bucket": args.bucket, "pairs": fields}
            cells[name] = _cached(os.path.join(args.out, "cells", name + ".json"), want, make)
            print(f"{name}: loss {cells[name]['mean']:.3f} ({time.time() - start:.0f} s)",
                  flush=True)  # fmt: skip
        for name in needled or todo:
            needles[name] = _needle(args, name, todo[name], lengths)
    except KeyboardInterrupt as e:  # the cells written so far stay; a rerun resumes
        sys.exit(signals.interrupted(e, "the same command resumes"))
    stem = os.path.join(args.out, "frequency_surgery")
    _write_json(stem + ".json", {**meta, "scores": scores, "cells": cells, "needle": needles,
                                 "turning": masks})  # fmt: skip
    with open(stem + ".md", "w") as f:
        f.write(page(meta, scores, cells, needles, masks))
    plot(stem + ".png", scores, cells)
    print(f"wrote {stem}.md, .json and .png")


def _inputs(args, argv):
    """((strategies, keeps, ps, needle lengths, needle variants), the page's facts, the
    held-out window [1, length], the calibration tokens, config.model), checked:
    ValueError naming the flag before anything is built."""
    strategies = parse_list(args.strategies, str, "--strategies")
    for s in strategies:
        strategy_pairs(s, 1, 1, np.zeros((1, 1, 1)))  # a name that is not one: now
    keeps = parse_list(args.keep, int, "--keep")
    ps = parse_list(args.p, float, "--p")
    if any(not 0 < v < 1 for v in ps):
        raise ValueError(f"--p={args.p!r}: each p must be in (0, 1)")
    lengths = parse_list(args.needle_lengths, int, "--needle_lengths")
    names = variant_names(strategies, keeps, ps)
    needled = parse_list(args.needle_variants, str, "--needle_variants")
    unknown = [n for n in needled if n not in names]
    if unknown:
        raise ValueError(f"--needle_variants: {unknown[0]!r} is not a variant of this study "
                         f"({', '.join(names)})")  # fmt: skip
    from rope_jax.experiments import position_loss

    if args.length % position_loss.CHUNK or args.bucket < 1 or args.examples < 1:
        raise ValueError(f"--length must be a multiple of {position_loss.CHUNK}; --bucket "
                         "and --examples positive")  # fmt: skip
    from rope_jax import defaults
    from rope_jax.harness import checks, runfiles

    config = defaults.fill(runfiles.load_config(args.workdir))
    tok = runfiles.load_tokenizer(args.workdir)
    held_out, plays = position_loss.text()
    ids = tok.encode(held_out)
    batch = position_loss.windows(ids, args.length, 1)
    calib = np.asarray(tok.encode(calibration_text()[0])[: args.calibration], np.int32)
    if calib.size < args.calibration:
        raise ValueError(f"--calibration={args.calibration} is more than the training "
                         f"plays' {calib.size:,} tokens")  # fmt: skip
    m = config.model
    meta = {"command": "python -m rope_jax.experiments.frequency_surgery " + " ".join(
        sys.argv[1:] if argv is None else argv), "workdir": args.workdir, "plays": plays,
        "tokens": len(ids), "length": args.length, "bucket": args.bucket,
        "calibration": args.calibration, "examples": args.examples,
        "needle_lengths": lengths, "trained_length": checks.trained_length(config),
        "layers": m.num_layers, "kv_heads": m.num_kv_heads}  # fmt: skip
    return (strategies, keeps, ps, lengths, needled), meta, batch, calib, m


def _needle(args, name: str, fields, lengths) -> dict:
    """Step 3 for one variant: the suite's cells {length: {score, examples}}."""
    from rope_jax.harness import suite

    if not lengths:
        return {}
    results = suite.run(args.workdir, os.path.join(args.out, "needle", name), tasks=(NEEDLE,),
                        lengths=lengths, examples=args.examples, step=args.step,
                        pairs=fields)  # fmt: skip
    cells = results["cells"].get(NEEDLE, {})
    print(f"{name}: {NEEDLE} " + ", ".join(f"@{n} {c['score']:.2f}" for n, c in cells.items()),
          flush=True)  # fmt: skip
    return {n: {"score": c["score"], "examples": c["examples"]} for n, c in cells.items()}


if __name__ == "__main__":
    main()
