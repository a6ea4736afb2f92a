"""Subword tokenizers, `python -m rope_jax.data.prepare` and the shard reader.

Small corpora written into tmp dirs (.txt, .jsonl, .jsonl.gz, .parquet) and the shipped
Shakespeare limited by --max_documents; every prepared split is checked against the
in-memory concatenation of its documents.
"""

import gzip
import io
import json
import os
import pickle
import subprocess
import sys
import time

import numpy as np
import pytest

import rope_jax.data.preparation as prep
from rope_jax import data
from rope_jax.data import byte_ids, corpora, shards, tokenizers

WORDS = "the of and to in is naïve ∀x 日本 café <eos> <pad> 🙂 \t def return".split(" ")


SYLLABLES = "ka lo mi ne ru sa ti vo pe gu zan der ion ing qu ex".split()


def _text(rng, n: int) -> str:
    """n words: fixed ones (multi-byte, special-token look-alikes) and made-up ones."""
    made = ["".join(rng.choice(SYLLABLES, size=rng.integers(1, 4))) for _ in range(n)]
    fixed = rng.choice(WORDS, size=n)
    return " ".join(np.where(rng.random(n) < 0.5, fixed, made)) + "\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(glob, every non-empty document in source order) over 4 kinds of files."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    docs = []
    lines = [{"text": _text(rng, int(rng.integers(1, 120))), "id": i} for i in range(40)]
    lines[3]["text"] = ""  # empty documents are skipped
    with open(root / "a.jsonl", "w", encoding="utf-8") as f:
        for i, line in enumerate(lines):
            f.write(json.dumps(line) + ("\n\n" if i == 5 else "\n"))  # blank lines too
    docs += [x["text"] for x in lines if x["text"]]
    gz = [_text(rng, 30) for _ in range(10)]
    with gzip.open(root / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"meta": {"body": t}, "text": t}) + "\n" for t in gz)
    docs += gz
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [_text(rng, 40) for _ in range(8)]
    pq.write_table(pa.table({"text": rows, "n": list(range(8))}), root / "c.parquet")
    docs += rows
    for i in range(4):
        text = _text(rng, 300 + 100 * i)
        (root / f"d{i}.txt").write_text(text, encoding="utf-8")
        docs.append(text)
    return str(root / "*"), docs


def _prepare(source, tok, out, name, **kw):
    workers = kw.pop("workers", 1)
    settings = prep.Settings(source=source, tokenizer=tok, **kw)
    return prep.prepare(settings, name, str(out), workers=workers, progress=False)


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    """The corpus prepared with bytes and with a BPE trained here (small shards/records)."""
    out = tmp_path_factory.mktemp("prepared")
    small = dict(shard_tokens=2000, record_tokens=300)
    _prepare(corpus[0], "bytes", out, "bytes", **small)
    _prepare(corpus[0], "train:512", out, "bpe", **small)
    return out


def _files(path) -> dict:
    """Every file of a dataset (bytes), metadata without its `command`."""
    out = {}
    for dirpath, _, names in os.walk(path):
        for name in names:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = f.read()
    meta = json.loads(out.pop(shards.METADATA))
    meta.pop("command")
    return out | {"meta": meta}


def _split_docs(split: shards.TokenSplit, tok) -> list[str]:
    """The documents of a split read back through the reader (stream cut at EOS)."""
    stream = split.read(0, len(split))["tokens"]
    cuts = np.flatnonzero(stream == split.eos_id)
    return [tok.decode(d) for d in np.split(stream, cuts + 1)[:-1]]


def _reference_stream(tok, texts) -> np.ndarray:
    parts = [np.append(np.asarray(tok.encode(t), np.int64), tok.eos_id) for t in texts]
    return np.concatenate(parts)


# --------------------------------------------------------------------------- tokenizers


def test_bytes_tokenizer_keeps_todays_ids():
    tok = tokenizers.from_spec("bytes")
    text = "naïve ∀x <eos>\n"
    assert tok.encode(text) == byte_ids.encode(text).tolist()
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (259, 256, 257, 258)
    assert tok.decode(tok.encode(text) + [tok.eos_id]) == text
    assert tok.token_byte_lengths().sum() == 256


