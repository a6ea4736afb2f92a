"""Where one training step's time goes: a jax.profiler trace summed by source operation.

  python benchmarks/step_profile.py [--size small] [--set model.rope.sites=qkvo]
                                    [--steps 3] [--top 30]
                                    [--out results/performance/step_profile.md]

Builds the step exactly as train.py does (`harness.build`), times it on one
synthetic batch after warm-up, then records `--steps` steps with `jax.profiler.trace`
and reads the trace back (`jax.profiler.ProfileData`). Every XLA kernel in it is
matched with the optimised HLO of the step (the kernel's name is its HLO instruction)
to find the JAX operation it came from (its `op_name`, e.g.
`transpose(jvp(dense_384x2x1024))/dot_general` = the backward of the SwiGLU input
projection) and, for matrix products, their FLOPs. Prints a table of kernel time per
source operation, summed over the threads that ran it, with GFLOP/s for products.

On a CPU the kernels run on the machine's cores in parallel, so the thread-summed
total exceeds the step's wall-clock time; read the shares.
"""

from __future__ import annotations

import argparse
import collections
import glob
import math
import os
import re
import statistics
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (_ROOT, os.path.join(_ROOT, "benchmarks")):  # configs, bench_shapes
    if _path not in sys.path:
        sys.path.insert(0, _path)

import bench_child  # noqa: E402
import bench_shapes  # noqa: E402


def parse_sets(items: list[str], config) -> dict:
    """`--set` items -> {dotted field: value}, each parsed as its field's type.

    The sweep's parser (`rope_jax.experiments.plan`): "a.b=1,c=x" splits before each `key=`;
    a missing '=' raises ValueError.
    """
    from rope_jax.experiments import plan

    fields = plan.leaves(config)
    return {key: plan.parse_value(text, fields.get(key)) for key, text in plan.split_sets(items)}


def kernel_table(hlo_text: str) -> dict:
    """HLO instruction name -> (op_name, FLOPs of the matrix products it computes)."""
    bodies = {
        m.group(1): m.group(0) for m in re.finditer(r"^%([\w.\-]+) .*?^}", hlo_text, re.S | re.M)
    }
    entry = hlo_text[hlo_text.find("ENTRY") :]
    entry_shapes = _shapes(entry)
    table = {}
    for line in entry.splitlines():
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ", line)
        if not m:
            continue
        meta = re.search(r'op_name="([^"]*)"', line)
        calls = re.search(r"calls=%([\w.\-]+)", line)
        if calls:  # a fusion: the products inside its computation
            flops = dot_flops(bodies.get(calls.group(1), ""))
        else:  # a lone instruction: its operands' shapes are the entry's
            flops = dot_flops(line, shapes=entry_shapes)
        table[m.group(1)] = (meta.group(1) if meta else "", flops)
    return table


def _shapes(hlo_text: str) -> dict:
    """HLO instruction name -> its array shape (list of ints)."""
    return {
        m.group(1): [int(d) for d in m.group(2).split(",") if d]
        for m in re.finditer(r"%([\w.\-]+) = \w+\[([\d,]*)\]", hlo_text)
    }


def dot_flops(hlo_text: str, shapes: dict | None = None) -> int:
    """FLOPs of every `dot` in an HLO snippet: 2 x output elements x contracted size.

    Operand shapes are looked up in `shapes` (default: the snippet's own instructions).
    """
    shapes = _shapes(hlo_text) if shapes is None else shapes
    flops = 0
    for m in re.finditer(r"= \w+\[([\d,]*)\]\S* dot\(%([\w.\-]+), %[\w.\-]+\),([^\n]*)", hlo_text):
        out = [int(d) for d in m.group(1).split(",") if d]
        lhs = shapes.get(m.group(2))
        dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", m.group(3))
        if lhs is None or dims is None:
            continue
        contracted = math.prod(lhs[int(d)] for d in dims.group(1).split(",") if d)
        flops += 2 * math.prod(out) * contracted
    return flops


