"""Tests for rope_jax.data: corpora, tokenizer, Grain pipelines, error messages."""

import json
import pickle
import time

import jax
import numpy as np
import pytest

from rope_jax import data
from rope_jax.data import corpora, sources, splits
from tests.conftest import no_network

T = 64  # training context used throughout


def _config(**overrides):
    cfg = data.default_config()
    cfg.seq_len = T
    cfg.update(overrides)
    return cfg


def _names(builder):
    src = builder.as_data_source()
    return {s: [r["name"].decode() for r in src[s]] for s in corpora.SPLITS}, src


def _take(it, n):
    return [next(it) for _ in range(n)]


def _same(batches_a, batches_b):
    return all(
        np.array_equal(a[k], b[k]) for a, b in zip(batches_a, batches_b, strict=True) for k in a
    )


def _write_files(tmp_path, n):
    folder = tmp_path / "corpus"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(n):
        words = ["".join(rng.choice(list("abcdefghé "), size=30)) for _ in range(40)]
        (folder / f"doc{i:02d}.txt").write_text("\n".join(words) + "\n", encoding="utf-8")
    return str(folder / "*.txt")


# ---------------------------------------------------------------------------- corpora


def test_shakespeare_builds_split_by_whole_play(data_dir):
    names, src = _names(corpora.build_corpus("shakespeare", data_dir))
    assert [len(names[s]) for s in corpora.SPLITS] == [32, 3, 3]
    assert sorted(names["validation"]) == sorted(corpora.VALIDATION_PLAYS)
    assert sorted(names["test"]) == sorted(corpora.TEST_PLAYS)
    all_names = [n for s in corpora.SPLITS for n in names[s]]
    assert len(set(all_names)) == len(all_names) == 38  # no play in two splits
    assert set(all_names) == set(corpora.play_files())
    for split in corpora.SPLITS:
        for record in src[split]:
            text = record["text"].decode()
            assert len(text) > 50_000, record["name"]
            assert "**" not in text and "\\[" not in text and "\n# " not in text
    hamlet = next(r["text"].decode() for r in src["train"] if r["name"] == b"hamlet")
    assert "HAMLET:\nTo be, or not to be" in hamlet


def test_python_stdlib_builds_split_by_file(data_dir):
    names, src = _names(corpora.build_corpus("python_stdlib", data_dir))
    all_names = [n for s in corpora.SPLITS for n in names[s]]
    assert len(set(all_names)) == len(all_names) > 300
    assert all(names[s] for s in corpora.SPLITS)
    assert "os.py" in all_names and "json/decoder.py" in all_names
    for name in all_names:
        assert not {"test", "tests", "idle_test", "site-packages"} & set(name.split("/")[:-1])
        assert splits.by_name(name) in [s for s in corpora.SPLITS if name in names[s]]
    assert b"def " in src["validation"][0]["text"] or b"import" in src["validation"][0]["text"]


def test_tfds_name_of_a_prepared_dataset_uses_the_generic_path(data_dir):
    cfg = _config(name="rope_shakespeare", data_dir=data_dir, text_key="name")
    assert sorted(d.decode() for d in data.documents(cfg, "test")) == sorted(corpora.TEST_PLAYS)
    with pytest.raises(ValueError, match="text_key='nope'"):
        data.documents(_config(name="rope_shakespeare", data_dir=data_dir, text_key="nope"), "test")
    with pytest.raises(ValueError, match="split 'dev'.*available"):
        data.documents(_config(name="shakespeare", data_dir=data_dir), "dev")


# -------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_unicode():
    text = "To be, or not to be — naïve café, 数学, ∀x∈ℝ, 🎭\n\ttab"
    ids = data.encode(text)
    assert ids.dtype == np.int32 and ids.max() < 256 and len(ids) == len(text.encode())
    assert data.decode(ids) == text
    framed = data.encode(text, bos=True, eos=True)
    assert framed[0] == data.BOS_ID and framed[-1] == data.EOS_ID
    assert data.decode(framed) == text  # specials are dropped
    assert data.VOCAB_SIZE == 259 and data.PAD_ID < data.VOCAB_SIZE
    assert data.decode([0xE2, 0x82]) == "\ufffd"  # broken UTF-8 is replaced, not raised
    with pytest.raises(ValueError, match="token ids"):
        data.decode([data.VOCAB_SIZE])


