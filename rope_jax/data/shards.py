"""Pre-tokenized corpora on disk: the format, its writer, and a reader that never loads it.

A dataset prepared by `python -m rope_jax.data.prepare` is a directory DIR/NAME:

  metadata.json                       written last: its presence means "complete"
  tokenizer/                          `tokenizers.load(DIR/NAME/tokenizer)`
  token_bytes.npy                     int32 [V] UTF-8 bytes per id (only when exact)
  <split>-NNNNN-of-MMMMM.array_record records: token ids, little-endian uint16 (V <= 65536)
                                      or uint32; one record per document, a document
                                      longer than `record_tokens` cut into consecutive
                                      records; no EOS stored; ArrayRecord group_size:1
  <split>-NNNNN-of-MMMMM.index.npy    int64 [3, R+1] for the shard's R records:
                                      row 0: offset of record r in the shard's token
                                             stream (documents each followed by EOS), so
                                             row 0 [R] is the shard's stream length;
                                      row 1: cumulative UTF-8 bytes of the records;
                                      row 2: cumulative documents completed, so record
                                             r ends its document iff row2[r+1] > row2[r].

Documents never cross shards. `metadata.json` lists per split the shards with their
counts, sizes and sha256, which `open_split` checks (a shard that does not match is one
ValueError line naming it).

The token stream of a split is its documents in order, each followed by EOS; window i
of length T is `stream[i*T : i*T + T + 1]` (as `pipeline.Windows`), padded with PAD past
the end. Per window the reader also gives segment ids (1, 2, ... per document piece in
the window, 0 for padding), positions (0 at the window start and at every document
start) and the UTF-8 bytes of each target:

* `bytes_per_token == "exact"` (bytes, byte-level BPE): bytes of a token = `token_bytes[id]`,
  verified at preparation to add up to every document's UTF-8 size;
* `"proportional"` (normalizing tokenizers): record r's b bytes over its n tokens, token
  j gets `b*(j+1)//n - b*j//n` (integers that add up exactly to b).

EOS and PAD carry 0 bytes, so the bytes of all targets of a split add up to the split's
UTF-8 size and bits per byte = sum(nats) / (ln 2 * sum(bytes)).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os

import grain
import numpy as np
from array_record.python import array_record_data_source, array_record_module

FORMAT = "rope_jax.prepared/1"
METADATA = "metadata.json"
TOKENIZER_DIR = "tokenizer"
TOKEN_BYTES = "token_bytes.npy"
COMPRESSION = {"zstd": "group_size:1,zstd:3", "none": "group_size:1,uncompressed"}
VERIFY = ("hash", "size", "none")


# ----------------------------------------------------------------------------- names


def shard_stem(split: str, index: int, count: int | None = None) -> str:
    """`train-00003-of-00010` (final) or `train-00003` (while the count is unknown)."""
    return f"{split}-{index:05d}" + ("" if count is None else f"-of-{count:05d}")


def data_file(stem: str) -> str:
    return stem + ".array_record"


def index_file(stem: str) -> str:
    return stem + ".index.npy"


def token_dtype(vocab_size: int) -> np.dtype:
    """Little-endian uint16 when every id fits, else uint32."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def file_sha256(path: str) -> str:
    """sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def proportional_bytes(total: int, count: int) -> np.ndarray:
    """Integer bytes of each of `count` tokens sharing `total` bytes; they sum to `total`."""
    j = np.arange(count + 1, dtype=np.int64)
    return np.diff(total * j // max(count, 1)).astype(np.int32)


def split_pieces(num_tokens: int, record_tokens: int) -> list[tuple[int, int]]:
    """[start, stop) token ranges of a document's records (one if record_tokens <= 0)."""
    step = record_tokens if record_tokens > 0 else max(num_tokens, 1)
    return [(a, min(a + step, num_tokens)) for a in range(0, num_tokens, step)]


# ---------------------------------------------------------------------------- writer


