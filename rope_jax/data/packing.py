"""Packing: how windows cut from a stream of documents meet the model (`data.packing`).

  stream     windows of the token stream as they fall (the default): attention and
             positions run on across document boundaries inside a window.
  documents  positions restart at 0 at every document start inside a window and
             attention stays inside each document: batches carry `segments` int32
             [B, T] (1, 2, ... per document piece, 0 for padding) and `positions`
             float32 [B, T, 1], which the model takes as its attention segments and
             rotation positions. A packed row gives the same logits as its documents
             run one by one.

A document is its tokens and the EOS that ends it; the token after an EOS starts the
next document, and the first token of a window starts a piece (at position 0).
"""

from __future__ import annotations

import numpy as np

MODES = ("stream", "documents")


def mode(data_config) -> str:
    return data_config.packing


def check(data_config, text: bool) -> None:
    """`data.packing` is a known mode; `documents` is for text corpora only."""
    value = mode(data_config)
    if value not in MODES:
        raise ValueError(f"data.packing={value!r} is not one of {', '.join(MODES)}")
    if value == "documents" and not text:
        raise ValueError(
            "data.packing='documents' is for text corpora; multimodal rows already hold "
            "one question each"
        )


def batch_fields(data_config) -> dict:
    """Extra batch fields of the mode: name -> (shape after B, dtype)."""
    if mode(data_config) != "documents":
        return {}
    t = int(data_config.seq_len)
    return {"segments": ((t,), np.int32), "positions": ((t, 1), np.float32)}


def fields(segments: np.ndarray, positions: np.ndarray) -> dict[str, np.ndarray]:
    """The batch fields from segment ids and positions [B, T]."""
    return {
        "segments": np.ascontiguousarray(segments, dtype=np.int32),
        "positions": np.ascontiguousarray(positions, dtype=np.float32)[..., None],
    }


def from_stream(inputs: np.ndarray, valid: np.ndarray, eos_id: int) -> dict[str, np.ndarray]:
    """`fields` of windows of a token stream whose documents each end with EOS.

    Args:
      inputs: int [B, T] the windows' input tokens.
      valid: bool [B, T] real tokens (False for padding past the end of the stream).
      eos_id: the id that ends every document.
    """
    b, t = inputs.shape
    starts = np.ones((b, t), dtype=bool)
    starts[:, 1:] = inputs[:, :-1] == eos_id
    segments = np.cumsum(starts, axis=1, dtype=np.int32) * valid
    arange = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    positions = (arange - np.maximum.accumulate(np.where(starts, arange, 0), axis=1)) * valid
    return fields(segments, positions)
