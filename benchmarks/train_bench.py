"""Training-step throughput against the PyTorch peer, rotation overhead, input pipeline.

  python benchmarks/train_bench.py [--sizes tiny,small] [--out results/performance/perf.md]

Needs the bench venv for the peer (requirements-bench.txt: torch CPU + transformers);
without torch the peer columns read "n/a". Every measurement runs in its own child
process (this script with `--only=...`), which prints one JSON line: the peak RSS of
each framework is then its own, and JAX and torch never share a process's threads.
In one run, for each size of `configs/common.py` (tiny, small):

  ours      rope_jax.harness.build(lm.get_config("size=S")).train_step, float32.
  peer      HF transformers LlamaForCausalLM of the same shape (vocab 259, untied head,
            sdpa attention), torch.optim.AdamW (same lr, betas, decay on matrices,
            clip 1.0), float32, torch.set_num_threads(cores); and the same in bfloat16
            compute under torch.autocast (float32 weights and optimiser state); and the
            float32 one again with its forward and loss under torch.compile (`--peer_compile`
            mode, TorchInductor; "" leaves it out), as a PyTorch user would train.
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

Modules: train_ours.py (our side, the matmul ceiling), train_peer.py (the peer),
train_report.py (the markdown report), bench_child.py (the child runner),
bench_shapes.py (shapes, model FLOPs, synthetic batches); this file is the command line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (_ROOT, os.path.join(_ROOT, "benchmarks")):  # configs, the modules beside
    if _path not in sys.path:
        sys.path.insert(0, _path)

import bench_child  # noqa: E402
import pipeline_bench  # noqa: E402
import train_report  # noqa: E402
from train_ours import VARIANTS, measure_ceiling, measure_ours  # noqa: E402
from train_peer import measure_peer  # noqa: E402

from rope_jax import provenance  # noqa: E402

SIZES = ("tiny", "small")
DEFAULT_STEPS = {"tiny": (5, 30), "small": (2, 8)}  # (warm-up, timed) steps per size


# ------------------------------------------------------------------ command line


def _parser() -> argparse.ArgumentParser:
    """The flags of the parent run and of its `--only=...` children."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--steps", default="", help="size=warmup:timed,... e.g. small=1:4")
    parser.add_argument("--pipeline_steps", type=int, default=100)
    parser.add_argument("--out", default="", help="markdown report (keeps its ## Notes)")
    parser.add_argument(
        "--peer_compile", default="default", help="torch.compile mode of the peer ('' = none)"
    )
    parser.add_argument("--only", default="", help="child: ours|variants|peer|ceiling|...")
    parser.add_argument("--size", default="tiny", type=bench_child.preset)
    return parser


def _steps_arg(value: str) -> dict:
    """`--steps` "size=warmup:timed,..." over DEFAULT_STEPS: {size: (warm-up, timed)}."""
    steps = dict(DEFAULT_STEPS)
    for item in filter(None, value.split(",")):
        size, _, spec = item.partition("=")
        warm, _, timed = spec.partition(":")
        steps[size] = (int(warm), int(timed))
    return steps


# ------------------------------------------------------------------ a child


