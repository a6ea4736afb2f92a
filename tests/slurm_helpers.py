"""What the tests on the local SLURM cluster share besides the `cluster` fixture (in
conftest.py): waiting for an idle node, the run environment, a final checkpoint's
parameters; and the XLA flags of a process with N CPU devices, which every multi-device
test uses."""

import os
import subprocess
import time

import jax

from rope_jax import harness
from rope_jax.harness import checkpoint, runfiles

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB_NAME = "rope_jax_slurm_test"  # the srun steps of the tests; cancelled after the module


def xla_flags(devices: int) -> str:
    """XLA_FLAGS of a process with `devices` CPU devices (and the tests' own flags)."""
    flags = os.environ.get("XLA_FLAGS", "")
    return f"{flags} --xla_force_host_platform_device_count={devices}".strip()


def wait_for_idle_node(timeout: float = 300) -> None:
    """Waits until the local cluster runs no job (a previous test's job may still be
    completing: its processes get SIGKILL KillWait seconds after SIGTERM); fails with
    squeue's and sinfo's view when it does not happen within `timeout` s."""
    deadline = time.time() + timeout
    while True:
        jobs = subprocess.run(["squeue", "-h"], capture_output=True, text=True).stdout.strip()
        if not jobs:
            return
        if time.time() > deadline:
            node = subprocess.run(["sinfo", "-h", "-N"], capture_output=True, text=True).stdout
            raise AssertionError(f"the node still runs jobs after {timeout} s:\n{jobs}\n{node}")
        time.sleep(0.5)


def run_env(cache: str, devices: int) -> dict:
    """The environment of a run: no SLURM variables of an enclosing job, the persistent
    compilation cache `cache`, unbuffered output, `devices` CPU devices per process."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return dict(base, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(devices),
                JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                PYTHONUNBUFFERED="1")  # fmt: skip


def final_params(workdir: str):
    """(step, parameter arrays) of the newest checkpoint, restored in this process."""
    config = runfiles.load_config(workdir)
    run_ = harness.build(config)
    mngr = checkpoint.Manager(workdir, read_only=True)
    try:
        step = mngr.latest_step()
        state, _ = mngr.restore(step, run_.abstract)
    finally:
        mngr.close()
    return step, jax.tree.leaves(jax.device_get(state["params"]))
