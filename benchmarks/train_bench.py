"""Training-step throughput against the PyTorch peer, rotation overhead, input pipeline.

  python benchmarks/train_bench.py [--sizes tiny,small] [--out results/perf.md]

Needs the bench venv for the peer (requirements-bench.txt: torch CPU + transformers);
without torch the peer columns read "n/a". Every measurement runs in its own child
process (this script with `--only=...`), which prints one JSON line: the peak RSS of
each framework is then its own, and JAX and torch never share a process's threads.
In one run, for each size of `configs/common.py` (tiny, small):

  ours      rope_jax.harness.build(lm.get_config("size=S")).train_step, float32.
  peer      HF transformers LlamaForCausalLM of the same shape (vocab 259, untied head,
            sdpa attention), torch.optim.AdamW (same lr, betas, decay on matrices,
            clip 1.0), float32, torch.set_num_threads(cores).
  variants  ours with rope.sites "" (NoPE), "qk", "qkvo" and bfloat16 compute
            (float32 parameters), compiled in one child and timed round-robin, so
            their ratios share the machine's state.
  pipeline  (benchmarks/pipeline_bench.py) train.py's loop on real Shakespeare batches
            (next(harness.Prefetch) + step) against the same loop on one
            pre-placed batch.
  ceiling   a jitted 2048^3 matmul, 8192^3 on a GPU/TPU (float32; bfloat16 inputs, float32
            accumulation).
  layouts   (pipeline_bench.py) layouts.positions / batch_positions for 256 mixed text/image/video
            sequences of 2,048 tokens (rope_tv, mrope) against one step of that batch.

Synthetic batches: uniform random bytes [B, T+1] (numpy seed 0), the same for both
frameworks. Times are medians of timed steps after warm-up steps. Absolute times are
noisy on shared machines: read the ratios, measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (_ROOT, os.path.join(_ROOT, "benchmarks")):  # configs, pipeline_bench
    if _path not in sys.path:
        sys.path.insert(0, _path)

import pipeline_bench  # noqa: E402

SIZES = ("tiny", "small")
VARIANTS = {  # name -> dotted config overrides (ours)
    "nope": {"model.rope.sites": ""},
    "qk": {"model.rope.sites": "qk"},
    "qkvo": {"model.rope.sites": "qkvo"},
    "bf16": {"model.dtype": "bfloat16"},
}
DEFAULT_STEPS = {"tiny": (5, 30), "small": (2, 8)}  # (warm-up, timed) steps per size
NOTES_HEADING = "## Notes"  # a trailing section of --out that the benchmark keeps


# ------------------------------------------------------------------ shapes and FLOPs


def shape(size: str) -> dict:
    """Model and batch shape of a size preset: L, D, N, K, H, F, V, T, B."""
    from configs import lm

    c = lm.get_config(f"size={size}")
    m = c.model
    return dict(
        L=m.num_layers,
        D=m.embed_dim,
        N=m.num_heads,
        K=m.num_kv_heads,
        H=m.head_dim,
        F=m.mlp_dim,
        V=m.vocab_size,
        T=c.data.seq_len,
        B=c.data.global_batch_size,
    )


def matmul_params(s: dict) -> int:
    """Weights that enter a matmul: per layer q, k, v, o and SwiGLU, plus the head.

    The embedding table (a gather) and the norms' scales (elementwise) are left out.
    """
    d, n, k, h, f = s["D"], s["N"], s["K"], s["H"], s["F"]
    per_layer = d * n * h + 2 * d * k * h + n * h * d + 3 * d * f
    return s["L"] * per_layer + d * s["V"]


def step_flops(s: dict, *, batch: int | None = None, seq_len: int | None = None) -> int:
    """Model FLOPs of one training step (forward + backward = 3x forward):

      6 * P * B*T  +  12 * L * B * T^2 * N*H

    P = `matmul_params`; the second term is q.k and probs.v (2 * 2 * T^2 * N*H per
    layer and sequence forward), counted over the full T x T square (no causal
    halving, as in the PaLM MFU convention). Softmax, norms, rotation and the
    optimiser are not counted.
    """
    b = s["B"] if batch is None else batch
    t = s["T"] if seq_len is None else seq_len
    return 6 * matmul_params(s) * b * t + 12 * s["L"] * b * t * t * s["N"] * s["H"]


def synthetic_batch(b: int, t: int, seed: int = 0) -> dict:
    """{"inputs", "targets"} int32 [B, T] of random bytes, "weights" float32 ones."""
    tokens = np.random.default_rng(seed).integers(0, 256, (b, t + 1)).astype(np.int32)
    return {
        "inputs": np.ascontiguousarray(tokens[:, :-1]),
        "targets": np.ascontiguousarray(tokens[:, 1:]),
        "weights": np.ones((b, t), np.float32),
    }


def peak_rss_mib() -> float:
    """This process's peak resident set size (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def jax_peak_mib() -> float:
    """Peak memory of the JAX side: device peak bytes on a GPU/TPU, else the peak RSS."""
    import jax

    stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    return stats["peak_bytes_in_use"] / 2**20 if stats else peak_rss_mib()