def _pipeline(size: str, pipeline_steps: int) -> dict:
    """pipeline_bench's loop on real batches: `pipeline_steps` at tiny, 1/20 (>= 4) above."""
    from configs import lm

    n = pipeline_steps if size == "tiny" else max(pipeline_steps // 20, 4)
    config = lm.get_config(f"size={size}")
    return {**pipeline_bench.measure_pipeline(config, steps=n), "size": size}


def _child(args, steps: dict) -> dict | None:
    """The measurement `--only` names (None if it names none), run in this process."""
    warm, timed = steps[args.size]
    measurements = {
        "ours": lambda: measure_ours(args.size, ["qk"], warmup=warm, steps=timed),
        "variants": lambda: measure_ours(args.size, list(VARIANTS), warmup=warm, steps=timed),
        "peer": lambda: measure_peer(args.size, warmup=warm, steps=timed),
        "peer_bf16": lambda: measure_peer(args.size, warmup=warm, steps=timed, dtype="bfloat16"),
        "peer_compiled": lambda: measure_peer(
            args.size, warmup=warm, steps=timed, compile=args.peer_compile
        ),
        "ceiling": measure_ceiling,
        "pipeline": lambda: _pipeline(args.size, args.pipeline_steps),
        "layouts": pipeline_bench.measure_layouts,
    }
    measure = measurements.get(args.only)
    return measure() if measure else None


# ------------------------------------------------------------------ the parent


def _run_children(sizes: list[str], steps: dict, pipeline_steps: int, has_peer: bool,
                  peer_compile: str = ""):  # fmt: skip
    """Every measurement, each in its own child: (rows, ceiling, pipelines, layouts)."""
    child = lambda args: bench_child.run_child(args, script=__file__)
    step_args = ["--steps", ",".join(f"{k}={w}:{t}" for k, (w, t) in steps.items())]
    ceiling = child(["--only=ceiling"])
    rows, pipelines = [], []
    for size in sizes:
        common = [f"--size={size}", *step_args]
        ours = child(["--only=ours", *common])
        peer = child(["--only=peer", *common]) if has_peer else None
        peer_bf16 = child(["--only=peer_bf16", *common]) if has_peer else None
        compiled = (child(["--only=peer_compiled", *common, f"--peer_compile={peer_compile}"])
                    if has_peer and peer_compile else None)  # fmt: skip
        variants = child(["--only=variants", *common])
        rows.append(train_report.summarize(size, ours, peer, variants, ceiling, peer_bf16,
                                           peer_compiled=compiled))  # fmt: skip
        pipe = child(["--only=pipeline", *common, f"--pipeline_steps={pipeline_steps}"])
        if pipe:
            pipelines.append(pipe)
    lay = child(["--only=layouts"])
    return rows, ceiling, pipelines, lay


def _accelerator() -> str:
    """'NAME (jax backend gpu), ' when JAX runs on an accelerator, else ''."""
    import jax

    if jax.default_backend() == "cpu":
        return ""
    return f"{jax.devices()[0].device_kind} (jax backend {jax.default_backend()}), "


def _versions(has_peer: bool) -> str:
    """The versions line: jax's, and torch's and transformers' when the peer ran."""
    import jax

    versions = f"jax {jax.__version__}"
    if has_peer:
        import torch
        import transformers

        versions += f", torch {torch.__version__}, transformers {transformers.__version__}"
    return versions


def _meta(argv, steps: dict, has_peer: bool) -> dict:
    """The report's command, date, machine, versions, threads, steps and GPU note."""
    import jax

    versions = _versions(has_peer)
    cpu = provenance.cpu_name()
    return {
        "command": "python benchmarks/train_bench.py " + " ".join(argv or sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "machine": _accelerator() + f"{os.cpu_count()} CPU cores ({cpu}), {platform.machine()}, "
        f"Python {platform.python_version()}",
        "versions": versions,
        "threads": os.cpu_count(),
        "peer_compile": _parser().parse_args(argv).peer_compile if has_peer else "",
        "steps": steps,
        "note": ""
        if jax.default_backend() == "cpu"
        else " On the GPU both sides keep float32 parameters and activations and multiply "
        "float32 matrices in TF32 (XLA's default; torch `set_float32_matmul_precision('high')`).",
    }


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    steps = _steps_arg(args.steps)

    if args.only:  # a child: one measurement, one JSON line
        result = _child(args, steps)
        if result is None:
            parser.error(f"--only={args.only!r} is not one of ours, variants, peer, ...")
        print(json.dumps(result))
        return 0

    sizes = [s for s in args.sizes.split(",") if s]
    has_peer = bench_child.torch_available()
    if not has_peer:
        print(
            "torch/transformers not importable: peer columns are n/a "
            "(use the venv of requirements-bench.txt)",
            file=sys.stderr,
        )
    rows, ceiling, pipelines, lay = _run_children(sizes, steps, args.pipeline_steps, has_peer,
                                                  args.peer_compile)  # fmt: skip
    text = train_report.report(rows, ceiling, pipelines, lay, _meta(argv, steps, has_peer))
    print(text)
    summary = {"rows": [{k: v for k, v in r.items() if k != "variants"} for r in rows]}
    print(json.dumps({**summary, "ceiling": ceiling}, indent=1))
    if args.out:
        train_report.write(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
