r"""Aborts tiny train.py runs with a second Ctrl-C, many at once, and counts how they end.

  python scripts/abort_stress.py --data_dir=/tmp/tfds --runs=6 --parallel=3

Each run trains the 1-layer test model with an evaluation of 400 batches after every
step; once its first step is printed it gets Ctrl-C, and a second Ctrl-C 0-20 ms (at
random, seeded) after it says "saving at the end of this step", while that step is still
evaluating. Every run must end with exit status 130 and the one-line message; the
script prints each run's status and time to exit, then the counts, and exits 1 on any
other ending (a crash or a run still alive after 60 s, killed); --dump_dir keeps the
whole stderr of each such run as <pid>.txt. The workdirs go to a temporary directory;
the shipped corpora are built into --data_dir if missing.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MESSAGE = "error: aborted by a second Ctrl-C; the newest checkpoint is kept"


def command(data_dir: str, workdir: str) -> list[str]:
    from tests.faults_test import flags
    from tests.train_test import tiny

    config = tiny(data_dir, **{"train.log_every_steps": 1, "train.ckpt_every_steps": 0,
                               "train.eval_every_steps": 1, "eval.num_batches": 400})  # fmt: skip
    return [sys.executable, "train.py", *flags(config), f"--workdir={workdir}"]


def abort_one(cmd: list[str], delay_s: float, dump_dir: str = "") -> tuple[str, float]:
    """(how the run ended, seconds from the second Ctrl-C to its end); the stderr of any
    other ending than exit 130 goes to <dump_dir>/<pid>.txt where dump_dir is given."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    for want, after in (("step ", 0.0), ("Ctrl-C: saving", delay_s)):
        for line in proc.stdout:
            if line.startswith(want):
                break
        time.sleep(after)
        proc.send_signal(signal.SIGINT)
    sent = time.time()
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return "hung (killed after 60 s)", time.time() - sent
    lines = err.strip().splitlines()
    ok = proc.returncode == 130 and lines[-1:] == [MESSAGE]
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
    args = p.parse_args()
    from rope_jax import data

    config = data.default_config()
    config.data_dir = args.data_dir
    data.ensure_built(config)  # the default corpus, before the clock starts
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [(command(args.data_dir, os.path.join(tmp, f"run{k}")), rng.random() * 0.02)
                for k in range(args.runs * args.parallel)]  # fmt: skip
        with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
            ends = list(pool.map(lambda job: abort_one(*job, args.dump_dir), jobs))
    for k, (end, took) in enumerate(ends):
        print(f"run {k}: {end} {took:.2f} s after the second Ctrl-C")
    counts = collections.Counter(end for end, _ in ends)
    print(", ".join(f"{n} {end}" for end, n in counts.most_common()), f"of {len(ends)}")
    sys.exit(0 if set(counts) == {"exit 130"} else 1)


if __name__ == "__main__":
    main()
