"""The markdown report of benchmarks/train_bench.py, from its children's JSON.

`summarize` turns one size's children into a row of numbers, `report` writes the
markdown, `write` saves it and keeps the file's trailing "## Notes" section.
"""

from __future__ import annotations

import os

from bench_shapes import shape, step_flops

NOTES_HEADING = "## Notes"  # a trailing section of --out that the benchmark keeps


# ------------------------------------------------------------------ cells and tables


def render_table(header: list[str], rows: list[list]) -> str:
    """A markdown table; floats printed as given (format them before)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"row {row} has {len(row)} cells, header has {len(header)}")
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


def _fmt(x, spec: str = ".2f", na: str = "n/a") -> str:
    """`x` formatted with `spec`, or `na` for None."""
    return na if x is None else format(x, spec)


def _ratio(a, b):
    """a / b, or None when either is missing or b is 0."""
    return None if a is None or b is None or not b else a / b


def _mark(value, target: float, *, higher: bool = True) -> str:
    """`value` against `target` (a floor; a ceiling if not `higher`): "1.20 (met)", "n/a"."""
    if value is None:
        return "n/a"
    ok = value >= target if higher else value <= target
    return f"{value:.2f} ({'met' if ok else 'NOT met'})"


# ------------------------------------------------------------------ numbers


def summarize(
    size: str,
    ours: dict | None,
    peer: dict | None,
    variants: dict | None,
    ceiling: dict | None,
    peer_bf16: dict | None = None,
    *,
    peer_compiled: dict | None = None,
) -> dict:
    """Every number of one size's row from the children's JSON.

    MFU is counted both ways (`rope_jax.harness.flops`): "full" with attention over the
    whole T x T square (PaLM), "causal" with half of it (MaxText, Megatron-LM).
    """
    s = shape(size)
    flops, causal = step_flops(s), step_flops(s, causal=True)
    f32 = ours["variants"]["qk"] if ours else None
    var = variants["variants"] if variants else {}
    ceil = ceiling["f32_gflops"] * 1e9 if ceiling else None
    peer_s = peer["step_s"] if peer else None
    comp = peer_compiled
    return {
        "size": size,
        "tokens": s["B"] * s["T"],
        "flops": flops,
        "ours_tok_s": f32 and f32["tokens_per_s"],
        "peer_tok_s": peer and peer["tokens_per_s"],
        "bf16_tok_s": var.get("bf16", {}).get("tokens_per_s"),
        "ours_vs_peer": _ratio(f32 and f32["tokens_per_s"], peer and peer["tokens_per_s"]),
        "peer_bf16_tok_s": peer_bf16 and peer_bf16["tokens_per_s"],
        "peer_bf16_s": peer_bf16 and peer_bf16["step_s"],
        "peer_compiled_tok_s": comp and comp["tokens_per_s"],
        "peer_compiled_s": comp and comp["step_s"],
        "peer_compiled_first_s": comp and comp.get("first_step_s"),
        "ours_vs_peer_compiled": _ratio(f32 and f32["tokens_per_s"], comp and comp["tokens_per_s"]),
        "bf16_vs_f32": _ratio(
            var.get("bf16", {}).get("tokens_per_s"), var.get("qk", {}).get("tokens_per_s")
        ),
        "ceiling_bf16_vs_f32": _ratio(
            ceiling and ceiling.get("bf16_gflops"), ceiling and ceiling.get("f32_gflops")
        ),
        "ours_mfu": _ratio(f32 and flops / f32["step_s"], ceil),
        "ours_mfu_causal": _ratio(f32 and causal / f32["step_s"], ceil),
        "peer_mfu": _ratio(peer_s and flops / peer_s, ceil),
        "peer_mfu_causal": _ratio(peer_s and causal / peer_s, ceil),
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


# ------------------------------------------------------------------ the report's tables


def _targets_table(rows: list[dict]) -> str:
    """Per size: tokens/s, ratios and MFU against their targets, peak memory."""
    header = [
        "size",
        "ours tok/s f32",
        "peer tok/s f32",
        "ours/peer f32 (>=1.0)",
        "peer compiled tok/s f32",
        "ours/peer compiled f32",
        "ours bf16 tok/s",
        "peer bf16 tok/s",
        "ours bf16 / peer bf16 (>=1.0)",
        "bf16/f32 ours (>=3.0)",
        "bf16/f32 matmul ceiling",
        "MFU ours full (>=0.60)",
        "MFU ours causal",
        "MFU peer full",
        "MFU peer causal",
        "qk/nope (<=1.05)",
        "qkvo/nope (<=1.10)",
        "peak mem ours MiB",
        "peak mem peer MiB",
    ]
    cells = lambda r: [
        r["size"],
        _fmt(r["ours_tok_s"], ",.0f"),
        _fmt(r["peer_tok_s"], ",.0f"),
        _mark(r["ours_vs_peer"], 1.0),
        _fmt(r.get("peer_compiled_tok_s"), ",.0f"),
        _fmt(r.get("ours_vs_peer_compiled")),
        _fmt(r["bf16_tok_s"], ",.0f"),
        _fmt(r["peer_bf16_tok_s"], ",.0f"),
        _mark(_ratio(r["bf16_tok_s"], r["peer_bf16_tok_s"]), 1.0),
        _mark(r["bf16_vs_f32"], 3.0),
        _fmt(r["ceiling_bf16_vs_f32"]),
        _mark(r["ours_mfu"], 0.60),
        _fmt(r.get("ours_mfu_causal")),
        _fmt(r["peer_mfu"]),
        _fmt(r.get("peer_mfu_causal")),
        _mark(r["qk_vs_nope"], 1.05, higher=False),
        _mark(r["qkvo_vs_nope"], 1.10, higher=False),
        _fmt(r["ours_rss"], ",.0f"),
        _fmt(r["peer_rss"], ",.0f"),
    ]
    return render_table(header, [cells(r) for r in rows])


def _ms(seconds) -> str:
    """Seconds as milliseconds with one decimal; "n/a" for None."""
    return _fmt(seconds and 1e3 * seconds, ".1f")


def _gflops(flops: float, seconds) -> str:
    """FLOPs over seconds as GFLOP/s with one decimal; "n/a" for None seconds."""
    return _fmt(seconds and flops / seconds / 1e9, ".1f")


def _steps_table(rows: list[dict]) -> str:
    """Per size: tokens and model GFLOP per step, step ms of every variant, GFLOP/s."""
    header = [
        "size",
        "tokens/step",
        "model GFLOP/step (full)",
        "ours f32 step ms",
        "peer f32 step ms",
        "peer compiled f32 step ms",
        "nope ms",
        "qk ms",
        "qkvo ms",
        "bf16 ms",
        "peer bf16 ms",
        "ours GFLOP/s",
        "peer GFLOP/s",
    ]
    cells = lambda r: [
        r["size"],
        f"{r['tokens']:,}",
        f"{r['flops'] / 1e9:.2f}",
        _ms(r["ours_step_s"]),
        _ms(r["peer_step_s"]),
        _ms(r.get("peer_compiled_s")),
        *[_ms(r["variants"].get(v, {}).get("step_s")) for v in ("nope", "qk", "qkvo", "bf16")],
        _ms(r["peer_bf16_s"]),
        _gflops(r["flops"], r["ours_step_s"]),
        _gflops(r["flops"], r["peer_step_s"]),
    ]
    return render_table(header, [cells(r) for r in rows])


def _pipeline_table(pipelines: list[dict]) -> str:
    """Per size: step ms on pre-placed and real batches, the loop's wait in next()."""
    header = [
        "size",
        "steps",
        "step ms (pre-placed)",
        "step ms (real data)",
        "next ms/step",
        "next / step (<5%)",
        "wall-clock cost of real data",
    ]
    cells = lambda p: [
        p["size"],
        p["steps"],
        f"{1e3 * p['step_s_fixed']:.1f}",
        f"{1e3 * p['step_s_real']:.1f}",
        f"{1e3 * p['wait_s']:.2f}",
        f"{100 * p['wait_share']:.2f}%",
        f"{100 * p['wall_share']:.2f}%",
    ]
    return render_table(header, [cells(p) for p in pipelines])


