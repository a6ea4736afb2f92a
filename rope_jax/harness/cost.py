"""What a run costs: model FLOPs for a token budget, and wall time and device-hours on a
pod, as a markdown plan (the counts and their two conventions, PaLM's full T x T square
and MaxText/Megatron's causal half, are `harness/flops.py`).

  python -m rope_jax.harness.cost --config=configs/lm.py:size=1b --num_tokens=20e9,5e9 \
      --rows=9 --seeds=1,3 --out=results/performance/cost_plan.md
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence

from rope_jax import data, defaults, signals
from rope_jax.harness import flops, workdir

# Dense bfloat16 peak per device (no sparsity), FLOP/s.
PEAK_BF16 = {"H100 SXM": 989e12, "H200": 989e12, "TPU v5p": 459e12}
DEVICE_COUNTS = (8, 64, 256)
MFU = 0.40  # planning figure (full T x T count) for the wall-time columns of many devices
TOKENS_PER_PARAM = 20  # Chinchilla's compute-optimal ratio (Hoffmann et al., 2022)
NOTES_MARKER = "<!-- notes: written by hand, kept when the command rewrites this file -->"


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
      mfu: the planning MFU of the wall-time columns, counted over the full T x T
        square (`flops.CONVENTIONS`; the plan gives its causal equivalent).
      measured: a measured MFU (0-1, full square): adds a per-run wall-time column.
      peaks: device kind -> dense bf16 peak FLOP/s (default `PEAK_BF16`).
      counts: device counts per kind.

    Returns:
      Lines of markdown: a summary list, a blank line, a table (one row per device kind
      and count).
    """
    run_flops = flops.total_flops(config)
    runs = [(s, rows * s) for s in seeds if rows * s > 1]
    lines = summary_lines(config)
    if runs:
        totals = [f"{rows} rows x {s} seed{'s' * (s > 1)} = {n} runs: {sci(n * run_flops)} "
                  "model FLOPs" for s, n in runs]  # fmt: skip
        lines.append("- " + "; ".join(totals) + " (full)")
    lines.append(mfu_line(config, mfu, measured))
    peaks = PEAK_BF16 if peaks is None else peaks
    table = wall_time_table(run_flops, [n for _, n in runs], mfu=mfu, measured=measured,
                            peaks=peaks, counts=counts)  # fmt: skip
    return [*lines, "", *table]


def summary_lines(config) -> list[str]:
    """Parameters, FLOPs per token under both conventions (`flops.CONVENTIONS`), token
    budget and steps, FLOPs per run."""
    m, per_token, budget = config.model, flops.flops_per_token(config), flops.token_budget(config)
    p, attention = flops.matmul_params(m), flops.attention_flops_per_token(m, config.data.seq_len)
    causal = flops.flops_per_token(config, causal=True)
    n = flops.num_params(m, data.kind(config.data).num_axes)
    source = "train.num_tokens" if config.train.num_tokens else "steps x B x T"
    b, t = config.data.global_batch_size, config.data.seq_len
    lines = [
        f"parameters {n:,}; in matmuls (P) {p:,}",
        f"model FLOPs/token, {flops.CONVENTIONS['full']}: 6P + 12*L*T*N*H = {sci(6 * p)} + "
        f"{sci(attention)} = {sci(per_token)} (attention {attention / per_token:.1%}); "
        f"{flops.CONVENTIONS['causal']}: 6P + 6*L*T*N*H = {sci(6 * p)} + "
        f"{sci(attention // 2)} = {sci(causal)}",
        f"tokens {sci(budget)} ({source}) = {flops.steps_for_budget(config):,} steps of "
        f"{flops.tokens_per_step(config):,} tokens ({b} x {t}); "
        f"{budget / n:.1f} tokens per parameter",
        f"model FLOPs per run {sci(per_token * budget)} (full), {sci(causal * budget)} (causal)",
    ]
    remat = flops.remat_flops_per_token(config)
    if remat:
        hardware = per_token + remat
        lines[-1] += (f"; hardware FLOPs with remat={m.remat} {sci(hardware * budget)} "
                      f"(x{hardware / per_token:.3f} the full count, not in MFU)")  # fmt: skip
    return [f"- {line}" for line in lines]


def mfu_line(config, mfu: float, measured: float | None) -> str:
    """The MFU figures of the plan under both conventions: the wall times are the same
    under either (FLOPs / MFU), the percentages are not."""
    line = (f"- MFU: planning {mfu:.0%} ({flops.CONVENTIONS['full']}) = "
            f"{flops.causal_mfu(mfu, config):.1%} ({flops.CONVENTIONS['causal']})")  # fmt: skip
    if measured is not None:
        line += (f"; measured {measured:.1%} (full) = {flops.causal_mfu(measured, config):.1%} "
                 "(causal)")  # fmt: skip
    return line + "; the wall times are the same under either"


