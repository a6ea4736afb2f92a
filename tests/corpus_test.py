"""Training on prepared corpora: kinds, vocabularies, packing, process shards, bits/byte.

One small corpus of short documents (so windows cross document boundaries) in .txt
files, read raw and prepared (bytes and a BPE trained here); the end-to-end runs
through train.py / eval.py are `slow`.
"""

import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

import rope_jax.data.preparation as prep
from configs import lm
from rope_jax import data
from rope_jax.data import packing, prepared, shards, tokenizers
from rope_jax.harness import checkpoint, checks, flops, runfiles, setup
from rope_jax.harness.evaluate import evaluate_checkpoint, generate_text
from rope_jax.harness.loop import train_and_evaluate
from rope_jax.nn import model as model_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T = 32
# The models that run here are 1-layer D = 32 decoders: the data and its tokenizer are the
# point, and a smaller model compiles sooner.
SMALL = {"model.num_layers": 1, "model.embed_dim": 32, "model.num_heads": 2,
         "model.num_kv_heads": 1, "model.head_dim": 16, "model.mlp_dim": 64}  # fmt: skip
SMALL_FLAGS = [f"--config.{k}={v}" for k, v in SMALL.items()]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A glob of 60 .txt documents of 3-60 bytes (multi-byte characters included)."""
    root = tmp_path_factory.mktemp("docs")
    rng = np.random.default_rng(1)
    words = "the of naïve café 日本 ∀x def return to be or not".split()
    for i in range(60):
        n = int(rng.integers(1, 9))
        (root / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words, n)) + "\n", "utf-8")
    return str(root / "*.txt")


@pytest.fixture(scope="module")
def data_root(corpus, tmp_path_factory):
    """DIR with NAME = bytes and bpe (a BPE of at most 400 ids trained on the train split)."""
    out = tmp_path_factory.mktemp("prepared")
    for name, tok in (("bytes", "bytes"), ("bpe", "train:400")):
        settings = prep.Settings(source=corpus, tokenizer=tok, shard_tokens=300, record_tokens=40)
        prep.prepare(settings, name, str(out), progress=False)
    return str(out)


def _config(data_root, name, **data_fields):
    config = lm.get_config("size=tiny")
    config.data.name, config.data.data_dir, config.data.seq_len = name, data_root, T
    config.data.global_batch_size = 4
    config.eval.batch_size = 4
    for key, value in data_fields.items():
        config.data[key] = value
    return config


# ------------------------------------------------------------------------------ kinds


def test_named_dataset_is_prepared_and_raw_files_are_text(data_root, corpus):
    config = _config(data_root, "bpe")
    kind = data.kind(config.data)
    assert kind.name == "prepared" and kind.path == os.path.join(data_root, "bpe")
    assert kind.tokenizer().name == shards.read_metadata(kind.path)["tokenizer"]["name"]
    raw = _config(data_root, "", files=corpus)
    assert data.kind(raw.data).name == "text" and data.kind(raw.data).vocab_size == 259
    auto = _config(data_root, "", files=corpus, tokenizer="train:300")
    path = data.kind(auto.data).path
    assert path.startswith(os.path.join(data_root, prepared.AUTO_DIR, "files-bpe300-"))
    assert data.kind(_config(data_root, "", files=corpus, tokenizer="train:301").data).path != path


def test_vocab_follows_the_tokenizer_and_a_hand_set_mismatch_is_one_line(data_root):
    config = _config(data_root, "bpe")
    want = shards.read_metadata(os.path.join(data_root, "bpe"))["tokenizer"]["vocab_size"]
    assert checks.settle_vocab(config).model.vocab_size == want != 259
    config = _config(data_root, "bpe")
    config.model.vocab_size = 300
    with pytest.raises(ValueError, match=rf"model.vocab_size=300 does not match .* \({want} ids\)"):
        setup.build(config)
    assert checks.settle_vocab(_config(data_root, "bytes")).model.vocab_size == 259


def test_a_tokenizer_beside_a_prepared_dataset_must_be_its_own(data_root, tmp_path):
    other = tokenizers.train_bpe(["some other text entirely"] * 5, 270)
    other.save(str(tmp_path / "tok"))
    config = _config(data_root, "bpe", tokenizer=str(tmp_path / "tok"))
    with pytest.raises(
        data.DataSourceError, match="is not the tokenizer of .*leave data.tokenizer"
    ):
        checks.check_config(config)
    own = os.path.join(data_root, "bpe", shards.TOKENIZER_DIR)
    checks.check_config(_config(data_root, "bpe", tokenizer=own))  # its own: fine
    with pytest.raises(data.DataSourceError, match="prepare it first"):
        data.kind(_config(data_root, "no_such_tfds_name", tokenizer="train:300").data)


def test_a_tokenizer_file_that_does_not_load_fails_before_preparing(corpus, tmp_path):
    (tmp_path / "garbage.json").write_text("[1, 2")
    config = _config(str(tmp_path), "", files=corpus, tokenizer=str(tmp_path / "garbage.json"))
    with pytest.raises(data.DataSourceError, match="garbage.json does not load as an HF") as e:
        data.ensure_built(config.data)
    assert "\n" not in str(e.value)
    assert not os.path.exists(os.path.join(data.kind(config.data).path, shards.METADATA))


def test_checkpoints_refuse_data_with_another_tokenizer(data_root, tmp_path):
    workdir = str(tmp_path)
    bpe = data.kind(_config(data_root, "bpe").data).tokenizer()
    runfiles.save_tokenizer(workdir, bpe)
    (tmp_path / runfiles.CONFIG_FILE).write_text("{}")
    runfiles.check_tokenizer(workdir, bpe)
    assert runfiles.load_tokenizer(workdir).name == bpe.name
    with pytest.raises(checkpoint.CheckpointError, match=r"trained with tokenizer bpe400-.* bytes"):
        runfiles.check_tokenizer(workdir, tokenizers.ByteTokenizer())


def test_missing_split_and_unprepared_dataset_are_one_line(data_root, tmp_path):
    config = _config(data_root, "bpe", eval_split="dev")
    with pytest.raises(data.DataSourceError, match=r"'dev' are not in .*validation"):
        checks.check_config(config)
    os.makedirs(tmp_path / "half" / ".staging")
    with pytest.raises(data.DataSourceError, match="not a prepared dataset.*rerun the same"):
        checks.settle_vocab(_config(str(tmp_path), "half"))


def test_a_shard_changed_after_its_first_check_fails_on_open(data_root, tmp_path):
    path = tmp_path / "copy"
    shutil.copytree(os.path.join(data_root, "bytes"), path)
    prepared.open_split(str(path), "train")  # hashed once; the verdict kept
    assert (path / prepared.VERIFIED).is_file()
    shard = path / shards.read_metadata(str(path))["splits"]["train"]["shards"][0]["file"]
    blob = bytearray(shard.read_bytes())
    blob[len(blob) // 2] ^= 0x01  # same size, new mtime: hashed again
    shard.write_bytes(bytes(blob))
    with pytest.raises(data.DataSourceError, match="is corrupt: its sha256") as e:
        prepared.open_split(str(path), "train")
    assert "\n" not in str(e.value)
    shard.write_bytes(bytes(blob[:50]))
    with pytest.raises(data.DataSourceError, match="truncated"):
        prepared.open_split(str(path), "train")


# ---------------------------------------------------------------------------- batches


def test_stream_packing_restarts_after_every_eos():
    eos = 9
    inputs = np.array([[5, 6, eos, 7, eos, eos, 1, 2], [3, eos, 4, 4, 4, 0, 0, 0]])
    valid = np.array([[1] * 8, [1] * 5 + [0] * 3], bool)
    out = packing.from_stream(inputs, valid, eos)
    np.testing.assert_array_equal(
        out["segments"], [[1, 1, 1, 2, 2, 3, 4, 4], [1, 1, 2, 2, 2, 0, 0, 0]]
    )
    np.testing.assert_array_equal(
        out["positions"][..., 0], [[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 0, 1, 2, 0, 0, 0]]
    )
    assert out["positions"].shape == (2, 8, 1) and out["positions"].dtype == np.float32


@pytest.mark.parametrize("source", [pytest.param("prepared", marks=pytest.mark.slow), "raw"])
def test_packed_rows_give_the_logits_of_their_documents_run_alone(data_root, corpus, source):
    fields = dict(packing="documents")
    config = (_config(data_root, "bytes", **fields) if source == "prepared"
              else _config(data_root, "", files=corpus, **fields))  # fmt: skip
    config.update_from_flattened_dict(SMALL)
    batch = next(data.make_train_iterator(config.data, seed=0, batch_size=2))
    assert int(batch["segments"].max()) >= 2  # rows hold several documents
    net = model_lib.Decoder(config.model, rngs=nnx.Rngs(0))
    forward = nnx.jit(lambda net, tokens, pos, seg: net(tokens, pos, segments=seg))
    packed = forward(net, batch["inputs"], batch["positions"], batch["segments"])
    alone = nnx.jit(lambda net, tokens: net(tokens))  # one shape: [1, T]
    for row in range(2):
        for seg in np.unique(batch["segments"][row]):
            where = np.flatnonzero(batch["segments"][row] == seg)
            assert batch["positions"][row, where[0], 0] == 0
            doc = np.zeros((1, T), np.int32)  # the document first, then padding, which a
            doc[0, : len(where)] = batch["inputs"][row, where]  # causal model cannot see
            logits = alone(net, doc)[0, : len(where)]
            np.testing.assert_allclose(packed[row, where], logits, atol=3e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["bpe", "raw"])
def test_two_processes_read_disjoint_halves_of_every_global_batch(data_root, corpus, name):
    config = _config(data_root, name) if name != "raw" else _config(data_root, "", files=corpus)
    config.data.packing = "documents"
    make = lambda i, n: data.make_train_iterator(
        config.data, seed=3, batch_size=4 // n, process_index=i, process_count=n
    )
    one, halves = make(0, 1), [make(0, 2), make(1, 2)]
    for _ in range(3):
        whole, parts = next(one), [next(it) for it in halves]
        for key in whole:
            np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), whole[key])
    for it in halves:  # each process's iterator resumes bit-exactly from its own state
        state = json.loads(json.dumps(it.get_state()))
        ahead = [next(it) for _ in range(2)]
        again = make(halves.index(it), 2)
        again.set_state(state)
        for want in ahead:
            got = next(again)
            for key in want:
                np.testing.assert_array_equal(got[key], want[key])


def test_eval_scores_every_utf8_byte_of_a_split_once(data_root, corpus):
    """Every byte but those of the stream's first token (never a target) is scored once."""
    for name in ("bpe", "bytes"):
        config = _config(data_root, name)
        total = 0
        for batch in data.make_eval_iterator(config.data, split="validation", batch_size=4):
            total += int((batch["target_bytes"] * batch["weights"]).sum())
        path = os.path.join(data_root, name)
        first = int(shards.open_split(path, "validation").read(0, 1)["bytes"][0])
        assert total == shards.read_metadata(path)["splits"]["validation"]["bytes"] - first
        assert first >= 1 and (first > 1) == (name == "bpe")
    raw = _config(data_root, "", files=corpus)
    docs = data.documents(raw.data, "validation")
    batches = data.make_eval_iterator(raw.data, split="validation", batch_size=4)
    assert (
        sum(int((b["target_bytes"] * b["weights"]).sum()) for b in batches)
        == sum(len(d) for d in docs) - 1
    )


