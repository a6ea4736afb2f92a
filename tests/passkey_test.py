"""Passkey retrieval (rope_jax.data.passkey): the examples, the training mix, the scoring."""

import jax.numpy as jnp
import numpy as np
import pytest

from configs import common
from rope_jax import data
from rope_jax.data import passkey
from rope_jax.harness import checks, metrics

FILLER = data.encode("Now is the winter of our discontent made glorious summer. " * 40)


def test_an_example_hides_the_key_at_its_depth_and_ends_with_the_digits():
    length = 128
    size = length + 1 - passkey.OVERHEAD
    for depth in (0, 17, size):
        x = passkey.example(FILLER, length, depth, "48213")
        assert x.shape == (length + 1,) and x.dtype == np.int32
        text = data.decode(x)
        assert text.index(" The pass key is #48213. ") == depth
        assert text.endswith(" What is the pass key? The pass key is #48213")
        assert text.replace(" The pass key is #48213. ", "").startswith(
            data.decode(FILLER[:size])[:10]
        )
    with pytest.raises(ValueError, match="at least"):
        passkey.example(FILLER, passkey.min_length() - 1, 0, "12345")
    with pytest.raises(ValueError, match="depth"):
        passkey.example(FILLER, length, size + 1, "12345")


def test_insert_is_fixed_by_seed_and_window_index_and_keeps_other_rows():
    rng = np.random.default_rng(0)
    window = rng.integers(0, 256, (6, 101)).astype(np.int32)
    indices = np.array([3, 9, 14, 2, 77, 40])
    same, rows = passkey.insert(window, indices, rate=0.0, seed=1)
    assert same is window and not rows.any()
    every, rows = passkey.insert(window, indices, rate=1.0, seed=1)
    assert rows.all()
    assert all(data.decode(row).endswith(data.decode(row)[-5:]) for row in every)
    for row in every:
        text = data.decode(row)
        key = text[-5:]
        assert key.isdigit() and f" The pass key is #{key}. " in text
    half, rows = passkey.insert(window, indices, rate=0.5, seed=1)
    changed = [not np.array_equal(a, b) for a, b in zip(half, window, strict=True)]
    assert 0 < sum(changed) < len(window) and changed == list(rows)
    # The same window index gives the same row, whatever batch it is in.
    again, _ = passkey.insert(window[::-1], indices[::-1], rate=0.5, seed=1)
    np.testing.assert_array_equal(again[::-1], half)
    other_seed, _ = passkey.insert(window, indices, rate=1.0, seed=2)
    assert not np.array_equal(other_seed, every)


def test_eval_batches_weight_only_the_answer_and_spread_the_depths():
    batches = list(passkey.eval_batches(FILLER, 100, 5, batch_size=4, seed=3))
    assert len(batches) == 2
    first, last = batches
    assert first["inputs"].shape == (4, 100) and first["targets"].shape == (4, 100)
    np.testing.assert_array_equal(first["weights"].sum(1), [5, 5, 5, 5])
    np.testing.assert_array_equal(last["weights"].sum(1), [5, 0, 0, 0])  # padding rows
    np.testing.assert_array_equal(last["task"], [0, -1, -1, -1])
    answers = [data.decode(b["targets"][r, -5:]) for b in batches for r in range(len(b["task"]))
               if b["task"][r] == 0]  # fmt: skip
    assert all(a.isdigit() and len(a) == 5 for a in answers)
    depths = [data.decode(b["inputs"][r]).index(" The pass key") for b in batches
              for r in range(4) if b["task"][r] == 0]  # fmt: skip
    assert depths == sorted(depths) and depths[0] == 0 and depths[-1] > 20
    again = list(passkey.eval_batches(FILLER, 100, 5, batch_size=4, seed=3))
    np.testing.assert_array_equal(again[0]["inputs"], first["inputs"])


def test_exact_match_accuracy_needs_every_digit():
    batch = next(passkey.eval_batches(FILLER, 80, 4, batch_size=4))
    logits = jnp.asarray(np.eye(data.VOCAB_SIZE, dtype=np.float32)[batch["targets"]])
    wrong = np.array(logits)
    wrong[1, -3] = np.roll(wrong[1, -3], 1)  # one digit of row 1 mispredicted
    wrong[2, 10] = np.roll(wrong[2, 10], 1)  # a filler token: not scored
    for got, want in ((logits, 1.0), (jnp.asarray(wrong), 0.75)):
        sums = metrics.eval_sums(got, batch["targets"], batch["weights"], batch["task"],
                                 num_tasks=1)  # fmt: skip
        out = metrics.summarize(jax_to_np(sums), ("passkey",))
        assert out["answer_accuracy"] == want and out["questions"] == 4


def jax_to_np(tree):
    return {k: np.asarray(v) for k, v in tree.items()}


def test_training_batches_carry_passkeys_and_resume_exactly(data_dir):
    config = common.base_config("tiny").data
    config.data_dir, config.seq_len, config.passkey_rate = data_dir, 96, 0.5
    config.passkey_weight = 10.0
    it = data.make_train_iterator(config, seed=0, batch_size=8)
    first = next(it)
    texts = [data.decode(row) for row in first["inputs"]]
    examples = np.array([" The pass key is #" in t for t in texts])
    assert 0 < examples.sum() < 8
    # Only the five answer targets of the examples weigh 10; the rest 1.
    weights = first["weights"]
    np.testing.assert_array_equal(weights[examples, -5:], 10.0)
    assert (weights[~examples] == 1).all() and (weights[:, :-5] == 1).all()
    np.testing.assert_array_equal(first["inputs"][:, 1:], first["targets"][:, :-1])
    state = it.get_state()
    following = next(it)
    resumed = data.make_train_iterator(config, seed=0, batch_size=8)
    resumed.set_state(state)
    np.testing.assert_array_equal(next(resumed)["inputs"], following["inputs"])


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"data.passkey_rate": 1.5}, "must be a number in"),
        ({"data.passkey_weight": 0.0}, "must be a number > 0"),
        ({"data.passkey_rate": 0.5, "data.seq_len": 32}, "needs data.seq_len >="),
        ({"data.passkey_rate": 0.5, "data.name": "digit_grids", "model.patch_dim": 16},
         "byte-level text"),
        ({"data.passkey_rate": 0.5, "data.tokenizer": "train:300"}, "byte-level text"),
    ],
)  # fmt: skip
def test_bad_passkey_settings_are_one_line_errors(changes, message):
    config = common.base_config("tiny")
    config.update_from_flattened_dict(changes)
    with pytest.raises(ValueError, match=message) as e:
        checks.check_config(config)
    assert "\n" not in str(e.value)


def test_passkey_evaluation_refuses_what_it_cannot_score():
    from configs import multimodal
    from rope_jax.harness import evals

    def check_passkey(config, lengths, examples):
        config = checks.resolve(config)
        evals.check(config, ["passkey"], lengths=lengths, examples=examples)

    text = common.base_config("tiny")
    check_passkey(text, [128, 1024], 10)  # fine
    for config, lens, n, message in (
        (text, [64], 10, "needs at least 70 tokens, got 64"),
        (text, [128], -1, "must be a number of examples"),
        (multimodal.get_config(), [128], 10, "needs byte-level text"),
    ):
        with pytest.raises(ValueError, match=message) as e:
            check_passkey(config, lens, n)
        assert "\n" not in str(e.value)
