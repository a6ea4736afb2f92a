"""Tokenizers behind one interface: bytes, SentencePiece, HF `tokenizer.json`, trained BPE.

    tok = from_spec("bytes")                        # today's byte ids, V = 259
    tok = from_spec("corpus/tokenizer.json")        # any HF tokenizers file
    tok = from_spec("corpus/spm.model")             # a SentencePiece model
    tok = from_spec("train:32000", texts=iter(...)) # byte-level BPE trained here
    ids = tok.encode("text"); text = tok.decode(ids)
    tok.save("out/tokenizer"); tok = load("out/tokenizer")

Every tokenizer has `vocab_size`, `pad_id`, `bos_id`, `eos_id` and a `name` that ends in
a hash of its files, so two datasets (or a model and a dataset) can tell whether they
share a tokenizer. `encode` never emits special ids, not even for text that spells one
("<eos>" in a document is tokenized as the five characters): the data pipeline alone
puts EOS after documents. `decode` drops special ids.

`token_byte_lengths()` is the UTF-8 byte length of every id when that is a property of
the vocabulary (bytes, byte-level BPE with no normalizer), so byte counts of any token
span are exact; it is None for tokenizers that normalize (SentencePiece, most
WordPiece/Metaspace files), where callers attribute bytes proportionally instead.

`save(dir)` writes the tokenizer's own file (`tokenizer.json` / `tokenizer.model`, none
for bytes) and `tokenizer_info.json` ({"kind", "file", "name", "vocab_size", "pad_id",
"bos_id", "eos_id"}, and an HF model's "chat_template"); `load` takes that dir, a bare
`.json` / `.model` file, or a `.gguf` checkpoint (its vocabulary, `gguf_file`). A file
that does not load, or is of the wrong kind, raises one `ValueError` line naming it.
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
from collections.abc import Iterable, Sequence

import numpy as np

from rope_jax.data import byte_ids, gguf_file

INFO_FILE = "tokenizer_info.json"
HF_FILE = "tokenizer.json"
SP_FILE = "tokenizer.model"

# Special tokens of a BPE trained here, with ids 0, 1, 2 in this order.
PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"

# Looked up, in this order, in an HF tokenizer.json that has no tokenizer_info.json.
_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "<|end_of_text|>", "[SEP]")
_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<|padding|>")
_BOS_NAMES = ("<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]")


class Tokenizer(abc.ABC):
    """Text <-> token ids. Subclasses set the attributes and the three methods."""

    kind: str  # "bytes" | "hf" | "sentencepiece": which loader reads its saved dir
    name: str
    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Ids of `text`, with no special ids (no BOS/EOS added)."""

    @abc.abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; special ids are dropped."""

    @abc.abstractmethod
    def _write_files(self, directory: str) -> str | None:
        """Writes the tokenizer's own file into `directory`; returns its base name."""

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode` of each text as an int64 array (subclasses may do it in one call)."""
        return [np.asarray(self.encode(t), dtype=np.int64) for t in texts]

    def token_byte_lengths(self) -> np.ndarray | None:
        """UTF-8 bytes of each id [vocab_size] (0 for specials), or None if not exact."""
        return None

    def info(self) -> dict:
        """The `tokenizer_info.json` fields (file excepted)."""
        return {
            "kind": self.kind,
            "name": self.name,
            "vocab_size": int(self.vocab_size),
            "pad_id": int(self.pad_id),
            "bos_id": int(self.bos_id),
            "eos_id": int(self.eos_id),
        }

    def save(self, directory: str) -> str:
        """Writes the tokenizer into `directory` (created); returns `directory`."""
        os.makedirs(directory, exist_ok=True)
        info = dict(self.info(), file=self._write_files(directory))
        _write_json(os.path.join(directory, INFO_FILE), info)
        return directory

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


# ------------------------------------------------------------------------------ bytes


class ByteTokenizer(Tokenizer):
    """`rope_jax.data.tokenizer` as an object: ids 0..255 bytes, PAD 256, BOS 257, EOS 258."""

    kind = "bytes"
    name = "bytes"
    vocab_size = byte_ids.VOCAB_SIZE
    pad_id = byte_ids.PAD_ID
    bos_id = byte_ids.BOS_ID
    eos_id = byte_ids.EOS_ID

    def encode(self, text: str) -> list[int]:
        return byte_ids.encode(text).tolist()

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [byte_ids.encode_bytes(t.encode("utf-8")) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return byte_ids.decode(np.fromiter(ids, dtype=np.int64))

    def token_byte_lengths(self) -> np.ndarray:
        lengths = np.zeros(self.vocab_size, dtype=np.int32)
        lengths[:256] = 1
        return lengths

    def _write_files(self, directory: str) -> None:
        return None

    def to_hf(self) -> HFTokenizer:
        """The same ids as an HF `tokenizer.json` (what a byte-level run exports): a
        byte-level BPE with no merges whose 256 symbols (GPT-2's byte alphabet) have
        their byte's id, and PAD/BOS/EOS as special tokens at 256/257/258."""
        tokenizers = _import_hf("bytes")
        from tokenizers import decoders, models, pre_tokenizers

        vocab = _bytes_to_unicode()  # character -> its byte, the id
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([PAD, BOS, EOS])  # the next ids: 256, 257, 258
        ids = [tok.token_to_id(t) for t in (PAD, BOS, EOS)]
        if ids != [self.pad_id, self.bos_id, self.eos_id]:  # byte_ids changed
            raise ValueError(f"byte specials landed at {ids}, not the byte tokenizer's ids")
        name = f"hf-bytes-{_text_hash(tok.to_str())}"
        return HFTokenizer(tok, name=name, pad_id=ids[0], bos_id=ids[1], eos_id=ids[2])


# ------------------------------------------------------------------ HF tokenizer.json


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable character -> the byte it stands for."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` (any `tokenizer.json`); specials found by name or given."""

    kind = "hf"

    def __init__(self, tok, *, name: str, pad_id: int, bos_id: int, eos_id: int,
                 chat_template: str | None = None):  # fmt: skip
        tok.encode_special_tokens = True  # "<eos>" in a document is text, not EOS
        self.tok = tok
        self.name = name
        self.chat_template = chat_template  # the model's Jinja chat template, kept as given
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        self.pad_id, self.bos_id, self.eos_id = int(pad_id), int(bos_id), int(eos_id)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """One call for many texts; `encode_batch_fast` (no offsets, ~15% faster) if there."""
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        encodings = encode(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def to_str(self) -> str:
        return self.tok.to_str()

    def info(self) -> dict:
        info = super().info()
        return info if self.chat_template is None else {**info, "chat_template": self.chat_template}

    def token_byte_lengths(self) -> np.ndarray | None:
        """Exact for byte-level files with no normalizer (GPT-2 style, `train_bpe`)."""
        config = json.loads(self.to_str())
        decoder = config.get("decoder") or {}
        if config.get("normalizer") is not None or decoder.get("type") != "ByteLevel":
            return None
        alphabet = _bytes_to_unicode()
        added = {t["id"]: t for t in config.get("added_tokens", [])}
        lengths = np.zeros(self.vocab_size, dtype=np.int32)
        for i in range(self.vocab_size):
            if i in added:
                token = added[i]
                lengths[i] = 0 if token["special"] else len(token["content"].encode("utf-8"))
                continue
            piece = self.tok.id_to_token(i)
            if piece is None or any(c not in alphabet for c in piece):
                return None
            lengths[i] = len(piece)
        return lengths

    def _write_files(self, directory: str) -> str:
        with open(os.path.join(directory, HF_FILE), "w", encoding="utf-8") as f:
            f.write(self.to_str())
        return HF_FILE


def _special_id(tok, names: Sequence[str]) -> int | None:
    for name in names:
        i = tok.token_to_id(name)
        if i is not None:
            return int(i)
    return None


def load_hf(path: str, info: dict | None = None) -> HFTokenizer:
    """An HF `tokenizer.json`; special ids from `info` or found by their usual names."""
    tokenizers = _import_hf(path)
    try:
        tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # Rust errors surface as Exception subclasses
        raise ValueError(
            f"tokenizer file {path} does not load as an HF tokenizer.json: {_first_line(e)}"
        ) from None
    name = f"hf-{_file_hash(path)}"
    if info is not None:
        ids = {k: info[k] for k in ("pad_id", "bos_id", "eos_id")}
        return HFTokenizer(tok, name=info.get("name", name), chat_template=info.get(
            "chat_template"), **ids)  # fmt: skip
    eos = _special_id(tok, _EOS_NAMES)
    if eos is None:
        raise ValueError(
            f"tokenizer file {path} has no end-of-document token "
            f"(looked for {', '.join(_EOS_NAMES)})"
        )
    pad = _special_id(tok, _PAD_NAMES)
    bos = _special_id(tok, _BOS_NAMES)
    return HFTokenizer(
        tok,
        name=name,
        pad_id=eos if pad is None else pad,
        bos_id=eos if bos is None else bos,
        eos_id=eos,
    )


def load_gguf(path: str) -> HFTokenizer:
    """The tokenizer inside a GGUF file (`gguf_file.tokenizer_json`: its vocabulary,
    merges, special ids and chat template); one ValueError line when it has none."""
    meta = gguf_file.read(path)[1]
    text, specials = gguf_file.tokenizer_json(meta, where=path)
    tok = _import_hf(path).Tokenizer.from_str(text)
    name = f"gguf-{_text_hash(text)}"
    return HFTokenizer(tok, name=name, **specials)


def _import_hf(path: str):
    try:
        import tokenizers
    except ImportError:
        raise ValueError(
            f"tokenizer {path} needs the HF `tokenizers` package: pip install tokenizers"
        ) from None
    return tokenizers


def check_bpe_vocab(vocab_size: int) -> None:
    """A byte-level BPE's vocabulary holds the 3 specials, 256 bytes and one merge."""
    minimum = 3 + 256 + 1
    if vocab_size < minimum:
        raise ValueError(
            f"train:{vocab_size}: a byte-level BPE needs vocab_size >= {minimum} "
            "(3 specials + 256 bytes + at least one merge)"
        )


