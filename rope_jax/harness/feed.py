"""Feeding batches to the devices: placement, a prefetch thread, abstract batches.

batches = Prefetch(train_iterator, batch_sharding(mesh, rules))   # placed ahead
batch = next(batches)                                             # global arrays
"""

from __future__ import annotations

import contextlib
import copy
import queue
import threading

import jax
import numpy as np
from jax.sharding import NamedSharding


def put_batch(batch, sharding: NamedSharding):
    """Process-local numpy batch -> global arrays (each process passes its own rows)."""
    put = lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x))
    return jax.tree.map(put, batch)


class Prefetch:
    """Places the next `size` batches of a Grain iterator on devices in a background thread.

    `next()` returns a batch already placed with `put_batch`, so the training loop never
    waits on the host pipeline while the previous step runs. `get_state()` is the
    wrapped iterator's state just after the last batch returned (not after the batches
    still in the buffer): a checkpoint of it resumes at the next unseen batch. Restore a
    state on the iterator before wrapping it. An error in the pipeline (StopIteration
    included) is raised by the `next()` that would have returned that batch.
    """

    def __init__(self, iterator, sharding: NamedSharding, size: int = 2):
        self._iterator, self._sharding = iterator, sharding
        self._state = copy.deepcopy(iterator.get_state())
        self._queue: queue.Queue = queue.Queue(maxsize=max(int(size), 1))
        self._stop = threading.Event()
        self._error = None
        self._thread = threading.Thread(target=self._fill, name="prefetch", daemon=True)
        self._thread.start()

    def _fill(self):
        try:
            while not self._stop.is_set():
                batch = put_batch(next(self._iterator), self._sharding)
                self._put((batch, copy.deepcopy(self._iterator.get_state()), None))
        except BaseException as e:  # noqa: BLE001  (re-raised in the consumer's thread)
            self._put((None, None, e))

    def _put(self, item):
        while not self._stop.is_set():
            try:
                return self._queue.put(item, timeout=0.1)
            except queue.Full:
                continue

    def __iter__(self):
        return self

    def __next__(self):
        if self._error is not None:
            raise self._error
        batch, state, error = self._queue.get()
        if error is not None:
            self._error = error
            raise error
        self._state = state
        return batch

    def get_state(self):
        return self._state

    def close(self):
        """Stops the thread; the batches in the buffer are dropped."""
        self._stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        self._thread.join()


def abstract_batch(
    global_batch_size: int, seq_len: int, sharding: NamedSharding, extra: dict | None = None
) -> dict:
    """ShapeDtypeStructs of a batch: inputs, targets int32 and weights float32 [B, T],
    plus `extra` fields given as name -> (shape after B, dtype)."""
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(
        (global_batch_size, *shape), dtype, sharding=sharding
    )
    fields = {"inputs": ((seq_len,), np.int32), "targets": ((seq_len,), np.int32),
              "weights": ((seq_len,), np.float32), **(extra or {})}  # fmt: skip
    return {name: spec(shape, dtype) for name, (shape, dtype) in fields.items()}