# ------------------------------------------------------------------ the report's sections


def _intro(meta: dict) -> list[str]:
    """Title, command, machine and how the steps were timed: the report's first lines."""
    return [
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
        f"torch threads = {meta['threads']}, run eagerly" + _compiled_note(meta) + "; "
        "ours = `rope_jax.harness` train_step "
        "(float32, sites qk unless noted; JAX uses all cores). Synthetic random-byte batches, "
        "the same for both." + meta.get("note", ""),
        "",
    ]


def _compiled_note(meta: dict) -> str:
    """How the compiled peer ran (a clause of the intro), or "" without one."""
    mode = meta.get("peer_compile")
    if not mode:
        return ""
    return (f", and again compiled: forward and loss under `torch.compile(mode={mode!r})` "
            "(TorchInductor's C++/OpenMP kernels on a CPU; the backward compiled with them; "
            "AdamW eager), timed after its first step, which compiles")  # fmt: skip


def _ceiling_notes(ceiling: dict | None) -> list[str]:
    """The matmul ceiling, how MFU is counted, and what the variant columns mean."""
    ceil_f32 = ceiling and ceiling["f32_gflops"]
    return [
        f"Matmul ceiling (jitted {ceiling and ceiling['n']}^3, same run): "
        f"float32 {_fmt(ceil_f32, '.1f')} GFLOP/s, "
        f"bfloat16 inputs with float32 accumulation "
        f"{_fmt(ceiling and ceiling['bf16_gflops'], '.1f')} GFLOP/s. MFU = model FLOPs per step "
        "/ step time / float32 ceiling, model FLOPs = 6 * P * B*T + 12 * L * B * T^2 * N*H "
        "counting attention over the full T x T square (PaLM; 'full'), or 6 * P * B*T + "
        "6 * L * B * T^2 * N*H counting causal attention as half of it (MaxText, "
        "Megatron-LM; 'causal') (P = weights that enter a matmul: q, k, v, o, SwiGLU and the "
        "head; no embedding table; softmax, norms, rotation and the optimiser uncounted; "
        "`rope_jax/harness/flops.py`). The same FLOPs are used for the peer.",
        "",
        "qk/nope and qkvo/nope: step time with `model.rope.sites` = qk / qkvo over sites = "
        "'' (NoPE), compiled in one child and timed round-robin with bf16 (the `nope, qk, "
        "qkvo, bf16` ms columns; the headline f32 column is the separate child that also "
        "gives the peak memory: the process's peak RSS on a CPU, the device's peak "
        "allocation on a GPU).",
        "",
    ]


