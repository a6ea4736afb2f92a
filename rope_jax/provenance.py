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
None and the package's version stands in, unless the tree was stamped before it was
copied: `python -m rope_jax.provenance --stamp` writes CODE_VERSION.json beside the
package (the commit, and a digest of every tracked Python file), and a tree without git
that holds it reports that commit, "(stamped)", with "+ uncommitted changes" when its
Python files no longer match the digest. A copy whose .git travelled from an older state
(its HEAD is not the code in the tree) reports the stamp too, when the files match it.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import platform
import subprocess
import sys
import time

from rope_jax import __version__, signals  # standard library only, as this module

FILE = "provenance.jsonl"
STAMP = "CODE_VERSION.json"  # a copied tree's commit (`stamp`), beside the package
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
    was installed inside). Results and other data files do not make it "changed". A tree
    without git that holds a stamp (`stamp`) gives its commit, with "stamped": True.
    Asked once per process."""
    return _code_version()


def _code_version() -> dict:
    top = _git("rev-parse", "--show-toplevel")
    commit = None
    if top and os.path.realpath(top) == os.path.realpath(_ROOT):
        commit = _git("rev-parse", "HEAD")
    changed = None
    if commit:
        diff = _git("status", "--porcelain", "--untracked-files=no", "--", "*.py")
        changed = None if diff is None else bool(diff)
    if commit and changed is False:
        return {"commit": commit, "changed": False, "rope_jax": __version__}
    # a copied tree, stamped before the copy: without git, or with a .git that travelled
    # from an older state (its HEAD is not the code here: "changed" against it), the
    # stamp names the code when the files still match it
    if (stamped := _read_stamp()) is not None:
        files = stamped["files"]
        moved = bool(stamped["changed"]) or _digest(files) != stamped["digest"]
        if not commit or not moved:
            return {"commit": stamped["commit"], "changed": moved, "rope_jax": __version__,
                    "stamped": True}  # fmt: skip
    return {"commit": commit, "changed": changed, "rope_jax": __version__}


def _digest(files: list[str]) -> str:
    """sha256 over the paths (relative to the tree's top) and contents of `files`; a
    missing file counts as its path alone."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0")
        path = os.path.join(_ROOT, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                h.update(f.read())
        h.update(b"\0")
    return h.hexdigest()


def _read_stamp() -> dict | None:
    try:
        with open(os.path.join(_ROOT, STAMP)) as f:
            data = json.load(f)
        return data if {"commit", "changed", "files", "digest"} <= data.keys() else None
    except (OSError, ValueError, AttributeError):
        return None


def stamp() -> str:
    """Writes <tree>/CODE_VERSION.json from this git checkout (its HEAD, whether a tracked
    Python file differs, the tracked Python files and their digest), for a copy of the
    tree that travels without .git; returns its path. ValueError outside a checkout."""
    version = _code_version()  # now, not what this process saw first
    files = _git("ls-files", "--", "*.py")
    if not version["commit"] or version.get("stamped") or files is None:
        raise ValueError(f"{_ROOT} is not a git checkout: nothing to stamp")
    files = files.splitlines()
    data = {"commit": version["commit"], "changed": version["changed"], "files": files,
            "digest": _digest(files)}  # fmt: skip
    path = os.path.join(_ROOT, STAMP)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".tmp", path)
    return path


def describe(version: dict | None) -> str:
    """A version as one short phrase: the short commit, '+ uncommitted changes' when a
    tracked Python file differed, or the package version outside a checkout."""
    if not version:
        return "unknown"
    if not version.get("commit"):
        return f"rope_jax {version.get('rope_jax', '?')} (no git commit)"
    text = version["commit"][:7] + (" (stamped)" if version.get("stamped") else "")
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


def portable(text: str) -> str:
    """`text` (a recorded command) with this machine's paths made a reader's: the working
    directory's prefix dropped (relative paths) and the home directory written `~`."""
    cwd, home = os.getcwd().rstrip("/") + "/", os.path.expanduser("~").rstrip("/")
    text = text.replace(cwd, "")
    return text.replace(home + "/", "~/") if home not in ("", "/") else text


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


def main(argv=None) -> None:
    signals.release_signals()  # one that came while the modules imported: stops it here
    p = argparse.ArgumentParser(prog="python -m rope_jax.provenance",
                                description="The code version of this tree.")  # fmt: skip
    p.add_argument("--stamp", action="store_true",
                   help=f"write {STAMP} for a copy of the tree without .git")  # fmt: skip
    args = p.parse_args(argv)
    if args.stamp:
        try:
            print(f"wrote {stamp()}: {describe(code_version())}")
        except ValueError as e:
            sys.exit(f"error: {e}")
        return
    print(describe(code_version()))


if __name__ == "__main__":
    main()
