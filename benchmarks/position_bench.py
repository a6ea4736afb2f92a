r"""What each position scheme costs per training step, beside QK-RoPE, in one run.

  python benchmarks/position_bench.py --out results/performance/position_bench.md
  python benchmarks/position_bench.py --seq_len 128 --steps 3 --impls xla   # quick

The `tiny` preset (2 layers, D = 128, 4 heads of H = 32, 2 kv heads) at batch --batch and
context --seq_len: one full training step (forward, backward, AdamW) per row and kernel
(`model.attention.impl`). Rows: qk (RoPE on q and k), nope (no position signal),
alibi, fire and FoX's forget gate (`model.attention.bias`, with no rotation), fire beside
qk, xPos, half-truncated RoPE with its key offset, and stick-breaking weights (a kernel
that cannot compute a row, as chunked stick-breaking, reads "refused"). Every row's
step is compiled first, then the rows' steps are interleaved --steps times and each
row's least CPU seconds kept (`time.process_time`: the work done, which other programs
on a shared machine disturb far less than the wall clock); the table gives each as a
ratio to qk's with the same kernel, all measured in this one run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rope_jax import provenance  # noqa: E402

ROWS = {  # row -> overrides of the tiny preset
    "qk": {},
    "nope": {"model.rope.sites": ""},
    "alibi": {"model.rope.sites": "", "model.attention.bias": "alibi"},
    "fire": {"model.rope.sites": "", "model.attention.bias": "fire"},
    "qk + fire": {"model.attention.bias": "fire"},
    "fox": {"model.rope.sites": "", "model.attention.bias": "forget"},
    "stick-breaking": {"model.rope.sites": "", "model.attention.stick_breaking": True},
    "xpos": {"model.rope.xpos_scale_base": 512.0},
    "half-trunc + key offset": {
        "model.rope.pairs.rule": "half_truncated",
        "model.rope.key_offset": True,
    },
}


def compiled_step(row: str, impl: str, seq_len: int, batch: int):
    """(compiled train step, initial state, a placed batch) of one row and kernel."""
    import jax
    import numpy as np

    from configs import lm
    from rope_jax import harness, sharding

    config = lm.get_config("size=tiny")
    config.update_from_flattened_dict({**ROWS[row], "model.attention.impl": impl})
    config.data.seq_len, config.data.global_batch_size = seq_len, batch
    config.eval.batch_size = batch
    run = harness.build(config)
    tokens = np.random.default_rng(0).integers(0, 256, (batch, seq_len + 1)).astype(np.int32)
    data = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "weights": np.ones((batch, seq_len), np.float32)}  # fmt: skip
    with sharding.use_mesh(run.mesh, run.rules):
        compiled = run.train_step.lower(
            run.abstract, harness.abstract_batch(batch, seq_len, run.batch_sharding)
        ).compile()
        state = jax.jit(run.init_fn, out_shardings=run.shardings)()
        placed = harness.put_batch(data, run.batch_sharding)
    return compiled, state, placed, run


def measure(impls, seq_len: int, batch: int, steps: int) -> list[dict]:
    import jax

    from rope_jax import sharding

    results = []
    for impl in impls:
        built = {}
        for row in ROWS:
            try:
                built[row] = compiled_step(row, impl, seq_len, batch)
            except ValueError as e:  # the kernel refuses the row (one line): no number
                print(f"{impl} {row}: {e}", file=sys.stderr)
        cpu = {row: [] for row in built}
        for i in range(steps + 1):  # the first round is the warm-up
            for row, (compiled, state, placed, run) in built.items():
                with sharding.use_mesh(run.mesh, run.rules):
                    start = time.process_time()
                    state, metrics = compiled(state, placed)
                    jax.block_until_ready(metrics["loss"])
                    cpu[row] += [time.process_time() - start] if i else []
                built[row] = (compiled, state, placed, run)
        for row in ROWS:
            results.append(
                {"impl": impl, "row": row, "cpu_s": min(cpu[row]) if row in cpu else None}
            )
        print(f"{impl}: " + ", ".join(f"{r} {min(cpu[r]):.3f}s" for r in cpu), file=sys.stderr)
    return results


def report(results: list[dict], args, command: str) -> str:
    import jax

    by = {(r["impl"], r["row"]): r["cpu_s"] for r in results}
    head = "| row | " + " | ".join(f"{i} CPU s | {i} x qk" for i in args.impls) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(args.impls))]
    for row in ROWS:
        cells = []
        for impl in args.impls:
            s, ref = by[(impl, row)], by[(impl, "qk")]
            cells += ["refused", "-"] if s is None else [f"{s:.3f}", f"{s / ref:.2f}"]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join([
        "# Position schemes: the cost of a training step beside QK-RoPE", "",
        f"Command: `{command}`", "",
        f"Date: {datetime.datetime.now():%Y-%m-%d %H:%M}; jax {jax.__version__}; "
        f"{jax.default_backend()} ({provenance.cpu_name()}), {os.cpu_count()} cores.", "",
        f"The `tiny` preset at batch {args.batch}, T = {args.seq_len}: one training step "
        f"(forward, backward, AdamW), the least CPU seconds of {args.steps} interleaved "
        "steps per row, and its ratio to qk with the same kernel (one run).", "",
        *lines, "",
        "Reading: a bias costs its [T, S] term per layer (ALiBi a product, FIRE a 32-wide "
        "MLP per entry, FoX a difference of running sums, in `xla` over the whole square, "
        "in `chunked` per block and again in the backward); qk's rotation is two "
        "elementwise passes over q and k, xPos one more, the key offset one shift; "
        "stick-breaking replaces the softmax by log-sigmoids and a cumulative sum over "
        "each row of the [T, S] scores.",
    ])  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--impls", type=lambda s: s.split(","), default=["xla", "chunked"])
    p.add_argument("--out", default=None, help="write <out> (markdown) and <out>.json")
    args = p.parse_args(argv)
    command = "python benchmarks/position_bench.py " + " ".join(argv or sys.argv[1:])
    results = measure(args.impls, args.seq_len, args.batch, args.steps)
    page = report(results, args, command)
    print(page)
    if args.out:
        base = args.out[:-3] if args.out.endswith(".md") else args.out
        with open(base + ".md", "w") as f:
            f.write(page + "\n")
        with open(base + ".json", "w") as f:
            json.dump({"command": command, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