class ShardWriter:
    """Writes one shard under temporary names; `close()` renames it and returns its entry.

    `token_bytes` (exact mode) or None (proportional) sets how a document's bytes are
    divided between the records of a long document.
    """

    def __init__(
        self,
        directory: str,
        stem: str,
        *,
        dtype: np.dtype,
        record_tokens: int,
        token_bytes: np.ndarray | None,
        compression: str = "zstd",
    ):
        self.directory, self.stem = directory, stem
        self.dtype, self.record_tokens, self.token_bytes = dtype, record_tokens, token_bytes
        self._tmp = os.path.join(directory, data_file(stem) + ".tmp")
        self._writer = array_record_module.ArrayRecordWriter(self._tmp, COMPRESSION[compression])
        self._rows = [[0], [0], [0]]  # stream offset, cumulative bytes, documents completed
        self.tokens = 0

    def add(self, ids: np.ndarray, num_bytes: int) -> None:
        """Appends one document (token ids, its UTF-8 size); at least one id."""
        ids = np.asarray(ids).astype(self.dtype, copy=False)
        cuts = split_pieces(len(ids), self.record_tokens)
        ends = np.array([b for _, b in cuts], dtype=np.int64)
        if self.token_bytes is not None:
            cum = np.concatenate([[0], np.cumsum(self.token_bytes[ids], dtype=np.int64)])
            piece_bytes = np.diff(np.concatenate([[0], cum[ends]]))
        else:
            piece_bytes = np.diff(np.concatenate([[0], num_bytes * ends // len(ids)]))
        offset, total, docs = (row[-1] for row in self._rows)
        for (a, b), nbytes in zip(cuts, piece_bytes, strict=True):
            self._writer.write(ids[a:b].tobytes())
            last = b == len(ids)
            offset += b - a + last
            total += int(nbytes)
            self._rows[0].append(offset)
            self._rows[1].append(total)
            self._rows[2].append(docs + last)
        self.tokens += len(ids)

    def close(self) -> dict:
        """Finishes the shard: `<stem>.array_record` and `<stem>.index.npy` appear
        (renamed from temporary names, index last); returns the metadata entry."""
        self._writer.close()
        index = np.asarray(self._rows, dtype=np.int64)
        index_tmp = os.path.join(self.directory, index_file(self.stem) + ".tmp")
        with open(index_tmp, "wb") as f:
            np.save(f, index)
        data_path = os.path.join(self.directory, data_file(self.stem))
        index_path = os.path.join(self.directory, index_file(self.stem))
        os.replace(self._tmp, data_path)
        os.replace(index_tmp, index_path)
        return {
            "file": data_file(self.stem),
            "index": index_file(self.stem),
            "records": int(index.shape[1] - 1),
            "documents": int(index[2, -1]),
            "tokens": int(self.tokens),
            "stream_tokens": int(index[0, -1]),
            "bytes": int(index[1, -1]),
            "size": os.path.getsize(data_path),
            "sha256": file_sha256(data_path),
            "index_size": os.path.getsize(index_path),
            "index_sha256": file_sha256(index_path),
        }

    def abort(self) -> None:
        """Closes and removes the temporary file (an interrupted shard; a close that
        fails, on a full disk say, still removes it)."""
        try:
            self._writer.close()
        except Exception:  # noqa: BLE001  (ArrayRecord raises RuntimeError; the cause is reported)
            pass
        if os.path.exists(self._tmp):
            os.remove(self._tmp)


def check_shard(directory: str, entry: dict, *, verify: str = "hash") -> str | None:
    """None if the shard's two files match `entry` (size, and sha256 with verify='hash');
    else a one-line reason naming the file."""
    files = (entry["file"], entry["index"])
    for name, size_key, hash_key in zip(
        files, ("size", "index_size"), ("sha256", "index_sha256"), strict=True
    ):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            return f"shard file {path} is missing"
        size = os.path.getsize(path)
        if verify != "none" and size != entry[size_key]:
            want = entry[size_key]
            return f"shard file {path} is truncated or corrupt: {size} bytes, expected {want}"
        if verify == "hash" and file_sha256(path) != entry[hash_key]:
            return f"shard file {path} is corrupt: its sha256 differs from {METADATA}"
    return None


# ---------------------------------------------------------------------------- reader


def read_metadata(path: str) -> dict:
    """The metadata of a complete dataset DIR/NAME; ValueError (one line) otherwise."""
    file = os.path.join(os.path.expanduser(path), METADATA)
    if not os.path.isfile(file):
        raise ValueError(
            f"{path} is not a prepared dataset: no {METADATA} (not prepared, or "
            "preparation did not finish; rerun the same prepare command)"
        )
    try:
        with open(file, encoding="utf-8") as f:
            meta = json.load(f)
    except ValueError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{file} has format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def load_tokenizer(path: str):
    """The tokenizer a prepared dataset was made with."""
    from rope_jax.data import tokenizers

    return tokenizers.load(os.path.join(os.path.expanduser(path), TOKENIZER_DIR))


class TokenSplit:
    """Random access to one split's token stream, straight from its shards.

    Memory: the per-shard index files are memory-mapped (int64 per record, pages read on
    demand) and records are read one at a time (ArrayRecord, group_size 1) with a small
    LRU cache, so the resident size does not grow with the dataset. Picklable (for Grain
    workers): files are reopened lazily after unpickling.
    """

    def __init__(self, path: str, split: str, *, verify: str = "hash"):
        if verify not in VERIFY:
            raise ValueError(f"verify={verify!r} is not one of {VERIFY}")
        self.path = os.path.expanduser(path)
        self.meta = read_metadata(self.path)
        if split not in self.meta["splits"]:
            raise ValueError(
                f"split {split!r} is not in {self.path}; available: {sorted(self.meta['splits'])}"
            )
        self.split = split
        self.shards = self.meta["splits"][split]["shards"]
        if not self.shards:
            raise ValueError(f"split {split!r} of {self.path} has no documents")
        for entry in self.shards:
            problem = check_shard(self.path, entry, verify=verify)
            if problem:
                raise ValueError(f"{problem}; prepare again (the same command redoes it)")
        table = os.path.join(self.path, TOKEN_BYTES)
        if verify == "hash" and self.meta["bytes_per_token"] == "exact":
            if not os.path.isfile(table) or file_sha256(table) != self.meta["token_bytes_sha256"]:
                raise ValueError(f"{table} is missing or corrupt; prepare again")
        self.dtype = np.dtype(self.meta["dtype"])
        self.eos_id, self.pad_id = int(self.meta["eos_id"]), int(self.meta["pad_id"])
        self.exact_bytes = self.meta["bytes_per_token"] == "exact"
        counts = np.array([[e["stream_tokens"], e["records"]] for e in self.shards], np.int64)
        self._stream_base = np.concatenate([[0], np.cumsum(counts[:, 0])])  # [S+1]
        self._record_base = np.concatenate([[0], np.cumsum(counts[:, 1])])  # [S+1]
        self.num_documents = sum(e["documents"] for e in self.shards)
        self.num_bytes = sum(e["bytes"] for e in self.shards)
        self._open()

    def _open(self) -> None:
        files = [
            f"{os.path.join(self.path, e['file'])}[0:{e['records']}]" for e in self.shards
        ]  # `[0:R]` spares opening every file just to count its records
        self._source = array_record_data_source.ArrayRecordDataSource(files)
        self._indexes: list[np.ndarray | None] = [None] * len(self.shards)
        self._token_bytes = (
            np.load(os.path.join(self.path, TOKEN_BYTES)) if self.exact_bytes else None
        )
        self._record = functools.lru_cache(maxsize=32)(self._read_record)

    def __getstate__(self):
        state = self.__dict__.copy()
        for key in ("_source", "_indexes", "_token_bytes", "_record"):
            del state[key]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._open()

    def __len__(self) -> int:
        """N: tokens of the stream (documents and one EOS after each)."""
        return int(self._stream_base[-1])

    def _index(self, shard: int) -> np.ndarray:
        if self._indexes[shard] is None:
            file = os.path.join(self.path, self.shards[shard]["index"])
            self._indexes[shard] = np.load(file, mmap_mode="r")
        return self._indexes[shard]

    def _read_record(self, key: int) -> np.ndarray:
        return np.frombuffer(self._source[key], dtype=self.dtype)

    def _pieces(self, start: int, stop: int):
        """(record tokens, starts a document, ends with EOS, record bytes, offset of the
        record in the stream) for every record overlapping stream [start, stop)."""
        shard = int(np.searchsorted(self._stream_base, start, side="right")) - 1
        at = start
        while at < stop:
            index, base = self._index(shard), int(self._stream_base[shard])
            r = int(np.searchsorted(index[0], at - base, side="right")) - 1
            while r < index.shape[1] - 1 and at < stop:
                first = r == 0 or index[2, r] > index[2, r - 1]
                last = bool(index[2, r + 1] > index[2, r])
                offset = base + int(index[0, r])
                tokens = self._record(int(self._record_base[shard]) + r)
                yield tokens, first, last, int(index[1, r + 1] - index[1, r]), offset
                at = base + int(index[0, r + 1])
                r += 1
            shard += 1

    def read(self, start: int, stop: int) -> dict[str, np.ndarray]:
        """Stream positions [start, stop) (past the end: PAD, segment 0, 0 bytes).

        Returns int32 arrays [stop - start]: `tokens`, `segment_ids` (1, 2, ... from the
        first position; a new one at each document start), `positions` (0 at `start` and
        at each document start), `bytes` (UTF-8 bytes of each token; 0 for EOS and PAD).
        """
        length = stop - start
        tokens = np.full(length, self.pad_id, dtype=np.int32)
        starts = np.zeros(length, dtype=bool)
        nbytes = np.zeros(length, dtype=np.int32)
        end = min(stop, len(self))
        for ids, first, last, record_bytes, offset in self._pieces(start, end):
            if self._token_bytes is not None:
                counts = self._token_bytes[ids]
            else:
                counts = proportional_bytes(record_bytes, len(ids))
            piece = np.concatenate([ids, [self.eos_id]]) if last else ids
            counts = np.concatenate([counts, [0]]) if last else counts
            a, b = max(start, offset), min(end, offset + len(piece))
            tokens[a - start : b - start] = piece[a - offset : b - offset]
            nbytes[a - start : b - start] = counts[a - offset : b - offset]
            if first and offset >= start:
                starts[offset - start] = True
        real = end - start
        starts[0] = real > 0
        segment_ids = np.cumsum(starts, dtype=np.int32)
        segment_ids[max(real, 0) :] = 0
        arange = np.arange(length, dtype=np.int32)
        positions = arange - np.maximum.accumulate(np.where(starts, arange, 0))
        positions[max(real, 0) :] = 0
        return {
            "tokens": tokens,
            "segment_ids": segment_ids,
            "positions": positions,
            "bytes": nbytes,
        }

    def num_windows(self, seq_len: int, *, partial: bool = False) -> int:
        """Full windows of T targets (training), or with `partial` every window needed to
        score all N-1 targets once, the last one padded (evaluation)."""
        targets = len(self) - 1
        return -(-targets // seq_len) if partial else targets // seq_len

    def window(self, i: int, seq_len: int) -> np.ndarray:
        """Tokens int32 [T+1] of window i: stream[i*T : i*T + T + 1], PAD past the end."""
        return self.read(i * seq_len, i * seq_len + seq_len + 1)["tokens"]

    def windows(self, rows: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
        """Windows `rows` as the window source of `pipeline.Windows`: `tokens`,
        `segment_ids`, `positions`, `bytes` and `valid` (bool), each [B, T+1]."""
        reads = [self.read(int(i) * seq_len, int(i) * seq_len + seq_len + 1) for i in rows]
        out = {key: np.stack([r[key] for r in reads]) for key in reads[0]}
        out["valid"] = rows[:, None] * seq_len + np.arange(seq_len + 1)[None, :] < len(self)
        return out

    def example(self, i: int, seq_len: int) -> dict[str, np.ndarray]:
        """Window i as a training example, every field [T]: `inputs`, `targets` (int32),
        `weights` (float32, 0 on padding), `segment_ids`, `positions` (of the inputs),
        `target_bytes` (int32 UTF-8 bytes of each target, for bits per byte)."""
        w = self.read(i * seq_len, i * seq_len + seq_len + 1)
        valid = (i * seq_len + np.arange(1, seq_len + 1)) < len(self)
        return {
            "inputs": w["tokens"][:-1],
            "targets": w["tokens"][1:],
            "weights": valid.astype(np.float32),
            "segment_ids": w["segment_ids"][:-1],
            "positions": w["positions"][:-1],
            "target_bytes": w["bytes"][1:],
        }


def open_split(path: str, split: str, *, verify: str = "hash") -> TokenSplit:
    """The reader of `split` in the prepared dataset DIR/NAME (checks every shard first:
    `verify='hash'` reads each file once, 'size' only stats it)."""
    return TokenSplit(path, split, verify=verify)


class WindowSource:
    """Grain random-access source: element i = `TokenSplit.example(i, seq_len)`."""

    def __init__(self, split: TokenSplit, seq_len: int, *, partial: bool = False):
        if seq_len < 1:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len}")
        self.split, self.seq_len = split, seq_len
        self._len = split.num_windows(seq_len, partial=partial)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i) -> dict[str, np.ndarray]:
        i = int(i)
        if not 0 <= i < self._len:
            raise IndexError(f"window {i} out of range [0, {self._len})")
        return self.split.example(i, self.seq_len)

    def __repr__(self) -> str:
        return f"WindowSource({self.split.path!r}, {self.split.split!r}, T={self.seq_len})"


def window_dataset(
    path: str, split: str, seq_len: int, *, partial: bool = False, verify: str = "hash"
) -> grain.MapDataset:
    """`grain.MapDataset` of the windows of a prepared split (see `TokenSplit.example`);
    shuffle, repeat and batch it like any Grain dataset."""
    source = WindowSource(open_split(path, split, verify=verify), seq_len, partial=partial)
    return grain.MapDataset.source(source)
