"""GGUF files (llama.cpp's checkpoint format): opening, metadata, split parts, vocabulary.

    readers, meta = gguf_file.read("model.gguf")        # `gguf.GGUFReader`s, {key: value}
    text, specials = gguf_file.tokenizer_json(meta, where="model.gguf")

A GGUF file is a header of typed key/value metadata (the architecture, the rope
settings, the tokenizer's vocabulary and merges, its chat template) followed by tensors,
often quantized. Reading is ggml-org's `gguf` package (NumPy only, its own
dequantization); this module adds the checks a user needs as one line each
(`GGUFError`): a file that is not GGUF or is cut short, a split checkpoint with a part
missing, a tokenizer whose model or pre-tokenizer is not one this project rebuilds.

Split checkpoints (`NAME-00001-of-00003.gguf`, llama.cpp's gguf-split) are read whole:
`open_parts` opens every part from any one of them; the first holds the metadata.
`read` is the one way in: it opens a checkpoint once (about 2 s for a 49k-token
vocabulary) and keeps it while its files are unchanged, for the config, the tensors and
the tokenizer alike.

The tokenizer (`tokenizer.ggml.model = "gpt2"`, a byte-level BPE) becomes an HF
`tokenizer.json`: the vocabulary `tokenizer.ggml.tokens`, the merges
`tokenizer.ggml.merges`, control tokens (token type 3) as special added tokens, and the
pre-tokenizer that `tokenizer.ggml.pre` names (`PRE_TOKENIZERS`). Its ids are the
file's: `encode` gives what llama.cpp's own tokenizer gives for these pre-tokenizers.
"""

from __future__ import annotations

import functools
import json
import os
import re

GGUF_SUFFIX = ".gguf"
MAGIC = b"GGUF"
_SPLIT = re.compile(r"(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")
TOKENIZER_PREFIX = "tokenizer.ggml."
CHAT_TEMPLATE = "tokenizer.chat_template"
CONTROL = 3  # tokenizer.ggml.token_type of a control (special) token
USER_DEFINED = 4  # ... of a user-defined token: added, not special

# GPT-2's split of text before byte-level BPE (tokenizers' ByteLevel(use_regex=True))
_GPT2 = [{"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
          "use_regex": True}]  # fmt: skip
# `tokenizer.ggml.pre` -> the pre-tokenizer steps of tokenizer.json that reproduce it
# (llama.cpp's llama-vocab.cpp regexes for that name): "smollm" splits each digit first
PRE_TOKENIZERS = {
    "default": _GPT2,
    "gpt2": _GPT2,
    "smollm": [{"type": "Digits", "individual_digits": True}, *_GPT2],
}


class GGUFError(ValueError):
    """A GGUF file that cannot be read as asked (one line)."""


def is_gguf(path: str) -> bool:
    """True for a file named *.gguf or starting with GGUF's magic bytes."""
    path = os.path.expanduser(str(path))
    if not os.path.isfile(path):
        return path.endswith(GGUF_SUFFIX)
    if path.endswith(GGUF_SUFFIX):
        return True
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


def part_paths(path: str) -> list[str]:
    """Every part of the checkpoint `path` belongs to, first part first: [path] for one
    file; all of NAME-0000i-of-0000N.gguf for a split one (GGUFError naming a missing
    part)."""
    path = os.path.expanduser(str(path))
    if not os.path.isfile(path):
        raise GGUFError(f"{path} does not exist (give a .gguf file)")
    split = _SPLIT.fullmatch(os.path.basename(path))
    if not split:
        return [path]
    count, stem = int(split["count"]), os.path.join(os.path.dirname(path), split["stem"])
    paths = [f"{stem}-{i:05d}-of-{count:05d}{GGUF_SUFFIX}" for i in range(1, count + 1)]
    missing = [os.path.basename(p) for p in paths if not os.path.isfile(p)]
    if missing:
        raise GGUFError(f"{path} is part of a split GGUF of {count} parts, and "
                        f"{', '.join(missing)} is missing beside it: every part is "
                        "read")  # fmt: skip
    return paths


