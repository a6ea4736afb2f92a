"""Training on a prepared corpus: windows read from its ArrayRecord shards on demand.

A config names a dataset made by `python -m rope_jax.data.prepare` with
`data.name=NAME data.data_dir=DIR` (the directory DIR/NAME holds its metadata.json).
A shipped corpus or `data.files` with a `data.tokenizer` other than bytes is prepared
once, on first use, into DIR/prepared/<source>-<tokenizer>-<hash> (DIR = `data.data_dir`
or the TFDS default) with the same command's code; later runs find it complete.

Nothing is loaded whole: a batch reads its windows from the shards by random access
(`shards.TokenSplit`), so resident memory does not grow with the corpus. Batches have
the fields of the byte pipeline (`pipeline.Windows`), so a prepared corpus and a raw
one train the same way. The tokenizer (and so the vocabulary size) is the dataset's.

Shards are checked against metadata.json by size every time a split is opened and by
sha256 the first time (or after their size or mtime changed): the verdict is kept in
DIR/NAME/verified.json, so a 100 GB corpus is hashed once, not at every start.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os

import grain

from rope_jax.data import packing, pipeline, shards, sources, synthetic, tokenizers

AUTO_DIR = "prepared"  # DIR/prepared/...: corpora prepared on first use
VERIFIED = "verified.json"  # DIR/NAME/verified.json: shards whose sha256 matched
READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)


# ----------------------------------------------------------------------------- naming


def tokenizer_spec(data_config) -> str:
    """`data.tokenizer` ('' = the data's own: bytes for raw text, a dataset's stored one)."""
    return str(data_config.tokenizer).strip()


def auto_source(data_config) -> str | None:
    """The `prepare --source` of a raw corpus to prepare on first use, or None when the
    config reads raw bytes (no tokenizer, or `bytes`) or names a prepared dataset."""
    if not sources.tokenizes(data_config):
        return None
    source = sources.resolve(data_config)
    if source.kind == "prepared":
        return None  # a prepared dataset: its tokenizer is checked in `check_tokenizer`
    if source.kind in sources.SOURCES and sources.SOURCES[source.kind].auto_prepared:
        return source.spec
    spec = tokenizer_spec(data_config)
    raise sources.DataSourceError(
        f"data.tokenizer={spec!r} needs a corpus this project can read itself (a shipped "
        f"corpus, an archive or data.files); for data.name={data_config.name!r} prepare it "
        f"first: python -m rope_jax.data.prepare --source=... --tokenizer={spec} "
        "--name=NAME --data_dir=DIR, then train with data.name=NAME data.data_dir=DIR"
    )


def dataset_path(data_config) -> str | None:
    """DIR/NAME of the prepared dataset this config reads, or None for raw text."""
    source = auto_source(data_config)
    if source is not None:
        name = _auto_name(data_config, source)
        return os.path.join(sources.root_dir(data_config), AUTO_DIR, name)
    if not data_config.files and not data_config.name:
        return None  # nothing named: the raw path says so in one line
    source = sources.resolve(data_config)
    return source.spec if source.kind == "prepared" else None


def _auto_settings(data_config, source: str):
    from rope_jax.data import preparation as prepare

    return prepare.Settings(
        source=source,
        tokenizer=tokenizer_spec(data_config),
        text_key=data_config.text_key,
        max_documents=int(data_config.max_documents),
    )


def _auto_name(data_config, source: str) -> str:
    """<source>-<tokenizer>-<hash of the settings>, e.g. python_stdlib-bpe8000-1f2e3d4c."""
    settings = _auto_settings(data_config, source)
    kind, value = tokenizers.parse_spec(settings.tokenizer)
    tok = f"bpe{value}" if kind == "train" else _stem(value)
    if kind == "path" and os.path.exists(value):
        tok += "-" + _content_hash(value)
    stem = {"corpus": source, "files": "files"}.get(sources.parse(source).kind, "archive")
    key = json.dumps([source, settings.tokenizer, settings.text_key, settings.max_documents])
    return f"{stem}-{tok}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


def _stem(path: str) -> str:
    base = os.path.basename(os.path.normpath(path))
    return "".join(c if c.isalnum() else "_" for c in base.rsplit(".", 1)[0])[:24] or "tok"


def _content_hash(path: str) -> str:
    h = hashlib.sha256()
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, f) for f in os.listdir(path)
    )  # fmt: skip
    for file in files:
        if os.path.isfile(file):
            with open(file, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:8]


# ------------------------------------------------------------------ preparing, checking


def ensure_prepared(data_config) -> str:
    """Prepares an auto-prepared corpus if it is not complete (one process at a time,
    under a lock); checks a named dataset's metadata. Returns DIR/NAME."""
    path = dataset_path(data_config)
    source = auto_source(data_config)
    if source is not None:
        from rope_jax.data import preparation as prepare

        try:  # makes DIR/NAME; one process at a time (`prepare` holds the dataset's lock)
            prepare.prepare(_auto_settings(data_config, source), os.path.basename(path),
                            os.path.dirname(path), workers=min(4, os.cpu_count() or 1),
                            command="", progress=True)  # fmt: skip
        except prepare.OutOfSpace as e:  # names the directory already
            raise sources.DataSourceError(str(e)) from None
        except ValueError as e:
            raise sources.DataSourceError(f"preparing {path}: {e}") from None
    metadata(path)
    return path


