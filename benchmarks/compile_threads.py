"""Compiling in threads against one after another, on this host: two rows of the GPU
rung (a smaller model than the rung's, on CPU) and two kernel-check cases.

  python benchmarks/compile_threads.py

Prints the wall seconds of each way, each measured in a fresh process (no compile cache
shared between them); tracing is inside the clock for both, as the stages do it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "benchmarks")]

import gpu_kernels  # noqa: E402
import gpu_rung  # noqa: E402

SHAPE = dict(gpu_rung.RUNG_SHAPE, num_layers=4, embed_dim=256, num_heads=4, num_kv_heads=2,
             mlp_dim=768, seq_len=128, batch=8)  # fmt: skip


def rung_rows(threads: bool) -> float:
    configs = {r: gpu_rung.rung_config(SHAPE, r, 8000, 100, "xla") for r in ("qk", "vo")}
    if threads:
        return _timed(lambda: gpu_rung.compile_rows(configs))
    return _timed(lambda: [gpu_rung.compile_rows({r: c}) for r, c in configs.items()])


def kernel_cases(threads: bool) -> float:
    args = [("separate", s, ["dot_product", "chunked"], ("float32", "bfloat16"), True)
            for s in ("qk", "vo")]  # fmt: skip
    if not threads:
        return _timed(lambda: [gpu_kernels._loss_and_grads_all(*a) for a in args])
    workers = [threading.Thread(target=gpu_kernels._loss_and_grads_all, args=a) for a in args]
    return _timed(lambda: ([w.start() for w in workers], [w.join() for w in workers]))


def _timed(fn) -> float:
    start = time.time()
    fn()
    return time.time() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=2, metavar=("WHAT", "THREADS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:  # one measurement, in its own process
        what, threads = args.child
        print(f"{MEASURES[what](threads == '1'):.1f}")
        return
    print(f"{os.cpu_count()} CPU cores")
    for what, name in (("rung", "rung rows (train + 3 eval programs each)"),
                       ("kernels", "kernel cases")):  # fmt: skip
        wall = [subprocess.run([sys.executable, __file__, "--child", what, str(t)], check=True,
                               capture_output=True, text=True).stdout.split()[-1]
                for t in (0, 1)]  # fmt: skip
        print(f"{name}: one after another {wall[0]} s, in threads {wall[1]} s")


MEASURES = {"rung": rung_rows, "kernels": kernel_cases}

if __name__ == "__main__":
    main()