def wall_time_table(run_flops: float, totals: Sequence[int], *, mfu: float,
                    measured: float | None, peaks: dict,
                    counts: Sequence[int]) -> list[str]:  # fmt: skip
    """Markdown rows (kind x count): wall time and device-hours of one run at `mfu` (and at
    `measured`), and of `n` runs one after another for each n in `totals`."""
    header = ["device", "peak bf16 TFLOP/s", "count", f"wall/run @{mfu:.0%} MFU (full)",
              "device-h/run"]  # fmt: skip
    if measured is not None:
        header.append(f"wall/run @{measured:.1%} (measured, full)")
    for n in totals:
        header += [f"wall, {n} runs", f"device-h, {n} runs"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for kind, peak in peaks.items():
        for count in counts:
            run_s = flops.wall_seconds(run_flops, count, peak, mfu)
            device_h = run_s * count / 3600
            cells = [
                kind,
                f"{peak / 1e12:g}",
                str(count),
                format_duration(run_s),
                f"{device_h:,.0f}",
            ]
            if measured is not None:
                cells.append(format_duration(flops.wall_seconds(run_flops, count, peak, measured)))
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
    p.add_argument("--mfu", type=float, default=MFU, help="planning MFU (0-1, full T x T)")
    p.add_argument("--measured_mfu", type=float, default=None,
                   help="a measured MFU (0-1, full T x T)")  # fmt: skip
    p.add_argument("--out", default="", help="write a markdown file here (default: print)")
    return p


def check_args(args) -> None:
    """ValueError naming the flag whose value the plan cannot use."""
    for flag, text, kind in (
        ("--num_tokens", args.num_tokens, float),
        ("--seeds", args.seeds, int),
    ):
        try:
            values = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"{flag}={text} must be comma-separated positive numbers") from None
        if any(not v > 0 for v in values):
            raise ValueError(f"{flag}={text} must be comma-separated positive numbers")
    if args.rows < 1:
        raise ValueError(f"--rows={args.rows} must be >= 1")
    if args.vocab_size < 0:
        raise ValueError(f"--vocab_size={args.vocab_size} must be >= 0 (0: the config's)")
    for flag, mfu in (("--mfu", args.mfu), ("--measured_mfu", args.measured_mfu)):
        if mfu is not None and not 0 < mfu <= 1:
            raise ValueError(f"{flag}={mfu:g} must be a fraction in (0, 1]")
    if args.out:
        workdir.check_can_write(args.out, what=f"--out={args.out}")


def render(argv: Sequence[str]) -> list[str]:
    """The markdown document `main(argv)` writes: the command, one section per budget;
    ValueError for arguments it cannot use (`check_args`)."""
    args = _parser().parse_args(argv)
    check_args(args)
    config = load_config(args.config)
    if args.vocab_size:
        config.model.vocab_size = args.vocab_size
    budgets = [int(float(x)) for x in args.num_tokens.split(",") if x.strip()] or [0]
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    params = flops.num_params(config.model, data.kind(config.data).num_axes)
    lines = [
        f"# Cost plan: `{args.config}`",
        "",
        f"Made by `python -m rope_jax.harness.cost {shlex.join(argv)}`.",
        "",
        f"Compute-optimal budget (Chinchilla, {TOKENS_PER_PARAM} tokens per parameter): "
        f"{sci(TOKENS_PER_PARAM * params, 3)} tokens for {params:,} parameters.",
        "Model FLOPs are 6P + 12*L*T*N*H per token counting the full T x T attention "
        "(PaLM's MFU convention, the one the MFU figures and the FLOP totals use), or "
        "6P + 6*L*T*N*H counting causal attention as half of it (MaxText's and "
        "Megatron-LM's); wall time = FLOPs / (devices x dense bf16 peak x MFU); runs go one "
        "after another, each on all the devices of its row; device-hours = wall x devices.",
    ]
    for budget in budgets:
        if budget:
            config.train.num_tokens = budget
        lines += ["", f"## {format_count(flops.token_budget(config))} tokens per run", ""]
        lines += format_plan(config, rows=args.rows, seeds=seeds, mfu=args.mfu,
                             measured=args.measured_mfu)  # fmt: skip
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    """Prints the plan, or writes it to --out keeping that file's notes (`kept_notes`)."""
    signals.release_signals()  # one that came while the modules imported: stops it here
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        text = "\n".join(render(argv)) + "\n"
    except ValueError as e:  # a bad number or --out, a config that does not load: one line
        sys.exit(f"error: {e}")
    out = _parser().parse_args(argv).out
    if not out:
        print(text, end="")
        return
    notes = kept_notes(out)
    workdir.write_atomic(out, text + (f"\n{notes}" if notes else ""))  # the notes: never lost
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