# ------------------------------------------------------------------ children: ours


def _ours_setup(size: str, overrides: dict, batches: list[dict]):
    import jax

    from configs import lm
    from rope_jax import harness, sharding

    config = lm.get_config(f"size={size}")
    config.update_from_flattened_dict(overrides)
    run = harness.build(config)
    with sharding.use_mesh(run.mesh, run.rules):
        state = jax.jit(run.init_fn, out_shardings=run.shardings)()
        placed = [harness.put_batch(b, run.batch_sharding) for b in batches]
    return config, run, state, placed


def measure_ours(
    size: str, variants: list[str], *, warmup: int, steps: int, num_batches: int = 2
) -> dict:
    """Median step time of each variant, compiled up front and timed round-robin."""
    import jax

    from rope_jax import sharding

    s = shape(size)
    batches = [synthetic_batch(s["B"], s["T"], seed) for seed in range(num_batches)]
    setups, compile_s = {}, {}
    for name in variants:
        start = time.perf_counter()
        setups[name] = list(_ours_setup(size, VARIANTS[name], batches))
        config, run, state, placed = setups[name]
        with sharding.use_mesh(run.mesh, run.rules):
            state, m = run.train_step(state, placed[0])
            jax.block_until_ready(m)
        setups[name][2] = state
        compile_s[name] = time.perf_counter() - start
    times = {name: [] for name in variants}
    losses = {name: [] for name in variants}
    for i in range(warmup + steps):
        for name in variants:
            config, run, state, placed = setups[name]
            with sharding.use_mesh(run.mesh, run.rules):
                start = time.perf_counter()
                state, m = run.train_step(state, placed[i % len(placed)])
                jax.block_until_ready(m)
                elapsed = time.perf_counter() - start
            setups[name][2] = state
            losses[name].append(float(m["loss"]))
            if i >= warmup:
                times[name].append(elapsed)
    tokens = s["B"] * s["T"]
    out = {}
    for name in variants:
        med = statistics.median(times[name])
        out[name] = dict(
            step_s=med,
            tokens_per_s=tokens / med,
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


# ------------------------------------------------------------------ children: peer


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


def measure_peer(size: str, *, warmup: int, steps: int, num_batches: int = 2) -> dict:
    """Median step time of the peer: forward, cross-entropy, backward, clip, AdamW."""
    import torch
    import transformers

    from configs import lm

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":  # TF32 for float32 matmuls, as XLA does by default on GPUs
        torch.set_float32_matmul_precision("high")
    s, optim = shape(size), lm.get_config(f"size={size}").optim
    model = peer_model(s).to(device)
    model.train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": optim.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=optim.lr,
        betas=(optim.b1, optim.b2),
    )
    batches = [
        {
            k: torch.from_numpy(v).long().to(device)
            for k, v in synthetic_batch(s["B"], s["T"], seed).items()
            if k != "weights"
        }
        for seed in range(num_batches)
    ]

    def step(batch):
        logits = model(input_ids=batch["inputs"]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, s["V"]).float(), batch["targets"].reshape(-1)
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    times, losses = [], []
    for i in range(warmup + steps):
        start = time.perf_counter()
        losses.append(step(batches[i % len(batches)]))
        if i >= warmup:
            times.append(time.perf_counter() - start)
    med = statistics.median(times)
    return {
        "side": "peer",
        "size": size,
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
    }


# ------------------------------------------------------------------ children: others


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


# ------------------------------------------------------------------ parent


