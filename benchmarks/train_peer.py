"""The PyTorch peer of benchmarks/train_bench.py: HF transformers LlamaForCausalLM.

`measure_peer` runs inside a child process of train_bench.py (needs the bench venv,
requirements-bench.txt) and returns the dict that the child prints as its JSON line.
With `compile=MODE` the model's forward and loss run through `torch.compile(mode=MODE)`
(TorchInductor: generated C++/OpenMP kernels on a CPU, Triton on a GPU; the backward
compiled with them by AOTAutograd), as a PyTorch user would train; the optimiser step
stays eager.
"""

from __future__ import annotations

import os
import statistics
import time

from bench_child import peak_rss_mib
from bench_shapes import shape, synthetic_batch


def peer_model(s: dict):
    """HF LlamaForCausalLM with our shape: untied head, sdpa attention, float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=s["V"],
        hidden_size=s["D"],
        intermediate_size=s["F"],
        num_hidden_layers=s["L"],
        num_attention_heads=s["N"],
        num_key_value_heads=s["K"],
        head_dim=s["H"],
        max_position_embeddings=s["T"],
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).float()


def _torch_device() -> str:
    """Sets torch's threads (all cores) and seed (0); "cuda" if there is a GPU, else "cpu"."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":  # TF32 for float32 matmuls, as XLA does by default on GPUs
        torch.set_float32_matmul_precision("high")
    return device


def _adamw(model, optim):
    """torch AdamW with our optimiser's lr and betas; weight decay on matrices only;
    the fused kernel on a GPU."""
    import torch

    fused = next(model.parameters()).is_cuda
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": optim.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=optim.lr,
        betas=(optim.b1, optim.b2),
        **({"fused": True} if fused else {}),
    )


def _torch_batches(s: dict, device: str, num_batches: int) -> list[dict]:
    """`synthetic_batch` [B, T] int64 tensors on `device`, seeds 0.., "weights" dropped."""
    import torch

    return [
        {
            k: torch.from_numpy(v).long().to(device)
            for k, v in synthetic_batch(s["B"], s["T"], seed).items()
            if k != "weights"
        }
        for seed in range(num_batches)
    ]


def _loss_fn(model, vocab: int, compile_mode: str = ""):
    """(inputs, targets) -> mean cross-entropy of the model's logits (float32), through
    `torch.compile(mode=compile_mode)` when a mode is given."""
    import torch

    def loss(inputs, targets):
        logits = model(input_ids=inputs).logits  # [B, T, V]
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, vocab).float(), targets.reshape(-1)
        )

    return torch.compile(loss, mode=compile_mode) if compile_mode else loss


def _train_step(model, opt, batch: dict, *, loss_fn, clip: float, dtype: str) -> float:
    """Forward, cross-entropy (`loss_fn`), backward, clip, AdamW step: the loss.

    dtype "bfloat16": the forward under `torch.autocast` (bfloat16 matmuls, float32
    master weights, optimiser state and loss), torch's mixed precision, as ours.
    """
    import torch

    device = batch["inputs"].device.type
    with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
        loss = loss_fn(batch["inputs"], batch["targets"])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def _time_steps(step, batches: list, *, warmup: int, steps: int) -> tuple[list, list]:
    """`step` over `batches` in turn, `warmup + steps` times: (timed seconds, all losses)."""
    times, losses = [], []
    for i in range(warmup + steps):
        start = time.perf_counter()
        losses.append(step(batches[i % len(batches)]))
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times, losses


def measure_peer(
    size: str,
    *,
    warmup: int,
    steps: int,
    num_batches: int = 2,
    dtype: str = "float32",
    batch: int | None = None,
    remat: bool = False,
    compile: str = "",
) -> dict:
    """Median step time of the peer: forward, cross-entropy, backward, clip, AdamW.

    dtype: "float32", or "bfloat16" compute under autocast (`_train_step`).
    batch: sequences per step instead of the preset's. remat: HF gradient checkpointing
    (each decoder layer recomputed in the backward, as our `model.remat=block`).
    compile: a `torch.compile` mode ("default", "max-autotune-no-cudagraphs", ...) for
    the forward and loss, or "" (eager); the first step's time, compile included, is
    returned as `first_step_s`.
    """
    import torch
    import transformers

    from configs import lm

    device = _torch_device()
    s, optim = shape(size), lm.get_config(f"size={size}").optim
    if batch:
        s["B"] = batch
    model = peer_model(s).to(device)
    if remat:
        model.gradient_checkpointing_enable()
    model.train()
    opt = _adamw(model, optim)
    batches = _torch_batches(s, device, num_batches)
    clip = optim.grad_clip_norm
    loss_fn = _loss_fn(model, s["V"], compile)
    step = lambda batch: _train_step(model, opt, batch, loss_fn=loss_fn, clip=clip, dtype=dtype)
    start = time.perf_counter()
    first_loss = step(batches[0])  # compiles, when compiling
    first_step_s = time.perf_counter() - start
    times, losses = _time_steps(step, batches, warmup=max(warmup - 1, 0), steps=steps)
    losses = [first_loss, *losses]
    med = statistics.median(times)
    return {
        "side": "peer",
        "size": size,
        "dtype": dtype,
        "step_s": med,
        "tokens_per_s": s["B"] * s["T"] / med,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "rss_mib": (
            torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else peak_rss_mib()
        ),
        "device": device,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "attn": model.config._attn_implementation,
        "batch": s["B"],
        "seq_len": s["T"],
        "remat": remat,
        "fused_adamw": device == "cuda",
        "compile": compile,
        "first_step_s": first_step_s,
    }