def open_reader(path: str):
    """`gguf.GGUFReader` of one file; GGUFError for a file that is not GGUF, is cut short
    or names what the reader does not know."""
    try:
        import gguf
    except ImportError:
        raise GGUFError(f"{path}: reading GGUF needs the `gguf` package: "
                        "pip install gguf") from None  # fmt: skip
    with open(path, "rb") as f:
        if f.read(4) != MAGIC:
            raise GGUFError(f"{path} is not a GGUF file (it does not start with {MAGIC!r})")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001  (the reader's own errors for a short or bad file)
        text = str(e).strip().splitlines()
        why = f"{type(e).__name__}{': ' + text[0] if text else ''}"
        raise GGUFError(f"{path} is not a complete GGUF file (truncated or damaged: "
                        f"{why})") from None  # fmt: skip


def open_parts(path: str) -> list:
    """The readers of every part of `path` (`part_paths`), first part first; GGUFError
    when a part's split.no / split.count disagree with its name."""
    paths = part_paths(path)
    readers = [open_reader(p) for p in paths]
    for i, (p, reader) in enumerate(zip(paths, readers, strict=True)):
        count = _value(reader, "split.count", 1 if len(paths) == 1 else None)
        if len(paths) == 1 and count not in (None, 0, 1):
            raise GGUFError(f"{p} is one part of a split GGUF (split.count={count}) but is not "
                            "named NAME-0000i-of-0000N.gguf: name its parts so, or merge them "
                            "with llama.cpp's gguf-split --merge")  # fmt: skip
        if len(paths) > 1 and (count != len(paths) or _value(reader, "split.no", None) != i):
            raise GGUFError(f"{p}: split.no/split.count do not match its name (part {i + 1} "
                            f"of {len(paths)})")  # fmt: skip
    return readers


def read(path: str) -> tuple[tuple, dict]:
    """(the readers of every part, the first part's metadata) of the checkpoint `path`,
    opened once and kept while its parts are unchanged (same size and mtime); GGUFError
    as `open_parts`."""
    paths = part_paths(path)
    version = tuple((os.stat(p).st_mtime_ns, os.stat(p).st_size) for p in paths)
    return _read(tuple(os.path.realpath(p) for p in paths), version)


@functools.lru_cache(maxsize=4)
def _read(paths: tuple, _version: tuple) -> tuple[tuple, dict]:
    readers = tuple(open_parts(paths[0]))
    return readers, metadata(readers[0])


def _value(reader, key: str, default):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def metadata(reader) -> dict:
    """{key: value} of a reader's metadata (the reader's own GGUF.* fields left out)."""
    return {key: field.contents() for key, field in reader.fields.items()
            if not key.startswith("GGUF.")}  # fmt: skip


def has_tokenizer(meta: dict) -> bool:
    return f"{TOKENIZER_PREFIX}tokens" in meta


def tokenizer_json(meta: dict, *, where: str) -> tuple[str, dict]:
    """(tokenizer.json text, {"bos_id", "eos_id", "pad_id", "chat_template"}) of a GGUF's
    tokenizer metadata; GGUFError (one line, saying what to pass instead) when it has none
    or one this project does not rebuild."""
    instead = "pass the model's tokenizer.json as --config.data.tokenizer=PATH"
    if not has_tokenizer(meta):
        raise GGUFError(f"{where} has no tokenizer (no {TOKENIZER_PREFIX}tokens): {instead}")
    model = meta.get(f"{TOKENIZER_PREFIX}model")
    if model != "gpt2":
        raise GGUFError(f"{where}: {TOKENIZER_PREFIX}model={model!r} is not read (only 'gpt2', "
                        f"a byte-level BPE): {instead}")  # fmt: skip
    pre = meta.get(f"{TOKENIZER_PREFIX}pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"{where}: {TOKENIZER_PREFIX}pre={pre!r} is not one this project "
                        f"rebuilds ({', '.join(PRE_TOKENIZERS)}): {instead}")  # fmt: skip
    tokens = list(meta[f"{TOKENIZER_PREFIX}tokens"])
    types = list(meta.get(f"{TOKENIZER_PREFIX}token_type") or [1] * len(tokens))
    merges = list(meta.get(f"{TOKENIZER_PREFIX}merges") or [])
    added = [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": t == CONTROL}
             for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)]  # fmt: skip
    config = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": PRE_TOKENIZERS[pre]},
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },  # fmt: skip
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": [m.split(" ", 1) for m in merges],
        },  # fmt: skip
    }
    eos = meta.get(f"{TOKENIZER_PREFIX}eos_token_id")
    if eos is None:
        raise GGUFError(f"{where} has no {TOKENIZER_PREFIX}eos_token_id: {instead}")
    bos = meta.get(f"{TOKENIZER_PREFIX}bos_token_id", eos)
    pad = meta.get(f"{TOKENIZER_PREFIX}padding_token_id", eos)
    specials = {"bos_id": int(bos), "eos_id": int(eos), "pad_id": int(pad),
                "chat_template": meta.get(CHAT_TEMPLATE)}  # fmt: skip
    return json.dumps(config, ensure_ascii=False), specials
