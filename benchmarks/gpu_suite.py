"""The GPU agenda in one command: check, kernels, step1b, rung, peer, inside a time budget.

  python -m benchmarks.gpu_suite --out runs/gpu --stage=all --budget_s=500
  python -m benchmarks.gpu_suite --out runs/gpu --stage=kernels,step1b   # some stages
  python -m benchmarks.gpu_suite --out runs/gpu --report                # re-render the page
  python -m benchmarks.gpu_suite --out /tmp/smoke --smoke               # tiny, on a CPU

Stages (in this order; `benchmarks/gpu_stages.py` names them, each in its own module):

  check    devices, versions, cuDNN, the dense matmul ceiling (bf16 and f32) measured.
  kernels  every attention impl equal to `xla` in loss and gradients, bf16 and f32, over
           the 16 rotation-site subsets and the tied key/value cache, packed documents
           (segment ids) and decoding through the cache; whether cuDNN's fused attention
           is in the compiled program.
  step1b   the `1b` preset in bf16 at the settings of STEP1B_SETTINGS (attention impl,
           remat, batch), in that order: tokens/s, MFU against the device's dense bf16
           peak counting attention over the full T x T square (PaLM) and causally, as
           half of it (MaxText, Megatron-LM; `rope_jax.harness.flops`), the full count
           against the ceiling measured by `check`, peak device memory.
  rung     the nine-row rotation-site ablation on a travelling corpus
           (`benchmarks/gpu_data.py` makes it), trained and scored through train.py's
           own path (`benchmarks/gpu_rung.py`: its build, train step, data iterator and
           `loss` task): every row's programs compiled at once in parallel threads,
           then the rows trained one after another, `--rung_tokens` each (100M by
           default). A rung longer than one call goes on in the next:
           the same OUT, or `--resume_from` the folder where a call's files were kept.
           `--rung_seed K --rung_rows qkvo,vo` trains those rows again at seed K (init
           and data order) beside the table, as its measure of the seed noise;
           `--rung_variant float32` / `lr=3e-4` (or both) trains rows with float32
           compute / another peak learning rate beside it (is a row's loss the
           precision's or the step size's?).
  peer     HF `LlamaForCausalLM` in bf16 autocast (SDPA, fused AdamW) against ours at
           `small` and at the 1b body (the batch step1b ran).

Every stage runs in its own child process (its own device memory, a crash stays in
it) and writes OUT/<stage>.json as it goes: a rerun skips finished stages and, inside
a stage, finished items (kernel cases, step1b settings, rung rows), so a run cut off by
its time limit resumes with the same command; on a machine that starts bare each time,
`--resume_from DIR` first copies into OUT the stage files an earlier call returned (kept
in DIR, e.g. committed under results/device/). `--budget_s` is the wall time of the
whole command; each stage gets a share of it (SHARES) plus whatever earlier stages left,
and stops starting new items when its next one would not fit. OUT/gpu_suite.md is the
page rendered from the JSON files after every stage, and OUT/rung_sweep.json the rung
in a sweep's format, for `python -m rope_jax.experiments.ladder`.

`--smoke` runs every stage with tiny shapes and a few steps, on any backend: the test
suite runs it on a CPU so that the command cannot rot between GPU runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (_ROOT, os.path.join(_ROOT, "benchmarks")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import bench_child  # noqa: E402  (standard library only, as this parent)

ORDER = ("check", "kernels", "step1b", "rung", "peer")
SHARES = {"check": 0.03, "kernels": 0.17, "step1b": 0.22, "rung": 0.43, "peer": 0.15}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_suite", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", required=True, help="directory for the stage JSON files and the page")
    p.add_argument("--stage", default="all", help=f"all or a comma list of {', '.join(ORDER)}")
    p.add_argument("--budget_s", type=float, default=500.0, help="wall seconds for the command")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and few steps (any backend)")
    p.add_argument("--data", default=os.path.join(_ROOT, "gpu_corpus"),
                   help="the travelling corpus (benchmarks/gpu_data.py) for the rung")  # fmt: skip
    p.add_argument("--rung_tokens", type=float, default=0,
                   help="tokens per rung row (default 100M; a rung keeps its first)")  # fmt: skip
    p.add_argument("--rung_seed", type=int, default=0,
                   help="seed of the rung rows run (init and data order); a seed other than 0 "
                   "adds a measure of the seed noise beside the rung's table")  # fmt: skip
    p.add_argument("--rung_rows", default="",
                   help="comma list of the rung rows to run (default: all)")  # fmt: skip
    p.add_argument("--rung_variant", default="",
                   help="train the rows with float32 compute and/or another peak learning rate: "
                   "'float32', 'lr=3e-4' or both, comma-separated; kept beside the rung's "
                   "table, not in it")  # fmt: skip
    p.add_argument("--resume_from", default="",
                   help="start OUT from the stage files an earlier call left there")  # fmt: skip
    p.add_argument("--report", action="store_true", help="only re-render OUT/gpu_suite.md")
    # a child's own arguments (set by the parent)
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    return p


def rung_spec(spec: str) -> tuple:
    """--rung_rows as a tuple of the site ablation's rows (() for all of them); an unknown
    row is a one-line error."""
    from configs import lm

    names = tuple(dict.fromkeys(s.strip() for s in spec.split(",") if s.strip()))
    bad = [s for s in names if s not in lm.ROWS]
    if bad:
        raise SystemExit(f"gpu_suite: --rung_rows={spec!r}: {', '.join(bad)} is not a row; "
                         f"the rows are {', '.join(lm.ROWS)}")  # fmt: skip
    return names


def stages(spec: str) -> list[str]:
    """`all` or a comma list -> the stages in ORDER; an unknown name is a one-line error."""
    if spec == "all":
        return list(ORDER)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [s for s in names if s not in ORDER]
    if bad or not names:
        raise SystemExit(f"gpu_suite: --stage={spec!r}: stages are all or {', '.join(ORDER)}")
    return [s for s in ORDER if s in names]


def load(out: str, stage: str) -> dict:
    """OUT/<stage>.json, or {} when the stage has not run."""
    path = os.path.join(out, f"{stage}.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def save(out: str, stage: str, result: dict) -> None:
    """Writes OUT/<stage>.json atomically (a crash leaves the previous version)."""
    path = os.path.join(out, f"{stage}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


def resume_from(folder: str, out: str) -> None:
    """Copies the stage files of `folder` that OUT lacks into OUT (a run that spans
    sessions: each call's OUT comes back, is committed, and the next call starts from
    it); a folder not made yet (the first call) starts afresh, and says so."""
    if not os.path.isdir(folder):
        print(f"gpu_suite: nothing to resume in {folder} (no such folder): starting afresh",
              flush=True)  # fmt: skip
        return
    os.makedirs(out, exist_ok=True)
    for stage in ORDER:
        if os.path.isfile(os.path.join(folder, f"{stage}.json")) and not load(out, stage):
            save(out, stage, load(folder, stage))


def _run_stage(args, stage: str, deadline: float) -> int:
    """The stage in a child process (this module with --child); its return code."""
    cmd = [sys.executable, "-m", "benchmarks.gpu_suite", "--out", args.out, "--child", stage,
           "--deadline", repr(deadline), "--data", args.data,
           "--rung_tokens", repr(args.rung_tokens), "--rung_seed", str(args.rung_seed),
           "--rung_rows", args.rung_rows, "--rung_variant", args.rung_variant]  # fmt: skip
    if args.smoke:
        cmd.append("--smoke")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if stage == "peer":  # torch shares the GPU with JAX there: no up-front JAX pool
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    else:  # JAX alone in the process: most of the device's memory (default 75%)
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    try:
        return subprocess.run(cmd, cwd=_ROOT, env=env, timeout=max(deadline - time.time() + 60, 60)
                              ).returncode  # fmt: skip
    except subprocess.TimeoutExpired:
        print(f"gpu_suite: {stage} ran past its deadline and was stopped", flush=True)
        return 124


def _child(args) -> None:
    import gpu_common
    import gpu_stages

    out, stage = args.out, args.child
    result = load(out, stage)
    result.pop("stopped_for_time", None)  # says what the last call did, not an earlier one
    ctx = gpu_common.Context(out=out, smoke=args.smoke, deadline=args.deadline, data=args.data,
                             result=result, save=lambda: save(out, stage, result),
                             load=lambda name: load(out, name),
                             rung_tokens=int(args.rung_tokens), rung_seed=args.rung_seed,
                             rung_rows=rung_spec(args.rung_rows),
                             rung_variant=args.rung_variant)  # fmt: skip
    try:
        gpu_stages.STAGES[stage](ctx)
    except Exception as e:  # recorded, so the page says what stopped the stage
        result.setdefault("errors", []).append(f"{type(e).__name__}: {str(e)[:2000]}")
        ctx.save()
        raise
    ctx.save()


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    args.out = os.path.abspath(args.out)
    if args.child:
        return _child(args)
    todo = stages(args.stage)
    if not args.budget_s > 0:
        raise SystemExit(f"gpu_suite: --budget_s={args.budget_s:g} must be > 0")
    rows = rung_spec(args.rung_rows)
    if args.rung_seed < 0:
        raise SystemExit(f"gpu_suite: --rung_seed={args.rung_seed} must be >= 0")
    import gpu_rung

    variant = gpu_rung.rung_variant(args.rung_variant)[0]
    # the stage files go there as each finishes: it must take them (made once stages start)
    existing = bench_child.nearest_existing(args.out)
    if not os.path.isdir(existing):
        raise SystemExit(f"gpu_suite: --out={args.out}: Not a directory ({existing})")
    if args.resume_from:
        resume_from(args.resume_from, args.out)
    rung = load(args.out, "rung")
    rung_left = gpu_rung.rung_todo(rung, args.smoke, args.rung_seed, rows, variant)
    if "rung" in todo and rung_left and not args.report:  # before anything runs
        problem = gpu_rung.rung_problem(rung, args.out, args.data, int(args.rung_tokens),
                                          args.smoke)  # fmt: skip
        if problem:
            raise SystemExit(problem)
    os.makedirs(args.out, exist_ok=True)
    if not args.report:
        start = time.time()
        end = start + args.budget_s
        for i, stage in enumerate(todo):
            pending = (gpu_rung.rung_todo(load(args.out, stage), args.smoke, args.rung_seed, rows,
                                            variant)
                       if stage == "rung" else not load(args.out, stage).get("done"))  # fmt: skip
            if not pending:
                print(f"gpu_suite: {stage} already done in {args.out}", flush=True)
                continue
            left = end - time.time()
            rest = sum(SHARES[s] for s in todo[i:])
            # this stage's share of what is left: time an earlier stage did not use
            # goes to the later ones
            deadline = time.time() + left * SHARES[stage] / rest
            if left < 5:
                print(f"gpu_suite: no time left for {stage}", flush=True)
                continue
            print(f"gpu_suite: {stage} (until +{deadline - start:.0f} s of {args.budget_s:.0f})",
                  flush=True)  # fmt: skip
            t0 = time.time()
            rc = _run_stage(args, stage, deadline)
            print(f"gpu_suite: {stage} exit {rc} after {time.time() - t0:.0f} s", flush=True)
            _write_page(args)
    _write_page(args)


def _write_page(args) -> None:
    import gpu_report

    page = gpu_report.render({s: load(args.out, s) for s in ORDER})
    with open(os.path.join(args.out, "gpu_suite.md"), "w") as f:
        f.write(page)
    sweep = gpu_report.rung_as_sweep(load(args.out, "rung"))
    if sweep:  # for `python -m rope_jax.experiments.ladder --sweeps=...,OUT/rung_sweep.json`
        save(args.out, "rung_sweep", sweep)


if __name__ == "__main__":
    main()