# ----------------------------------------------------------------------------- train


def test_windows_are_stream_slices_shifted_by_one():
    tokens = np.arange(10, dtype=np.uint16)
    out = data.Windows(tokens, 4)(np.array([0, 2]))
    np.testing.assert_array_equal(out["inputs"], [[0, 1, 2, 3], [8, 9, 256, 256]])
    np.testing.assert_array_equal(out["targets"], [[1, 2, 3, 4], [9, 256, 256, 256]])
    np.testing.assert_array_equal(out["weights"], [[1, 1, 1, 1], [1, 0, 0, 0]])


def test_train_batches_shapes_dtypes_and_shift(data_dir):
    it = data.make_train_iterator(_config(data_dir=data_dir), seed=0, batch_size=4)
    for batch in _take(it, 3):
        assert set(batch) == {"inputs", "targets", "weights"}
        assert batch["inputs"].shape == batch["targets"].shape == batch["weights"].shape == (4, T)
        assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
        assert batch["weights"].dtype == np.float32 and np.all(batch["weights"] == 1)
        np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
        assert 0 <= batch["inputs"].min() and batch["inputs"].max() < data.VOCAB_SIZE


def test_train_is_deterministic_per_seed(data_dir):
    cfg = _config(data_dir=data_dir)
    first = _take(data.make_train_iterator(cfg, seed=3, batch_size=4), 3)
    again = _take(data.make_train_iterator(cfg, seed=3, batch_size=4), 3)
    other = _take(data.make_train_iterator(cfg, seed=4, batch_size=4), 3)
    assert _same(first, again)
    assert not _same(first, other)


def test_train_covers_every_window_each_epoch_in_a_new_order(tmp_path):
    cfg = _config(files=_write_files(tmp_path, 5), seq_len=16)
    tokens = data.token_stream(cfg, "train")
    n = (len(tokens) - 1) // 16
    windows = {tokens[i * 16 : i * 16 + 17].tobytes(): i for i in range(n)}
    assert len(windows) == n > 20  # random text: every window is unique
    it = data.make_train_iterator(cfg, seed=0, batch_size=1)

    def epoch():
        rows = [next(it) for _ in range(n)]
        full = [np.append(b["inputs"][0], b["targets"][0, -1]).astype(np.uint16) for b in rows]
        return [windows[w.tobytes()] for w in full]

    first, second = epoch(), epoch()
    assert sorted(first) == sorted(second) == list(range(n))
    assert first != second


def test_train_checkpoint_state_round_trip(data_dir):
    cfg = _config(data_dir=data_dir)
    it = data.make_train_iterator(cfg, seed=0, batch_size=2)
    start = it.get_state()
    _take(it, 3)
    state = it.get_state()
    assert state != start
    expected = _take(it, 4)
    for restored_state in (json.loads(json.dumps(state)), pickle.loads(pickle.dumps(state))):
        fresh = data.make_train_iterator(cfg, seed=0, batch_size=2)
        fresh.set_state(restored_state)
        assert _same(_take(fresh, 4), expected)


