"""What the tests on the local SLURM cluster share: the cluster fixture, the run
environment, a final checkpoint's parameters.

  from tests.slurm_helpers import cluster  # noqa: F401  (a session-scoped fixture)

`cluster` starts the single-node cluster of `scripts/local_slurm.sh` once for the session
(and stops it at the end, unless it was running before); the modules' tests are skipped,
with the reason, where it cannot start (not root, no apt-get, a daemon fails).
"""

import os
import subprocess

import jax
import pytest

from rope_jax import harness
from rope_jax.harness import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER_SCRIPT = os.path.join(ROOT, "scripts", "local_slurm.sh")
JOB_NAME = "rope_jax_slurm_test"  # the srun steps of the tests; cancelled after the module
# Each process: N CPU devices; XLA at a low optimisation level compiles in half the time.
XLA_FLAGS = "--xla_force_host_platform_device_count={} --xla_backend_optimization_level=0"


def has(program: str) -> bool:
    """Whether `program` is an executable on PATH."""
    return any(os.access(os.path.join(d, program), os.X_OK)
               for d in os.environ.get("PATH", "").split(os.pathsep))  # fmt: skip


@pytest.fixture(scope="session")
def cluster():
    """The local cluster, started once for the test session's SLURM modules (and stopped
    at its end, unless it was running before; one worker runs them all: their
    xdist_group); the tests are skipped, with the reason, where it cannot start."""
    if os.geteuid() != 0:
        pytest.skip("local SLURM cluster needs root (it installs packages, starts daemons)")
    was_up = has("sinfo") and subprocess.run(["sinfo", "-h"], capture_output=True).returncode == 0
    proc = subprocess.run(["bash", CLUSTER_SCRIPT, "up"], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    if proc.returncode != 0:
        reason = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"local SLURM cluster did not start: {reason}")
    yield proc.stdout.strip()
    subprocess.run(["scancel", f"--name={JOB_NAME}"], capture_output=True)
    if not was_up:
        subprocess.run(["bash", CLUSTER_SCRIPT, "down"], capture_output=True)


def run_env(cache: str, devices: int) -> dict:
    """The environment of a run: no SLURM variables of an enclosing job, the persistent
    compilation cache `cache`, unbuffered output, `devices` CPU devices per process."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return dict(base, JAX_PLATFORMS="cpu", XLA_FLAGS=XLA_FLAGS.format(devices),
                JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                PYTHONUNBUFFERED="1")  # fmt: skip


def final_params(workdir: str):
    """(step, parameter arrays) of the newest checkpoint, restored in this process."""
    config = checkpoint.load_config(workdir)
    run_ = harness.build(config)
    mngr = checkpoint.Manager(workdir, read_only=True)
    try:
        step = mngr.latest_step()
        state, _ = mngr.restore(step, run_.abstract)
    finally:
        mngr.close()
    return step, jax.tree.leaves(jax.device_get(state["params"]))
