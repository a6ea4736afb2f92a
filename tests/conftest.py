"""Shared fixtures: one offline TFDS data dir per session with every shipped dataset.

Tests marked `slow` (end-to-end training, subprocesses, sweeps) are left out of the
quick loop: `python -m pytest -m "not slow"`. So are the cases of a parametrized test
past its first QUICK_CASES: the quick loop runs every test, the full suite every case.
"""

import collections
import contextlib
import socket

import pytest

from rope_jax import data

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
    """One persistent XLA compilation cache for the session's subprocesses: the many
    tiny train.py / eval.py / sweep runs of the same shapes compile each program once
    (a cached executable is the one a compile would give: results do not change)."""
    path = str(tmp_path_factory.mktemp("jax_cache"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAX_COMPILATION_CACHE_DIR", path)
        mp.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
        yield path


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