def summarize(events, table: dict, steps: int) -> list[dict]:
    """Kernel events (name, duration ns) -> rows per source op, most time first."""
    time_ns, flops, count = collections.Counter(), collections.Counter(), collections.Counter()
    for name, duration in events:
        if name not in table:
            continue
        op, dot = table[name]
        key = re.sub(r"^jit\([^)]*\)/", "", op) or name
        time_ns[key] += duration
        flops[key] += dot
        count[key] += 1
    rows = []
    for key, ns in time_ns.most_common():
        ms = ns / 1e6 / steps
        rate = (flops[key] / steps) / (ms / 1e3) / 1e9 if flops[key] else None
        rows.append(dict(op=key, ms=ms, kernels=count[key] // steps, gflops=rate))
    return rows


def profile(config, *, steps: int, warmup: int = 2):
    """(median step s, kernel rows, optimised HLO text) of `config`'s train step."""
    import jax
    from jax.profiler import ProfileData

    from rope_jax import harness, sharding

    run = harness.build(config)
    s = dict(B=config.data.global_batch_size, T=config.data.seq_len)
    with sharding.use_mesh(run.mesh, run.rules):
        state = jax.jit(run.init_fn, out_shardings=run.shardings)()
        batch = harness.put_batch(bench_shapes.synthetic_batch(s["B"], s["T"]), run.batch_sharding)
        hlo = run.train_step.lower(state, batch).compile().as_text()
        times = []
        for i in range(warmup + steps):
            start = time.perf_counter()
            state, m = run.train_step(state, batch)
            jax.block_until_ready(m)
            if i >= warmup:
                times.append(time.perf_counter() - start)
        with tempfile.TemporaryDirectory() as trace_dir:
            with jax.profiler.trace(trace_dir):
                for _ in range(steps):
                    state, m = run.train_step(state, batch)
                    jax.block_until_ready(m)
            (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
            data = ProfileData.from_file(path)
            events = [(ev.name, ev.duration_ns) for plane in data.planes
                      for line in plane.lines for ev in line.events]  # fmt: skip
    return statistics.median(times), summarize(events, kernel_table(hlo), steps), hlo


def report(size, sets, step_s, rows, top: int, command: str) -> str:
    import jax

    from rope_jax import provenance  # the CPU by its model name (jax calls every CPU "cpu")

    shape = bench_shapes.shape(size)
    shape.update({"T": sets.get("data.seq_len", shape["T"]),
                  "B": sets.get("data.global_batch_size", shape["B"])})  # fmt: skip
    total = sum(r["ms"] for r in rows)
    dots = sum(r["ms"] for r in rows if r["gflops"])
    lines = [
        f"# Where a training step's time goes (size={size})",
        "",
        f"Command: `{command}`",
        "",
        f"Device: {provenance.devices()}, jax {jax.__version__}. "
        f"Overrides: {sets or 'none'}. Step: {1e3 * step_s:.1f} ms (median), "
        f"{bench_shapes.step_flops(shape) / step_s / 1e9:.1f} model GFLOP/s. "
        f"Kernel time summed over threads: {total:.1f} ms per step, "
        f"{100 * dots / max(total, 1e-9):.0f}% of it in kernels holding matrix products.",
        "",
        "| kernel ms per step | share | kernels | GFLOP/s | source operation |",
        "|---|---|---|---|---|",
    ]
    for r in rows[:top]:
        rate = f"{r['gflops']:.0f}" if r["gflops"] else ""
        lines.append(f"| {r['ms']:.1f} | {100 * r['ms'] / total:.1f}% | {r['kernels']} | "
                     f"{rate} | `{r['op']}` |")  # fmt: skip
    lines += [
        "",
        "Source operation = the JAX operation that produced the kernel (`jvp(...)`: forward, "
        "`transpose(jvp(...))`: backward; einsum strings name the product). A kernel that "
        "fuses a product with elementwise work counts wholly as the product's.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", type=bench_child.preset)
    parser.add_argument("--set", action="append", default=[], help="FIELD=VALUE override")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--out", default="", type=bench_child.page_path)
    args = parser.parse_args(argv)
    from configs import lm
    from rope_jax import harness
    from rope_jax.experiments import plan

    config = lm.get_config(f"size={args.size}")
    try:
        sets = parse_sets(args.set, config)
        plan.apply(config, sets, "--set")  # unknown fields and wrong types: one line
        config = harness.resolve(config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    step_s, rows, _ = profile(config, steps=args.steps)
    command = "python benchmarks/step_profile.py " + " ".join(argv or sys.argv[1:])
    text = report(args.size, sets, step_s, rows, args.top, command.strip())
    bench_child.publish(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
