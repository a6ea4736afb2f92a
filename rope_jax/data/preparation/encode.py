"""The tokenizer (loaded, or trained on the train split) and the worker processes that
encode documents with it.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
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


def _init_worker(tokenizer_dir: str, exact: bool) -> None:
    """Pool initializer: one thread per worker; the saved tokenizer, so every process
    encodes with exactly the files that ship with the dataset."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = tokenizers.load(tokenizer_dir)
    _WORKER.update(
        tok=tok,
        dtype=shards.token_dtype(tok.vocab_size),
        table=tok.token_byte_lengths() if exact else None,
    )


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
        self.pool = ctx.Pool(workers, initializer=_init_worker, initargs=initargs)
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