def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """A byte-level BPE (GPT-2 alphabet, no normalizer) trained on `texts`.

    Ids 0, 1, 2 are PAD, BOS, EOS; then the 256 byte symbols; then merges up to
    `vocab_size` (fewer if the texts run out of pairs). The same texts in the same order
    give the same file (checked across processes and thread counts).
    """
    check_bpe_vocab(vocab_size)
    tokenizers = _import_hf("train:VOCAB")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    name = f"bpe{vocab_size}-{_text_hash(tok.to_str())}"
    return HFTokenizer(tok, name=name, pad_id=0, bos_id=1, eos_id=2)


# ---------------------------------------------------------------------- SentencePiece


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece `.model`; PAD falls back to EOS when the model has none."""

    kind = "sentencepiece"

    def __init__(self, processor, model_bytes: bytes, *, name: str):
        self.sp = processor
        self.model_bytes = model_bytes
        self.name = name
        self.vocab_size = int(processor.get_piece_size())
        self.eos_id = int(processor.eos_id())
        self.bos_id = int(processor.bos_id()) if processor.bos_id() >= 0 else self.eos_id
        self.pad_id = int(processor.pad_id()) if processor.pad_id() >= 0 else self.eos_id

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int64) for ids in self.sp.encode(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def _write_files(self, directory: str) -> str:
        with open(os.path.join(directory, SP_FILE), "wb") as f:
            f.write(self.model_bytes)
        return SP_FILE


def load_sentencepiece(path: str, info: dict | None = None) -> SentencePieceTokenizer:
    """A SentencePiece model file (needs the `sentencepiece` wheel)."""
    try:
        import sentencepiece
    except ImportError:
        raise ValueError(
            f"tokenizer {path} needs the `sentencepiece` package: pip install sentencepiece"
        ) from None
    with open(path, "rb") as f:
        model_bytes = f.read()
    try:
        processor = sentencepiece.SentencePieceProcessor(model_proto=model_bytes)
    except Exception as e:
        raise ValueError(
            f"tokenizer file {path} does not load as a SentencePiece model: {_first_line(e)}"
        ) from None
    if processor.eos_id() < 0:
        raise ValueError(f"tokenizer file {path} has no end-of-document piece (eos_id = -1)")
    name = (info or {}).get("name") or f"sp-{_file_hash(path)}"
    return SentencePieceTokenizer(processor, model_bytes, name=name)


# ---------------------------------------------------------------------------- loading


def load(path: str) -> Tokenizer:
    """A tokenizer from a dir written by `save`, a `tokenizer.json`, a `.model` file or
    the vocabulary inside a `.gguf` checkpoint."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        return _load_dir(path)
    if not os.path.isfile(path):
        raise ValueError(f"tokenizer file {path} does not exist")
    if path.endswith(".model"):
        return load_sentencepiece(path)
    if gguf_file.is_gguf(path):
        return load_gguf(path)
    if os.path.basename(path) == INFO_FILE:
        return _load_dir(os.path.dirname(path) or ".")
    if path.endswith(".json"):
        return load_hf(path)
    raise ValueError(
        f"tokenizer file {path} is not a SentencePiece .model, an HF tokenizer.json, "
        f"a .gguf checkpoint or a dir with {INFO_FILE}"
    )


