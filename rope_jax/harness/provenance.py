"""Which code made a number: the git commit of this checkout, recorded with each run.

  provenance.code_version()          # {"commit": "0c85ec3...", "changed": False, ...}
  provenance.describe(version)       # "0c85ec3" / "0c85ec3 + uncommitted changes"
  provenance.record_start(workdir, step)   # one line in <workdir>/provenance.jsonl
  provenance.read_starts(workdir)    # those lines, oldest first

A run records a line each time it starts or resumes (its step, the commit, whether a
tracked Python file differs from that commit, jax's version, the devices), so a run
resumed under newer code says so. Evaluation files and a sweep's results carry the same
description. Outside a git checkout (an installed package, a copied tree) the commit is
None and the package's version stands in.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import time

FILE = "provenance.jsonl"
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # rope_jax/
_ROOT = os.path.dirname(_PACKAGE)  # the checkout holding it


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


def record_start(workdir: str, step: int) -> None:
    """Appends this process's code version, jax's and the devices to
    <workdir>/provenance.jsonl as the run (re)starts at `step` (process 0 only)."""
    import jax

    if jax.process_index() != 0:
        return
    dev = jax.devices()[0]
    record = {"step": int(step), "time": time.time(), "code": describe(code_version()),
              **code_version(), "jax": jax.__version__,
              "devices": f"{dev.platform} ({dev.device_kind}) x{jax.device_count()}"}  # fmt: skip
    with open(os.path.join(workdir, FILE), "a") as f:
        f.write(json.dumps(record) + "\n")


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


def codes(workdir: str) -> list[str]:
    """The code descriptions a run was trained under, in the order it met them."""
    return list(dict.fromkeys(r["code"] for r in read_starts(workdir) if "code" in r))
