"""The tokenizer (loaded, or trained on the train split) and the worker processes that
encode documents with it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator

import numpy as np

from rope_jax.data import shards, tokenizers
from rope_jax.data.preparation.plan import Settings, SplitPlan, assigned
from rope_jax.data.readers import PrepareError


def _train_texts(settings: Settings, plan: SplitPlan) -> Iterator[str]:
    budget = settings.tokenizer_train_bytes
    for _, split, text in assigned(settings, plan):
        if split != "train":
            continue
        if budget <= 0:
            return
        budget -= len(text.encode("utf-8"))
        yield text


def make_tokenizer(settings: Settings, plan: SplitPlan, out: str) -> tokenizers.Tokenizer:
    """Loads DIR/NAME/tokenizer if a previous run of these settings saved it; else makes
    it (training on the train split for train:VOCAB) and saves it there."""
    directory = os.path.join(out, shards.TOKENIZER_DIR)
    if os.path.isdir(directory):
        return tokenizers.load(directory)
    kind, _ = tokenizers.parse_spec(settings.tokenizer)
    texts = _train_texts(settings, plan) if kind == "train" else None
    tok = tokenizers.from_spec(settings.tokenizer, texts)
    tmp = directory + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tok.save(tmp)
    os.replace(tmp, directory)
    return tokenizers.load(directory)


def byte_table(tok: tokenizers.Tokenizer, mode: str) -> np.ndarray | None:
    """The exact per-id byte table, or None for proportional byte counts."""
    if mode == "proportional":
        return None
    table = tok.token_byte_lengths()
    if table is None and mode == "exact":
        raise PrepareError(
            f"--byte_counts=exact: tokenizer {tok.name} has no exact per-token "
            "byte lengths (it normalizes text); use auto or proportional"
        )
    return table


_WORKER: dict = {}
QUIET_TRACKER = "ignore:resource_tracker:UserWarning"  # a -W option (`Pool`)


def _init_worker(tokenizer_dir: str, exact: bool, quiet: bool = False) -> None:
    """Pool initializer: one thread per worker; the saved tokenizer, so every process
    encodes with exactly the files that ship with the dataset. `quiet` (a worker
    process): once the tokenizer loaded, Python's stderr is closed (`_quiet_worker`)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = tokenizers.load(tokenizer_dir)
    _WORKER.update(
        tok=tok,
        dtype=shards.token_dtype(tok.vocab_size),
        table=tok.token_byte_lengths() if exact else None,
    )
    if quiet:
        _quiet_worker()


def _quiet_worker() -> None:
    """A pool worker's errors reach the main process with its task's result, and are
    shown there; what the worker prints itself is only multiprocessing's traceback of
    a result it could not send back: a BrokenPipeError, when the main process was
    killed (kill -9, the OOM killer). That must not land on the user's terminal, so a
    worker's Python stderr goes nowhere; it also ends with the forkserver it came from
    (Linux PR_SET_PDEATHSIG, SIGKILL), which exits with the main process."""
    sys.stderr = open(os.devnull, "w")  # noqa: SIM115  (the worker's, for its lifetime)
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the broken pipe ends it
        pass
    if os.getppid() == 1:  # the forkserver ended before the call above
        os._exit(0)


def encode_chunk(texts: list[str]) -> tuple[list[np.ndarray], list[int], int, float]:
    """Token arrays and UTF-8 sizes of a chunk of documents, the position of the first
    document whose exact byte table disagrees with its size (-1: none), CPU seconds."""
    cpu = time.process_time()
    tok, dtype, table = _WORKER["tok"], _WORKER["dtype"], _WORKER["table"]
    ids = [a.astype(dtype) for a in tok.encode_batch(texts)]
    sizes = [len(t.encode("utf-8")) for t in texts]
    bad = -1
    if table is not None:
        for i, (a, size) in enumerate(zip(ids, sizes, strict=True)):
            if int(table[a].sum()) != size:
                bad = i
                break
    return ids, sizes, bad, time.process_time() - cpu


class _Done:
    """A result computed already (the in-process twin of `AsyncResult`)."""

    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value


class InProcess:
    """`--workers=1`: the same tasks, run in this process."""

    def __init__(self, *initargs):
        self.saved = os.environ.get("TOKENIZERS_PARALLELISM")
        _init_worker(*initargs)

    def submit(self, texts):
        return _Done(encode_chunk(texts))

    def close(self, finished: bool = True):
        del finished  # nothing runs in the background
        _WORKER.clear()
        if self.saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = self.saved


class Pool:
    """`--workers=N`: N processes (forkserver: safe after JAX/threads), tasks in order."""

    def __init__(self, workers: int, *initargs):
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])  # the imports are paid once, in the server
        # The resource tracker (started with the pool's first semaphore, given this
        # process's -W options) warns of "leaked semaphore objects" when this process
        # was killed before closing the pool; it removes them all the same.
        if QUIET_TRACKER not in sys.warnoptions:
            sys.warnoptions.append(QUIET_TRACKER)
        self.pool = ctx.Pool(workers, initializer=_init_worker, initargs=(*initargs, True))
        start = time.monotonic()
        self.pool.apply(os.getpid)  # the first worker is up (they start together)
        self.startup_s = time.monotonic() - start

    def submit(self, texts):
        return self.pool.apply_async(encode_chunk, (texts,))

    def close(self, finished: bool = True):
        """Waits for the workers to exit; after an error, stops them at once."""
        if finished:
            self.pool.close()
        else:
            self.pool.terminate()
        self.pool.join()
