"""Process start-up of a multi-process run: one call before anything touches a device.

  distributed.define_flags()                     # beside the entry point's own flags
  distributed.start()                            # first thing in main(); errors: one line
  distributed.initialize("10.0.0.1:1234", 2, 0)  # the same, explicit

A run is one of several processes, and `jax.distributed.initialize` is called, when

  explicit   --coordinator_address=HOST:PORT --num_processes=N --process_id=I are given
             (all three, N > 1);
  env        JAX_COORDINATOR_ADDRESS is set (JAX reads it, and the rest from the
             cluster it detects);
  slurm      it is a task of a SLURM job step with more than one task (`srun -n 2`):
             the variables JAX's own SLURM detection reads are all set (SLURM_JOB_ID,
             SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID) and
             SLURM_NTASKS > 1. JAX then takes the coordinator from the first node of
             the step (port from the job id), the process count from SLURM_NTASKS, the
             process id from SLURM_PROCID and, on GPUs, the local device from
             SLURM_LOCALID;
  tpu        it runs on a Cloud TPU VM (JAX found TPU chips and libtpu): JAX reads the
             workers of the slice from the TPU metadata (one worker: one process).

`process_0_first(fn)` runs work that must not race (building a dataset in a shared
directory) on process 0 before the others; `any_process(flag)` is True on every
process when the flag is True on one (how a SIGTERM that reached some processes
becomes one agreed stop step).

Otherwise (a plain process, a batch script's own shell step, `srun -n 1`) nothing is
done. On the CPU backend cross-process collectives go over gloo
(`jax_cpu_collectives_implementation`), unless JAX_CPU_COLLECTIVES_IMPLEMENTATION
names another; gloo's "[Gloo] Rank i is connected to ..." lines, which it prints on
file descriptor 1 from every process, then go to stderr (`console.native_stdout_to_stderr`),
so that stdout holds the run's own output only. A bad explicit combination is a
`DistributedFlagError` (one line); a start-up that fails (coordinator unreachable, ...)
is a `DistributedError`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from typing import NamedTuple, TypeVar

import jax
import numpy as np
from absl import flags
from jax.experimental import multihost_utils

from rope_jax.harness import cli, console

FLAGS = flags.FLAGS
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
              "SLURM_LOCALID")  # fmt: skip
EXPLICIT_FLAGS = ("coordinator_address", "num_processes", "process_id")
T = TypeVar("T")


class DistributedError(RuntimeError):
    """jax.distributed.initialize failed (one line: how the run was detected, why)."""


class DistributedFlagError(ValueError):
    """A bad --coordinator_address / --num_processes / --process_id combination."""


class Plan(NamedTuple):
    """How to start: `source` (explicit, env, slurm, tpu) and the keyword arguments
    of `jax.distributed.initialize` (empty: JAX detects them itself)."""

    source: str
    kwargs: dict


def define_flags() -> None:
    """The three explicit flags (for clusters JAX does not detect)."""
    flags.DEFINE_string(
        "coordinator_address", None, "HOST:PORT of process 0, for a multi-process run that "
        "JAX does not detect (use with --num_processes and --process_id).",
    )  # fmt: skip
    flags.DEFINE_integer("num_processes", None, "Number of processes of the run.")
    flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes).")


def plan(coordinator_address: str | None = None, num_processes: int | None = None,
         process_id: int | None = None, *, environ: Mapping[str, str] | None = None,
         on_tpu_vm: bool = False) -> Plan | None:  # fmt: skip
    """What `initialize` will do (pure): a Plan, or None for a plain single process.

    Explicit values win over the environment. Raises DistributedFlagError (one line)
    when only some of the three explicit values are given, or they do not fit together.
    """
    environ = os.environ if environ is None else environ
    explicit = {"coordinator_address": coordinator_address, "num_processes": num_processes,
                "process_id": process_id}  # fmt: skip
    given = [name for name, value in explicit.items() if value is not None]
    if given:
        check_explicit(coordinator_address, num_processes, process_id)
        return Plan("explicit", explicit) if num_processes > 1 else None
    if environ.get("JAX_COORDINATOR_ADDRESS"):
        return Plan("env", {})
    if slurm_tasks(environ) > 1:
        return Plan("slurm", {})
    if on_tpu_vm:
        return Plan("tpu", {})
    return None


def check_explicit(coordinator_address, num_processes, process_id) -> None:
    """The three explicit values together, N >= 1, 0 <= I < N, HOST:PORT with a port."""
    values = {"coordinator_address": coordinator_address, "num_processes": num_processes,
              "process_id": process_id}  # fmt: skip
    missing = [f"--{name}" for name, value in values.items() if value is None]
    if missing:
        given = [f"--{name}" for name, value in values.items() if value is not None]
        raise DistributedFlagError(
            f"{' and '.join(given)} also need{'s' * (len(given) == 1)} {' and '.join(missing)} "
            "(--coordinator_address, --num_processes and --process_id go together)"
        )
    if num_processes < 1:
        raise DistributedFlagError(f"--num_processes={num_processes} must be >= 1")
    if not 0 <= process_id < num_processes:
        raise DistributedFlagError(
            f"--process_id={process_id} must lie in [0, {num_processes}) "
            f"(--num_processes={num_processes})"
        )
    match = re.fullmatch(r"(\[[^\]]+\]|[^\s:\[\]]+):(\d+)", coordinator_address)
    if not match or not 0 < int(match.group(2)) < 65536:
        raise DistributedFlagError(
            f"--coordinator_address={coordinator_address!r} must be HOST:PORT with a port "
            "in 1-65535, e.g. 10.0.0.1:12355 (the address of process 0)"
        )


def slurm_tasks(environ: Mapping[str, str]) -> int:
    """SLURM_NTASKS where JAX's SLURM detection applies (all of SLURM_VARS set), else 0."""
    if not all(environ.get(name) for name in SLURM_VARS):
        return 0
    try:
        return int(environ["SLURM_NTASKS"])
    except ValueError:
        return 0


