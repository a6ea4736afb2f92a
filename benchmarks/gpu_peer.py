"""The `peer` stage: HF `LlamaForCausalLM` in bf16 autocast against ours, at `small`
and at the 1b body with the batch step1b ran."""

from __future__ import annotations

from gpu_common import Context, jax_facts, oom
from gpu_step1b import best_step1b


def peer(ctx: Context) -> None:
    """Ours at `small` in bf16 here (JAX), then the peer (torch) at small and at the 1b
    body with step1b's batch; both sides on the same synthetic batches."""
    import jax
    from bench_child import torch_available
    from train_ours import measure_ours
    from train_peer import measure_peer

    r = ctx.result
    r.update(jax_facts())
    if not torch_available():
        r["skipped"] = "torch or transformers is not installed"
        r["done"] = True
        return
    warm, steps = (1, 2) if ctx.smoke else (3, 8)
    size = "tiny" if ctx.smoke else "small"
    if "ours_small" not in r and ctx.fits(10 if ctx.smoke else 40):
        r["ours_small"] = measure_ours(size, ["bf16"], warmup=warm, steps=steps)["variants"]["bf16"]
        ctx.save()
    jax.clear_caches()
    if "peer_small" not in r and ctx.fits(10 if ctx.smoke else 30):
        r["peer_small"] = measure_peer(size, warmup=warm, steps=steps, dtype="bfloat16")
        ctx.save()
    best = best_step1b(ctx.load("step1b"))
    if best is None:
        r["peer_1b"] = None
        r["note_1b"] = "step1b has no setting that ran: no batch to compare at"
    elif "peer_1b" not in r and ctx.fits(10 if ctx.smoke else 60):
        s = best["setting"]
        r["ours_1b"] = dict(tokens_per_s=best["tokens_per_s"], setting=s, batch=best["batch"])
        try:
            r["peer_1b"] = measure_peer("tiny" if ctx.smoke else "1b", warmup=warm, steps=4,
                                        dtype="bfloat16", batch=best["batch"],
                                        remat=s["remat"] == "block")  # fmt: skip
        except Exception as e:
            if not oom(e):
                raise
            r["peer_1b"] = dict(oom=True, error=str(e).splitlines()[0][:300])
        ctx.save()
    r["done"] = all(k in r for k in ("ours_small", "peer_small", "peer_1b"))
