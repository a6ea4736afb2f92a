"""Byte-level ids: 0..255 are UTF-8 bytes, then three special ids (`tokenizers.ByteTokenizer`
wraps them behind the interface of every tokenizer).

No vocabulary file, no training, no unknown token: every string round-trips.

    >>> decode(encode("naïve ∀x"))
    'naïve ∀x'
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

PAD_ID = 256  # padding; never a target with weight 1
BOS_ID = 257  # beginning of sequence (reserved; the text pipeline does not emit it)
EOS_ID = 258  # end of document; the text pipeline puts one after every document
VOCAB_SIZE = 259  # V: 256 bytes + PAD + BOS + EOS


def encode(text: str, *, bos: bool = False, eos: bool = False) -> np.ndarray:
    """UTF-8 bytes of `text` as int32 ids [L], optionally framed by BOS / EOS."""
    ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
    if bos or eos:
        ids = np.concatenate([[BOS_ID] * bos, ids, [EOS_ID] * eos]).astype(np.int32)
    return ids


def decode(ids: Iterable[int] | np.ndarray) -> str:
    """Inverse of `encode`: special ids are dropped, broken UTF-8 becomes U+FFFD."""
    ids = np.asarray(ids).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= VOCAB_SIZE):
        raise ValueError(f"token ids must lie in [0, {VOCAB_SIZE}), got {ids.min()}..{ids.max()}")
    data = ids[ids < 256].astype(np.uint8).tobytes()
    return data.decode("utf-8", errors="replace")


def encode_bytes(data: bytes) -> np.ndarray:
    """Raw bytes (already UTF-8) as uint8 ids [L] without a copy; for bulk corpora."""
    return np.frombuffer(data, dtype=np.uint8)
