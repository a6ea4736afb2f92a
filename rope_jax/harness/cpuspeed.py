"""Whether bfloat16 products are slower than float32's on this CPU: measured, then cached.

  line = cpuspeed.bf16_advice("bfloat16")   # None, or the line train.py prints once

Some CPUs multiply bfloat16 matrices in hardware (AVX512-BF16, AMX) several times faster
than float32; others (no AVX-512) convert and run them slower than float32, so that
`model.dtype=bfloat16` only costs time there. Which kind this CPU is is measured, not
read from its flags: one jitted [M, K] x [K, N] product of each dtype in the form the
model's dense layers run (`nn.products.dense`: bfloat16 operands, float32 result; NN),
best of a few repeats, interleaved (a fraction of a second). The result is kept per CPU
(model name, flags, cores, jax version) in `cache_dir()`, so a machine measures once.

Shape letters: M rows, K contracted, N columns.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from rope_jax import provenance
from rope_jax.harness import workdir
from rope_jax.nn import products

SHAPE = (1024, 512, 512)  # M, K, N: 0.54 GFLOP a product, a few ms in either dtype
REPEATS = 10
FILE = "cpu_products.json"


def cache_dir() -> str:
    """$ROPE_JAX_CACHE_DIR, else $XDG_CACHE_HOME/rope_jax, else ~/.cache/rope_jax."""
    if os.environ.get("ROPE_JAX_CACHE_DIR"):
        return os.environ["ROPE_JAX_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "rope_jax")


def cpu_key() -> str:
    """This CPU as the cache names it: model name, a digest of its flags, cores, jax."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    digest = hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:12]
    cores, version = os.cpu_count(), jax.__version__
    return f"{provenance.cpu_name()} | flags {digest} | {cores} cores | jax {version}"


def measure(shape: tuple[int, int, int] = SHAPE, repeats: int = REPEATS) -> dict:
    """GFLOP/s of one jitted product in bfloat16 (float32 result) and in float32."""
    m, k, n = shape
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
    fns, args = {}, {}
    for name in ("bfloat16", "float32"):
        dtype = jnp.dtype(name)
        fns[name] = jax.jit(lambda x, w, d=dtype: products.dense(
            x, w, dtype=d, out_dtype=jnp.float32, form="plain"))  # fmt: skip
        args[name] = (jnp.asarray(x, dtype), jnp.asarray(w, dtype))
        for _ in range(3):  # compiled and warm (thread pools, packed weights) before timing
            fns[name](*args[name]).block_until_ready()
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):  # interleaved: both see the same machine state
        for name, fn in fns.items():
            start = time.perf_counter()
            fn(*args[name]).block_until_ready()
            best[name] = min(best[name], time.perf_counter() - start)
    flops = 2 * m * k * n
    return {f"{'bf16' if name == 'bfloat16' else 'f32'}_gflops": flops / s / 1e9
            for name, s in best.items()}  # fmt: skip


def cached_measure(measure_fn=measure, directory: str | None = None) -> dict:
    """`measure_fn()` for this CPU, from the cache file when it holds this CPU's entry;
    a new measurement is added to the file (an unwritable cache only loses the entry)."""
    path = os.path.join(directory or cache_dir(), FILE)
    key = cpu_key()
    try:
        with open(path) as f:
            entries = json.load(f)
    except (OSError, ValueError):
        entries = {}
    if isinstance(entries, dict) and isinstance(entries.get(key), dict):
        return entries[key]
    result = {**measure_fn(), "shape": list(SHAPE), "measured": time.strftime("%Y-%m-%d")}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        entries = entries if isinstance(entries, dict) else {}
        workdir.write_atomic(path, json.dumps({**entries, key: result}, indent=1) + "\n")
    except OSError:
        pass
    return result


def bf16_advice(dtype, *, backend: str | None = None, measure_fn=measure,
                directory: str | None = None) -> str | None:  # fmt: skip
    """The line to print when `dtype` is bfloat16 on a CPU whose bfloat16 products are
    measured slower than float32's (`cached_measure`); None otherwise (no measurement
    runs unless bfloat16 on a CPU is asked for)."""
    try:
        name = jnp.dtype(dtype).name
    except TypeError:  # not a dtype: the config check names it later
        name = str(dtype)
    if name != "bfloat16" or (backend or jax.default_backend()) != "cpu":
        return None
    speed = cached_measure(measure_fn, directory)
    bf16, f32 = speed["bf16_gflops"], speed["f32_gflops"]
    if bf16 >= f32:
        return None
    return (f"model.dtype=bfloat16 on this CPU ({provenance.cpu_name()}): its bfloat16 "
            f"products run at {bf16:.0f} GFLOP/s against float32's {f32:.0f} (measured, "
            "cached in " + os.path.join(directory or cache_dir(), FILE) + "); "
            "--config.model.dtype=float32 would be faster here")  # fmt: skip
