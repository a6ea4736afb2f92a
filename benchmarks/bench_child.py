"""Running one measurement in a child process, and facts about this process and machine.

A benchmark script runs each measurement as a child (the script itself with `--only=...`)
that prints one JSON line: each framework then has its own peak memory and its own threads.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys


def run_child(args: list[str], *, script: str, timeout: float = 1800) -> dict | None:
    """Runs `script` as a child with `args`; its last stdout line is JSON.

    A child that fails writes the tail of its stderr to ours and gives None.
    """
    cmd = [sys.executable, os.path.abspath(script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        sys.stderr.write(f"child {' '.join(args)} failed:\n{proc.stderr[-3000:]}\n")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def preset(value: str) -> str:
    """argparse `type` of a benchmark's --size: a size preset of configs/common.py."""
    from configs.common import SIZES

    if value not in SIZES:
        raise argparse.ArgumentTypeError(f"{value!r} is not one of {', '.join(SIZES)}")
    return value


def nearest_existing(path: str) -> str:
    """`path`, or the nearest folder above it that exists (where a write would begin)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def page_path(value: str) -> str:
    """argparse `type` of a benchmark's --out (a page written at the end): where nothing
    can be written is a usage error at once, not a traceback after the measurements."""
    existing = nearest_existing(os.path.dirname(os.path.abspath(value))) if value else ""
    if existing and not (os.path.isdir(existing) and os.access(existing, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{value}: {existing} is not a writable directory")
    return value


def publish(text: str, out: str = "") -> None:
    """Prints a benchmark's page and, with `out`, writes it there whole or not at all
    (`workdir.write_atomic`, imported here: the parent runs its children first)."""
    print(text)
    if out:
        from rope_jax.harness.workdir import write_atomic

        write_atomic(out, text)


def torch_available() -> bool:
    """Whether the peer's packages (torch, transformers) can be imported."""
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


def peak_rss_mib() -> float:
    """This process's peak resident set size (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