def test_bits_per_byte_is_total_nats_over_total_bytes():
    from rope_jax.harness import metrics

    sums = {"loss_sum": 30.0, "weight_sum": 10.0, "correct_sum": 0.0, "byte_sum": 40.0}
    out = metrics.summarize(sums)
    assert out["loss"] == 3.0 and out["bits_per_byte"] == pytest.approx(30 / 40 / math.log(2))
    assert "bits_per_byte" not in metrics.summarize({**sums, "byte_sum": 0.0})


# ---------------------------------------------------------------------- end to end


def _run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True)


@pytest.mark.slow
def test_train_and_eval_on_a_prepared_bpe_corpus_report_bits_per_byte(
    data_root, corpus, tmp_path, capsys
):
    """train.py and eval.py on the BPE corpus: bits per byte over every byte of the split;
    the run evaluated on another dataset of its tokenizer, and decoding with it, are
    eval.py's library calls in-process; data of another tokenizer is refused."""
    workdir = str(tmp_path / "run")
    flags = ["--config.data.name=bpe", f"--config.data.data_dir={data_root}",
             f"--config.data.seq_len={T}", "--config.data.global_batch_size=4",
             "--config.train.num_steps=4", "--config.train.eval_every_steps=0",
             "--config.eval.batch_size=4", "--config.eval.num_batches=0", *SMALL_FLAGS]  # fmt: skip
    proc = _run("train.py", "--config=configs/lm.py:size=tiny", f"--workdir={workdir}", *flags)
    assert proc.returncode == 0, proc.stderr[-2000:]
    saved = runfiles.load_config(workdir)
    tok = runfiles.load_tokenizer(workdir)
    assert saved.model.vocab_size == tok.vocab_size and tok.name.startswith("bpe400-")
    final = [r for r in _records(workdir) if "eval/bits_per_byte" in r][-1]
    path = os.path.join(data_root, "bpe")
    first = int(shards.open_split(path, "validation").read(0, 1)["bytes"][0])
    assert (
        final["eval/bytes"] == shards.read_metadata(path)["splits"]["validation"]["bytes"] - first
    )
    proc = _run("eval.py", f"--workdir={workdir}", "--num_batches=0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(open(os.path.join(workdir, "eval_4.json")).read())[str(T)]
    assert result["bits_per_byte"] == pytest.approx(final["eval/bits_per_byte"], rel=1e-6)
    # another dataset with the run's tokenizer (a part of the corpus): --data, --data_dir
    part = str(tmp_path / "parts")
    prep.prepare(prep.Settings(source=corpus.replace("*.txt", "doc[0-3]*.txt"),
                               tokenizer=os.path.join(path, "tokenizer"), shard_tokens=300,
                               record_tokens=40, held_out_percent=30), "part", part,
                 progress=False)  # fmt: skip
    # (eval.py's --data/--data_dir/--tag: in-process, as the rest below; eval.py ran above)
    evaluate_checkpoint(workdir, num_batches=0, data_name="part", data_dir=part, tag="part")
    other = json.loads(open(os.path.join(workdir, "eval_4_part.json")).read())
    meta = shards.read_metadata(os.path.join(part, "part"))["splits"]["validation"]
    first = int(shards.open_split(os.path.join(part, "part"), "validation").read(0, 1)["bytes"][0])
    assert other[str(T)]["bytes"] == meta["bytes"] - first != result["bytes"]
    assert other["settings"]["data"] == {"name": "part", "data_dir": part}
    # data with another tokenizer: refused in one line (a ValueError: eval.py and train.py
    # print it as their one line), nothing written; checked in-process
    with pytest.raises(checkpoint.CheckpointError, match="trained with tokenizer bpe400-") as e:
        evaluate_checkpoint(workdir, data_name="bytes", tag="bytes")
    assert "\n" not in str(e.value) and not os.path.exists(f"{workdir}/eval_4_bytes.json")
    capsys.readouterr()
    text = generate_text(workdir, prompt="the", max_new_tokens=5)  # eval.py --generate's
    assert text.startswith("the") and capsys.readouterr().out.startswith(text)
    # the same workdir trained on data with another tokenizer: refused the same way
    config = _config(data_root, "bytes")
    config.update_from_flattened_dict(SMALL)
    config.train.num_steps, config.train.eval_every_steps, config.eval.num_batches = 4, 0, 0
    before = _records(workdir)
    with pytest.raises(checkpoint.CheckpointError, match="trained with tokenizer bpe400-") as e:
        train_and_evaluate(config, workdir)
    assert "\n" not in str(e.value) and _records(workdir) == before


@pytest.mark.slow
def test_a_raw_corpus_with_a_tokenizer_is_prepared_once_then_trained(corpus, tmp_path):
    flags = ["--config=configs/lm.py:size=tiny", f"--config.data.files={corpus}",
             "--config.data.tokenizer=train:300", f"--config.data.data_dir={tmp_path}",
             f"--config.data.seq_len={T}", "--config.data.global_batch_size=4",
             "--config.train.num_steps=2", "--config.eval.batch_size=4", *SMALL_FLAGS]  # fmt: skip
    first = _run("train.py", f"--workdir={tmp_path / 'a'}", *flags)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "prepare: wrote" in first.stderr
    saved = runfiles.load_config(str(tmp_path / "a"))
    assert saved.data.tokenizer == "train:300" and saved.model.vocab_size <= 300
    path = data.kind(saved.data).path  # the same config finds it complete: nothing redone
    stamp = os.path.getmtime(os.path.join(path, shards.METADATA))
    data.ensure_built(saved.data)
    assert os.path.getmtime(os.path.join(path, shards.METADATA)) == stamp


def _records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# ------------------------------------------------------------------------- the split


def _prepared_documents(path: str, split: str) -> list[str]:
    """The documents of a prepared split, decoded with the dataset's tokenizer."""
    stream = prepared.open_split(path, split)
    tokens = stream.read(0, len(stream))["tokens"]
    tok = prepared.tokenizer(path)
    ends = np.flatnonzero(tokens == tok.eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tok.decode(tokens[a:b].tolist()) for a, b in zip(starts, ends, strict=True)]


@pytest.mark.parametrize("split", ["validation", "test", "train"])
def test_the_same_files_hold_out_the_same_documents_whatever_the_tokenizer(
    data_root, corpus, split
):
    raw = [
        d.decode("utf-8") for d in data.documents(_config(data_root, "", files=corpus).data, split)
    ]
    assert raw and (split == "train" or len(raw) < 10)  # 60 documents: 1% each, at least one
    for name in ("bytes", "bpe"):  # prepared with --tokenizer=bytes and train:400
        assert sorted(_prepared_documents(os.path.join(data_root, name), split)) == sorted(raw)


def test_one_file_is_cut_the_same_way_raw_and_prepared(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("".join(f"line {i} é\n" for i in range(400)), encoding="utf-8")
    settings = prep.Settings(source=str(path), tokenizer="bytes", shard_tokens=3000)
    prep.prepare(settings, "one", str(tmp_path / "out"), progress=False)
    config = _config(str(tmp_path / "out"), "", files=str(path))
    for split in ("train", "validation", "test"):
        raw = [d.decode("utf-8") for d in data.documents(config.data, split)]
        assert len(raw) == 1 and raw == _prepared_documents(str(tmp_path / "out" / "one"), split)


@pytest.mark.slow  # compiles the step
def test_the_dry_run_counts_the_head_of_the_data_s_vocabulary(data_root):
    config = _config(data_root, "bpe")
    config.update_from_flattened_dict(SMALL)
    report = setup.dry_run(config)
    settled = checks.settle_vocab(config)
    assert settled.model.vocab_size != data.VOCAB_SIZE == config.model.vocab_size
    assert report["flops_per_token"] == flops.flops_per_token(settled)