def _pipeline_section(pipelines: list[dict]) -> list[str]:
    """The "## Input pipeline" section: its table and how the loop was timed."""
    return [
        "## Input pipeline",
        "",
        _pipeline_table(pipelines),
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


def _layouts_section(rows: list[dict], lay: dict) -> list[str]:
    """The multimodal positions section: layout times against a step of that batch.

    The step (small model, B = lay["num"], T = lay["seq_len"]) is not run: it is estimated
    at the small row's model-FLOP rate (the last row's when there is no small row).
    """
    small = next((r for r in rows if r["size"] == "small"), rows[-1] if rows else None)
    flops = step_flops(dict(shape("small"), B=lay["num"], T=lay["seq_len"]))
    rate = small and small["ours_step_s"] and small["flops"] / small["ours_step_s"]
    est = rate and flops / rate
    header = [
        "scheme",
        "positions() x 256 s",
        "batch_positions() s",
        "estimated small step of that batch s",
        "batch_positions / step",
    ]
    cells = lambda scheme: [
        scheme,
        f"{lay[scheme]['positions_s']:.3f}",
        f"{lay[scheme]['batch_positions_s']:.3f}",
        _fmt(est, ".2f"),
        _fmt(_ratio(lay[scheme]["batch_positions_s"], est), ".5f"),
    ]
    return [
        "## Multimodal positions vs a training step",
        "",
        render_table(header, [cells(scheme) for scheme in ("rope_tv", "mrope")]),
        "",
        f"{lay['num']} sequences of {lay['seq_len']:,} tokens ({lay['segments']:,} "
        "text/image/video segments, 3 axes), best of 3. The step of that batch (small "
        f"model at B = {lay['num']}, T = {lay['seq_len']}: {flops / 1e12:.2f} model "
        "TFLOP) is not run: it is estimated from the "
        f"{small and small['size']} model's measured f32 model-FLOP rate in this run "
        "(the T^2 attention term included).",
        "",
    ]


def report(rows: list[dict], ceiling, pipelines, lay, meta: dict) -> str:
    """The markdown report (everything but the kept notes section)."""
    lines = [
        *_intro(meta),
        _targets_table(rows),
        "",
        _steps_table(rows),
        "",
        *_ceiling_notes(ceiling),
        *_pipeline_section(pipelines),
    ]
    if lay:
        lines += _layouts_section(rows, lay)
    return "\n".join(lines)


# ------------------------------------------------------------------ the file


def _kept_notes(path: str) -> str:
    """The trailing "## Notes" section of the file at `path` (from its newline), else ""."""
    if not os.path.exists(path):
        return ""
    text = open(path).read()
    at = text.find("\n" + NOTES_HEADING)
    return text[at:] if at >= 0 else ""


def write(path: str, text: str) -> None:
    """Writes the report `text` to `path`, keeping the notes section already there."""
    notes = _kept_notes(path)
    with open(path, "w") as f:
        f.write(text + (notes if notes else "\n"))
