"""What a run costs: model FLOPs per token, for a token budget, and wall time on a pod.

Convention (PaLM appendix B, as MaxText reports MFU): model FLOPs per token are

  6 * P  +  12 * L * T * N * H

P = `matmul_params` (every weight that enters a matmul: q, k, v (or the tied kv), o,
SwiGLU, the LM head and the patch embedding; not the embedding table, a gather, nor
the norms' scales), 6 = 2 (multiply-add) x 3 (forward + backward for the activations
and for the weights). The second term is q.k^T and probs.v, 2 * 2 * T * N * H per token
and layer forward, times 3, over the full T x T square: no causal discount, although a
causal kernel may skip half of it. Softmax, norms, rotations and the optimiser are not
counted. MFU = model FLOPs / (devices * peak * seconds); rematerialisation does not
change the model FLOPs, only the hardware FLOPs (`remat_flops_per_token`), reported
separately.

  python -m rope_jax.harness.cost --config=configs/lm.py:size=1b --num_tokens=20e9,5e9 \
      --rows=9 --seeds=1,3 --out=results/cost_plan.md

Shape letters: L layers, D embed dim, N query heads, K kv heads, H head dim, F mlp dim,
V vocab, E patch width, T training context, B global batch (sequences).
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
from collections.abc import Sequence

from rope_jax import data, defaults, learned
from rope_jax.nn import model

# Dense bfloat16 peak per device (no sparsity), FLOP/s.
PEAK_BF16 = {"H100 SXM": 989e12, "H200": 989e12, "TPU v5p": 459e12}
DEVICE_COUNTS = (8, 64, 256)
MFU = 0.40  # planning figure for the wall-time columns (no 1b step measured here)
TOKENS_PER_PARAM = 20  # Chinchilla's compute-optimal ratio (Hoffmann et al., 2022)
NOTES_MARKER = "<!-- notes: written by hand, kept when the command rewrites this file -->"



# ------------------------------------------------------------------ counts


def block_matmul_params(model_cfg) -> int:
    """Matmul weights of the L decoder blocks: q D*N*H, k and v 2*D*K*H (tied: one
    D*K*H), o N*H*D, SwiGLU 3*D*F, per layer."""
    m = model_cfg
    d, n, k, h, f = m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim
    kv = 1 if m.attention.kv == "tied" else 2
    return m.num_layers * (2 * d * n * h + kv * d * k * h + 3 * d * f)


def matmul_params(model_cfg) -> int:
    """P: every weight that enters a matmul: the blocks', the LM head D*V and the patch
    embedding E*D (applied at every position). Not the embedding table (a gather) or
    the norms' scales (elementwise)."""
    m = model_cfg
    return block_matmul_params(m) + m.embed_dim * m.vocab_size + m.patch_dim * m.embed_dim