def test_train_bpe_round_trips_and_is_deterministic(corpus):
    texts = corpus[1]
    a, b = tokenizers.train_bpe(texts, 400), tokenizers.train_bpe(iter(texts), 400)
    assert a.to_str() == b.to_str() and a.name == b.name and a.name.startswith("bpe400-")
    assert a.vocab_size == 400 and (a.pad_id, a.bos_id, a.eos_id) == (0, 1, 2)
    table = a.token_byte_lengths()
    assert [list(x) for x in a.encode_batch(texts[:5])] == [a.encode(t) for t in texts[:5]]
    for text in [*texts[:5], "unseen ✓ text\r\n  with  spaces", "<eos><pad><bos>", ""]:
        ids = a.encode(text)
        assert a.decode(ids) == text
        assert not set(ids) & {0, 1, 2}  # specials only ever come from the pipeline
        assert table[ids].sum() == len(text.encode("utf-8"))


def test_save_load_and_from_spec(corpus, tmp_path):
    bpe = tokenizers.from_spec("train:300", texts=corpus[1])
    saved = bpe.save(str(tmp_path / "tok"))
    for spec in (saved, os.path.join(saved, "tokenizer.json")):
        again = tokenizers.from_spec(spec)
        assert again.encode("naïve café") == bpe.encode("naïve café")
        assert again.eos_id == bpe.eos_id
    assert tokenizers.load(saved).name == bpe.name
    assert isinstance(tokenizers.load(tokenizers.ByteTokenizer().save(str(tmp_path / "b"))),
                      tokenizers.ByteTokenizer)  # fmt: skip
    # A foreign tokenizer.json: specials found by their usual names, pad falls back to EOS.
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    foreign = Tokenizer(models.BPE(unk_token="<unk>"))
    foreign.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=100, special_tokens=["<unk>", "<s>", "</s>"])
    foreign.train_from_iterator(corpus[1], trainer)
    foreign.save(str(tmp_path / "f.json"))
    f = tokenizers.load(str(tmp_path / "f.json"))
    assert (f.eos_id, f.bos_id, f.pad_id) == (2, 1, 2) and f.name.startswith("hf-")
    assert f.token_byte_lengths() is None  # not byte-level: proportional byte counts