def _load_dir(directory: str) -> Tokenizer:
    info_path = os.path.join(directory, INFO_FILE)
    if not os.path.isfile(info_path):
        for file in (HF_FILE, SP_FILE):
            if os.path.isfile(os.path.join(directory, file)):
                return load(os.path.join(directory, file))
        raise ValueError(f"tokenizer dir {directory} has no {INFO_FILE}, {HF_FILE} or {SP_FILE}")
    try:
        with open(info_path, encoding="utf-8") as f:
            info = json.load(f)
        kind = info["kind"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"tokenizer file {info_path} is not valid: {_first_line(e)}") from None
    if kind == "bytes":
        return ByteTokenizer()
    file = os.path.join(directory, str(info.get("file")))
    if kind == "hf":
        return load_hf(file, info)
    if kind == "sentencepiece":
        return load_sentencepiece(file, info)
    raise ValueError(f"tokenizer file {info_path} names an unknown kind {kind!r}")


def parse_spec(spec: str) -> tuple[str, int | str | None]:
    """("bytes", None) | ("train", vocab_size) | ("path", path); ValueError otherwise."""
    spec = spec.strip()
    if spec == "bytes":
        return "bytes", None
    if spec.startswith("train:"):
        vocab = spec.split(":", 1)[1]
        if not vocab.isdigit():
            raise ValueError(f"tokenizer spec {spec!r}: train:VOCAB needs a positive integer "
                             "vocab size, e.g. train:8000")  # fmt: skip
        check_bpe_vocab(int(vocab))  # before any text is read
        return "train", int(vocab)
    if not spec:
        raise ValueError("tokenizer spec is empty: give bytes, train:VOCAB or a file")
    return "path", os.path.expanduser(spec)


def from_spec(spec: str, texts: Iterable[str] | None = None) -> Tokenizer:
    """`bytes`, a `.model` / `tokenizer.json` / saved dir, or `train:VOCAB` on `texts`."""
    kind, value = parse_spec(spec)
    if kind == "bytes":
        return ByteTokenizer()
    if kind == "train":
        if texts is None:
            raise ValueError(f"tokenizer spec {spec!r} trains a BPE and needs texts")
        return train_bpe(texts, value)
    return load(value)


# ---------------------------------------------------------------------------- helpers


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def _text_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:8]


def _file_hash(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:8]


def _write_json(path: str, value) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1, sort_keys=True)
        f.write("\n")
