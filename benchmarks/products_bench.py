"""Each dense layer of a training step, forward + backward, in each product form.

  python benchmarks/products_bench.py [--size small] [--repeats 5]
                                      [--out results/performance/products_bench.md]

For every weight of a size preset (q, k, v, o, the stacked SwiGLU gate/up, down, the
head), with M = B*T tokens, times one jitted forward + backward of
`rope_jax.nn.products.dense` (the value and both gradients, dx and dW), round-robin in
one process:

  f32    float32 operands, the plain form (one einsum, XLA's autodiff)
  plain  bfloat16 operands (float32 weights cast at use), the plain form
  split  bfloat16 operands, the split form (float32 results, token-chunked dW)

and reports GFLOP/s (3 products of 2*M*I*O each) and the ratios split / plain and
split / f32. The matmul ceiling of the same run (one 2048^3 product, float32 and
bfloat16 with float32 results) bounds what a 16-bit form can gain over float32.
Times are the minimum over repeats (noise on a shared machine only adds time).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (_ROOT, os.path.join(_ROOT, "benchmarks")):  # configs, bench_*
    if _path not in sys.path:
        sys.path.insert(0, _path)

import bench_child  # noqa: E402
from bench_shapes import shape  # noqa: E402

from rope_jax import provenance  # noqa: E402

FORMS = {"f32": ("float32", "plain"), "plain": ("bfloat16", "plain"),
         "split": ("bfloat16", "split")}  # fmt: skip


def layers(size: str) -> list[tuple[str, tuple, tuple, int]]:
    """(name, x shape, w shape, num_in) of each dense product of one step of `size`."""
    s = shape(size)
    b, t, d, n, k, h, f, v = (s[c] for c in "BTDNKHFV")
    return [
        ("q", (b, t, d), (d, n, h), 1),
        ("k, v", (b, t, d), (d, k, h), 1),
        ("o", (b, t, n, h), (n, h, d), 2),
        ("gate+up", (b, t, d), (d, 2, f), 1),
        ("down", (b, t, f), (f, d), 1),
        ("head", (b, t, d), (d, v), 1),
    ]


def _step_fn(form: str, num_in: int):
    """jitted (x, w, dy) -> (y, dx, dW) of `dense` in `form`."""
    import jax

    from rope_jax.nn import products

    dtype, how = FORMS[form]

    def f(x, w, dy):
        y, vjp = jax.vjp(lambda a, b: products.dense(a, b, num_in=num_in, form=how), x, w)
        return (y, *vjp(dy))

    return jax.jit(f), dtype


def measure(size: str, repeats: int) -> list[dict]:
    """Per layer and form: the minimum seconds of forward + backward."""
    import jax
    import jax.numpy as jnp

    rows = []
    for name, xs, ws, num_in in layers(size):
        x32 = jax.random.normal(jax.random.key(0), xs, jnp.float32)
        w = jax.random.normal(jax.random.key(1), ws, jnp.float32) * ws[0] ** -0.5
        y_shape = xs[: len(xs) - num_in] + ws[num_in:]
        fns = {}
        for form in FORMS:
            fn, dtype = _step_fn(form, num_in)
            x = x32.astype(dtype)
            dy = jnp.ones(y_shape, dtype)
            jax.block_until_ready(fn(x, w, dy))  # compile + warm-up
            fns[form] = (fn, (x, w, dy))
        best = {form: math.inf for form in FORMS}
        for _ in range(repeats):
            for form, (fn, args) in fns.items():
                start = time.perf_counter()
                jax.block_until_ready(fn(*args))
                best[form] = min(best[form], time.perf_counter() - start)
        m = math.prod(xs[: len(xs) - num_in])
        flops = 3 * 2 * m * math.prod(ws)
        rows.append({"name": name, "mio": (m, ws), "flops": flops, "seconds": best})
    return rows


def ceiling() -> dict:
    """GFLOP/s of a 2048^3 product, float32 and bfloat16 with a float32 result."""
    from train_ours import measure_ceiling

    return measure_ceiling(2048)


def report(size: str, rows: list[dict], ceil: dict, command: str) -> str:
    import jax

    gf = lambda r, form: r["flops"] / r["seconds"][form] / 1e9
    lines = [
        f"# Dense layers forward + backward, by product form (size={size})",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {os.cpu_count()} CPU cores ({provenance.cpu_name()}), {platform.machine()}; "
        f"jax {jax.__version__}, backend {jax.default_backend()}. Matmul ceiling in the same "
        f"run (2048^3): float32 {ceil['f32_gflops']:.0f} GFLOP/s, bfloat16 with float32 "
        f"results {ceil['bf16_gflops']:.0f} GFLOP/s "
        f"({ceil['bf16_gflops'] / ceil['f32_gflops']:.2f}x).",
        "",
        "| layer | M x W | f32 GFLOP/s | bf16 plain GFLOP/s | bf16 split GFLOP/s | "
        "split / plain | split / f32 |",
        "|---|---|---|---|---|---|---|",
    ]
    total = {form: 0.0 for form in FORMS}
    for r in rows:
        for form in FORMS:
            total[form] += r["seconds"][form]
        m, ws = r["mio"]
        lines.append(
            f"| {r['name']} | {m} x {list(ws)} | {gf(r, 'f32'):.0f} | {gf(r, 'plain'):.0f} | "
            f"{gf(r, 'split'):.0f} | {r['seconds']['plain'] / r['seconds']['split']:.2f} | "
            f"{r['seconds']['f32'] / r['seconds']['split']:.2f} |"
        )
    lines += [
        f"| all (one of each) | | {sum(r['flops'] for r in rows) / total['f32'] / 1e9:.0f} | "
        f"{sum(r['flops'] for r in rows) / total['plain'] / 1e9:.0f} | "
        f"{sum(r['flops'] for r in rows) / total['split'] / 1e9:.0f} | "
        f"{total['plain'] / total['split']:.2f} | {total['f32'] / total['split']:.2f} |",
        "",
        "GFLOP/s = 3 products (y, dx, dW) of 2*M*I*O FLOPs each over the best time of one "
        "jitted forward + backward. plain = one einsum and XLA's autodiff; split = the "
        "custom backward of `rope_jax.nn.products` (float32 results, the weight gradient "
        "contracted over token chunks [M/c, c], kept float32). The decoder uses split for "
        "16-bit compute on a CPU backend, plain elsewhere.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", type=bench_child.preset)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="", type=bench_child.page_path)
    args = parser.parse_args(argv)
    rows = measure(args.size, args.repeats)
    text = report(args.size, rows, ceiling(), "python " + " ".join(sys.argv))
    bench_child.publish(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
