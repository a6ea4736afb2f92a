"""The training step's matrix products, one by one: XLA (jax.jit) against PyTorch.

  python benchmarks/matmul_bench.py [--size small] [--out results/performance/matmul_bench.md]

A training step of the decoder is mostly matrix products. For each weight of a size
preset (`configs/common.py`) with M = B*T tokens, x [M, Din], W [Din, Dout] and the
output gradient dy [M, Dout], the three products of a dense layer are timed:

  fwd  x @ W        [M, Din] x [Din, Dout]    (NN: both operands row-major)
  dx   dy @ W^T     contracts W's minor dim    (NT)
  dW   x^T @ dy     contracts the token dim    (TN)

plus the attention products (batched over B*K, per batch [T*G, H] x [H, S] and the
like). Each product runs in float32 and in bfloat16 with float32 accumulation, jitted
on the JAX side and as `torch.matmul` (torch threads = cores) on the peer side, each
framework in its own child process (this script with --only=jax|torch), so that
neither shares threads with the other. Times are medians after warm-up.

Per product the table gives both rates and their ratio; the last rows add the times
up with each product's count in one training step: the matmul-only time of a step,
a floor under the step time each framework can reach. Needs the bench venv
(requirements-bench.txt) for the torch side.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (_ROOT, os.path.join(_ROOT, "benchmarks")):  # configs, bench_child
    if _path not in sys.path:
        sys.path.insert(0, _path)

import bench_child  # noqa: E402

from rope_jax import provenance  # noqa: E402

DTYPES = ("float32", "bfloat16")


def products(size: str) -> list[dict]:
    """Every distinct matrix product of one training step of `size`, with its count.

    Each entry: name, batch, (m, k, n), lhs/rhs transposed flags, count per step.
    Dense weights per layer: q (D, N*H), k and v (D, K*H), o (N*H, D), gate+up
    (D, 2F, one stacked product), down (F, D); the head (D, V) once.
    """
    from configs import lm

    c = lm.get_config(f"size={size}")
    m_ = c.model
    d, n, kh, h, f, v = (m_.embed_dim, m_.num_heads, m_.num_kv_heads, m_.head_dim,
                         m_.mlp_dim, m_.vocab_size)  # fmt: skip
    b, t, layers = c.data.global_batch_size, c.data.seq_len, m_.num_layers
    tokens, g = b * t, n // kh
    dense = [("q", d, n * h, layers), ("k, v", d, kh * h, 2 * layers),
             ("o", n * h, d, layers), ("gate+up", d, 2 * f, layers),
             ("down", f, d, layers), ("head", d, v, 1)]  # fmt: skip
    out = []
    for name, din, dout, count in dense:
        out += [
            dict(name=f"{name} fwd", batch=1, mkn=(tokens, din, dout), ta=False, tb=False,
                 count=count),
            dict(name=f"{name} dx", batch=1, mkn=(tokens, dout, din), ta=False, tb=True,
                 count=count),
            dict(name=f"{name} dW", batch=1, mkn=(din, tokens, dout), ta=True, tb=False,
                 count=count),
        ]  # fmt: skip
    bk = b * kh
    out += [  # scores q.k^T, probs.v, and their gradients, batched over B*K
        dict(name="attn q.k^T", batch=bk, mkn=(t * g, h, t), ta=False, tb=True, count=2 * layers),
        dict(name="attn p.v", batch=bk, mkn=(t * g, t, h), ta=False, tb=False, count=2 * layers),
        dict(name="attn p^T.do", batch=bk, mkn=(t, t * g, h), ta=True, tb=False,
             count=2 * layers),
    ]  # fmt: skip
    return out


def _operands(p: dict):
    """Shapes of lhs and rhs as stored (transposed operands stored the other way round)."""
    m, k, n = p["mkn"]
    lhs = (k, m) if p["ta"] else (m, k)
    rhs = (n, k) if p["tb"] else (k, n)
    if p["batch"] > 1:
        lhs, rhs = (p["batch"], *lhs), (p["batch"], *rhs)
    return lhs, rhs


def _median(fn, repeats: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_jax(size: str, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    out = {}
    for dtype in DTYPES:
        for p in products(size):
            lhs, rhs = _operands(p)
            a = jnp.ones(lhs, dtype)
            b = jnp.ones(rhs, dtype)
            ta, tb = p["ta"], p["tb"]

            def mm(x, y, ta=ta, tb=tb):
                x = jnp.swapaxes(x, -1, -2) if ta else x
                y = jnp.swapaxes(y, -1, -2) if tb else y
                return jnp.matmul(x, y, preferred_element_type=jnp.float32)

            fn = jax.jit(mm)
            out[f"{dtype}|{p['name']}"] = _median(
                lambda fn=fn, a=a, b=b: fn(a, b).block_until_ready(), repeats
            )
    return {"side": "jax", "times": out, "version": jax.__version__}


def measure_torch(size: str, repeats: int) -> dict:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    out = {}
    for dtype in DTYPES:
        for p in products(size):
            lhs, rhs = _operands(p)
            a = torch.ones(lhs, dtype=getattr(torch, dtype))
            b = torch.ones(rhs, dtype=getattr(torch, dtype))
            x = a.transpose(-1, -2) if p["ta"] else a
            y = b.transpose(-1, -2) if p["tb"] else b
            with torch.no_grad():
                out[f"{dtype}|{p['name']}"] = _median(lambda x=x, y=y: torch.matmul(x, y), repeats)
    return {"side": "torch", "times": out, "version": torch.__version__}


def report(size: str, ours: dict, peer: dict | None, command: str) -> str:
    rows, totals = [], {}
    for dtype in DTYPES:
        for p in products(size):
            key = f"{dtype}|{p['name']}"
            m, k, n = p["mkn"]
            flops = 2 * p["batch"] * m * k * n
            t_ours = ours["times"][key]
            t_peer = peer["times"][key] if peer else None
            tot = totals.setdefault(dtype, [0.0, 0.0, 0])
            tot[0] += p["count"] * t_ours
            tot[1] += p["count"] * (t_peer or 0.0)
            tot[2] += p["count"] * flops
            shape = f"{p['batch']} x " if p["batch"] > 1 else ""
            form = ("T" if p["ta"] else "N") + ("T" if p["tb"] else "N")
            vs = f"{flops / t_peer / 1e9:.0f} | {t_peer / t_ours:.2f}" if t_peer else "n/a | n/a"
            rows.append(
                f"| {dtype} | {p['name']} | {shape}{m} x {k} x {n} | {form} | {p['count']} | "
                f"{flops / t_ours / 1e9:.0f} | {vs} |"
            )
    lines = [
        f"# The training step's matrix products: XLA vs PyTorch (size={size})",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {os.cpu_count()} CPU cores ({provenance.cpu_name()}), {platform.machine()}. "
        f"Versions: jax {ours['version']}" + (f", torch {peer['version']}" if peer else "") + ".",
        "",
        "| dtype | product | (batch x) M x K x N | form | per step | XLA GFLOP/s | "
        "torch GFLOP/s | XLA / torch speed |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "| dtype | GFLOP per step | XLA matmul ms per step | torch matmul ms per step | "
        "XLA / torch speed |",
        "|---|---|---|---|---|",
    ]
    for dtype, (t_ours, t_peer, flops) in totals.items():
        lines.append(
            f"| {dtype} | {flops / 1e9:.1f} | {1e3 * t_ours:.0f} | "
            + (f"{1e3 * t_peer:.0f} | {t_peer / t_ours:.2f} |" if peer else "n/a | n/a |")
        )
    lines += [
        "",
        "form: N = operand row-major as the product reads it, T = stored transposed "
        "(the backward pass's dx and dW products). Matmul ms per step = sum over the "
        "step's products of count x time: what the step costs if nothing but these "
        "products ran, one after another.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", type=bench_child.preset)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="", type=bench_child.page_path)
    parser.add_argument("--only", default="", help="child: jax | torch")
    args = parser.parse_args(argv)
    if args.only:
        measure = {"jax": measure_jax, "torch": measure_torch}[args.only]
        print(json.dumps(measure(args.size, args.repeats)))
        return 0
    common = [f"--size={args.size}", f"--repeats={args.repeats}"]
    ours = bench_child.run_child(["--only=jax", *common], script=__file__)
    if ours is None:
        return 1
    peer = bench_child.run_child(["--only=torch", *common], script=__file__)
    command = "python benchmarks/matmul_bench.py " + " ".join(argv or sys.argv[1:])
    text = report(args.size, ours, peer, command.strip())
    bench_child.publish(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
