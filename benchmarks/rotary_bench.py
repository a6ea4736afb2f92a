"""Times rotary.rotate against the memory floor and a textbook implementation.

  python benchmarks/rotary_bench.py [--shape 8,2048,16,128] [--repeats 20] [--out FILE]

In one run, for float32 and bfloat16 inputs x [B, T, N, H] with positions [B, T]:
  floor     one jitted elementwise pass over x (`x * 2 + 1`): reads x, writes x.
  textbook  a precomputed cos/sin table [max_len, H/2] gathered by position, rotate_half.
  rotate    rope_jax.rotary.rotate (phase computed in-kernel from positions).
Prints median times and the ratios rotate/floor and rotate/textbook; writes a
markdown table. Absolute times are noisy on shared machines: read the ratios.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from rope_jax import provenance, rotary

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_child
import bench_child  # noqa: E402


def _kind(device) -> str:
    """The device's kind; a CPU by its model name (jax calls every CPU "cpu")."""
    return provenance.cpu_name() if device.platform == "cpu" else device.device_kind


def textbook_rotate(x, positions, cos_table, sin_table):
    """cos/sin tables [L, H/2] gathered by position, then rotate_half (layout "half")."""
    cos = cos_table[positions][:, :, None, :].astype(jnp.float32)  # [B, T, 1, H/2]
    sin = sin_table[positions][:, :, None, :].astype(jnp.float32)
    xf = x.astype(jnp.float32)
    u, v = jnp.split(xf, 2, axis=-1)
    return jnp.concatenate([u * cos - v * sin, u * sin + v * cos], axis=-1).astype(x.dtype)


def _median_seconds(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm-up
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(shape, dtype, repeats):
    b, t, _, h = shape
    x = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(dtype)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    phase = np.arange(t)[:, None] * rotary.frequencies(h)[None].astype(np.float64)
    cos_table = jnp.asarray(np.cos(phase), jnp.float32)
    sin_table = jnp.asarray(np.sin(phase), jnp.float32)

    floor = jax.jit(lambda a: a * 2 + 1)
    ours = jax.jit(lambda a, p: rotary.rotate(a, p))
    book = jax.jit(textbook_rotate)
    np.testing.assert_allclose(
        np.asarray(ours(x, positions), np.float32),
        np.asarray(book(x, positions, cos_table, sin_table), np.float32),
        atol=2e-2 if dtype == jnp.bfloat16 else 1e-3,
    )
    t_floor = _median_seconds(floor, x, repeats=repeats)
    t_ours = _median_seconds(ours, x, positions, repeats=repeats)
    t_book = _median_seconds(book, x, positions, cos_table, sin_table, repeats=repeats)
    gbytes = 2 * x.size * x.dtype.itemsize / 1e9  # read + write of x
    return dict(
        dtype=jnp.dtype(dtype).name,
        floor_ms=1e3 * t_floor,
        textbook_ms=1e3 * t_book,
        rotate_ms=1e3 * t_ours,
        floor_gbs=gbytes / t_floor,
        vs_floor=t_ours / t_floor,
        vs_textbook=t_ours / t_book,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8,2048,16,128", help="B,T,N,H")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="", type=bench_child.page_path,
                        help="markdown file to write")  # fmt: skip
    args = parser.parse_args(argv)
    shape = tuple(int(s) for s in args.shape.split(","))
    rows = [bench(shape, dt, args.repeats) for dt in (jnp.float32, jnp.bfloat16)]

    header = (
        "| dtype | floor ms | textbook ms | rotate ms | floor GB/s | rotate / floor "
        "| rotate / textbook |\n|---|---|---|---|---|---|---|"
    )
    lines = [header] + [
        f"| {r['dtype']} | {r['floor_ms']:.1f} | {r['textbook_ms']:.1f} | {r['rotate_ms']:.1f} "
        f"| {r['floor_gbs']:.2f} | {r['vs_floor']:.2f} | {r['vs_textbook']:.2f} |"
        for r in rows
    ]
    device = jax.devices()[0]
    text = "\n".join(
        [
            "# rotary.rotate vs the memory floor and a textbook implementation",
            "",
            f"Command: `python benchmarks/rotary_bench.py --shape {args.shape} "
            f"--repeats {args.repeats}{' --out ' + args.out if args.out else ''}`",
            "",
            f"x [B, T, N, H] = {list(shape)}, positions [B, T] int32; median of "
            f"{args.repeats} timed calls after warm-up. Device: {device.platform} "
            f"({_kind(device)}, {jax.device_count()} device(s)), jax {jax.__version__}, "
            f"{platform.machine()}.",
            "",
            *lines,
            "",
            "floor = one jitted `x * 2 + 1` over the same array (read + write once);",
            "textbook = cos/sin table [T, H/2] precomputed on the host, gathered by position.",
            "Targets: rotate / floor <= 1.3, rotate / textbook <= 1.0.",
            "",
        ]
    )
    bench_child.publish(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