def metadata(path: str) -> dict:
    """metadata.json of DIR/NAME; one DataSourceError line if it is not complete."""
    try:
        return shards.read_metadata(path)
    except ValueError as e:
        raise sources.DataSourceError(str(e)) from None


def tokenizer(path: str) -> tokenizers.Tokenizer:
    """The dataset's own tokenizer; one DataSourceError line if it does not load."""
    try:
        return shards.load_tokenizer(path)
    except ValueError as e:
        raise sources.DataSourceError(f"the tokenizer of {path}: {e}") from None


def check_tokenizer(data_config, path: str) -> None:
    """A `data.tokenizer` set beside a named prepared dataset must be the dataset's."""
    spec = tokenizer_spec(data_config)
    if not spec or auto_source(data_config) is not None:
        return
    stored = metadata(path)["tokenizer"]["name"]
    kind, value = tokenizers.parse_spec(spec)
    given = "bytes" if kind == "bytes" else None
    if kind == "path":
        try:
            given = tokenizers.load(value).name
        except ValueError as e:
            raise sources.DataSourceError(f"data.tokenizer={spec!r}: {e}") from None
    if given != stored:
        raise sources.DataSourceError(
            f"data.tokenizer={spec!r} is not the tokenizer of {path} ({stored}); a prepared "
            "dataset brings its own: leave data.tokenizer empty"
        )


def check_splits(path: str, splits) -> None:
    """Every split named exists in the dataset (one line naming the missing ones)."""
    have = metadata(path)["splits"]
    missing = [s for s in dict.fromkeys(splits) if s not in have]
    if missing:
        raise sources.DataSourceError(
            f"split(s) {', '.join(map(repr, missing))} are not in {path}; "
            f"it has {', '.join(sorted(have))}"
        )


def open_split(path: str, split: str) -> shards.TokenSplit:
    """The reader of one split, every shard checked (sha256 once, then size and mtime)."""
    _verify_hashes(path, split)
    try:
        return shards.open_split(path, split, verify="size")
    except ValueError as e:
        raise sources.DataSourceError(str(e)) from None


def _verify_hashes(path: str, split: str) -> None:
    entries = metadata(path)["splits"].get(split, {}).get("shards", [])
    record_path = os.path.join(path, VERIFIED)
    try:
        with open(record_path, encoding="utf-8") as f:
            verified = json.load(f)
    except (OSError, ValueError):
        verified = {}
    changed = False
    for entry in entries:
        key = entry["file"]
        stamp = [_stamp(os.path.join(path, n)) for n in (entry["file"], entry["index"])]
        if verified.get(key) == [entry["sha256"], stamp]:
            continue
        problem = shards.check_shard(path, entry, verify="hash")
        if problem:
            raise sources.DataSourceError(f"{problem}; prepare again (the same command redoes it)")
        verified[key], changed = [entry["sha256"], stamp], True
    if changed:
        with contextlib.suppress(OSError):  # a read-only dataset is hashed at every open
            tmp = f"{record_path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(verified, f)
            os.replace(tmp, record_path)


def _stamp(file: str) -> list[int]:
    try:
        st = os.stat(file)
    except OSError:
        return [-1, -1]
    return [st.st_size, st.st_mtime_ns]


# ---------------------------------------------------------------------------- batches


def train_iterator(data_config, path: str, *, seed: int, batch_size: int, shard):
    """Shuffled full windows of the train split, a new permutation per epoch, forever."""
    seq_len = int(data_config.seq_len)
    split = open_split(path, data_config.train_split)
    num_windows = split.num_windows(seq_len)
    if num_windows < 1:
        raise sources.DataSourceError(
            f"the train split of {path} has {len(split)} tokens, fewer than "
            f"data.seq_len + 1 = {seq_len + 1}"
        )
    sample = split.read(0, min(len(split), 4 * seq_len + 4))["tokens"]  # checks the mix
    mix = synthetic.Mix.of(data_config, seed=seed, tokenizer=tokenizer(path), text=sample)
    windows = pipeline.Windows(split, seq_len, shard=shard, packing_mode=packing.mode(data_config),
                               synthetic=mix)  # fmt: skip
    return pipeline.shuffled_batches(num_windows, windows, seed=seed, batch_size=batch_size,
                                     shard=shard, options=READ_OPTIONS)  # fmt: skip


def eval_iterator(data_config, path: str, *, split: str, batch_size: int, seq_len: int,
                  num_batches: int | None, shard, spread: bool = False):  # fmt: skip
    """Every window of a split once, in order, padded to whole batches, with target bytes."""
    reader = open_split(path, split)
    windows = pipeline.Windows(reader, seq_len, shard=shard, packing_mode=packing.mode(data_config),
                      target_bytes=True)  # fmt: skip
    return pipeline.ordered_batches(reader.num_windows(seq_len, partial=True), windows,
                                    batch_size=batch_size, shard=shard,
                                    num_batches=num_batches, options=READ_OPTIONS,
                                    spread=spread)  # fmt: skip
