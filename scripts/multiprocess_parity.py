r"""Multi-process parity: `srun -n P` of train.py against one process, same global batch.

  sudo scripts/local_slurm.sh up                 # or any SLURM cluster with srun
  python scripts/multiprocess_parity.py          # writes results/performance/multiprocess_parity.md

Trains the same config twice on CPU: once as one process with P x D devices, once as
`srun -n P` (P processes of D devices each, started by `harness.distributed` from
SLURM's variables, collectives over gloo). Both see P x D devices and the same global
batch, so their per-step losses and evaluations should agree to float32 rounding.
Writes the exact commands, the losses side by side and the largest difference to
--out. The two workdirs, <workdir>/one and <workdir>/two, are this script's own and
are replaced on every run. Fails with one line when srun is missing or a run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = [
    "--config=configs/lm.py:size=tiny",
    "--config.train.num_steps={steps}",
    "--config.train.log_every_steps=1",
    "--config.train.ckpt_every_steps={steps}",
    "--config.train.eval_every_steps=0",
    "--config.eval.num_batches=4",
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--processes", type=int, default=2, help="P, tasks of srun")
    p.add_argument("--devices", type=int, default=2, help="D, CPU devices per process")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--workdir", default="runs/multiprocess_parity")
    p.add_argument("--out", default="results/performance/multiprocess_parity.md")
    return p.parse_args(argv)


def commands(args) -> dict[str, tuple[dict, list[str]]]:
    """{"one": (env, argv), "two": (env, argv)}: the single-process and srun runs."""
    config = [flag.format(steps=args.steps) for flag in CONFIG]
    xla = "--xla_force_host_platform_device_count={}"
    python = ["python", "train.py", *config]
    srun = ["srun", f"--ntasks={args.processes}", "--cpus-per-task=1", "--kill-on-bad-exit=1"]
    return {
        "one": ({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla.format(args.processes * args.devices)},
                [*python, f"--workdir={args.workdir}/one"]),
        "two": ({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla.format(args.devices)},
                [*srun, *python, f"--workdir={args.workdir}/two"]),
    }  # fmt: skip


def shell_line(env: dict, argv: list[str]) -> str:
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), *map(shlex.quote, argv)])


def run(name: str, env: dict, argv: list[str]) -> float:
    """Runs one command from the repository root (python = this interpreter); seconds."""
    argv = [sys.executable if a == "python" else a for a in argv]
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    t = time.time()
    proc = subprocess.run(argv, cwd=ROOT, env={**base, **env}, text=True, capture_output=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["no output"]
        sys.exit(f"error: the {name} run failed (exit {proc.returncode}): {tail[0]}")
    return time.time() - t


def read_metrics(workdir: str) -> tuple[dict[int, float], dict]:
    """(step -> training loss, the last evaluation record) of a workdir's metrics.jsonl."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    evals = [r for r in records if "eval/loss" in r]
    return losses, evals[-1] if evals else {}


def jax_version() -> str:
    from importlib import metadata

    return metadata.version("jax")


def slurm_version() -> str:
    """`slurm 22.05.8` as `srun --version` says it."""
    proc = subprocess.run(["srun", "--version"], capture_output=True, text=True)
    return proc.stdout.strip() or "slurm (unknown version)"


def report(args, cmds, one, two, seconds) -> str:
    """The markdown: commands, losses side by side, the largest differences."""
    (loss1, eval1), (loss2, eval2) = one, two
    steps = sorted(loss1)
    diffs = [abs(loss1[s] - loss2[s]) for s in steps]
    eval_diff = abs(eval1["eval/loss"] - eval2["eval/loss"])
    lines = [
        "# Multi-process parity: `srun -n 2` against one process",
        "",
        f"The tiny LM (`configs/lm.py:size=tiny`), {args.steps} steps on CPU, trained as one "
        f"process with {args.processes * args.devices} devices and as `srun -n "
        f"{args.processes}` ({args.processes} processes x {args.devices} devices, started "
        "by `rope_jax.harness.distributed` from SLURM's variables, cross-process "
        "collectives over gloo) on a single-node SLURM cluster on this machine "
        "(`scripts/local_slurm.sh up`). Same global batch, same device count: each process "
        "reads its own rows of every global batch.",
        "",
        "Made by `python scripts/multiprocess_parity.py` (after `sudo scripts/local_slurm.sh "
        "up`), which ran, from the repository root:",
        "",
        "```sh",
        *(shell_line(*cmds[name]) for name in ("one", "two")),
        "```",
        "",
        f"Date: {time.strftime('%Y-%m-%d')}. Machine: {os.cpu_count()} CPU cores, Python "
        f"{sys.version.split()[0]}. Versions: jax {jax_version()}, {slurm_version()}.",
        "",
        f"Wall time: one process {seconds['one']:.0f} s, srun {seconds['two']:.0f} s "
        f"(compile included; {os.cpu_count()} CPU cores shared by all processes).",
        "",
        f"| step | one process | srun -n {args.processes} | abs. difference |",
        "|---:|---:|---:|---:|",
        *(
            f"| {s} | {loss1[s]:.6f} | {loss2[s]:.6f} | {d:.1e} |"
            for s, d in zip(steps, diffs, strict=True)
        ),  # fmt: skip
        "",
        f"Largest difference of the training loss over {len(steps)} steps: **{max(diffs):.1e}**.",
        "",
        f"Final evaluation ({eval1['eval/tokens']} tokens of the validation split): loss "
        f"{eval1['eval/loss']:.6f} (one process) and {eval2['eval/loss']:.6f} (srun), "
        f"difference {eval_diff:.1e}.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    if shutil.which("srun") is None:
        sys.exit("error: srun not found: start a cluster (sudo scripts/local_slurm.sh up)")
    cmds = commands(args)
    seconds = {}
    for name, (env, command) in cmds.items():
        shutil.rmtree(os.path.join(ROOT, args.workdir, name), ignore_errors=True)
        print(f"{name}: {shell_line(env, command)}", flush=True)
        seconds[name] = run(name, env, command)
    one = read_metrics(os.path.join(ROOT, args.workdir, "one"))
    two = read_metrics(os.path.join(ROOT, args.workdir, "two"))
    if sorted(one[0]) != sorted(two[0]):
        sys.exit(f"error: the runs logged different steps: {sorted(one[0])} {sorted(two[0])}")
    text = report(args, cmds, one, two, seconds)
    with open(os.path.join(ROOT, args.out), "w") as f:
        f.write(text)
    largest = max(abs(one[0][s] - two[0][s]) for s in one[0])
    print(f"largest training-loss difference: {largest:.1e}; wrote {args.out}")


if __name__ == "__main__":
    main()