def run_child(args: list[str], *, timeout: float = 1800, script: str = __file__) -> dict | None:
    """Runs `script` (default this one) as a child with `args`; its last stdout line is JSON."""
    cmd = [sys.executable, os.path.abspath(script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        sys.stderr.write(f"child {' '.join(args)} failed:\n{proc.stderr[-3000:]}\n")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def torch_available() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


def render_table(header: list[str], rows: list[list]) -> str:
    """A markdown table; floats printed as given (format them before)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"row {row} has {len(row)} cells, header has {len(header)}")
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


def _fmt(x, spec: str = ".2f", na: str = "n/a") -> str:
    return na if x is None else format(x, spec)


def _ratio(a, b):
    return None if a is None or b is None or not b else a / b


def _mark(value, target: float, *, higher: bool = True) -> str:
    if value is None:
        return "n/a"
    ok = value >= target if higher else value <= target
    return f"{value:.2f} ({'met' if ok else 'NOT met'})"


def summarize(
    size: str, ours: dict | None, peer: dict | None, variants: dict | None, ceiling: dict | None
) -> dict:
    """Every number of one size's row from the children's JSON."""
    s = shape(size)
    flops = step_flops(s)
    f32 = ours["variants"]["qk"] if ours else None
    var = variants["variants"] if variants else {}
    ceil = ceiling["f32_gflops"] * 1e9 if ceiling else None
    peer_s = peer["step_s"] if peer else None
    return {
        "size": size,
        "tokens": s["B"] * s["T"],
        "flops": flops,
        "ours_tok_s": f32 and f32["tokens_per_s"],
        "peer_tok_s": peer and peer["tokens_per_s"],
        "bf16_tok_s": var.get("bf16", {}).get("tokens_per_s"),
        "ours_vs_peer": _ratio(f32 and f32["tokens_per_s"], peer and peer["tokens_per_s"]),
        "bf16_vs_f32": _ratio(
            var.get("bf16", {}).get("tokens_per_s"), var.get("qk", {}).get("tokens_per_s")
        ),
        "ours_mfu": _ratio(f32 and flops / f32["step_s"], ceil),
        "peer_mfu": _ratio(peer_s and flops / peer_s, ceil),
        "qk_vs_nope": _ratio(var.get("qk", {}).get("step_s"), var.get("nope", {}).get("step_s")),
        "qkvo_vs_nope": _ratio(
            var.get("qkvo", {}).get("step_s"), var.get("nope", {}).get("step_s")
        ),
        "ours_rss": ours and ours["rss_mib"],
        "peer_rss": peer and peer["rss_mib"],
        "ours_step_s": f32 and f32["step_s"],
        "peer_step_s": peer_s,
        "variants": var,
    }


def report(rows: list[dict], ceiling, pipelines, lay, meta: dict) -> str:
    """The markdown report (everything but the kept notes section)."""
    ceil_f32 = ceiling and ceiling["f32_gflops"]
    table = render_table(
        [
            "size",
            "ours tok/s f32",
            "peer tok/s f32",
            "ours/peer f32 (>=1.0)",
            "ours bf16 tok/s",
            "ours bf16 / peer f32 (>=1.5)",
            "bf16/f32 ours",
            "MFU ours (>=0.60)",
            "MFU peer",
            "qk/nope (<=1.05)",
            "qkvo/nope (<=1.10)",
            "peak mem ours MiB",
            "peak mem peer MiB",
        ],
        [
            [
                r["size"],
                _fmt(r["ours_tok_s"], ",.0f"),
                _fmt(r["peer_tok_s"], ",.0f"),
                _mark(r["ours_vs_peer"], 1.0),
                _fmt(r["bf16_tok_s"], ",.0f"),
                _mark(_ratio(r["bf16_tok_s"], r["peer_tok_s"]), 1.5),
                _fmt(r["bf16_vs_f32"]),
                _mark(r["ours_mfu"], 0.60),
                _fmt(r["peer_mfu"]),
                _mark(r["qk_vs_nope"], 1.05, higher=False),
                _mark(r["qkvo_vs_nope"], 1.10, higher=False),
                _fmt(r["ours_rss"], ",.0f"),
                _fmt(r["peer_rss"], ",.0f"),
            ]
            for r in rows
        ],
    )
    steps = render_table(
        [
            "size",
            "tokens/step",
            "model GFLOP/step",
            "ours f32 step ms",
            "peer f32 step ms",
            "nope ms",
            "qk ms",
            "qkvo ms",
            "bf16 ms",
            "ours GFLOP/s",
            "peer GFLOP/s",
        ],
        [
            [
                r["size"],
                f"{r['tokens']:,}",
                f"{r['flops'] / 1e9:.2f}",
                _fmt(r["ours_step_s"] and 1e3 * r["ours_step_s"], ".1f"),
                _fmt(r["peer_step_s"] and 1e3 * r["peer_step_s"], ".1f"),
                *[
                    _fmt(
                        r["variants"].get(v, {}).get("step_s") and 1e3 * r["variants"][v]["step_s"],
                        ".1f",
                    )
                    for v in ("nope", "qk", "qkvo", "bf16")
                ],
                _fmt(r["ours_step_s"] and r["flops"] / r["ours_step_s"] / 1e9, ".1f"),
                _fmt(r["peer_step_s"] and r["flops"] / r["peer_step_s"] / 1e9, ".1f"),
            ]
            for r in rows
        ],
    )
    pipe = render_table(
        [
            "size",
            "steps",
            "step ms (pre-placed)",
            "step ms (real data)",
            "next ms/step",
            "next / step (<5%)",
            "wall-clock cost of real data",
        ],
        [
            [
                p["size"],
                p["steps"],
                f"{1e3 * p['step_s_fixed']:.1f}",
                f"{1e3 * p['step_s_real']:.1f}",
                f"{1e3 * p['wait_s']:.2f}",
                f"{100 * p['wait_share']:.2f}%",
                f"{100 * p['wall_share']:.2f}%",
            ]
            for p in pipelines
        ],
    )
    lines = [
        "# Training-step performance: rope_jax vs the PyTorch peer",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Date: {meta['date']}. Machine: {meta['machine']}. Versions: {meta['versions']}.",
        "",
        "Median of timed steps after warm-up (tiny "
        f"{meta['steps']['tiny']}, small {meta['steps']['small']} (warm-up, timed)); each side "
        "in its own child process. Peer = HF transformers `LlamaForCausalLM` (same shape, "
        "untied head, sdpa attention), torch.optim.AdamW, float32, "
        f"torch threads = {meta['threads']}; ours = `rope_jax.harness` train_step "
        "(float32, sites qk unless noted; JAX uses all cores). Synthetic random-byte batches, "
        "the same for both." + meta.get("note", ""),
        "",
        table,
        "",
        steps,
        "",
        f"Matmul ceiling (jitted {ceiling and ceiling['n']}^3, same run): "
        f"float32 {_fmt(ceil_f32, '.1f')} GFLOP/s, "
        f"bfloat16 inputs with float32 accumulation "
        f"{_fmt(ceiling and ceiling['bf16_gflops'], '.1f')} GFLOP/s. MFU = model FLOPs per step "
        "/ step time / float32 ceiling, model FLOPs = 6 * P * B*T + 12 * L * B * T^2 * N*H "
        "(P = weights that enter a matmul: q, k, v, o, SwiGLU and the head; no embedding "
        "table; attention over the full T x T square; softmax, norms, rotation and the "
        "optimiser uncounted). The same FLOPs are used for the peer.",
        "",
        "qk/nope and qkvo/nope: step time with `model.rope.sites` = qk / qkvo over sites = "
        "'' (NoPE), compiled in one child and timed round-robin with bf16 (the `nope, qk, "
        "qkvo, bf16` ms columns; the headline f32 column is the separate child that also "
        "gives the peak memory: the process's peak RSS on a CPU, the device's peak "
        "allocation on a GPU).",
        "",
        "## Input pipeline",
        "",
        pipe,
        "",
        "train.py's loop structure (`next(batches)` from `harness.Prefetch`, which runs "
        "`put_batch(next(it))` two batches ahead in a thread; `train_step`; losses fetched "
        "every log_every_steps) on real Shakespeare batches from "
        "`data.make_train_iterator(config.data, seed=0, batch_size=B)`, against the same "
        "loop on one pre-placed batch; best of the rounds. next = host time the loop "
        "spends getting the next batch (the step of the previous iteration may still be "
        "running then, JAX dispatches asynchronously); wall-clock cost = (real - "
        "pre-placed) / real.",
        "",
    ]
    if lay:
        small = next((r for r in rows if r["size"] == "small"), rows[-1] if rows else None)
        big = dict(shape("small"), B=lay["num"], T=lay["seq_len"])
        flops = step_flops(big)
        rate = small and small["ours_step_s"] and small["flops"] / small["ours_step_s"]
        est = rate and flops / rate
        lines += [
            "## Multimodal positions vs a training step",
            "",
            render_table(
                [
                    "scheme",
                    "positions() x 256 s",
                    "batch_positions() s",
                    "estimated small step of that batch s",
                    "batch_positions / step",
                ],
                [
                    [
                        scheme,
                        f"{lay[scheme]['positions_s']:.3f}",
                        f"{lay[scheme]['batch_positions_s']:.3f}",
                        _fmt(est, ".2f"),
                        _fmt(_ratio(lay[scheme]["batch_positions_s"], est), ".5f"),
                    ]
                    for scheme in ("rope_tv", "mrope")
                ],
            ),
            "",
            f"{lay['num']} sequences of {lay['seq_len']:,} tokens ({lay['segments']:,} "
            "text/image/video segments, 3 axes), best of 3. The step of that batch (small "
            f"model at B = {lay['num']}, T = {lay['seq_len']}: {flops / 1e12:.2f} model "
            "TFLOP) is not run: it is estimated from the "
            f"{small and small['size']} model's measured f32 model-FLOP rate in this run "
            "(the T^2 attention term included).",
            "",
        ]
    return "\n".join(lines)


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else platform.processor()."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _accelerator() -> str:
    """'NAME (jax backend gpu), ' when JAX runs on an accelerator, else ''."""
    import jax

    if jax.default_backend() == "cpu":
        return ""
    return f"{jax.devices()[0].device_kind} (jax backend {jax.default_backend()}), "


def _keep_notes(path: str) -> str:
    if not os.path.exists(path):
        return ""
    text = open(path).read()
    at = text.find("\n" + NOTES_HEADING)
    return text[at:] if at >= 0 else ""


def _steps_arg(value: str) -> dict:
    steps = dict(DEFAULT_STEPS)
    for item in filter(None, value.split(",")):
        size, _, spec = item.partition("=")
        warm, _, timed = spec.partition(":")
        steps[size] = (int(warm), int(timed))
    return steps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--steps", default="", help="size=warmup:timed,... e.g. small=1:4")
    parser.add_argument("--pipeline_steps", type=int, default=100)
    parser.add_argument("--out", default="", help="markdown report (keeps its ## Notes)")
    parser.add_argument("--only", default="", help="child: ours|variants|peer|ceiling|...")
    parser.add_argument("--size", default="tiny")
    args = parser.parse_args(argv)
    steps = _steps_arg(args.steps)

    if args.only:  # a child: one measurement, one JSON line
        warm, timed = steps[args.size]
        if args.only == "ours":
            result = measure_ours(args.size, ["qk"], warmup=warm, steps=timed)
        elif args.only == "variants":
            result = measure_ours(args.size, list(VARIANTS), warmup=warm, steps=timed)
        elif args.only == "peer":
            result = measure_peer(args.size, warmup=warm, steps=timed)
        elif args.only == "ceiling":
            result = measure_ceiling()
        elif args.only == "pipeline":
            n = args.pipeline_steps if args.size == "tiny" else max(args.pipeline_steps // 20, 4)
            from configs import lm

            config = lm.get_config(f"size={args.size}")
            result = {**pipeline_bench.measure_pipeline(config, steps=n), "size": args.size}
        elif args.only == "layouts":
            result = pipeline_bench.measure_layouts()
        else:
            parser.error(f"--only={args.only!r} is not one of ours, variants, peer, ...")
        print(json.dumps(result))
        return 0

    sizes = [s for s in args.sizes.split(",") if s]
    has_peer = torch_available()
    if not has_peer:
        print(
            "torch/transformers not importable: peer columns are n/a "
            "(use the venv of requirements-bench.txt)",
            file=sys.stderr,
        )
    step_args = ["--steps", ",".join(f"{k}={w}:{t}" for k, (w, t) in steps.items())]
    ceiling = run_child(["--only=ceiling"])
    rows, pipelines = [], []
    for size in sizes:
        common = [f"--size={size}", *step_args]
        ours = run_child(["--only=ours", *common])
        peer = run_child(["--only=peer", *common]) if has_peer else None
        variants = run_child(["--only=variants", *common])
        rows.append(summarize(size, ours, peer, variants, ceiling))
        pipe = run_child(["--only=pipeline", *common, f"--pipeline_steps={args.pipeline_steps}"])
        if pipe:
            pipelines.append(pipe)
    lay = run_child(["--only=layouts"])

    import jax

    versions = f"jax {jax.__version__}"
    if has_peer:
        import torch
        import transformers

        versions += f", torch {torch.__version__}, transformers {transformers.__version__}"
    cpu = cpu_name()
    meta = {
        "command": "python benchmarks/train_bench.py " + " ".join(argv or sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "machine": _accelerator() + f"{os.cpu_count()} CPU cores ({cpu}), {platform.machine()}, "
        f"Python {platform.python_version()}",
        "versions": versions,
        "threads": os.cpu_count(),
        "steps": steps,
        "note": ""
        if jax.default_backend() == "cpu"
        else " On the GPU both sides keep float32 parameters and activations and multiply "
        "float32 matrices in TF32 (XLA's default; torch `set_float32_matmul_precision('high')`).",
    }
    text = report(rows, ceiling, pipelines, lay, meta)
    print(text)
    print(
        json.dumps(
            {
                "rows": [{k: v for k, v in r.items() if k != "variants"} for r in rows],
                "ceiling": ceiling,
            },
            indent=1,
        )
    )
    if args.out:
        notes = _keep_notes(args.out)
        with open(args.out, "w") as f:
            f.write(text + (notes if notes else "\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