def test_sentencepiece_model(tmp_path):
    import sentencepiece as spm

    model = io.BytesIO()
    lines = [f"the quick brown fox jumps over the lazy dog {i}" for i in range(200)]
    options = dict(vocab_size=60, model_type="bpe", minloglevel=2, pad_id=3)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, **options)
    path = tmp_path / "m.model"
    path.write_bytes(model.getvalue())
    tok = tokenizers.from_spec(str(path))
    assert (tok.vocab_size, tok.pad_id, tok.eos_id) == (60, 3, 2)
    ids = tok.encode("the lazy fox 42")
    assert tok.decode(ids + [tok.eos_id]) == "the lazy fox 42"
    assert tok.token_byte_lengths() is None  # normalizes: bytes are attributed proportionally
    again = tokenizers.load(tok.save(str(tmp_path / "saved")))
    assert again.encode("the lazy fox 42") == ids and again.name == tok.name


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("bad.json", "{not json", "does not load as an HF tokenizer.json"),
        ("bad.model", "garbage", "does not load as a SentencePiece model"),
        ("vocab.txt", "a b c", "is not a SentencePiece .model"),
        ("missing.json", None, "does not exist"),
    ],
)
def test_bad_tokenizer_file_is_one_line(tmp_path, name, content, match):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=match) as e:
        tokenizers.from_spec(str(path))
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_bad_tokenizer_specs():
    for spec, match in [("train:abc", "positive integer vocab"), ("train:-5", "positive integer"),
                        ("train:100", "vocab_size >= 260"), ("", "empty")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            tokenizers.from_spec(spec, texts=["x"])
        if spec:  # refused from the spec alone, before any text is read
            with pytest.raises(ValueError, match=match):
                tokenizers.parse_spec(spec)
    with pytest.raises(ValueError, match="needs texts"):
        tokenizers.from_spec("train:300")


# ---------------------------------------------------------------------------- prepare


@pytest.mark.parametrize("name", ["bytes", "bpe"])
def test_prepared_splits_hold_every_document_once(prepared, corpus, name):
    path = prepared / name
    meta = shards.read_metadata(str(path))
    tok = shards.load_tokenizer(str(path))
    assert meta["vocab_size"] == tok.vocab_size and meta["tokenizer"]["name"] == tok.name
    assert meta["dtype"] == "<u2" and meta["bytes_per_token"] == "exact"
    order = {text: i for i, text in reversed(list(enumerate(corpus[1])))}
    seen = []
    for split in prep.SPLITS:
        reader = shards.open_split(str(path), split)
        docs = _split_docs(reader, tok)
        assert docs and [order[d] for d in docs] == sorted(order[d] for d in docs)  # in order
        info = meta["splits"][split]
        assert info["documents"] == reader.num_documents == len(docs)
        assert info["bytes"] == sum(len(d.encode("utf-8")) for d in docs) == reader.num_bytes
        assert info["tokens"] + len(docs) == len(reader)
        seen += docs
    assert sorted(seen) == sorted(corpus[1])
    assert len(meta["splits"]["train"]["shards"]) > 1
    names = [s["file"] for s in meta["splits"]["train"]["shards"]]
    assert names[0] == f"train-00000-of-{len(names):05d}.array_record"


@pytest.mark.parametrize("name", ["bytes", "bpe"])
def test_windows_equal_the_concatenated_stream(prepared, name):
    path = str(prepared / name)
    tok = shards.load_tokenizer(path)
    reader = shards.open_split(path, "train")
    ref = _reference_stream(tok, _split_docs(reader, tok))
    assert len(reader) == len(ref)
    for seq_len in (1, 7, 64, 1000):
        count = reader.num_windows(seq_len, partial=True)
        assert reader.num_windows(seq_len) == (len(ref) - 1) // seq_len
        assert count == -(-(len(ref) - 1) // seq_len)
        for i in range(0, count, max(1, count // 40)):
            want = ref[i * seq_len : i * seq_len + seq_len + 1]
            got = reader.window(i, seq_len)
            assert got.shape == (seq_len + 1,)
            np.testing.assert_array_equal(got[: len(want)], want)
            assert (got[len(want) :] == tok.pad_id).all()


def test_segments_and_positions_restart_at_documents(prepared):
    reader = shards.open_split(str(prepared / "bytes"), "train")
    whole = reader.read(0, len(reader))
    eos = np.flatnonzero(whole["tokens"] == reader.eos_id)
    starts = np.concatenate([[0], eos[:-1] + 1])
    np.testing.assert_array_equal(np.flatnonzero(whole["positions"] == 0), starts)
    np.testing.assert_array_equal(np.unique(whole["segment_ids"]), np.arange(1, len(eos) + 1))
    np.testing.assert_array_equal(whole["segment_ids"][starts], np.arange(1, len(eos) + 1))
    # A window starting mid-document: segment 1 / position 0 there, then each document.
    a = int(starts[2]) + 5
    w = reader.read(a, a + 600)
    inside = starts[(starts > a) & (starts < a + 600)] - a
    np.testing.assert_array_equal(np.flatnonzero(w["positions"] == 0), np.r_[0, inside])
    np.testing.assert_array_equal(w["segment_ids"][np.r_[0, inside]], np.arange(1, len(inside) + 2))
    tail = reader.read(len(reader) - 3, len(reader) + 4)  # past the end: padding
    assert list(tail["segment_ids"]) == [1, 1, 1, 0, 0, 0, 0]
    assert list(tail["tokens"][3:]) == [reader.pad_id] * 4 and tail["bytes"][3:].sum() == 0


def test_target_bytes_add_up_to_utf8_sizes(prepared, corpus, tmp_path):
    # exact (bytes, BPE) and proportional (the same BPE, forced) byte counts
    tok_dir = str(prepared / "bpe" / shards.TOKENIZER_DIR)
    _prepare(corpus[0], tok_dir, tmp_path, "prop", byte_counts="proportional",
             shard_tokens=2000, record_tokens=50)  # fmt: skip
    for path in (prepared / "bytes", prepared / "bpe", tmp_path / "prop"):
        meta = shards.read_metadata(str(path))
        for split in prep.SPLITS:
            reader = shards.open_split(str(path), split)
            seq_len = 33
            total = sum(reader.example(i, seq_len)["target_bytes"].sum()
                        for i in range(reader.num_windows(seq_len, partial=True)))  # fmt: skip
            first = reader.read(0, 1)["bytes"][0]  # the first token is never a target
            assert total + first == meta["splits"][split]["bytes"] == reader.num_bytes
    assert shards.read_metadata(str(tmp_path / "prop"))["bytes_per_token"] == "proportional"
    assert np.array_equal(shards.proportional_bytes(10, 4), [2, 3, 2, 3])


def test_output_does_not_depend_on_workers(prepared, corpus, tmp_path):
    tok_dir = str(prepared / "bpe" / shards.TOKENIZER_DIR)
    for workers in (1, 2):
        _prepare(corpus[0], tok_dir, tmp_path, f"w{workers}", workers=workers,
                 shard_tokens=1500, record_tokens=100)  # fmt: skip
    one, two = _files(tmp_path / "w1"), _files(tmp_path / "w2")
    assert one.keys() == two.keys() and len([k for k in one if k.endswith(".array_record")]) > 3
    for key in one:
        assert one[key] == two[key], key
    assert _files(prepared / "bpe")["meta"]["splits"] != one["meta"]["splits"]  # other shards


def test_resume_after_interrupt_and_repair(corpus, tmp_path, monkeypatch, capsys):
    kw = dict(shard_tokens=1500, record_tokens=200)
    _prepare(corpus[0], "bytes", tmp_path, "ref", **kw)
    calls, close = [], shards.ShardWriter.close

    def dying_close(self):  # the 3rd shard is complete on disk but never recorded
        entry = close(self)
        calls.append(entry)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return entry

    monkeypatch.setattr(shards.ShardWriter, "close", dying_close)
    with pytest.raises(KeyboardInterrupt):
        _prepare(corpus[0], "bytes", tmp_path, "run", **kw)
    monkeypatch.undo()
    run = tmp_path / "run"
    assert not (run / shards.METADATA).exists()
    with pytest.raises(ValueError, match="not a prepared dataset"):
        shards.open_split(str(run), "train")
    staging = run / prep.STAGING
    (staging / "train-00001.array_record").write_bytes(b"half a shard")  # damaged by hand
    (staging / "train-00007.array_record.tmp").write_bytes(b"left by a kill")
    capsys.readouterr()
    prep.prepare(prep.Settings(corpus[0], "bytes", **kw), "run", str(tmp_path))
    err = capsys.readouterr().err
    assert "resuming train: 1 complete shard(s) kept" in err and "redoing train shard 1" in err
    assert _files(run) == _files(tmp_path / "ref") and not staging.exists()
    # A complete dataset that lost a shard is repaired by the same command.
    meta = shards.read_metadata(str(run))
    os.remove(run / meta["splits"]["train"]["shards"][2]["file"])
    prep.prepare(prep.Settings(corpus[0], "bytes", **kw), "run", str(tmp_path))
    err = capsys.readouterr().err
    assert "repairing" in err and "2 complete shard(s) kept" in err
    assert _files(run) == _files(tmp_path / "ref")
    prep.prepare(prep.Settings(corpus[0], "bytes", **kw), "run", str(tmp_path))
    assert "already prepared" in capsys.readouterr().err
    with pytest.raises(ValueError, match="other settings .*shard_tokens"):
        _prepare(corpus[0], "bytes", tmp_path, "run", shard_tokens=999)


def test_corrupt_or_truncated_shard_fails_on_open(prepared, tmp_path):
    import shutil

    path = tmp_path / "copy"
    shutil.copytree(prepared / "bytes", path)
    shard = path / shards.read_metadata(str(path))["splits"]["train"]["shards"][1]["file"]
    blob = bytearray(shard.read_bytes())
    blob[len(blob) // 3] ^= 0xFF
    shard.write_bytes(bytes(blob))
    with pytest.raises(ValueError, match="is corrupt: its sha256") as e:
        shards.open_split(str(path), "train")
    assert str(shard) in str(e.value) and "\n" not in str(e.value)
    shards.open_split(str(path), "validation")  # other splits still open
    shard.write_bytes(bytes(blob[:100]))
    with pytest.raises(ValueError, match="truncated"):
        shards.open_split(str(path), "train", verify="size")


def test_a_data_dir_or_tokenizer_that_cannot_be_used_is_one_line_and_makes_nothing(tmp_path):
    (tmp_path / "t.txt").write_text("hello")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"^--data_dir=.*/file: cannot create .*/file/x: Not a"):
        _prepare(str(tmp_path / "t.txt"), "bytes", tmp_path / "file", "x")
    with pytest.raises(ValueError, match=r"^tokenizer file .*/none\.model does not exist$"):
        _prepare(str(tmp_path / "t.txt"), str(tmp_path / "none.model"), tmp_path / "out", "x")
    with pytest.raises(ValueError, match=r"^--max_documents=-1 must be >= 0 \(0: all\)$"):
        _prepare(str(tmp_path / "t.txt"), "bytes", tmp_path / "out", "x", max_documents=-1)
    assert not (tmp_path / "out").exists()  # refused before the output directory is made


def test_bad_sources_are_one_line(tmp_path):
    def fails(source, match, **kw):
        with pytest.raises(ValueError, match=match) as e:
            _prepare(source, "bytes", tmp_path / "out", "x", **kw)
        assert "\n" not in str(e.value)
        return str(e.value)

    fails(str(tmp_path / "nothing*.txt"), "matched no files")
    (tmp_path / "empty.txt").write_text("")
    fails(str(tmp_path / "empty.txt"), "has no non-empty documents")
    assert not (tmp_path / "out" / "x" / shards.METADATA).exists()
    (tmp_path / "k.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    assert fails(str(tmp_path / "k.jsonl"), "no key 'text'").startswith(f"{tmp_path}/k.jsonl:2:")
    (tmp_path / "j.jsonl").write_text('{"text": "a"}\n{oops\n')
    fails(str(tmp_path / "j.jsonl"), "j.jsonl:2: not valid JSON")
    (tmp_path / "n.jsonl").write_text('{"text": 5}\n')
    fails(str(tmp_path / "n.jsonl"), "is a int, not a string")
    (tmp_path / "x.csv").write_text("a,b\n")
    fails(str(tmp_path / "x.csv"), "unsupported file type")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "p.parquet")
    fails(str(tmp_path / "p.parquet"), "p.parquet: no column 'text'")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    fails(str(tmp_path / "bad.parquet"), "not a readable parquet file")
    (tmp_path / "t.txt").write_text("hello")
    (tmp_path / "garbage.json").write_text("[1, 2")
    with pytest.raises(ValueError, match="garbage.json does not load as an HF"):
        _prepare(str(tmp_path / "t.txt"), str(tmp_path / "garbage.json"), tmp_path / "o", "y")


def test_nested_text_key_and_tiny_corpus_splits(tmp_path):
    with open(tmp_path / "n.jsonl", "w") as f:
        for i in range(3):
            f.write(json.dumps({"meta": {"body": f"document {i}\n"}}) + "\n")
    meta = _prepare(str(tmp_path / "n.jsonl"), "bytes", tmp_path, "n", text_key="meta/body")
    assert {s: v["documents"] for s, v in meta["splits"].items()} == dict.fromkeys(prep.SPLITS, 1)


def test_shakespeare_max_documents(tmp_path):
    meta = _prepare("shakespeare", "bytes", tmp_path, "plays", max_documents=1)
    tok = tokenizers.ByteTokenizer()
    plays = corpora.play_files()
    for split in prep.SPLITS:
        first = next(n for n in plays if corpora.play_split(n) == split)
        want = corpora.markdown_to_text(plays[first].read_text(encoding="utf-8"))
        assert _split_docs(shards.open_split(str(tmp_path / "plays"), split), tok) == [want]
        assert meta["splits"][split]["documents"] == 1
    records = meta["splits"]["train"]["shards"][0]["records"]
    assert records == -(-meta["splits"]["train"]["tokens"] // 16_384)  # long plays are cut


def test_tfds_source_keeps_its_held_out_splits(data_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TFDS_DATA_DIR", data_dir)
    meta = _prepare("tfds:rope_shakespeare", "bytes", tmp_path, "plays", max_documents=2)
    config = data.default_config()
    config.name, config.data_dir = "shakespeare", data_dir
    for split in prep.SPLITS:
        want = [d.decode() for d in data.documents(config, split)][:2]
        got = _split_docs(shards.open_split(str(tmp_path / "plays"), split), byte_ids)
        assert got == want and meta["splits"][split]["documents"] == len(want)
    with pytest.raises(ValueError, match="tfds:rope_shakespeare: no feature 'body'"):
        _prepare("tfds:rope_shakespeare", "bytes", tmp_path, "x", text_key="body")
    with pytest.raises(ValueError, match="tfds:no_such_set: .*neither a shipped corpus"):
        _prepare("tfds:no_such_set", "bytes", tmp_path, "y")


def test_grain_window_dataset_and_pickle(prepared):
    path = str(prepared / "bpe")
    ds = shards.window_dataset(path, "train", 16).seed(0).shuffle().batch(4)
    batch = ds[1]
    assert {k: v.shape for k, v in batch.items()} == dict.fromkeys(
        ["inputs", "targets", "weights", "segment_ids", "positions", "target_bytes"], (4, 16)
    )
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    reader = shards.open_split(path, "validation")
    clone = pickle.loads(pickle.dumps(reader))
    np.testing.assert_array_equal(clone.window(0, 9), reader.window(0, 9))
    assert callable(data.ensure_built)  # the CLI module does not shadow the builder


@pytest.mark.slow
def test_kill_9_mid_preparation_then_the_same_command_gives_the_same_bytes(tmp_path):
    import glob
    import signal
    import time

    cmd = [sys.executable, "-m", "rope_jax.data.prepare", "--source=python_stdlib",
           "--tokenizer=bytes", "--name=lib", f"--data_dir={tmp_path / 'run'}",
           "--shard_tokens=300000", "--quiet"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    staging = tmp_path / "run" / "lib" / prep.STAGING
    deadline = time.time() + 120
    while len(glob.glob(str(staging / "train-*.json"))) < 3 and proc.poll() is None:
        assert time.time() < deadline, "no shard was written in 120 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # mid-run: a few shards complete, one half-written
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "run" / "lib" / shards.METADATA).exists()
    again = subprocess.run(cmd[:-1], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming train:" in again.stderr and "complete shard(s) kept" in again.stderr
    _prepare("python_stdlib", "bytes", tmp_path / "ref", "lib", shard_tokens=300000)
    assert _files(tmp_path / "run" / "lib") == _files(tmp_path / "ref" / "lib")


@pytest.mark.slow
def test_cli_subprocess(corpus, tmp_path):
    cmd = [sys.executable, "-m", "rope_jax.data.prepare", f"--source={corpus[0]}",
           "--tokenizer=bytes", "--name=cli", f"--data_dir={tmp_path}", "--workers=2"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "docs/s" in done.stderr and "tokens/s" in done.stderr
    assert shards.read_metadata(str(tmp_path / "cli"))["command"].endswith("--workers=2")
    bad = subprocess.run([*cmd[:3], "--source=/nonexistent/*.txt", *cmd[4:]],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert bad.returncode == 1 and bad.stderr.strip().splitlines() == [
        "error: --source='/nonexistent/*.txt' matched no files and is not a shipped corpus "
        "(shakespeare, python_stdlib, linux_source)"
    ]


def test_a_preparation_that_fails_before_its_work_leaves_nothing_behind(corpus, tmp_path):
    """A tokenizer file that does not load: before, DIR/NAME/.staging/settings.json and
    DIR/.NAME.lock stayed. A finished preparation leaves no lock file either."""
    broken = tmp_path / "tok" / "tokenizer.json"
    broken.parent.mkdir()
    broken.write_text('{"version": "1.0", "model": {')
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="does not load as an HF tokenizer.json"):
        _prepare(corpus[0], str(broken), out, "x")
    assert os.listdir(out) == []
    _prepare(corpus[0], "bytes", out, "x")
    assert os.listdir(out) == ["x"] and not os.path.exists(out / "x" / ".staging")


def test_a_waiter_takes_the_lock_again_when_the_holder_removed_its_file(tmp_path):
    """The holder removes DIR/.NAME.lock before letting go: the process that waited on
    the removed file must not go on beside a third that made the file anew."""
    import fcntl
    import threading

    from rope_jax.data.preparation import run

    path, said = str(tmp_path / ".x.lock"), []
    holder = open(path, "a")  # noqa: SIM115
    fcntl.flock(holder, fcntl.LOCK_EX)
    got = []
    waiter = threading.Thread(target=lambda: got.append(run._lock(path, said.append, "x")))
    waiter.start()
    deadline = time.time() + 10
    while not said and time.time() < deadline:
        time.sleep(0.01)
    os.remove(path)
    third = open(path, "a")  # noqa: SIM115  (a third process, started after the removal)
    fcntl.flock(third, fcntl.LOCK_EX)
    fcntl.flock(holder, fcntl.LOCK_UN)  # the waiter wakes on the removed file
    time.sleep(0.3)
    assert not got and waiter.is_alive()  # it waits for the third now
    fcntl.flock(third, fcntl.LOCK_UN)
    waiter.join(timeout=10)
    assert got and os.fstat(got[0].fileno()).st_ino == os.stat(path).st_ino
    assert len(said) == 1
    for f in (holder, third, got[0]):
        f.close()