def on_cloud_tpu_vm() -> bool:
    """Whether JAX found Cloud TPU chips and libtpu on this machine (set when jax is
    imported; False where the flag is not available)."""
    try:
        from jax._src import cloud_tpu_init
    except ImportError:  # pragma: no cover - jax moved it
        return False
    return bool(getattr(cloud_tpu_init, "running_in_cloud_tpu_vm", False))


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> Plan | None:  # fmt: skip
    """Starts JAX's distributed runtime when this process is one of several (`plan`);
    does nothing for a plain single process or when it is already started.

    Call before anything touches a device. Returns the Plan followed, or None.
    """
    if jax.distributed.is_initialized():
        return None
    chosen = plan(coordinator_address, num_processes, process_id, on_tpu_vm=on_cloud_tpu_vm())
    if chosen is None:
        return None
    if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in os.environ:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if jax.config.jax_cpu_collectives_implementation == "gloo":
        console.native_stdout_to_stderr()  # its connection lines: not into eval.py's JSON
    try:
        jax.distributed.initialize(**chosen.kwargs)
    except Exception as e:  # noqa: BLE001  (XLA runtime errors of many types)
        raise DistributedError(describe_failure(chosen, e)) from e
    return chosen


def initialize_from_flags() -> Plan | None:
    """`initialize` with --coordinator_address, --num_processes, --process_id."""
    return initialize(*(FLAGS[name].value for name in EXPLICIT_FLAGS))


def start() -> Plan | None:
    """`initialize_from_flags` for an entry point: a bad flag combination is one
    `error: ...` line and exit status 2, a failed start-up one line and status 1."""
    try:
        return initialize_from_flags()
    except DistributedFlagError as e:
        cli.fail(e, cli.USAGE_ERROR)
    except DistributedError as e:
        cli.fail(e)


def process_0_first(fn: Callable[..., T], *args) -> T:
    """`fn(*args)` on process 0, then, once it returned, on the other processes.

    For work that must not run concurrently on a shared filesystem, such as building a
    dataset: the others then find it done. A single process just calls `fn`.
    """
    if jax.process_count() == 1:
        return fn(*args)
    if jax.process_index() == 0:
        result = fn(*args)
    multihost_utils.sync_global_devices(f"process 0 first: {getattr(fn, '__name__', fn)}")
    if jax.process_index() != 0:
        result = fn(*args)
    return result


def describe_failure(chosen: Plan, error: Exception) -> str:
    """One line: how the run was detected, and the first line of JAX's error."""
    how = {"explicit": "from --coordinator_address/--num_processes/--process_id",
           "env": "from JAX_COORDINATOR_ADDRESS", "slurm": "as a SLURM job step",
           "tpu": "on a Cloud TPU VM"}[chosen.source]  # fmt: skip
    text = str(error).strip().splitlines()
    first = text[0] if text else type(error).__name__
    return f"starting the multi-process run ({how}) failed: {first[:300]}"


def any_process(flag: bool) -> bool:
    """True on every process if `flag` is True on any (all processes must call it at
    the same point); the flag itself for a single process."""
    if jax.process_count() == 1:
        return bool(flag)
    flags_ = multihost_utils.process_allgather(np.asarray([int(bool(flag))], np.int32))
    return bool(np.asarray(flags_).any())
