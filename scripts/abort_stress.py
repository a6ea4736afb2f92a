r"""Stops tiny runs with Ctrl-C, many at once, and counts how they end.

  python scripts/abort_stress.py --data_dir=/tmp/tfds --runs=6 --parallel=3
  python scripts/abort_stress.py --data_dir=/tmp/tfds --command=eval
  python scripts/abort_stress.py --data_dir=/tmp/tfds --command=eval_start --runs=10 --parallel=2
  python scripts/abort_stress.py --data_dir=/tmp/tfds --command=prepare_start --runs=10 --parallel=2

--command=train (default): each run trains the 1-layer test model with an evaluation of
400 batches after every step; once its first step is printed it gets Ctrl-C, and a
second Ctrl-C 0-20 ms (at random, seeded) after it says "saving at the end of this
step", while that step is still evaluating: the second Ctrl-C aborts the run.
--command=eval: one run of that model is trained first; each run is then eval.py over
the whole validation split at two lengths, given Ctrl-C 0-20 ms after its first
progress line, while it scores: the first Ctrl-C stops it.
--command=eval_start: the same eval.py, given Ctrl-C 0-3 s after it is started (at
random, seeded): while Python imports, restores the checkpoint or compiles.
--command=prepare_start / sweep_start: `python -m rope_jax.data.prepare` (the Python
standard library with a 1000-token BPE trained on 3 MB) or `python -m
rope_jax.experiments.sweep` (one row of the 1-layer model), given Ctrl-C 0-3 s after
it is started: while its packages import (JAX, before the module's first line) or it
runs.
Every run must end with exit status 130 and its one-line message (stderr holds that
line and progress lines only, no traceback); the script prints
each run's status and time to exit after the (last) Ctrl-C, then the counts, and exits
1 on any other ending (a crash or a run still alive after 60 s, killed); --dump_dir
keeps the whole stderr of each such run as <pid>.txt. The workdirs go to a temporary
directory; the shipped corpora are built into --data_dir if missing.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# per command: the pattern of the last stderr line; the (stream, line start) after which
# each Ctrl-C is sent (the last one after a random delay), none: after the start; the
# longest delay
MESSAGES = {
    "train": r"error: aborted by a second Ctrl-C; the newest checkpoint is kept",
    "eval": r"error: interrupted by Ctrl-C; a result file is written only once complete",
    "eval_start": r"error: interrupted by Ctrl-C(; a result file is written only once complete)?",
    "prepare_start": r"error: interrupted by Ctrl-C(; the same command resumes)?",
    "sweep_start": r"error: interrupted by Ctrl-C(; the same command resumes)?",
}
CUES = {"train": (("stdout", "step "), ("stdout", "Ctrl-C: saving")),
        "eval": (("stderr", "eval step "),), "eval_start": ((None, None),),
        "prepare_start": ((None, None),), "sweep_start": ((None, None),)}  # fmt: skip
DELAYS_S = {"train": 0.02, "eval": 0.02, "eval_start": 3.0, "prepare_start": 3.0,
            "sweep_start": 3.0}  # fmt: skip


def train_command(data_dir: str, workdir: str) -> list[str]:
    from tests.faults_test import flags
    from tests.train_test import tiny

    config = tiny(data_dir, **{"train.log_every_steps": 1, "train.ckpt_every_steps": 0,
                               "train.eval_every_steps": 1, "eval.num_batches": 400})  # fmt: skip
    return [sys.executable, "train.py", *flags(config), f"--workdir={workdir}"]


def eval_command(trained: str, tag: str, every_batch: bool) -> list[str]:
    """eval.py over the whole validation split; a progress line after every batch, or
    its defaults (none in the first 10 s; the command an eval.py before them also runs)."""
    every = ["--progress_s=0"] if every_batch else []
    return [sys.executable, "eval.py", f"--workdir={trained}", "--num_batches=0",
            "--seq_lens=32,128", f"--tag={tag}", *every]  # fmt: skip


def prepare_command(data_dir: str) -> list[str]:
    return [sys.executable, "-m", "rope_jax.data.prepare", "--source=python_stdlib",
            "--tokenizer=train:1000", "--tokenizer_train_bytes=3000000", "--name=lib",
            f"--data_dir={data_dir}", "--quiet"]  # fmt: skip


def sweep_command(data_dir: str, workdir: str) -> list[str]:
    model = (
        "model.num_layers=1,model.embed_dim=32,model.num_heads=2,model.num_kv_heads=1,"
        "model.head_dim=16,model.mlp_dim=64,data.seq_len=32,data.global_batch_size=8"
    )
    return [sys.executable, "-m", "rope_jax.experiments.sweep", "--config=configs/lm.py:size=tiny",
            f"--workdir={workdir}", "--rows=qk",
            "--set", f"{model},data.data_dir={data_dir},train.num_steps=20"]  # fmt: skip


def train_once(data_dir: str, workdir: str) -> None:
    from tests.faults_test import flags
    from tests.train_test import tiny

    cmd = [sys.executable, "train.py", *flags(tiny(data_dir)), f"--workdir={workdir}"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)


def abort_one(cmd: list[str], delay_s: float, what: str, dump_dir: str = ""):
    """(how the run ended, seconds from the last Ctrl-C to its end); the stderr of any
    other ending than exit 130 goes to <dump_dir>/<pid>.txt where dump_dir is given."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    seen = []
    for k, (stream, want) in enumerate(CUES[what]):
        for line in getattr(proc, stream) if stream else ():
            if stream == "stderr":
                seen.append(line)
            if line.startswith(want):
                break
        time.sleep(delay_s if k == len(CUES[what]) - 1 else 0.0)
        proc.send_signal(signal.SIGINT)
    sent = time.time()
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return "hung (killed after 60 s)", time.time() - sent
    err = "".join(seen) + err
    lines = err.strip().splitlines()
    ok = (proc.returncode == 130 and re.fullmatch(MESSAGES[what], (lines or [""])[-1])
          and all(x.startswith("eval step ") for x in lines[:-1]))  # fmt: skip
    end = "exit 130" if ok else f"exit {proc.returncode} ({(lines or [''])[-1][:200]})"
    if not ok and dump_dir:
        with open(os.path.join(dump_dir, f"{proc.pid}.txt"), "w") as f:
            f.write(err)
    return end, time.time() - sent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--data_dir", required=True, help="TFDS data dir (built if missing)")
    p.add_argument("--runs", type=int, default=6, help="aborts per parallel lane")
    p.add_argument("--parallel", type=int, default=3, help="runs at the same time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dump_dir", default="", help="keep the stderr of every other ending here")
    p.add_argument("--command", choices=sorted(MESSAGES), default="train", help="what to stop")
    args = p.parse_args()
    if args.dump_dir:
        os.makedirs(args.dump_dir, exist_ok=True)
    from rope_jax import data

    config = data.default_config()
    config.data_dir = args.data_dir
    data.ensure_built(config)  # the default corpus, before the clock starts
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        trained = os.path.join(tmp, "trained")
        if args.command in ("eval", "eval_start"):
            train_once(args.data_dir, trained)
        runs = range(args.runs * args.parallel)
        if args.command == "train":
            cmds = [train_command(args.data_dir, os.path.join(tmp, f"run{k}")) for k in runs]
        elif args.command == "prepare_start":
            cmds = [prepare_command(os.path.join(tmp, f"run{k}")) for k in runs]
        elif args.command == "sweep_start":
            cmds = [sweep_command(args.data_dir, os.path.join(tmp, f"run{k}")) for k in runs]
        else:
            cmds = [eval_command(trained, f"run{k}", args.command == "eval") for k in runs]
        jobs = [(cmd, rng.random() * DELAYS_S[args.command]) for cmd in cmds]
        with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
            ends = list(pool.map(lambda job: abort_one(*job, args.command, args.dump_dir), jobs))
    for k, (end, took) in enumerate(ends):
        print(f"run {k}: {end} {took:.2f} s after the last Ctrl-C")
    counts = collections.Counter(end for end, _ in ends)
    print(", ".join(f"{n} {end}" for end, n in counts.most_common()), f"of {len(ends)}")
    sys.exit(0 if set(counts) == {"exit 130"} else 1)


if __name__ == "__main__":
    main()
