"""Which code and machine made a number: the git commit of this checkout and the
processor, recorded with each run. Standard library only (cheap to import anywhere).

  provenance.code_version()          # {"commit": "0c85ec3...", "changed": False, ...}
  provenance.describe(version)       # "0c85ec3" / "0c85ec3 + uncommitted changes"
  provenance.record_start(workdir, step)   # one line in <workdir>/provenance.jsonl
  provenance.read_starts(workdir)    # those lines, oldest first
  provenance.seen(workdir, "code")   # the codes a run was trained under, each once
  provenance.devices()               # "cpu (AMD EPYC) x1", "gpu (NVIDIA H100 80GB HBM3) x8"

A run records a line each time it starts or resumes (its step, the commit, whether a
tracked Python file differs from that commit, jax's version, the devices), so a run
resumed under newer code or on another machine says so. The processor matters on a
CPU: bfloat16 matmuls take other kernels on other CPUs (AMX on recent Xeons, AVX-512
on EPYCs), so the same command and seed are bit-identical on one machine but need not
be across machines. Evaluation files and a sweep's results carry the same
description. Outside a git checkout (an installed package, a copied tree) the commit is
None and the package's version stands in.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import time

FILE = "provenance.jsonl"
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # holds rope_jax/


def _git(*args: str) -> str | None:
    """`git -C ROOT args` stripped, or None (no git, not a checkout, any failure)."""
    try:
        out = subprocess.run(["git", "-C", _ROOT, *args], capture_output=True, text=True,
                             timeout=30, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


@functools.cache
def code_version() -> dict:
    """{"commit": the checkout's HEAD or None, "changed": whether a tracked Python file
    differs from it (None without a commit), "rope_jax": the package version}. Only a
    checkout whose top level holds this package counts (not a repository the package
    was installed inside). Results and other data files do not make it "changed"."""
    from rope_jax import __version__

    top = _git("rev-parse", "--show-toplevel")
    commit = None
    if top and os.path.realpath(top) == os.path.realpath(_ROOT):
        commit = _git("rev-parse", "HEAD")
    changed = None
    if commit:
        diff = _git("status", "--porcelain", "--untracked-files=no", "--", "*.py")
        changed = None if diff is None else bool(diff)
    return {"commit": commit, "changed": changed, "rope_jax": __version__}


def describe(version: dict | None) -> str:
    """A version as one short phrase: the short commit, '+ uncommitted changes' when a
    tracked Python file differed, or the package version outside a checkout."""
    if not version:
        return "unknown"
    if not version.get("commit"):
        return f"rope_jax {version.get('rope_jax', '?')} (no git commit)"
    text = version["commit"][:7]
    return text + " + uncommitted changes" if version.get("changed") else text


def record_start(workdir: str, step: int) -> str | None:
    """Appends this process's code version, jax's and the devices to
    <workdir>/provenance.jsonl as the run (re)starts at `step` (process 0 only).
    Returns what changed since the run's last start (one phrase: the code, jax, the
    devices), or None."""
    import jax

    if jax.process_index() != 0:
        return None
    record = {"step": int(step), "time": time.time(), "code": describe(code_version()),
              **code_version(), "jax": jax.__version__, "devices": devices()}  # fmt: skip
    last = (read_starts(workdir) or [None])[-1]
    with open(os.path.join(workdir, FILE), "a") as f:
        f.write(json.dumps(record) + "\n")
    return changes(last, record)


def changes(last: dict | None, now: dict) -> str | None:
    """What differs between two start records (code, jax, devices), as one phrase
    ("code abc1234 -> def5678; devices ... -> ..."), or None."""
    if not last:
        return None
    diffs = [f"{key} {last[key]} -> {now[key]}" for key in ("code", "jax", "devices")
             if key in last and last[key] != now.get(key)]  # fmt: skip
    return "; ".join(diffs) or None


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else platform.processor()."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def devices() -> str:
    """This process's devices as "<platform> (<kind>) x<count>", a CPU named by its
    model (jax calls every CPU "cpu")."""
    import jax

    dev = jax.devices()[0]
    kind = cpu_name() if dev.platform == "cpu" else dev.device_kind
    return f"{dev.platform} ({kind}) x{jax.device_count()}"


def read_starts(workdir: str) -> list[dict]:
    """The records of <workdir>/provenance.jsonl, oldest first ([] for a run made before
    runs recorded them); a line cut short by a kill is skipped."""
    path = os.path.join(workdir, FILE)
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return [r for r in out if isinstance(r, dict)]


def seen(workdir: str, key: str = "code") -> list[str]:
    """The values of `key` ("code", "devices", "jax") over a run's starts, each once, in
    the order met: the code (or the machines) a run was trained under."""
    return list(dict.fromkeys(r[key] for r in read_starts(workdir) if key in r))
