r"""Attention kernels against context length: compiled memory and step time of a train step.

  python benchmarks/attention_bench.py --out results/attention_bench.md
  python benchmarks/attention_bench.py --lengths 1024,2048 --impls xla,chunked   # quick

The `tiny` preset (2 layers, D = 128, 4 heads of H = 32, 2 kv heads) at batch 1 and
context T, one full training step (forward, backward, AdamW) per `model.attention.impl`.
For every (impl, T): the temporary memory XLA reports for the compiled step (the
activations, scores included; parameters and optimiser state are extra and tiny), and,
where that fits under --max_gib, the median time of --steps steps. Each measurement is
its own child process (its own peak RSS). The table gives each impl's memory as a ratio
to `xla` at the same T and the growth from one T to the next (2.0 = linear, 4.0 =
quadratic), all measured in this one run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_child  # noqa: E402

from rope_jax import provenance  # noqa: E402

IMPLS = ("xla", "dot_product", "chunked")


def build(impl: str, seq_len: int):
    """The harness pieces of the tiny preset at context `seq_len`, batch 1, kernel `impl`."""
    from configs import lm
    from rope_jax import harness

    config = lm.get_config("size=tiny")
    config.model.attention.impl = impl
    config.data.seq_len, config.data.global_batch_size = seq_len, 1
    config.eval.batch_size = 1
    return config, harness.build(config)


def measure(impl: str, seq_len: int, *, steps: int, max_gib: float) -> dict:
    """Compiled temp bytes of one train step; its time when the temp fits under max_gib."""
    import jax
    import numpy as np

    from rope_jax import harness, sharding

    config, run = build(impl, seq_len)
    batch = harness.abstract_batch(1, seq_len, run.batch_sharding)
    with sharding.use_mesh(run.mesh, run.rules):
        compiled = run.train_step.lower(run.abstract, batch).compile()
    temp = int(compiled.memory_analysis().temp_size_in_bytes)
    out = {"impl": impl, "T": seq_len, "temp_bytes": temp, "step_s": None}
    if temp > max_gib * 2**30:
        return out
    tokens = np.random.default_rng(0).integers(0, 256, (1, seq_len + 1)).astype(np.int32)
    data = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "weights": np.ones((1, seq_len), np.float32)}  # fmt: skip
    with sharding.use_mesh(run.mesh, run.rules):
        state = jax.jit(run.init_fn, out_shardings=run.shardings)()
        placed = harness.put_batch(data, run.batch_sharding)
        times = []
        for _ in range(steps + 1):  # the first call is the warm-up
            start = time.perf_counter()
            state, metrics = compiled(state, placed)
            jax.block_until_ready(metrics["loss"])
            times.append(time.perf_counter() - start)
    out["step_s"] = statistics.median(times[1:])
    return out


def table(results: list[dict], lengths: list[int], impls: list[str]) -> list[str]:
    """Markdown rows: per T, each impl's temp MiB (x of xla) and step time."""
    by = {(r["impl"], r["T"]): r for r in results}
    head = "| T | " + " | ".join(f"{i} temp MiB (x xla) | {i} step s" for i in impls) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(impls))]
    for t in lengths:
        cells = []
        for impl in impls:
            r, ref = by.get((impl, t)), by.get(("xla", t))
            if r is None:
                cells += ["failed", "—"]
                continue
            mib = r["temp_bytes"] / 2**20
            ratio = f" ({r['temp_bytes'] / ref['temp_bytes']:.3f})" if ref else ""
            cells += [f"{mib:,.1f}{ratio}", "—" if r["step_s"] is None else f"{r['step_s']:.2f}"]
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return lines


def growth(results: list[dict], lengths: list[int], impls: list[str]) -> list[str]:
    """Memory growth factor per doubling of T for each impl (2 = linear, 4 = quadratic)."""
    by = {(r["impl"], r["T"]): r["temp_bytes"] for r in results}
    lines = [
        "| impl | "
        + " | ".join(f"{a} -> {b}" for a, b in zip(lengths, lengths[1:], strict=False))
        + " |"
    ]
    lines.append("|" + "---|" * len(lengths))
    for impl in impls:
        cells = []
        for a, b in zip(lengths, lengths[1:], strict=False):
            if (impl, a) in by and (impl, b) in by:
                cells.append(f"{by[(impl, b)] / by[(impl, a)]:.2f}")
            else:
                cells.append("—")
        lines.append(f"| {impl} | " + " | ".join(cells) + " |")
    return lines


def report(results, args, command: str) -> str:
    import jax

    lengths, impls = args.lengths, args.impls
    return "\n".join([
        "# Attention kernels: memory and time of a train step against context length",
        "", f"Command: `{command}`", "",
        f"Date: {datetime.datetime.now():%Y-%m-%d %H:%M}; jax {jax.__version__}; "
        f"{jax.default_backend()} ({provenance.cpu_name()}), {os.cpu_count()} cores.", "",
        "The `tiny` preset (2 layers, D = 128, 4 heads x 32, 2 kv heads), batch 1: one "
        "training step (forward, backward, AdamW). Temp = XLA's compiled temporary memory; "
        f"step time (median of {args.steps}) only where temp < {args.max_gib} GiB.", "",
        *table(results, lengths, impls), "",
        "Memory growth per doubling of T (2 = linear, 4 = quadratic):", "",
        *growth(results, lengths, impls), "",
    ])  # fmt: skip


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="1024,2048,4096,8192,16384",
                   type=lambda s: [int(x) for x in s.split(",")])  # fmt: skip
    p.add_argument("--impls", default=",".join(IMPLS), type=lambda s: s.split(","))
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    p.add_argument("--max_gib", type=float, default=3.0, help="time only below this temp")
    p.add_argument("--out", default="", type=bench_child.page_path,
                   help="write the markdown report here")  # fmt: skip
    p.add_argument("--only", default="", help=argparse.SUPPRESS)  # child: impl,T
    return p.parse_args(argv)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.only:
        impl, t = args.only.split(",")
        print(json.dumps(measure(impl, int(t), steps=args.steps, max_gib=args.max_gib)))
        return
    results = []
    for t in args.lengths:
        for impl in args.impls:
            child = ["--only", f"{impl},{t}", "--steps", str(args.steps),
                     "--max_gib", str(args.max_gib)]  # fmt: skip
            r = bench_child.run_child(child, script=__file__)
            print(f"T={t:>6} {impl:>12}: {r}", flush=True)
            results += [r] if r else []
    text = report(results, args, "python benchmarks/attention_bench.py " + " ".join(argv))
    bench_child.publish(text, args.out)


if __name__ == "__main__":
    main()
