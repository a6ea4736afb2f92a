"""Free space: each shard is checked against its estimated size before it is written; a
full disk is one `OutOfSpace` line.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import shutil
import zlib

import numpy as np

from rope_jax.data.preparation.plan import SPLITS, Settings
from rope_jax.data.readers import PrepareError


class OutOfSpace(PrepareError):
    """The disk holding the dataset is (or would be) full; the same command resumes."""


@dataclasses.dataclass
class Space:
    """Free-space checks of one preparation of DIR/NAME: before each shard, its size on
    disk estimated as tokens x bytes per token (zlib level 1 of the first tokens, close to
    the shards' zstd; then what the shards written took)."""

    out: str
    settings: Settings
    left_bytes: dict  # UTF-8 bytes of the documents still to write, per split
    tokens_per_byte: float = 1.0
    disk_per_token: float | None = None

    def learn(self, ids: list[np.ndarray], sizes: list[int], entries: dict) -> None:
        """Updates the rates from a tokenized chunk and the shards written so far."""
        tokens, nbytes = sum(map(len, ids)), sum(sizes)
        if nbytes:
            self.tokens_per_byte = tokens / nbytes
        done = [e for split in SPLITS for e in entries[split]]
        if done and sum(e["tokens"] for e in done):
            size = sum(e["size"] + e["index_size"] for e in done)
            self.disk_per_token = size / sum(e["tokens"] for e in done)
        elif self.disk_per_token is None and tokens:
            raw = np.concatenate(ids).tobytes()[: 1 << 20]
            packed = zlib.compress(raw, 1) if self.settings.compression != "none" else raw
            self.disk_per_token = len(packed) / (len(raw) / ids[0].dtype.itemsize)

    def shard_bytes(self, split: str) -> int:
        """Estimated bytes on disk of the next shard of `split` (and its index)."""
        tokens = min(self.settings.shard_tokens, self.left_bytes[split] * self.tokens_per_byte)
        return math.ceil(tokens * (self.disk_per_token or 2.0)) + (64 << 10)

    def rest_bytes(self) -> int:
        """Estimated bytes on disk of everything still to write."""
        tokens = sum(self.left_bytes.values()) * self.tokens_per_byte
        return math.ceil(tokens * (self.disk_per_token or 2.0)) + (64 << 10)

    def check(self, split: str, stem: str) -> None:
        need, free = self.shard_bytes(split), shutil.disk_usage(self.out).free
        if free < need:
            raise OutOfSpace(self.message(f"shard {stem} needs about {_size(need)}", free))

    def message(self, what: str, free: int) -> str:
        return (
            f"not enough free space in {self.out}: {what}, {_size(free)} free (about "
            f"{_size(self.rest_bytes())} still to write); free some space or use another "
            "--data_dir, then run the same command again: it resumes from the shards done"
        )


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def out_of_space(error: BaseException) -> bool:
    """A write that failed for lack of space (OSError, or ArrayRecord's RuntimeError)."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(error, RuntimeError) and "No space left on device" in str(error)