def test_prefetch_places_the_same_batches_and_checkpoints_the_consumed_position(data_dir):
    from rope_jax import harness, sharding

    cfg = _config(data_dir=data_dir)
    place = sharding.batch_sharding(sharding.make_mesh((1,), ("data",)))
    expected = _take(data.make_train_iterator(cfg, seed=0, batch_size=2), 7)
    it = data.make_train_iterator(cfg, seed=0, batch_size=2)
    batches = harness.Prefetch(it, place, size=2)
    try:
        got = [jax.device_get(b) for b in _take(batches, 3)]
        fourth = next(batches)
        assert isinstance(fourth["inputs"], jax.Array) and fourth["inputs"].shape == (2, T)
        state = batches.get_state()  # after 4 consumed, though the thread ran ahead
    finally:
        batches.close()
    assert _same(got, expected[:3])
    fresh = data.make_train_iterator(cfg, seed=0, batch_size=2)
    fresh.set_state(json.loads(json.dumps(state)))
    assert _same(_take(fresh, 3), expected[4:7])


def test_prefetch_raises_the_pipelines_error_in_the_consumer():
    from rope_jax import harness, sharding

    class Broken:
        def __init__(self):
            self.n = 0

        def get_state(self):
            return {"n": self.n}

        def __next__(self):
            self.n += 1
            if self.n == 3:
                raise ValueError("record 3 is corrupt")
            return {"x": np.full((2,), self.n, np.int32)}

    place = sharding.batch_sharding(sharding.make_mesh((1,), ("data",)))
    batches = harness.Prefetch(Broken(), place)
    assert [int(next(batches)["x"][0]) for _ in range(2)] == [1, 2]
    assert batches.get_state() == {"n": 2}
    for _ in range(2):  # raised again, not a hang
        with pytest.raises(ValueError, match="record 3 is corrupt"):
            next(batches)
    batches.close()


def test_train_process_shards_partition_the_global_batch(data_dir):
    cfg = _config(data_dir=data_dir)
    whole = next(data.make_train_iterator(cfg, seed=1, batch_size=4))
    parts = [
        next(data.make_train_iterator(cfg, seed=1, batch_size=2, process_index=p, process_count=2))
        for p in range(2)
    ]
    np.testing.assert_array_equal(np.concatenate([p["inputs"] for p in parts]), whole["inputs"])


# ------------------------------------------------------------------------------ eval


@pytest.mark.parametrize("seq_len", [T, 4 * T])
def test_eval_covers_split_once_in_order(data_dir, seq_len):
    cfg = _config(data_dir=data_dir)
    tokens = data.token_stream(cfg, "validation")
    ds = data.make_eval_iterator(cfg, split="validation", batch_size=32, seq_len=seq_len)
    batches = list(ds)
    assert all(b["inputs"].shape == (32, seq_len) for b in batches)
    weights = np.concatenate([b["weights"].reshape(-1) for b in batches])
    targets = np.concatenate([b["targets"].reshape(-1) for b in batches])
    assert weights.sum() == len(tokens) - 1
    np.testing.assert_array_equal(targets[weights == 1], tokens[1:])
    assert np.all(targets[weights == 0] == data.PAD_ID)
    assert _same(batches, list(ds))  # re-iterable and deterministic


def test_eval_num_batches_limits(data_dir):
    cfg = _config(data_dir=data_dir)
    ds = data.make_eval_iterator(cfg, split="test", batch_size=4, num_batches=3)
    assert len(list(ds)) == 3


# ----------------------------------------------------------------------- local files


def test_local_files_split_by_file(tmp_path):
    cfg = _config(files=_write_files(tmp_path, 6), seq_len=16)
    docs = {s: data.documents(cfg, s) for s in corpora.SPLITS}
    assert [len(docs[s]) for s in corpora.SPLITS] == [4, 1, 1]
    assert len({d for s in docs for d in docs[s]}) == 6
    assert next(data.make_train_iterator(cfg, seed=0, batch_size=2))["inputs"].shape == (2, 16)
    assert len(list(data.make_eval_iterator(cfg, split="validation", batch_size=2))) >= 1


