"""Shared fixtures: one offline TFDS data dir per session with every shipped dataset; the
local SLURM cluster of the multi-process tests.

Tests marked `slow` (end-to-end training, subprocesses, sweeps) are left out of the
quick loop: `python -m pytest -m "not slow"`. So are the cases of a parametrized test
past its first QUICK_CASES: the quick loop runs every test, the full suite every case.
"""

import collections
import contextlib
import os
import shutil
import socket
import subprocess

# The tests' programs are tiny: compiling them costs more than running them, and XLA's
# backend optimisations cost more than they save (the attention, generate and train tests
# take about 30% less time without them), nor does the fusion emitter pipeline (the older
# loop emitters compile the tests' programs in about half the time). Set before jax starts
# its backend, for this process and every subprocess of the tests; numbers stay within
# float rounding.
FAST_XLA = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
            "--xla_cpu_use_fusion_emitters=false")  # fmt: skip
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_XLA}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache  # noqa: E402

from rope_jax import data  # noqa: E402
from tests.slurm_helpers import JOB_NAME, ROOT  # noqa: E402

QUICK_CASES = 2


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks the cases of each parametrized test past the first QUICK_CASES `slow`."""
    seen = collections.Counter()
    for item in items:
        if hasattr(item, "callspec"):
            seen[(item.path, item.originalname)] += 1
            if seen[(item.path, item.originalname)] > QUICK_CASES:
                item.add_marker(pytest.mark.slow)


@contextlib.contextmanager
def no_network():
    """Any attempt to open a connection or resolve a host fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args[:2]}")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", refuse)
        mp.setattr(socket, "create_connection", refuse)
        mp.setattr(socket, "getaddrinfo", refuse)
        yield


@pytest.fixture(scope="session", autouse=True)
def shared_compilation_cache(tmp_path_factory):
    """One persistent XLA compilation cache per test worker, for the worker's own process
    and its subprocesses: the many tiny train.py / eval.py / sweep runs and in-process
    `train_and_evaluate` calls of the same shapes compile each program once (a cached
    executable is the one a compile would give: results do not change). Not shared between
    workers: JAX's cache files are not written atomically, and a worker reading another's
    half-written entry recompiles with a warning."""
    path = str(tmp_path_factory.mktemp("jax_cache"))
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")  # fmt: skip
    before = {name: getattr(jax.config, name) for name in names}
    for name, value in zip(names, (path, 0.0, 0), strict=True):
        jax.config.update(name, value)
    compilation_cache.reset_cache()  # JAX opens its cache once: reopened at `path`
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAX_COMPILATION_CACHE_DIR", path)
        mp.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        yield path
    for name, value in before.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A TFDS data dir of the session's own (never ~/tensorflow_datasets) with the shipped
    corpora and the digits built, with the network refused while they build."""
    path = str(tmp_path_factory.mktemp("tfds"))
    config = data.default_config()
    config.data_dir = path
    with no_network():
        for name in (*data.CORPORA, "digit_grids"):
            config.name = name
            data.ensure_built(config)
    return path


@pytest.fixture(scope="session")
def cluster(request):
    """The single-node cluster of `scripts/local_slurm.sh`, started once for the session
    (and stopped at its end, unless it was running before); their tests are skipped, with
    the reason, where it cannot start (not root, no apt-get, a daemon fails).

    Under `--dist loadgroup` the SLURM modules share one worker (their xdist_group, which
    pytest-xdist marks by renaming each test `...@slurm`); a pytest release that ignores
    the renaming spreads them over workers that share, and stop, one cluster, so that
    fails here rather than as busy nodes and lost jobs."""
    if getattr(request.config.option, "loadgroup", False):
        loose = [i.nodeid for i in request.session.items
                 if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]  # fmt: skip
        if loose:
            pytest.fail(f"pytest-xdist did not group {loose[0]} (--dist loadgroup): use the "
                        "pytest pinned in requirements.txt", pytrace=False)  # fmt: skip
    if os.geteuid() != 0:
        pytest.skip("local SLURM cluster needs root (it installs packages, starts daemons)")
    sinfo = shutil.which("sinfo")
    was_up = bool(sinfo) and subprocess.run([sinfo, "-h"], capture_output=True).returncode == 0
    script = os.path.join(ROOT, "scripts", "local_slurm.sh")
    proc = subprocess.run(["bash", script, "up"], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        reason = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"local SLURM cluster did not start: {reason}")
    yield proc.stdout.strip()
    subprocess.run(["scancel", f"--name={JOB_NAME}"], capture_output=True)
    if not was_up:
        subprocess.run(["bash", script, "down"], capture_output=True)
