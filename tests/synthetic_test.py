"""RULER's tasks in training (`data.synthetic_tasks`): checks, windows, weights."""

import re

import numpy as np
import pytest

from configs import lm
from rope_jax import data, ruler
from rope_jax.data import synthetic, tokenizers
from rope_jax.harness import checks


def config(**overrides):
    c = lm.get_config("size=tiny")
    c.data.seq_len = 256
    c.data.synthetic_tasks = ("niah_single_1", "vt", "niah_single_2")
    c.data.synthetic_rate, c.data.synthetic_weight = 0.5, 10.0
    c.data.task_template = "short"
    c.update_from_flattened_dict(overrides)
    return c


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"data.synthetic_tasks": ("niah_singel_1",)}, "'niah_singel_1' is not one of"),
        ({"data.synthetic_tasks": "vt"}, "must be a tuple of task names"),
        ({"data.synthetic_rate": 1.5}, r"synthetic_rate=1.5 must be a number in \[0, 1\]"),
        ({"data.synthetic_tasks": ()}, "synthetic_rate=0.5 needs data.synthetic_tasks"),
        ({"data.synthetic_weight": 0.0}, "synthetic_weight=0.0 must be a number > 0"),
        ({"data.task_template": "long"}, "data.task_template='long' is not one of"),
    ],
)
def test_the_mix_is_checked_in_one_line(overrides, message):
    c = config()
    with c.ignore_type():
        c.update_from_flattened_dict(overrides)
    with pytest.raises(ValueError, match=message) as e:
        checks.check_config(c)
    assert "\n" not in str(e.value)


def test_a_task_that_does_not_fit_the_window_is_refused_before_training(data_dir):
    c = config(**{"data.synthetic_tasks": ("niah_multiquery",), "data.data_dir": data_dir})
    with pytest.raises(ValueError, match="niah_multiquery: length 256 is too short") as e:
        data.make_train_iterator(checks.resolve(c).data, seed=0, batch_size=4)
    assert "\n" not in str(e.value)


def test_training_windows_hold_examples_with_weighted_answers_fixed_by_seed_and_index(data_dir):
    c = checks.resolve(config(**{"data.data_dir": data_dir}))
    first = next(iter(data.make_train_iterator(c.data, seed=3, batch_size=16)))
    again = next(iter(data.make_train_iterator(c.data, seed=3, batch_size=16)))
    other = next(iter(data.make_train_iterator(c.data, seed=4, batch_size=16)))
    for key in first:
        np.testing.assert_array_equal(first[key], again[key])
    assert not np.array_equal(first["inputs"], other["inputs"])
    weights = first["weights"]
    rows = np.flatnonzero((weights == 10.0).any(axis=1))
    assert 2 <= len(rows) <= 14  # rate 0.5 of 16 rows
    tok = tokenizers.ByteTokenizer()
    ends = []
    for b in rows:
        answer = first["targets"][b][weights[b] == 10.0]
        # the answer targets end the example and hold its values; an EOS follows, then
        # text, unless the example fills the window
        end = np.flatnonzero(weights[b] == 10.0)[-1]
        assert np.all(weights[b][np.flatnonzero(weights[b] == 10.0)[0] : end + 1] == 10.0)
        ends.append(end)
        text = tok.decode(answer.tolist())
        prompt = tok.decode(first["inputs"][b][: end + 1].tolist())
        values = re.findall(r"[A-Za-z0-9-]+", text)
        assert values and all(v in prompt for v in values)
        specials = np.isin(first["inputs"][b], [tok.pad_id, tok.eos_id, tok.bos_id])
        assert not specials[: end + 1].any()
        if end < weights.shape[1] - 1:
            assert first["targets"][b][end + 1] == tok.eos_id and specials.sum() == 1
    # the answers land at many places, the window's end not the only one
    assert len(set(ends)) >= len(rows) // 2 and min(ends) < weights.shape[1] - 1
    plain = np.setdiff1d(np.arange(16), rows)
    assert set(np.unique(weights[plain])) <= {1.0}


def test_a_mix_row_equals_the_generator_training_window():
    tok = tokenizers.ByteTokenizer()
    text = np.asarray(tok.encode("Some text. " * 100), np.int32)
    mix = synthetic.Mix(("vt",), 1.0, 5.0, 7, tok, "short")
    window = np.zeros((2, 257), np.int32)
    out, answer = mix.insert(window, np.stack([text, text]), np.array([11, 12]))
    rng = np.random.default_rng([7, 11, synthetic.SALT])
    rng.random(), rng.integers(1)
    size = int(rng.integers(128, 257))
    ids, mask = ruler.training_window("vt", length=size, index=0, seed=int(rng.integers(2**31)),
                                      tokenizer=tok, haystack=text, template="short")  # fmt: skip
    n = size + 1
    np.testing.assert_array_equal(out[0, :n], ids)
    np.testing.assert_array_equal(answer[0, :n], mask)
    assert not answer[0, n:].any()
    if n < 257:  # an EOS, then the row's own text (zeros here)
        assert out[0, n] == tok.eos_id and not out[0, n + 1 :].any()
    assert not np.array_equal(out[0], out[1])


def test_an_example_that_does_not_fit_its_drawn_size_takes_the_whole_window():
    tok = tokenizers.ByteTokenizer()
    text = np.asarray(tok.encode("Some text. " * 100), np.int32)
    kw = dict(seed=3, tokenizer=tok, haystack=text, template="short")
    ids, mask = synthetic.example("niah_single_1", 40, 256, **kw)
    whole = ruler.training_window("niah_single_1", length=256, index=0, **kw)
    np.testing.assert_array_equal(ids, whole[0])
    np.testing.assert_array_equal(mask, whole[1])
    assert len(synthetic.example("niah_single_1", 200, 256, **kw)[0]) == 201
