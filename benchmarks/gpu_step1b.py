"""The `step1b` stage: the `1b` preset in bf16 at each setting of STEP1B_SETTINGS, in
order while time lasts: tokens/s, MFU (full and causal count), peak device memory."""

from __future__ import annotations

import gc
import statistics
import time

from gpu_common import Context, jax_facts, log, oom

# step1b: tried in this order while time lasts (remat none first: no recomputation)
STEP1B_SETTINGS = (
    dict(impl="dot_product", remat="none", batch=8, microbatches=1),
    dict(impl="dot_product", remat="block", batch=16, microbatches=1),
    dict(impl="chunked", remat="none", batch=8, microbatches=1),
)


def _peak(kind: str) -> float | None:
    from rope_jax.harness import cost

    for name, peak in cost.PEAK_BF16.items():
        if name.split()[0] in kind:
            return peak
    return None


def _time_train(config, *, warmup: int, steps: int) -> dict:
    """Builds `config`, compiles its train step, times `steps` steps after `warmup`."""
    import jax
    from bench_shapes import synthetic_batch

    from rope_jax import harness, sharding
    from rope_jax.harness import flops

    run = harness.build(config, vocab_from_data=False)
    b, t = config.data.global_batch_size, config.data.seq_len
    before = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    t0 = time.time()
    with sharding.use_mesh(run.mesh, run.rules):
        state = jax.jit(run.init_fn, out_shardings=run.shardings)()
        batches = [harness.put_batch(synthetic_batch(b, t, s), run.batch_sharding)
                   for s in range(2)]  # fmt: skip
        compiled = run.train_step.lower(state, batches[0]).compile()
        mem = compiled.memory_analysis()
        compile_s = time.time() - t0
        times, losses = [], []
        for i in range(warmup + steps):
            start = time.perf_counter()
            state, m = compiled(state, batches[i % 2])
            losses.append(float(jax.block_until_ready(m)["loss"]))
            if i >= warmup:
                times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    stats = jax.devices()[0].memory_stats() or {}
    del state, batches, compiled
    gc.collect()
    return dict(
        step_s=step_s,
        tokens_per_s=b * t / step_s,
        compile_s=compile_s,
        flops_per_token=flops.flops_per_token(config),
        flops_per_token_causal=flops.flops_per_token(config, causal=True),
        remat_flops_per_token=flops.remat_flops_per_token(config),
        params=flops.num_params(config.model),
        first_loss=losses[0],
        last_loss=losses[-1],
        peak_bytes=stats.get("peak_bytes_in_use"),  # the process's peak so far
        peak_bytes_before=before,  # ... before this setting: equal after = not raised by it
        program_bytes=None if mem is None else dict(
            arguments=mem.argument_size_in_bytes, outputs=mem.output_size_in_bytes,
            temp=mem.temp_size_in_bytes, aliased=mem.alias_size_in_bytes),
    )  # fmt: skip


def step1b(ctx: Context) -> None:
    import jax

    from configs import lm

    r = ctx.result
    r.update(jax_facts())
    peak = _peak(r["device"])
    ceiling = (ctx.load("check").get("ceiling") or {}).get("bf16_gflops")
    r["peak_flops"], r["ceiling_gflops"] = peak, ceiling
    runs = r.setdefault("settings", {})
    size = "tiny" if ctx.smoke else "1b"
    settings = STEP1B_SETTINGS[:1] if ctx.smoke else STEP1B_SETTINGS
    for s in settings:
        key = f"{s['impl']} remat={s['remat']} B={s['batch']} k={s['microbatches']}"
        if key in runs:
            continue
        if not ctx.fits(15 if ctx.smoke else 90):
            return
        config = lm.get_config(f"size={size}")
        config.update_from_flattened_dict({
            "model.dtype": "bfloat16", "model.attention.impl": s["impl"],
            "model.remat": s["remat"], "data.global_batch_size": 4 if ctx.smoke else s["batch"],
            "train.microbatches": s["microbatches"]})  # fmt: skip
        log(f"step1b: {key}")
        try:
            m = _time_train(config, warmup=1 if ctx.smoke else 2, steps=2 if ctx.smoke else 5)
        except Exception as e:  # an OOM is a result: this setting does not fit
            if not oom(e):
                raise
            runs[key] = dict(setting=s, oom=True, error=str(e).splitlines()[0][:300])
            jax.clear_caches()
            gc.collect()
            ctx.save()
            continue
        m["setting"], m["order"], m["size"] = s, len(runs), size  # order: as run, all calls
        m["seq_len"], m["batch"] = config.data.seq_len, config.data.global_batch_size
        if peak:
            m["mfu"] = m["tokens_per_s"] * m["flops_per_token"] / peak
            m["mfu_causal"] = m["tokens_per_s"] * m["flops_per_token_causal"] / peak
        if ceiling:
            m["of_ceiling"] = m["tokens_per_s"] * m["flops_per_token"] / (ceiling * 1e9)
        runs[key] = m
        log(f"step1b: {key}: {m['tokens_per_s']:,.0f} tok/s, MFU {m.get('mfu')}, "
             f"compile {m['compile_s']:.0f} s")  # fmt: skip
        jax.clear_caches()
        ctx.save()
    r["done"] = True


def best_step1b(result: dict) -> dict | None:
    """The fastest setting step1b ran (no OOM), or None."""
    ran = [m for m in result.get("settings", {}).values() if not m.get("oom")]
    return max(ran, key=lambda m: m["tokens_per_s"]) if ran else None