def rotation_params(model_cfg, num_axes: int = 1) -> int:
    """Learned-rotation parameters (`rope.learned`), per layer that rotates: frequencies
    K*(H/2)*A, and with `commuting` the basis generator H*H; 0 for the fixed rotation."""
    m = model_cfg
    trained = learned.KINDS[m.rope.learned]
    if not trained:
        return 0
    rotating = sum(spec is not None for spec in model.layer_rotations(m, num_axes))
    per_layer = m.num_kv_heads * (m.head_dim // 2) * num_axes if "rope_freqs" in trained else 0
    per_layer += m.head_dim**2 if "rope_basis" in trained else 0
    return rotating * per_layer


def num_params(model_cfg, num_axes: int = 1) -> int:
    """All parameters: `matmul_params` + the embedding table V*D (not again when the head
    is the table, `tie_embeddings`) + 2L + 1 norm scales of D + `rotation_params` (A
    position axes: 1 for text) + per layer the q/k/v biases (N + 2K)*H and q/k norm
    scales 2*H when the model has them."""
    m = model_cfg
    table = 0 if m.tie_embeddings else m.vocab_size * m.embed_dim
    extra = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim if m.attention.qkv_bias else 0
    extra += 2 * m.head_dim if m.attention.qk_norm else 0
    return (matmul_params(m) + table + (2 * m.num_layers + 1) * m.embed_dim
            + rotation_params(m, num_axes) + m.num_layers * extra)  # fmt: skip


def attention_flops_per_token(model_cfg, seq_len: int) -> int:
    """12 * L * T * N * H: q.k^T and probs.v, forward + backward, full T x T square."""
    m = model_cfg
    return 12 * m.num_layers * seq_len * m.num_heads * m.head_dim


def flops_per_token(config) -> int:
    """Model FLOPs per training token: 6 * P + 12 * L * T * N * H (see the module doc)."""
    return 6 * matmul_params(config.model) + attention_flops_per_token(
        config.model, config.data.seq_len
    )


def remat_flops_per_token(config) -> int:
    """Hardware FLOPs per token that rematerialisation adds to the model FLOPs.

    With `model.remat=block` the backward pass recomputes each block's forward:
    2 * `block_matmul_params` + 4 * L * T * N * H (the head is outside the blocks). 0
    without remat. Attention kernels that recompute scores in their backward (chunked,
    cuDNN flash) add up to 2 * L * T * N * H more, not counted here.
    """
    if config.model.remat != "block":
        return 0
    return (
        2 * block_matmul_params(config.model)
        + attention_flops_per_token(config.model, config.data.seq_len) // 3
    )


def tokens_per_step(config) -> int:
    """B * T training tokens per optimiser step (microbatches do not change it)."""
    return config.data.global_batch_size * config.data.seq_len


def token_budget(config) -> int:
    """`train.num_tokens` when set (> 0), else num_steps * B * T."""
    num_tokens = int(config.train.num_tokens)
    return num_tokens or config.train.num_steps * tokens_per_step(config)


def steps_for_budget(config) -> int:
    """Optimiser steps that cover `token_budget` (rounded up): set train.num_steps to it."""
    return math.ceil(token_budget(config) / tokens_per_step(config))


def total_flops(config) -> int:
    """Model FLOPs of one run: `flops_per_token` * `token_budget`."""
    return flops_per_token(config) * token_budget(config)


def wall_seconds(flops: float, devices: int, peak: float, mfu: float) -> float:
    """Seconds for `flops` model FLOPs on `devices` devices of `peak` FLOP/s at `mfu`."""
    return flops / (devices * peak * mfu)


def measured_mfu(tokens_per_s: float, flops_per_token_: float, devices: int, peak: float) -> float:
    """MFU of a measured throughput: tokens/s * FLOPs/token / (devices * peak)."""
    return tokens_per_s * flops_per_token_ / (devices * peak)


# ------------------------------------------------------------------ the plan


def format_plan(config, *, rows: int = 1, seeds: Sequence[int] = (1,), mfu: float = MFU,
                measured: float | None = None, peaks: dict | None = None,
                counts: Sequence[int] = DEVICE_COUNTS) -> list[str]:  # fmt: skip
    """The lines of a cost plan for `config`'s token budget (`token_budget`).

    Args:
      config: a full config (model, data, train).
      rows: runs of this shape per seed (a sweep's rows; rotation sites change no FLOPs).
      seeds: seed counts to total over: a wall-time and device-hour column pair each for
        rows x seeds runs (runs one after another, each on all the devices).
      mfu: the planning MFU of the wall-time columns.
      measured: a measured MFU (0-1): adds a per-run wall-time column at it.
      peaks: device kind -> dense bf16 peak FLOP/s (default `PEAK_BF16`).
      counts: device counts per kind.

    Returns:
      Lines of markdown: a summary list, a blank line, a table (one row per device kind
      and count).
    """
    run_flops = total_flops(config)
    runs = [(s, rows * s) for s in seeds if rows * s > 1]
    lines = summary_lines(config)
    if runs:
        totals = [f"{rows} rows x {s} seed{'s' * (s > 1)} = {n} runs: {sci(n * run_flops)} "
                  "model FLOPs" for s, n in runs]  # fmt: skip
        lines.append("- " + "; ".join(totals))
    peaks = PEAK_BF16 if peaks is None else peaks
    table = wall_time_table(run_flops, [n for _, n in runs], mfu=mfu, measured=measured,
                            peaks=peaks, counts=counts)  # fmt: skip
    return [*lines, "", *table]


def summary_lines(config) -> list[str]:
    """Parameters, FLOPs per token (both terms), token budget and steps, FLOPs per run."""
    m, per_token, budget = config.model, flops_per_token(config), token_budget(config)
    p, attention = matmul_params(m), attention_flops_per_token(m, config.data.seq_len)
    n = num_params(m, data.kind(config.data).num_axes)
    source = "train.num_tokens" if config.train.num_tokens else "steps x B x T"
    b, t = config.data.global_batch_size, config.data.seq_len
    lines = [
        f"parameters {n:,}; in matmuls (P) {p:,}",
        f"model FLOPs/token = 6P + 12*L*T*N*H = {sci(6 * p)} + {sci(attention)} = "
        f"{sci(per_token)} (attention {attention / per_token:.1%}; full T x T, no causal "
        "discount, as PaLM/MaxText MFU)",
        f"tokens {sci(budget)} ({source}) = {steps_for_budget(config):,} steps of "
        f"{tokens_per_step(config):,} tokens ({b} x {t}); "
        f"{budget / n:.1f} tokens per parameter",
        f"model FLOPs per run {sci(total_flops(config))}",
    ]
    remat = remat_flops_per_token(config)
    if remat:
        hardware = per_token + remat
        lines[-1] += (f"; hardware FLOPs with remat={m.remat} {sci(hardware * budget)} "
                      f"(x{hardware / per_token:.3f}, not counted in MFU)")  # fmt: skip
    return [f"- {line}" for line in lines]


def wall_time_table(run_flops: float, totals: Sequence[int], *, mfu: float,
                    measured: float | None, peaks: dict,
                    counts: Sequence[int]) -> list[str]:  # fmt: skip
    """Markdown rows (kind x count): wall time and device-hours of one run at `mfu` (and at
    `measured`), and of `n` runs one after another for each n in `totals`."""
    header = ["device", "peak bf16 TFLOP/s", "count", f"wall/run @{mfu:.0%} MFU", "device-h/run"]
    if measured is not None:
        header.append(f"wall/run @{measured:.1%} (measured)")
    for n in totals:
        header += [f"wall, {n} runs", f"device-h, {n} runs"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for kind, peak in peaks.items():
        for count in counts:
            run_s = wall_seconds(run_flops, count, peak, mfu)
            device_h = run_s * count / 3600
            cells = [
                kind,
                f"{peak / 1e12:g}",
                str(count),
                format_duration(run_s),
                f"{device_h:,.0f}",
            ]
            if measured is not None:
                cells.append(format_duration(wall_seconds(run_flops, count, peak, measured)))
            for n in totals:
                cells += [format_duration(n * run_s), _hours(n * device_h)]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def sci(x: float, digits: int = 4) -> str:
    """`x` with `digits` significant digits, exponent without '+' or padding: 1.329e20."""
    mantissa, _, exponent = f"{x:.{digits}g}".partition("e")
    return f"{mantissa}e{int(exponent)}" if exponent else mantissa


def format_count(n: float) -> str:
    """20B, 5.5B, 2M, 1.5k, 12."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.4g}{suffix}"
    return f"{n:g}"


def format_duration(seconds: float) -> str:
    """'9.5 s' under 2 min, '42 min' under 2 h, '11.7 h' under 48 h, else '315 h (13.1 d)'."""
    hours = seconds / 3600
    if seconds < 120:
        return f"{seconds:.2g} s"
    if hours < 2:
        return f"{seconds / 60:.0f} min"
    if hours < 48:
        return f"{hours:.1f} h"
    return f"{hours:,.0f} h ({hours / 24:.1f} d)"


# ------------------------------------------------------------------ command line


def load_config(spec: str):
    """`path/to/config.py:arg` -> the module's `get_config(arg)`, every field filled."""
    path, _, arg = spec.partition(":")
    try:
        module = defaults.load_module(path)
        return defaults.fill(module.get_config(arg) if arg else module.get_config())
    except ValueError as e:
        raise SystemExit(f"error: --config={spec}: {e}") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rope_jax.harness.cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument(
        "--config", required=True, help="config file and arg, e.g. configs/lm.py:size=1b"
    )
    p.add_argument(
        "--num_tokens", default="", help="token budgets: 20e9,5e9 (default the config's)"
    )
    p.add_argument(
        "--vocab_size", type=int, default=0, help="tokenizer size to plan for (default: config)"
    )
    p.add_argument("--rows", type=int, default=1, help="runs of this shape per seed")
    p.add_argument("--seeds", default="1", help="seed counts to total over, e.g. 1,3")
    p.add_argument("--mfu", type=float, default=MFU, help="planning MFU (0-1)")
    p.add_argument("--measured_mfu", type=float, default=None, help="a measured MFU (0-1)")
    p.add_argument("--out", default="", help="write a markdown file here (default: print)")
    return p


def render(argv: Sequence[str]) -> list[str]:
    """The markdown document `main(argv)` writes: the command, one section per budget."""
    args = _parser().parse_args(argv)
    config = load_config(args.config)
    if args.vocab_size:
        config.model.vocab_size = args.vocab_size
    budgets = [int(float(x)) for x in args.num_tokens.split(",") if x.strip()] or [0]
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    params = num_params(config.model, data.kind(config.data).num_axes)
    lines = [
        f"# Cost plan: `{args.config}`",
        "",
        f"Made by `python -m rope_jax.harness.cost {shlex.join(argv)}`.",
        "",
        f"Compute-optimal budget (Chinchilla, {TOKENS_PER_PARAM} tokens per parameter): "
        f"{sci(TOKENS_PER_PARAM * params, 3)} tokens for {params:,} parameters.",
        "Model FLOPs are 6P + 12*L*T*N*H per token (PaLM/MaxText MFU convention, full T x T "
        "attention); wall time = FLOPs / (devices x dense bf16 peak x MFU); runs go one "
        "after another, each on all the devices of its row; device-hours = wall x devices.",
    ]
    for budget in budgets:
        if budget:
            config.train.num_tokens = budget
        lines += ["", f"## {format_count(token_budget(config))} tokens per run", ""]
        lines += format_plan(config, rows=args.rows, seeds=seeds, mfu=args.mfu,
                             measured=args.measured_mfu)  # fmt: skip
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    """Prints the plan, or writes it to --out keeping that file's notes (`kept_notes`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    text = "\n".join(render(argv)) + "\n"
    out = _parser().parse_args(argv).out
    if not out:
        print(text, end="")
        return
    notes = kept_notes(out)
    with open(out, "w") as f:
        f.write(text + (f"\n{notes}" if notes else ""))
    print(f"wrote {out}" + (" (notes kept)" if notes else ""))


def kept_notes(path: str) -> str:
    """The hand-written end of an existing plan file: everything from the line
    `NOTES_MARKER` on ("" if the file or the marker is absent)."""
    if not os.path.isfile(path):
        return ""
    with open(path) as f:
        text = f.read()
    at = text.find(NOTES_MARKER)
    return text[at:] if at >= 0 else ""


def _hours(hours: float) -> str:
    return f"{hours:,.0f}" if hours >= 10 else f"{hours:.2g}"


if __name__ == "__main__":
    main()
