"""A carried corpus: a prepared dataset's token ids as arrays in one folder, small enough
to travel to a machine that holds no copy of the dataset (`benchmarks/gpu_data.py` packs
one for the GPU rung).

  DIR/meta.json                   the dataset, its preparing command, tokenizer name,
                                  vocab_size, token and byte counts
  DIR/train.npy.xz                uint16 token ids of the training split (EOS-separated)
  DIR/validation.npy.xz           ... of the validation split
  DIR/validation_bytes.npy.xz     the UTF-8 bytes of each validation token (bits per byte)

Each array is an .npy file in xz (LZMA) compression, or a plain DIR/<name>.npy. A
`data.name` naming such a folder (DIR, or NAME under `data.data_dir`; `sources.resolve`)
makes it the run's data (`kinds.Carried`): training windows shuffled as those of any
stream in memory (`pipeline.Windows` over a `pipeline.TokenArray` of `arrays`,
`pipeline.shuffled_batches`), evaluation windows in order with the carried bytes of each
target. A split carried without its bytes (the training split) scores no bits per byte.
Only the ids travel, not the tokenizer: text in, text out (passkey, RULER's tasks,
generation) needs the dataset.
"""

from __future__ import annotations

import functools
import io
import json
import lzma
import os

import numpy as np

from rope_jax.data.readers import DataSourceError

META = "meta.json"
BYTES = "_bytes"  # a split's bytes: <split>_bytes.npy.xz


def dump(array: np.ndarray) -> bytes:
    """The .npy file of `array`, xz-compressed."""
    buf = io.BytesIO()
    np.save(buf, array)
    return lzma.compress(buf.getvalue(), preset=6)


def load(path: str) -> np.ndarray:
    """An array `dump` wrote (PATH.npy.xz), or a plain PATH.npy."""
    if os.path.isfile(path + ".npy"):
        return np.load(path + ".npy", mmap_mode="r")
    with open(path + ".npy.xz", "rb") as f:
        return np.load(io.BytesIO(lzma.decompress(f.read())))


def has(path: str, name: str) -> bool:
    """Whether the folder `path` carries the array `name`."""
    return any(os.path.isfile(os.path.join(path, name + ext)) for ext in (".npy", ".npy.xz"))


def is_carried(path: str) -> bool:
    """A carried corpus: meta.json and the training ids."""
    return os.path.isfile(os.path.join(path, META)) and has(path, "train")


def metadata(path: str) -> dict:
    with open(os.path.join(path, META)) as f:
        return json.load(f)


@functools.lru_cache(maxsize=4)
def arrays(path: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, UTF-8 bytes of each token) of a carried split, read once per process;
    zero bytes (a broadcast view: no memory) where its bytes were not carried."""
    if not has(path, split):
        raise DataSourceError(f"the carried corpus {path} has no {split!r} split; it carries "
                              f"{', '.join(splits(path))}")  # fmt: skip
    tokens = load(os.path.join(path, split))
    if has(path, split + BYTES):
        return tokens, load(os.path.join(path, split + BYTES))
    return tokens, np.broadcast_to(np.zeros(1, np.uint8), tokens.shape)


def splits(path: str) -> list[str]:
    """The splits the folder carries."""
    names = {f.split(".npy")[0] for f in os.listdir(path) if ".npy" in f}
    return sorted(n for n in names if not n.endswith(BYTES))
