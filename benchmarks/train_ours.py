"""Our side of benchmarks/train_bench.py: rope_jax train steps and the matmul ceiling.

Each function here runs inside a child process of train_bench.py and returns the dict
that the child prints as its JSON line.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from bench_child import peak_rss_mib
from bench_shapes import shape, synthetic_batch

VARIANTS = {  # name -> dotted config overrides (ours)
    "nope": {"model.rope.sites": ""},
    "qk": {"model.rope.sites": "qk"},
    "qkvo": {"model.rope.sites": "qkvo"},
    "bf16": {"model.dtype": "bfloat16"},
}


def jax_peak_mib() -> float:
    """Peak memory of the JAX side: device peak bytes on a GPU/TPU, else the peak RSS."""
    import jax

    stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    return stats["peak_bytes_in_use"] / 2**20 if stats else peak_rss_mib()


@dataclasses.dataclass
class Variant:
    """One built variant: `harness.build`'s run, its train state, its batches on the devices."""

    run: object
    state: object
    placed: list

    def step(self, batch) -> tuple[dict, float]:
        """One train step on `batch`, state kept: (metrics, seconds until they were ready)."""
        import jax

        from rope_jax import sharding

        with sharding.use_mesh(self.run.mesh, self.run.rules):
            start = time.perf_counter()
            self.state, m = self.run.train_step(self.state, batch)
            jax.block_until_ready(m)
            elapsed = time.perf_counter() - start
        return m, elapsed


def build_variant(size: str, overrides: dict, batches: list[dict]) -> Variant:
    """The size preset with dotted `overrides`, built, initialised, `batches` placed."""
    import jax

    from configs import lm
    from rope_jax import harness, sharding

    config = lm.get_config(f"size={size}")
    config.update_from_flattened_dict(overrides)
    run = harness.build(config)
    with sharding.use_mesh(run.mesh, run.rules):
        state = jax.jit(run.init_fn, out_shardings=run.shardings)()
        placed = [harness.put_batch(b, run.batch_sharding) for b in batches]
    return Variant(run, state, placed)


def _compile(size: str, variants: list[str], batches: list[dict]) -> tuple[dict, dict]:
    """Each variant built and stepped once: ({name: Variant}, {name: seconds it took})."""
    setups, compile_s = {}, {}
    for name in variants:
        start = time.perf_counter()
        setups[name] = build_variant(size, VARIANTS[name], batches)
        setups[name].step(setups[name].placed[0])
        compile_s[name] = time.perf_counter() - start
    return setups, compile_s


def _round_robin(setups: dict, *, warmup: int, steps: int) -> tuple[dict, dict]:
    """`warmup + steps` rounds of one step per variant: ({name: timed s}, {name: losses})."""
    times = {name: [] for name in setups}
    losses = {name: [] for name in setups}
    for i in range(warmup + steps):
        for name, variant in setups.items():
            m, elapsed = variant.step(variant.placed[i % len(variant.placed)])
            losses[name].append(float(m["loss"]))
            if i >= warmup:
                times[name].append(elapsed)
    return times, losses


def measure_ours(
    size: str, variants: list[str], *, warmup: int, steps: int, num_batches: int = 2
) -> dict:
    """Median step time of each variant, compiled up front and timed round-robin."""
    import jax

    s = shape(size)
    batches = [synthetic_batch(s["B"], s["T"], seed) for seed in range(num_batches)]
    setups, compile_s = _compile(size, variants, batches)
    times, losses = _round_robin(setups, warmup=warmup, steps=steps)
    out = {}
    for name in variants:
        med = statistics.median(times[name])
        out[name] = dict(
            step_s=med,
            tokens_per_s=s["B"] * s["T"] / med,
            compile_s=compile_s[name],
            first_loss=losses[name][0],
            last_loss=losses[name][-1],
        )
    return {
        "side": "ours",
        "size": size,
        "variants": out,
        "rss_mib": jax_peak_mib(),
        "jax": jax.__version__,
        "devices": jax.device_count(),
    }


def measure_ceiling(n: int | None = None, repeats: int = 5) -> dict:
    """GFLOP/s of one jitted n^3 matmul: float32, and bfloat16 with float32 accumulation.

    n = 2048 on a CPU, 8192 on an accelerator (a smaller product does not fill it).
    """
    import jax
    import jax.numpy as jnp

    n = n or (2048 if jax.default_backend() == "cpu" else 8192)

    out = {}
    for name, dtype in (("f32", jnp.float32), ("bf16", jnp.bfloat16)):
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
        b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
        fn = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
        jax.block_until_ready(fn(a, b))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(a, b))
            times.append(time.perf_counter() - start)
        out[name + "_gflops"] = 2 * n**3 / statistics.median(times) / 1e9
    return {"side": "ceiling", "n": n, **out}
