"""The page of `benchmarks/gpu_suite.py`: OUT/gpu_suite.md from the stages' JSON files."""

from __future__ import annotations

import statistics

from rope_jax import provenance


def _f(x, fmt: str = ",.0f", none: str = "—") -> str:
    return none if x is None else format(x, fmt)


def _check(r: dict) -> list[str]:
    if not r:
        return ["Not run."]
    c = r.get("ceiling") or {}
    v = r.get("versions") or {}
    return [
        f"Device: {r.get('devices')} x {r.get('device')} ({r.get('backend')}); "
        f"nvidia-smi: {r.get('nvidia_smi') or '—'}; cuDNN {r.get('cudnn') or '—'}.",
        "Versions: "
        + ", ".join(f"{k} {val}" for k, val in v.items() if val)
        + f"; code {r.get('code') or 'not recorded'}.",
        f"Dense matmul ceiling ({c.get('n')}^3, jitted, median of 5): bf16 inputs with "
        f"float32 accumulation {_f(c.get('bf16_gflops'))} GFLOP/s, float32 "
        f"{_f(c.get('f32_gflops'))} GFLOP/s.",
    ]


def _kernels(r: dict) -> list[str]:
    if not r:
        return ["Not run."]
    cases = r.get("cases", {})
    out = [
        f"Impls against `xla`: {', '.join(r.get('impls', []))}. Error = max |a - b| / "
        "max |b| over each gradient leaf (the worst leaf), |loss - loss_xla| / |loss_xla|; "
        f"tolerances (loss, gradients): {r.get('tolerances')}. float32 products at "
        "`highest` precision (no TF32) so that float32 is compared in float32.",
        "",
        "| case | impl | dtype | loss error | gradient error | ok | cuDNN fused calls in program |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, case in cases.items():
        for row in case["rows"]:
            out.append(f"| {name} | {row['impl']} | {row['dtype']} | {row['loss_err']:.1e} | "
                       f"{row['grad_err']:.1e} | {'yes' if row['ok'] else 'NO'} | "
                       f"{case['cudnn_calls']} |")  # fmt: skip
    bad = [n for n, c in cases.items() if not all(x["ok"] for x in c["rows"])]
    out += ["", f"{len(cases)} cases, {sum(len(c['rows']) for c in cases.values())} comparisons; "
            f"outside tolerance: {', '.join(bad) or 'none'}."]  # fmt: skip
    decode = r.get("decode", {})
    if decode:
        out += ["", "Decoding through the cache (prefill T - 3, then 3 single tokens) against "
                "the full forward of `xla`: max |difference| / max |logit|.", "",
                "| case | error | ok |", "|---|---|---|"]  # fmt: skip
        out += [f"| {k} | {v['rel_err']:.1e} | {'yes' if v['ok'] else 'NO'} |"
                for k, v in decode.items()]  # fmt: skip
    return out


def _step1b_order(m: dict) -> int:
    """Where a setting ran: its recorded order, else (files from before the order was
    recorded) its place in STEP1B_SETTINGS, the order the stage tries them in."""
    if "order" in m:
        return m["order"]
    from gpu_step1b import STEP1B_SETTINGS

    return STEP1B_SETTINGS.index(m["setting"]) if m.get("setting") in STEP1B_SETTINGS else 99


def _mfu_causal(m: dict) -> float | None:
    """The setting's MFU counting causal attention as half the T x T square: recorded, or
    (files from before it was) recounted from the preset by `harness.flops`, provided
    that the preset's full count is the one recorded."""
    if "mfu_causal" in m or m.get("mfu") is None:
        return m.get("mfu_causal")
    from configs import lm
    from rope_jax.harness import flops

    config = lm.get_config(f"size={m.get('size', '1b')}")  # every file before: size=1b
    config.data.seq_len = m["seq_len"]
    if flops.flops_per_token(config) != m["flops_per_token"]:
        return None
    return flops.causal_mfu(m["mfu"], config)


def _step1b_memory(m: dict, earlier: int | None) -> tuple[str, str]:
    """The setting's peak device GiB ("<= X" when it did not raise the peak that an
    earlier setting of the process set) and XLA's bytes for its program alone."""
    peak = m.get("peak_bytes") or 0
    before = m.get("peak_bytes_before", earlier)
    own = f"{peak / 2**30:.1f}" if before is None or peak > before else f"<= {peak / 2**30:.1f}"
    p = m.get("program_bytes") or {}
    program = (p.get("arguments", 0) + p.get("outputs", 0) + p.get("temp", 0)
               - p.get("aliased", 0)) if p else None  # fmt: skip
    return own, _f(program and program / 2**30, ".1f")


def _step1b(r: dict) -> list[str]:
    if not r:
        return ["Not run."]
    out = [
        f"`size=1b`, bf16 compute, float32 master weights and Adam state, T = 2,048, synthetic "
        f"batches. MFU = tokens/s x model FLOPs per token / dense bf16 peak "
        f"({_f((r.get('peak_flops') or 0) / 1e12)} TFLOP/s for {r.get('device')}), under "
        "two conventions: 'full' counts attention over the whole T x T square (PaLM), "
        "'causal' half of it (MaxText, Megatron-LM; `rope_jax/harness/flops.py`); "
        "'of ceiling' divides the full count by the bf16 matmul ceiling `check` measured "
        f"({_f(r.get('ceiling_gflops'))} GFLOP/s).",
        "",
        "| setting | tok/s | step s | MFU (full) | MFU (causal) | of ceiling | compile s | "
        "peak device GiB | XLA program GiB | program temp GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    earlier = None
    for key, m in sorted(r.get("settings", {}).items(), key=lambda kv: _step1b_order(kv[1])):
        if m.get("oom"):
            out.append(f"| {key} | out of memory | | | | | | | | |")
            continue
        temp = (m.get("program_bytes") or {}).get("temp")
        peak, program = _step1b_memory(m, earlier)
        earlier = max(earlier or 0, m.get("peak_bytes") or 0)
        out.append(f"| {key} | {_f(m['tokens_per_s'])} | {m['step_s']:.3f} | "
                   f"{_f(m.get('mfu'), '.1%')} | {_f(_mfu_causal(m), '.1%')} | "
                   f"{_f(m.get('of_ceiling'), '.1%')} | {m['compile_s']:.0f} | {peak} | "
                   f"{program} | {_f((temp or 0) / 2**30, '.1f')} |")  # fmt: skip
    out += [
        "",
        "Settings in the order they ran, one after another in one process per call. Peak "
        "device memory is the process's peak after the setting: '<= X' marks a setting "
        "that did not raise the peak an earlier one had set, so its own peak is at most X "
        "and was not measured apart. XLA program = arguments + outputs + temp - aliased, "
        "XLA's own figure for that setting's compiled step alone.",
    ]
    return out


def _rung_timing(timing: dict | None) -> str:
    if not timing:
        return ""
    return (f" The last call compiled its rows in parallel in {timing['compile_wall_s']:.0f} s "
            f"(wall) and measured {timing['step_s'] * 1e3:.1f} ms a step.")  # fmt: skip


def _harness_rows(rows: dict) -> bool:
    """Whether the rows were trained and scored through the harness (`"path": "harness"`,
    `benchmarks/gpu_rung.py`); rows without it were made by the rung's earlier code."""
    return bool(rows) and all(m.get("path") == "harness" for m in rows.values())


def _rung_data_order(rows: dict) -> str:
    if _harness_rows(rows):
        return ("each step's batch from train.py's training iterator (windows of the carried "
                "tokens, shuffled by the seed).")  # fmt: skip
    return "each step's windows drawn at random from the carried tokens (the earlier code)."


def _rung_held_out(r: dict) -> str:
    if _harness_rows(r.get("rows", {})):
        return (f"the harness's `loss` task at T, 2T and 4T, {r.get('eval_batches')} batches "
                f"of {r.get('eval_batch_size')} validation windows at each length, spread "
                "evenly over the carried validation tokens.")  # fmt: skip
    return (f"{r.get('eval_windows')} validation windows of T tokens, and as many tokens in "
            "windows of 2T and 4T (the earlier code's own loop).")  # fmt: skip


def _rung(r: dict) -> list[str]:
    if not r or "steps" not in r:
        return ["Not run."]
    from configs import lm
    from rope_jax.experiments.report import kendall

    rows = r.get("rows", {})
    d, s = r.get("data", {}), r.get("shape", {})
    t = int(s.get("seq_len") or 0)
    out = [
        f"Corpus: {d.get('dataset')} ({d.get('tokenizer')}, {_f(d.get('train_tokens'))} "
        f"training tokens carried in {d.get('slices', 1)} slices spread over its "
        f"{_f(d.get('train_tokens_in_dataset'))}; prepared by "
        f"`{provenance.portable(str(d.get('prepared_by')))}`); "
        + _rung_data_order(rows)
        + " Model: "
        f"L{s.get('num_layers')} D{s.get('embed_dim')} N{s.get('num_heads')} "
        f"K{s.get('num_kv_heads')} H{s.get('head_dim')} F{s.get('mlp_dim')}, "
        f"{_f(r.get('params'))} parameters ({_f(r.get('block_params'))} in the blocks' "
        f"matmuls), bf16, attention `{r.get('impl')}`; T = {s.get('seq_len')}, "
        f"B = {s.get('batch')}, {r['steps']} steps = {_f(r.get('tokens_per_run'))} tokens "
        f"per row; {'seed 0' if r.get('more_seeds') else 'one seed'}, the same data order "
        "for every row. Held-out: " + _rung_held_out(r) + " 'Training windows': the final "
        "parameters scored on as many windows of the training tokens through the same "
        "evaluation (far above the last training losses: an evaluation fault; near them: "
        "poor generalisation); every "
        "step's loss and gradient norm are in rung.json (step_loss, step_grad_norm), and "
        "each layer's largest attention logit at 100 steps spread over the run (max_logit)."
        + _rung_timing(r.get("timing")),
        "",
        f"| row | held-out loss @{t} | @{2 * t} | @{4 * t} | bits/byte @{t} | "
        f"training windows @{t} | train s | compile s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    order = sorted(rows, key=lambda k: rows[k]["loss"])
    for row in order:
        m = rows[row]
        at = [_f((m.get("loss_at") or {}).get(str(n)), ".4f") for n in (2 * t, 4 * t)]
        out.append(f"| {row} | {m['loss']:.4f} | {' | '.join(at)} | {m['bits_per_byte']:.4f} | "
                   f"{_f(m.get('train_windows_loss'), '.4f')} | {m['train_s']:.1f} | "
                   f"{m['compile_s']:.1f} |")  # fmt: skip
    if len(rows) >= 2:
        tau, p, n = kendall({k: v["loss"] for k, v in rows.items()}, lm.ARTICLE_LOSS)
        nope = order.index("nope") + 1 if "nope" in order else None
        noise = (
            "One seed: a hint, not a finding; its seed noise is unmeasured."
            if not r.get("more_seeds")
            else "The table is seed 0; the seed noise below."
        )
        out += ["", f"Kendall tau against the article's order over {n} rows: "
                f"{_f(tau, '.3f')} (p {_f(p, '.3f')}); NoPE ranks {nope} of {len(order)}. "
                + noise]  # fmt: skip
    out += _rung_seeds(rows, r.get("more_seeds") or {}, t)
    out += _rung_variants(rows, r.get("variants") or {}, t)
    if len(rows) < len(lm.ROWS):
        out.append(f"Rows finished: {len(rows)} of {len(lm.ROWS)} (the rest did not fit).")
    devices = {m.get("device") for m in rows.values()} - {None}
    if len(devices) > 1:  # a rung that spanned sessions on different GPU kinds
        out.append("Rows ran on more than one device: " + ", ".join(
            f"{row} {rows[row].get('device')}" for row in order) + ".")  # fmt: skip
    return out


def _rung_seeds(rows: dict, more: dict, t: int) -> list[str]:
    """The rows trained again at other seeds: their loss at each seed, and how far the
    seeds of one row lie apart (the noise a gap between rows must exceed)."""
    again = {row: [rows[row]["loss"]] + [more[k][row]["loss"] for k in sorted(more, key=int)
                                         if row in more[k]]
             for row in rows if any(row in m for m in more.values())}  # fmt: skip
    if not again:
        return []
    seeds = ", ".join(sorted(more, key=int))
    out = ["", f"Seed noise: {len(again)} rows trained again at seed {seeds} (init and data "
           "order), the rest of the setup the same.", "",
           f"| row | seed 0 @{t} | other seeds @{t} | mean | spread (max - min) |",
           "|---|---|---|---|---|"]  # fmt: skip
    for row, losses in sorted(again.items(), key=lambda kv: statistics.fmean(kv[1])):
        out.append(
            f"| {row} | {losses[0]:.4f} | {', '.join(f'{v:.4f}' for v in losses[1:])} "
            f"| {statistics.fmean(losses):.4f} | {max(losses) - min(losses):.4f} |"
        )
    spread = max(max(v) - min(v) for v in again.values())
    out += ["", f"The largest spread between the seeds of a row is {spread:.4f}: gaps "
            "between rows smaller than that are ties."]  # fmt: skip
    return out


def _rung_variants(rows: dict, variants: dict, t: int) -> list[str]:
    """Rows trained again with float32 compute or another peak learning rate
    (`--rung_variant`), beside the table's row of the same seed."""
    lines = [(label, int(seed), row, m) for label, by_seed in sorted(variants.items())
             for seed, done in by_seed.items() for row, m in done.items()]  # fmt: skip
    if not lines:
        return []
    out = ["", "Variants: rows trained again with the changes named (the rest of the setup "
           "the same), beside the table's row.", "",
           f"| row | variant | seed | held-out loss @{t} | the table's @{t} (seed 0) | "
           f"training windows @{t} |", "|---|---|---|---|---|---|"]  # fmt: skip
    for label, seed, row, m in sorted(lines, key=lambda x: (x[2], x[0], x[1])):
        own = _f((rows.get(row) or {}).get("loss"), ".4f")
        out.append(f"| {row} | {label} | {seed} | {m['loss']:.4f} | {own} | "
                   f"{_f(m.get('train_windows_loss'), '.4f')} |")  # fmt: skip
    return out


def _peer(r: dict) -> list[str]:
    if not r:
        return ["Not run."]
    if r.get("skipped"):
        return [f"Skipped: {r['skipped']}."]
    out = [
        "Both sides bf16 compute with float32 master weights: ours `model.dtype=bfloat16`; "
        "the peer HF `LlamaForCausalLM` under `torch.autocast(bfloat16)`, SDPA attention, "
        "fused AdamW. Same shape, batch and synthetic tokens.",
        "",
        "| shape | ours tok/s | peer tok/s | ours / peer (>= 1.2) |",
        "|---|---|---|---|",
    ]
    pairs = [("small", r.get("ours_small"), r.get("peer_small")),
             ("1b body", r.get("ours_1b"), r.get("peer_1b"))]  # fmt: skip
    for name, ours, peer in pairs:
        if not ours or not peer or peer.get("oom"):
            why = "peer out of memory" if peer and peer.get("oom") else "not run"
            out.append(f"| {name} | {_f((ours or {}).get('tokens_per_s'))} | {why} | |")
            continue
        ratio = ours["tokens_per_s"] / peer["tokens_per_s"]
        met = "met" if ratio >= 1.2 else "NOT met"
        extra = f" (B = {peer.get('batch')}, T = {peer.get('seq_len')})" if name != "small" else ""
        out.append(f"| {name}{extra} | {_f(ours['tokens_per_s'])} | "
                   f"{_f(peer['tokens_per_s'])} | {ratio:.2f} ({met}) |")  # fmt: skip
    return out


def rung_as_sweep(rung: dict) -> dict | None:
    """The rung in the format of a sweep's results JSON (`rope_jax.experiments.sweep`), so
    that `rope_jax.experiments.ladder` puts it beside the other rungs; None before the
    rung ran."""
    from configs import lm

    if not rung.get("rows"):
        return None
    s, t = rung["shape"], str(rung["shape"]["seq_len"])
    settings = {f"model.{k}": s[k] for k in ("num_layers", "embed_dim", "num_heads",
                                             "num_kv_heads", "head_dim", "mlp_dim")}  # fmt: skip
    settings.update({"data.name": rung["data"]["dataset"], "data.seq_len": s["seq_len"],
                     "data.global_batch_size": s["batch"], "train.num_steps": rung["steps"],
                     "optim.lr": s["lr"], "data.tokenizer": rung["data"]["tokenizer"]})  # fmt: skip
    # held-out loss at T, 2T and 4T (a rung from before those were measured: T alone)
    lens = [n for n in (t, str(2 * s["seq_len"]), str(4 * s["seq_len"]))
            if all(n == t or n in m.get("loss_at", {}) for m in rung["rows"].values())]  # fmt: skip
    by_seed = {0: rung["rows"], **{int(k): v for k, v in (rung.get("more_seeds") or {}).items()}}

    def runs(row: str) -> list[dict]:
        return [{"seed": k, "bits_per_byte": {t: m["bits_per_byte"]},
                 "loss": {n: m.get("loss_at", {}).get(n, m["loss"]) for n in lens}}
                for k, m in ((k, by_seed[k].get(row)) for k in sorted(by_seed)) if m]  # fmt: skip

    return {"title": "VO-RoPE site ablation, GPU rung (benchmarks/gpu_suite.py)",
            "settings": settings, "article_loss": lm.ARTICLE_LOSS, "seeds": sorted(by_seed),
            "seq_lens": lens, "device": rung.get("device"), "code": [rung.get("code")],
            "command": "python -m benchmarks.gpu_suite --stage=rung",
            "rows": {r: {"runs": runs(r)} for r in rung["rows"]}}  # fmt: skip


def render(results: dict) -> str:
    lines = ["# GPU suite", "",
             "Command: `python -m benchmarks.gpu_suite --out DIR --stage=all --budget_s=N` "
             "(benchmarks/gpu_suite.py); this page is rendered from DIR's stage JSON files.",
             ""]  # fmt: skip
    for name, fn in (("check", _check), ("kernels", _kernels), ("step1b", _step1b),
                     ("rung", _rung), ("peer", _peer)):  # fmt: skip
        r = results.get(name) or {}
        state = "done" if r.get("done") else ("partial" if r else "not run")
        if r.get("stopped_for_time") and not r.get("done"):  # a later call finished it
            state += ", stopped for time"
        lines += [f"## {name} ({state})", ""]
        lines += fn(r)
        for err in r.get("errors", []):
            lines.append(f"\nError: `{err[:500]}`")
        lines.append("")
    return "\n".join(lines)