def test_single_local_file_is_cut_90_5_5(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("".join(f"line {i}\n" for i in range(1000)), encoding="utf-8")
    cfg = _config(files=str(path))
    parts = [b"".join(data.documents(cfg, s)) for s in corpora.SPLITS]
    assert b"".join(parts) == path.read_bytes()
    assert len(parts[0]) > 8 * len(parts[1]) > 0 and len(parts[2]) > 0


def test_empty_glob_is_one_clear_line(tmp_path):
    cfg = _config(files=str(tmp_path / "nothing" / "*.txt"))
    with pytest.raises(data.DataSourceError, match="matched no files") as err:
        data.make_train_iterator(cfg, seed=0, batch_size=2)
    assert "nothing" in str(err.value) and "\n" not in str(err.value)


# ----------------------------------------------------------------------------- TFDS


def test_missing_tfds_dataset_fails_fast(tmp_path):
    cfg = _config(name="lm1b", data_dir=str(tmp_path))
    start = time.perf_counter()
    with no_network(), pytest.raises(ValueError, match="lm1b") as err:
        data.make_train_iterator(cfg, seed=0, batch_size=2)
    assert time.perf_counter() - start < 5
    message = str(err.value)
    assert str(tmp_path) in message and "download_and_prepare" in message
    assert "\n" not in message
    assert not (tmp_path / "lm1b").exists()


def test_unknown_dataset_name_is_one_clear_line(tmp_path):
    cfg = _config(name="no_such_corpus_xyz", data_dir=str(tmp_path))
    with pytest.raises(data.DataSourceError, match="no_such_corpus_xyz") as err:
        data.ensure_built(cfg)
    assert "\n" not in str(err.value) and "shakespeare" in str(err.value)


def test_bad_arguments_name_the_field(data_dir):
    cfg = _config(data_dir=data_dir, seq_len=0)
    with pytest.raises(ValueError, match="data.seq_len"):
        data.make_train_iterator(cfg, seed=0, batch_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        data.make_eval_iterator(_config(data_dir=data_dir), split="test", batch_size=0)
    assert isinstance(sources.describe(cfg), str)


def test_a_binary_file_is_a_warning_with_the_count_of_replaced_bytes(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"plain text \xff\xfe more\n" * 3 + "ok \ufffd\n".encode())
    config = data.default_config()
    config.files = str(path)
    with pytest.warns(UserWarning, match=r"a\.txt is not valid UTF-8.*: 6 invalid byte"):
        docs = data.documents(config, "train")
    assert "\ufffd" in b"".join(docs).decode()


def test_eval_sample_spread_takes_windows_through_the_whole_split(tmp_path):
    cfg = _config(files=_write_files(tmp_path, 30), seq_len=16)
    batches = list(data.make_eval_iterator(cfg, split="train", batch_size=2))
    every = np.concatenate([b["inputs"] for b in batches])
    n = int(sum((b["weights"].sum(axis=1) > 0).sum() for b in batches))  # not the padding
    kw = dict(split="train", batch_size=2, num_batches=3)
    first = np.concatenate([b["inputs"] for b in data.make_eval_iterator(cfg, **kw)])
    spread = np.concatenate([b["inputs"] for b in data.make_eval_iterator(cfg, spread=True, **kw)])
    assert n > 60 and first.shape == spread.shape == (6, 16)
    np.testing.assert_array_equal(first, every[:6])  # the default: the split's beginning
    np.testing.assert_array_equal(spread, every[np.arange(6) * n // 6])  # evenly through it
    assert not np.array_equal(first, spread)


@pytest.mark.slow
def test_two_processes_needing_the_same_corpus_build_it_once(tmp_path):
    """Two eval.py started together on a fresh machine once both built the shipped corpus
    and one died in TFDS's rename (a 43-line FileExistsError); now the second waits for the
    first's build and then reads it."""
    import subprocess
    import sys

    code = ("import sys; from rope_jax import data; from configs import lm; "
            "c = lm.get_config(); c.data.data_dir = sys.argv[1]; "
            "data.ensure_built(c.data)")  # fmt: skip
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-500:] for _, err in outs]
    built = [out for out, _ in outs if "built the rope_shakespeare dataset once" in out]
    assert len(built) == 1, outs
    assert any("waiting for another process building data" in out for out, _ in outs)
