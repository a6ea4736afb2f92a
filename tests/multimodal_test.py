"""Tests for the multimodal digit data (rope_jax.data.digits, rope_jax.data.multimodal).

Answers are checked independently: every patch is mapped back to its 8x8 digit in the
raw splits, the question text is parsed, and the answer is recomputed from the labels.
"""

import dataclasses
import json
import re

import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.datasets import load_digits

from configs import common
from configs import multimodal as mm_config
from rope_jax import data, harness, layouts
from rope_jax.data import digits, multimodal
from rope_jax.data.byte_ids import PAD_ID
from rope_jax.experiments import plan
from rope_jax.harness import metrics

DIGIT_SPLITS = ("train", "validation", "test")
SPLITS = ("train", "validation", "test", "larger", "aspect", "long_prefix")
HELD_OUT = ("test", "larger", "aspect", "long_prefix")
IMAGE_TASKS = ("lookup_after", "lookup_before", "read", "compare")
VIDEO_TASKS = ("video_lookup", "video_lookup_before")
FAMILY = {False: "digit_grids", True: "digit_videos"}
PER_SPLIT = {False: 800, True: 400}  # generated examples per split: ~200 per task
B = 4  # batch rows


def _config(data_dir, *, video=False, arg="", **overrides):
    config = mm_config.get_config(f"video={str(video).lower()}" + (f",{arg}" if arg else ""))
    config.data.data_dir = data_dir
    config.update_from_flattened_dict(overrides)
    return config


@pytest.fixture(scope="module")
def raw():
    d = load_digits()
    return d.images.astype(np.uint8), d.target.astype(np.int64)


@pytest.fixture(scope="module")
def source_of(data_dir, raw):
    """Image bytes -> (digits split, label): the label from the raw sklearn digits, the
    split whose images hold it."""
    images, labels = raw
    label_of = {img.tobytes(): int(lab) for img, lab in zip(images, labels, strict=True)}
    assert len(label_of) == len(images)  # sklearn's digits have no exact duplicate images
    out = {}
    for split in DIGIT_SPLITS:
        for img in digits.load_split(data_dir, split)[0]:
            out[img.tobytes()] = (split, label_of[img.tobytes()])
    assert len(out) == len(images)
    return out


# ---------------------------------------------------------------------------- digits


def test_digit_splits_partition_sklearn_digits(data_dir, raw):
    images, labels = raw
    builder = digits.build(data_dir)
    seen = {}
    for split in DIGIT_SPLITS:
        src = builder.as_data_source(split=split)
        indices = []
        for i in range(len(src)):
            record = src[i]
            index = int(record["index"])
            np.testing.assert_array_equal(np.asarray(record["image"]), images[index])
            assert int(record["label"]) == labels[index]
            assert digits.split_of(index) == split
            indices.append(index)
        assert len(set(indices)) == len(indices)
        seen[split] = sorted(indices)
        # load_split: the same images and labels, ordered by index.
        imgs, labs = digits.load_split(data_dir, split)
        np.testing.assert_array_equal(imgs, images[seen[split]])
        np.testing.assert_array_equal(labs, labels[seen[split]])
    union = [i for s in DIGIT_SPLITS for i in seen[s]]
    assert sorted(union) == list(range(len(images))) == list(range(1797))
    fractions = {s: len(seen[s]) / len(images) for s in DIGIT_SPLITS}
    assert 0.64 <= fractions["train"] <= 0.76, fractions
    assert 0.12 <= fractions["validation"] <= 0.18, fractions
    assert 0.12 <= fractions["test"] <= 0.18, fractions
    # As multisets of (image, label) too, independently of the stored index.
    stored = sorted(
        (img.tobytes(), int(lab))
        for s in DIGIT_SPLITS
        for img, lab in zip(*digits.load_split(data_dir, s), strict=True)
    )
    assert stored == sorted(
        (img.tobytes(), int(lab)) for img, lab in zip(images, labels, strict=True)
    )


def test_load_split_arrays(data_dir):
    for split in DIGIT_SPLITS:
        images, labels = digits.load_split(data_dir, split)
        assert images.dtype == np.uint8 and images.shape[1:] == (8, 8)
        assert labels.dtype == np.int64 and labels.shape == images.shape[:1]
        assert images.min() == 0 and images.max() == 16
        assert set(np.unique(labels)) == set(range(10))
        assert not images.flags.writeable and not labels.flags.writeable
        with pytest.raises(ValueError):
            images[0, 0, 0] = 1
    with pytest.raises(ValueError, match="digits split 'larger'"):
        digits.load_split(data_dir, "larger")


# ------------------------------------------------------------ independent answer check


@dataclasses.dataclass
class Parsed:
    task: str
    text: str  # the text tokens, each visual segment replaced by "#"
    shapes: list  # grid shape of each visual segment
    grids: list  # label grid of each visual segment (from the raw digits)
    sources: set  # digits splits the patches came from
    answer: str  # the tokens marked as answer
    length: int  # tokens + patches


def _patch_image(vec) -> bytes:
    ink = (np.asarray(vec, np.float64) + 1.0) * 8.0  # patch = ink * 2/16 - 1
    img = np.rint(ink)
    np.testing.assert_allclose(ink, img, atol=1e-6)
    assert img.min() >= 0 and img.max() <= 16
    return img.astype(np.uint8).tobytes()


def _parse(task, seq, source_of) -> Parsed:
    n = len(seq.tokens)
    assert len(seq.patches) == len(seq.answer) == n == layouts.num_tokens(seq.segments)
    text, shapes, grids, sources, c = [], [], [], set(), 0
    for seg in seq.segments:
        k = seg.num_tokens
        if isinstance(seg, layouts.Text):
            assert all(p is None for p in seq.patches[c : c + k])
            chunk = bytes(seq.tokens[c : c + k])  # raises unless every token is a byte
            assert b"#" not in chunk
            text.append(chunk.decode())
        else:
            assert all(t == PAD_ID for t in seq.tokens[c : c + k])
            found = [source_of[_patch_image(p)] for p in seq.patches[c : c + k]]
            shape = dataclasses.astuple(seg)[:3]  # (h, w) or (t, h, w)
            shapes.append(shape)
            grids.append(np.array([lab for _, lab in found]).reshape(shape))
            sources |= {s for s, _ in found}
            text.append("#")
        c += k
    answer_at = np.flatnonzero(seq.answer)
    assert len(answer_at) and np.array_equal(answer_at, np.arange(n - len(answer_at), n))
    answer = bytes(seq.tokens[n - len(answer_at) :]).decode()
    return Parsed(task, "".join(text), shapes, grids, sources, answer, n)


_FILL = r"([a-z ]*)"
PATTERNS = {
    "lookup_after": rf"{_FILL}\[#\]r(\d)c(\d):(\d)",
    "lookup_before": rf"r(\d)c(\d):{_FILL}\[#\]=(\d)",
    "read": rf"{_FILL}\[#\]read:(\d+)",
    "compare": rf"{_FILL}\[#\]\[#\]r(\d)c(\d)\?r(\d)c(\d):([<=>])",
    "video_lookup": rf"{_FILL}\{{#\}}f(\d)r(\d)c(\d):(\d)",
    "video_lookup_before": rf"f(\d)r(\d)c(\d):{_FILL}\{{#\}}=(\d)",
}


def _check(p: Parsed) -> dict:
    """Asserts the answer is right for the digits shown; returns fill and named cells."""
    m = re.fullmatch(PATTERNS[p.task], p.text)
    assert m, (p.task, p.text)
    g = m.groups()
    assert g[-1] == p.answer, (p.text, p.answer)  # the marked tokens are the whole answer
    if p.task in ("lookup_after", "read", "compare", "video_lookup"):
        fill, nums = g[0], g[1:-1]
    else:
        fill, nums = g[-2], g[:-2]
    nums = [int(x) for x in nums]
    cells = []
    for grid, shape in zip(p.grids, p.shapes, strict=True):
        cell, nums = tuple(nums[: len(shape)]), nums[len(shape) :]
        if cell:
            assert all(1 <= i <= min(d, 3) for i, d in zip(cell, shape, strict=True)), (cell, shape)
            cells.append(int(grid[tuple(i - 1 for i in cell)]))
    if p.task == "read":
        expected = "".join(str(d) for row in p.grids[0] for d in row)
    elif p.task == "compare":
        a, b = cells
        expected = "<" if a < b else "=" if a == b else ">"
    else:
        expected = str(cells[0])
    assert p.answer == expected, (p.text, p.answer, p.grids)
    return {"fill": fill, "cells": cells}


@pytest.fixture(scope="module")
def generated(data_dir, source_of):
    """(video, split) -> (Examples, [Parsed]) for PER_SPLIT examples of every task."""
    out = {}
    for video in (False, True):
        config = _config(data_dir, video=video)
        names = multimodal.tasks(config.data)
        for split in SPLITS:
            ex = multimodal.Examples(config.data, split=split, seed=11)
            parsed = []
            for i in range(PER_SPLIT[video]):
                k, seq = ex.example(i)
                parsed.append(_parse(names[k], seq, source_of))
            out[video, split] = ex, parsed
    return out


@pytest.mark.slow
@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("video", [False, True], ids=["image", "video"])
def test_answers_are_right(generated, video, split):
    _, parsed = generated[video, split]
    tasks = VIDEO_TASKS if video else IMAGE_TASKS
    counts = {t: sum(p.task == t for p in parsed) for t in tasks}
    assert set(counts) == {p.task for p in parsed}
    assert min(counts.values()) >= PER_SPLIT[video] / len(tasks) / 2, counts
    relations = set()
    for p in parsed:
        _check(p)
        if p.task == "compare":
            relations.add(p.answer)
    if not video:
        assert relations == {"<", "=", ">"}


def test_answer_check_catches_a_wrong_answer(generated):
    """The checker itself: a flipped label or answer must fail it."""
    _, parsed = generated[False, "train"]
    p = next(p for p in parsed if p.task == "read")
    wrong = dataclasses.replace(p, grids=[(p.grids[0] + 1) % 10])
    with pytest.raises(AssertionError):
        _check(wrong)


# --------------------------------------------------------------------- split definitions


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("video", [False, True], ids=["image", "video"])
def test_split_definitions(generated, video, split):
    ex, parsed = generated[video, split]
    definition = multimodal.FAMILIES[FAMILY[video]].splits[split]
    want_images = "test" if split in HELD_OUT else split
    assert definition.images == want_images and ex.split.images == want_images
    seen_shapes, fills = set(), []
    for p in parsed:
        assert p.sources == {want_images}, p.sources  # every patch, and none from elsewhere
        assert all(s in definition.shapes for s in p.shapes), (p.shapes, definition.shapes)
        assert all(len(s) == (3 if video else 2) for s in p.shapes)
        seen_shapes.update(p.shapes)
        fills.append(len(_check(p)["fill"]))
    assert seen_shapes == set(definition.shapes)
    lo, hi = (24, 32) if split == "long_prefix" else (0, 8)
    assert min(fills) == lo and max(fills) == hi, (min(fills), max(fills))


@pytest.mark.parametrize("video", [False, True], ids=["image", "video"])
def test_generalisation_splits_change_one_thing(video):
    splits = multimodal.FAMILIES[FAMILY[video]].splits
    train = set(splits["train"].shapes)
    assert set(splits["validation"].shapes) == set(splits["test"].shapes) == train
    assert set(splits["long_prefix"].shapes) == train
    assert splits["train"].fill == splits["larger"].fill == splits["aspect"].fill == (0, 8)
    assert splits["long_prefix"].fill == (24, 32)
    biggest = np.max(np.array(sorted(train)), axis=0)  # largest training size per axis
    for shape in splits["larger"].shapes:
        assert shape not in train
        assert np.any(np.array(shape) > biggest), shape
    worst_train_ratio = max(max(s[-2:]) / min(s[-2:]) for s in train)
    assert worst_train_ratio <= 2
    for shape in splits["aspect"].shapes:
        assert shape not in train
        assert max(shape[-2:]) / min(shape[-2:]) > worst_train_ratio, shape


# ----------------------------------------------------------------------------- batches

FIELDS = {
    "inputs": (np.int32, ()),
    "targets": (np.int32, ()),
    "weights": (np.float32, ()),
    "patches": (np.float32, (64,)),
    "is_patch": (np.bool_, ()),
    "positions": (np.float32, None),  # (A,)
}


def _check_fields(batch, b, t, num_axes):
    assert set(batch) == set(FIELDS) | {"task"}
    for key, (dtype, tail) in FIELDS.items():
        tail = (num_axes,) if tail is None else tail
        assert batch[key].dtype == dtype, key
        assert batch[key].shape == (b, t, *tail), (key, batch[key].shape)
    assert batch["task"].dtype == np.int32 and batch["task"].shape == (b,)


def _check_shift(batch):
    """Targets are the inputs shifted by one wherever both slots hold text; a target
    before a patch is PAD; patches are 0 on text."""
    inputs, targets, is_patch = batch["inputs"], batch["targets"], batch["is_patch"]
    both_text = ~is_patch[:, :-1] & ~is_patch[:, 1:] & (inputs[:, 1:] != PAD_ID)
    np.testing.assert_array_equal(targets[:, :-1][both_text], inputs[:, 1:][both_text])
    assert np.all(targets[:, :-1][is_patch[:, 1:]] == PAD_ID)
    assert np.all(inputs[is_patch] == PAD_ID)
    assert np.all(batch["patches"][~is_patch] == 0)
    assert set(np.unique(batch["weights"])) <= {0.0, 1.0}


def _check_row(batch, row, k, seq, scheme, num_axes, source_of, task_names):
    """One batch row against the example it was built from, and its answer re-derived
    from the batch's own patches and weights."""
    t = batch["inputs"].shape[1]
    n = len(seq) - 1
    tokens = np.asarray(seq.tokens)
    patch = np.array([p is not None for p in seq.patches])
    np.testing.assert_array_equal(batch["inputs"][row, :n], tokens[:-1])
    np.testing.assert_array_equal(batch["targets"][row, :n], tokens[1:])
    assert np.all(batch["inputs"][row, n:] == PAD_ID)
    assert np.all(batch["targets"][row, n:] == PAD_ID)
    np.testing.assert_array_equal(batch["is_patch"][row, :n], patch[:-1])
    assert not batch["is_patch"][row, n:].any()
    assert batch["task"][row] == k
    # The answer, from the batch alone: weighted targets, patches as stored in the batch.
    rebuilt = multimodal.Question()
    rebuilt.segments = list(seq.segments)
    rebuilt.tokens = [int(batch["inputs"][row, 0]), *batch["targets"][row, :n].tolist()]
    rebuilt.patches = [
        batch["patches"][row, j] if batch["is_patch"][row, j] else None for j in range(n)
    ] + [None]
    rebuilt.answer = [False, *(batch["weights"][row, :n] > 0).tolist()]
    assert not batch["weights"][row, n:].any()
    _check(_parse(task_names[k], rebuilt, source_of))
    # Positions: the layout of the example's segments, then trailing text positions.
    expected = layouts.positions(seq.segments, scheme, num_axes)
    m = min(n + 1, t)  # the last token (not an input) still has a slot unless n == t
    np.testing.assert_array_equal(batch["positions"][row, :m], expected[:m])
    nxt = layouts.next_position(seq.segments, scheme, num_axes)
    tail = nxt + np.arange(t - n - 1, dtype=np.float64)
    np.testing.assert_array_equal(
        batch["positions"][row, n + 1 :], np.repeat(tail[:, None], num_axes, 1)
    )
    if scheme == "flat":
        np.testing.assert_array_equal(batch["positions"][row, :, 0], np.arange(t))


SCHEME_CASES = [(False, s) for s in ("flat", "mrope", "rope_tie", "rope_tie_frac", "rope_tv")]
SCHEME_CASES += [(True, s) for s in ("flat", "mrope", "rope_tv")]


@pytest.mark.parametrize("video,scheme", SCHEME_CASES)
def test_batch_rows_match_examples(data_dir, source_of, video, scheme):
    config = _config(data_dir, video=video, **{"data.scheme": scheme})
    num_axes = 3 if video else 2
    names = multimodal.tasks(config.data)
    ex = multimodal.Examples(config.data, split="train", seed=5)
    indices = np.arange(40, 40 + 3 * B)
    for chunk in indices.reshape(3, B):
        batch = ex(chunk)
        _check_fields(batch, B, config.data.seq_len, num_axes)
        _check_shift(batch)
        for row, i in enumerate(chunk):
            k, seq = ex.example(i)
            _check_row(batch, row, k, seq, scheme, num_axes, source_of, names)


def test_mrope_positions_by_hand(data_dir):
    """One independent layout: M-RoPE places patch (r, c) at L + (r, c)."""
    config = _config(data_dir, **{"data.scheme": "mrope", "data.tasks": ("lookup_after",)})
    ex = multimodal.Examples(config.data, split="train", seed=0)
    batch = ex(np.arange(B))
    for row in range(B):
        _, seq = ex.example(row)
        fill_and_open, image = seq.segments[0].n, seq.segments[1]
        L = fill_and_open - 1
        pos = batch["positions"][row]
        np.testing.assert_array_equal(pos[: L + 1], np.repeat(np.arange(L + 1)[:, None], 2, 1))
        rows, cols = np.divmod(np.arange(image.h * image.w), image.w)
        patch_pos = pos[L + 1 : L + 1 + image.h * image.w]
        np.testing.assert_array_equal(patch_pos, L + np.stack([rows + 1, cols + 1], 1))
        after = L + max(image.h, image.w) + 1
        np.testing.assert_array_equal(pos[L + 1 + image.h * image.w], [after, after])


def _take(it, n):
    return [next(it) for _ in range(n)]


def _same(a, b):
    return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in x)


def _train_iter(config, seed, **kw):
    return data.make_train_iterator(config.data, seed=seed, batch_size=B, **kw)


def test_train_iterator(data_dir, source_of):
    config = _config(data_dir, **{"data.scheme": "rope_tv"})
    first = _take(_train_iter(config, 3), 3)
    for batch in first:
        _check_fields(batch, B, 48, 2)
        _check_shift(batch)
        assert np.all(batch["task"] >= 0) and np.all(batch["weights"].sum(1) >= 1)
    assert _same(first, _take(_train_iter(config, 3), 3))
    other = _take(_train_iter(config, 4), 3)
    assert not any(
        np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(first, other, strict=True)
    )
    # Batch b holds examples b*B .. b*B + B - 1 of the seed.
    ex = multimodal.Examples(config.data, split="train", seed=3)
    names = multimodal.tasks(config.data)
    for row in range(B):
        k, seq = ex.example(B + row)
        _check_row(first[1], row, k, seq, "rope_tv", 2, source_of, names)


def test_train_iterator_resumes_exactly(data_dir):
    config = _config(data_dir, video=True, **{"data.scheme": "mrope"})
    it = _train_iter(config, 9)
    _take(it, 2)
    state = json.loads(json.dumps(it.get_state()))
    expected = _take(it, 2)
    resumed = _train_iter(config, 9)
    resumed.set_state(state)
    assert _same(_take(resumed, 2), expected)
    fresh = _take(_train_iter(config, 9), 1)
    assert not np.array_equal(fresh[0]["inputs"], expected[0]["inputs"])


def test_sharded_iterators_split_the_global_batch(data_dir):
    config = _config(data_dir)
    whole = data.make_train_iterator(config.data, seed=2, batch_size=2 * B)
    parts = [_train_iter(config, 2, process_index=p, process_count=2) for p in (0, 1)]
    for _ in range(2):
        a, b, w = next(parts[0]), next(parts[1]), next(whole)
        for key in w:
            np.testing.assert_array_equal(np.concatenate([a[key], b[key]]), w[key])
    kw = dict(split="test", num_batches=2)
    whole = list(data.make_eval_iterator(config.data, batch_size=2 * B, **kw))
    parts = [
        list(data.make_eval_iterator(config.data, batch_size=B, process_index=p,
                                         process_count=2, **kw))
        for p in (0, 1)
    ]  # fmt: skip
    # num_batches counts global batches: the two processes' rows are the whole run's
    # (they were its first half: each process read num_batches of its own batch size)
    assert len(parts[0]) == len(parts[1]) == len(whole) == 2
    for key in whole[0]:
        got = np.concatenate(
            [np.concatenate([x[key], y[key]]) for x, y in zip(*parts, strict=True)]
        )
        np.testing.assert_array_equal(got, np.concatenate([w[key] for w in whole]))


@pytest.mark.parametrize("video", [False, True], ids=["image", "video"])
def test_eval_iterator(data_dir, source_of, video):
    config = _config(data_dir, video=video)
    t = multimodal.eval_seq_len(config.data)
    assert t % 8 == 0 and t >= config.data.seq_len
    kw = dict(batch_size=B, num_batches=2)
    batches = list(data.make_eval_iterator(config.data, split="larger", **kw))
    assert len(batches) == 2
    for batch in batches:
        _check_fields(batch, B, t, 3 if video else 2)
        _check_shift(batch)
        assert np.all(batch["task"] >= 0) and np.all(batch["weights"].sum(1) >= 1)
    # Same examples whatever the training seed, and on every pass.
    reseeded = _config(data_dir, video=video, seed=1234)
    ds = data.make_eval_iterator(reseeded.data, split="larger", **kw)
    assert _same(batches, list(ds)) and _same(batches, list(ds))
    other = list(data.make_eval_iterator(config.data, split="aspect", **kw))
    assert not np.array_equal(other[0]["inputs"], batches[0]["inputs"])
    # Row r of batch b is example b*B + r of the split, generated from the split's own
    # seed; its patches are held-out test digits and its answers check out.
    ex = multimodal.Examples(config.data, split="larger", seed=multimodal._split_seed("larger"))
    names = multimodal.tasks(config.data)
    scheme, num_axes = config.data.scheme, 3 if video else 2
    for b, batch in enumerate(batches):
        for row in range(B):
            k, seq = ex.example(b * B + row)
            assert all(dataclasses.astuple(s)[:3] in ex.split.shapes for s in seq.segments[1::2])
            _check_row(batch, row, k, seq, scheme, num_axes, source_of, names)
            assert _parse(names[k], seq, source_of).sources == {"test"}


def test_eval_iterator_pads_the_last_batch(data_dir):
    config = _config(data_dir, **{"data.seq_len": 64})
    ds = multimodal.make_eval_iterator(
        config.data, split="validation", batch_size=B, num_examples=6,
        shard=(0, 1),
    )  # fmt: skip
    batches = list(ds)
    assert len(batches) == 2
    task = np.concatenate([b["task"] for b in batches])
    weights = np.concatenate([b["weights"] for b in batches])
    assert np.all(task[:6] >= 0) and np.all(task[6:] == -1)
    assert np.all(weights[:6].sum(1) >= 1) and np.all(weights[6:] == 0)
    full = list(
        multimodal.make_eval_iterator(
            config.data, split="validation", batch_size=B, num_examples=8,
            shard=(0, 1),
        )
    )  # fmt: skip
    # Padding rows are the only difference from a full split of 8.
    for key in ("inputs", "targets", "patches", "positions"):
        np.testing.assert_array_equal(batches[1][key], full[1][key])


def _worst_length(task, shapes, fill_max):
    """Longest example by the documented formats (independent of the code's bound)."""
    big = max(int(np.prod(s)) for s in shapes)
    name = len("r3c3:") if len(shapes[0]) == 2 else len("f3r3c3:")
    return {
        "lookup_after": fill_max + 1 + big + 1 + name + 1,
        "lookup_before": name + fill_max + 1 + big + 2 + 1,
        "read": fill_max + 1 + big + len("]read:") + big,
        "compare": fill_max + 2 * (1 + big + 1) + len("r3c3?r3c3:") + 1,
        "video_lookup": fill_max + 1 + big + 1 + name + 1,
        "video_lookup_before": name + fill_max + 1 + big + 2 + 1,
    }[task]


@pytest.mark.parametrize("video", [False, True], ids=["image", "video"])
def test_eval_seq_len_fits_every_split(generated, data_dir, video):
    config = _config(data_dir, video=video)
    t = multimodal.eval_seq_len(config.data)
    fam = multimodal.FAMILIES[FAMILY[video]]
    for split in SPLITS:
        lengths = [p.length for p in generated[video, split][1]]
        assert max(lengths) - 1 <= t, split
        if split == "train":
            assert max(lengths) - 1 <= config.data.seq_len == 48
        definition = fam.splits[split]
        for task in fam.tasks:
            worst = _worst_length(task, definition.shapes, definition.fill[1])
            assert worst - 1 <= t, (split, task)
            if split == "train":
                assert worst - 1 <= config.data.seq_len, task
    # One task: the bound follows the chosen tasks, still a multiple of 8.
    for task in fam.tasks:
        one = _config(data_dir, video=video, **{"data.tasks": (task,), "data.seq_len": 8})
        t1 = multimodal.eval_seq_len(one.data)
        worst = max(_worst_length(task, s.shapes, s.fill[1]) for s in fam.splits.values())
        assert t1 % 8 == 0 and worst - 1 <= t1 < worst - 1 + 8 + 8, (task, t1, worst)


# ------------------------------------------------------------------------ config checks


@pytest.mark.parametrize(
    "video,overrides,match",
    [
        (False, {"model.patch_dim": 48}, r"model\.patch_dim=48"),
        (False, {"model.patch_dim": 0}, r"model\.patch_dim=0"),
        (True, {"data.scheme": "rope_tie"}, r"data\.scheme='rope_tie'"),
        (True, {"data.scheme": "rope_tie_frac"}, r"data\.scheme='rope_tie_frac'"),
        (False, {"data.tasks": ("read", "count")}, r"data\.tasks=.*count"),
        (True, {"data.tasks": ("lookup_after",)}, r"data\.tasks=.*lookup_after"),
        (False, {"eval.splits": ("test", "huge")}, r"eval\.splits.*'huge'"),
        (False, {"data.eval_split": "dev"}, r"data\.eval_split.*'dev'"),
        (False, {"data.seq_len": 30}, r"data\.seq_len=30"),
        (True, {"data.seq_len": 30}, r"data\.seq_len=30"),
    ],
)
def test_check_config_names_the_field(data_dir, video, overrides, match):
    config = _config(data_dir, video=video, **overrides)
    with pytest.raises(ValueError, match=match):
        harness.check_config(config)
    with pytest.raises(ValueError, match=match):
        multimodal.check_config(config.data, config.model, config.eval.splits)


@pytest.mark.parametrize(
    "train_split,match",
    [("bogus", r"data\.train_split"), ("long_prefix", r"data\.(train_split|seq_len)")],
)
def test_check_config_checks_train_split(data_dir, train_split, match):
    config = _config(data_dir, **{"data.train_split": train_split})
    with pytest.raises(ValueError, match=match):
        harness.check_config(config)


def test_seq_len_check_is_tight(data_dir):
    """check_config accepts a seq_len exactly fitting the longest training example."""
    for video in (False, True):
        fam = multimodal.FAMILIES[FAMILY[video]]
        train = fam.splits["train"]
        need = max(_worst_length(t, train.shapes, train.fill[1]) for t in fam.tasks) - 1
        harness.check_config(_config(data_dir, video=video, **{"data.seq_len": need}))
        with pytest.raises(ValueError, match="data.seq_len"):
            harness.check_config(_config(data_dir, video=video, **{"data.seq_len": need - 1}))


@pytest.mark.parametrize(
    "video,overrides",
    [
        (False, {"model.rope.allocation": "sections", "model.rope.sections": (4, 4, 8)}),
        (True, {"model.rope.allocation": "sections", "model.rope.sections": (8, 8)}),
    ],
    ids=["image-3-sections", "video-2-sections"],
)
def test_rotation_axes_must_match_the_data(data_dir, video, overrides):
    """The data decides A (2 image, 3 video); the rotation's sections must have A entries."""
    config = _config(data_dir, video=video, **overrides)
    with pytest.raises(ValueError, match=r"model\.rope\.sections=.*axes"):
        harness.check_config(config)


def test_iterators_place_patches_with_data_scheme(data_dir):
    """`data.scheme` alone decides the batches' positions (no model field needed)."""
    batches = {}
    for scheme in ("mrope", "rope_tv"):
        config = _config(data_dir, **{"data.scheme": scheme})
        batches[scheme] = next(data.make_train_iterator(config.data, seed=0, batch_size=B))
    assert np.array_equal(batches["mrope"]["inputs"], batches["rope_tv"]["inputs"])
    assert not np.array_equal(batches["mrope"]["positions"], batches["rope_tv"]["positions"])


@pytest.mark.parametrize("video", [False, True], ids=["image", "video"])
def test_every_row_is_a_valid_config(data_dir, video):
    rows = mm_config.VIDEO_ROWS if video else mm_config.ROWS
    if video:
        assert not any(r.startswith("rope_tie") for r in rows)
        assert set(rows) == {r for r in mm_config.ROWS if not r.startswith("rope_tie")} | set(
            mm_config.VIDEO_ONLY_ROWS
        )
    for row in rows:
        config = _config(data_dir, video=video, arg=f"row={row}")
        harness.check_config(config)
        assert config.data.name == FAMILY[video]
        assert data.kind(config.data).num_axes == (3 if video else 2)
        for key, value in rows[row].items():
            assert plan.leaves(config)[key] == value
    if not video:
        with pytest.raises(ValueError, match="row='rope_tie'"):
            mm_config.get_config("video=true,row=rope_tie")


@pytest.mark.parametrize("size", ["tiny", "small", "1b"])
@pytest.mark.parametrize("video", [False, True], ids=["image", "video"])
def test_sections_rows_split_head_dim(size, video):
    head_dim = common.size_preset(size)["head_dim"]
    num_axes = 3 if video else 2
    rows = [r for r in mm_config.rows(video) if r.endswith("_sections")]
    assert rows
    for row in rows:
        sections = mm_config.row_overrides(row, size, video)["model.rope.sections"]
        assert len(sections) == num_axes and all(s > 0 for s in sections)
        assert sum(sections) == head_dim // 2


@pytest.mark.parametrize("video", [False, True], ids=["image", "video"])
def test_sweep_rows(video):
    added = []
    mm_config.sweep(lambda **kw: added.append(kw), f"video={str(video).lower()}")
    rows = mm_config.VIDEO_ROWS if video else mm_config.ROWS
    assert [a["name"] for a in added] == list(rows)
    for a in added:
        overrides = {k: v for k, v in a.items() if k != "name"}
        assert overrides == mm_config.row_overrides(a["name"], "tiny", video)


# ------------------------------------------------------------------------------ metrics


def _logits_for(predicted, vocab):
    """Logits whose argmax is `predicted` [B, T] (a clear margin)."""
    b, t = predicted.shape
    logits = np.tile(np.linspace(0.0, 0.5, vocab, dtype=np.float32), (b, t, 1))
    np.put_along_axis(logits, predicted[..., None], 3.0, axis=-1)
    return logits


@pytest.mark.slow
def test_eval_sums_and_summarize_by_hand():
    v = 5
    targets = np.array(
        [[1, 2, 3], [0, 1, 2], [3, 3, 3], [4, 4, 4], [2, 2, 2], [1, 1, 1], [0, 0, 0]], np.int32
    )
    predicted = targets.copy()
    predicted[1, 2] = 0  # row 1 (task 1): one answer token wrong
    predicted[2, 2] = 4  # row 2 (task 0): its only answer token wrong
    predicted[5, 0] = 4  # row 5 (task 1): a wrong token, but not an answer token
    predicted[6, 1] = 3  # row 6 (task 0): answer right, unweighted token wrong
    weights = np.array(
        [[0, 1, 1], [0, 1, 1], [0, 0, 1], [1, 1, 0], [0, 0, 0], [0, 1, 1], [1, 0, 1]],
        np.float32,
    )
    task = np.array([0, 1, 0, -1, 1, 1, 0], np.int32)  # row 3 padding, row 4 unscored
    logits = _logits_for(predicted, v)
    sums = metrics.eval_sums(
        jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights), jnp.asarray(task),
        num_tasks=3,
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(sums["answers"]), [3, 2, 0])  # rows 0,2,6 / 1,5
    # Task 0: rows 0 and 6 right, row 2 wrong; task 1: row 5 right, row 1 wrong.
    np.testing.assert_array_equal(np.asarray(sums["answers_correct"]), [2, 1, 0])
    assert float(sums["weight_sum"]) == weights.sum() == 11
    hits = (predicted == targets) * weights
    assert float(sums["correct_sum"]) == hits.sum() == 9
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    gold = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(float(sums["loss_sum"]), ((lse - gold) * weights).sum(), rtol=1e-5)
    out = metrics.summarize(sums, ("a", "b", "c"))
    assert out["questions"] == 5
    assert out["answer_accuracy"] == pytest.approx(3 / 5)
    assert out["answer_accuracy/a"] == pytest.approx(2 / 3)
    assert out["answer_accuracy/b"] == pytest.approx(0.5)
    assert np.isnan(out["answer_accuracy/c"])
    assert out["accuracy"] == pytest.approx(9 / 11)
    assert out["tokens"] == 11
    # evaluate adds batches before summarizing.
    halves = [
        dict(logits=logits[s], targets=targets[s], weights=weights[s], task=task[s])
        for s in (slice(0, 3), slice(3, 7))
    ]
    step = lambda params, b: metrics.eval_sums(  # noqa: E731
        b["logits"], b["targets"], b["weights"], b["task"], num_tasks=3
    )
    evaluated = metrics.evaluate(step, None, halves, ("a", "b", "c"))
    for key in (
        "questions",
        "answer_accuracy",
        "answer_accuracy/a",
        "answer_accuracy/b",
        "accuracy",
    ):
        assert evaluated[key] == pytest.approx(out[key]), key


def test_answer_metrics_on_a_real_batch(data_dir):
    """Oracle logits score every question; one wrong answer token loses that question."""
    config = _config(data_dir, **{"data.tasks": ("read", "compare"), "data.seq_len": 64})
    batches = list(
        multimodal.make_eval_iterator(
            config.data, split="test", batch_size=8, num_examples=6,
            shard=(0, 1),
        )
    )  # fmt: skip
    batch = batches[0]
    assert list(batch["task"][6:]) == [-1, -1]
    predicted = batch["targets"].copy()
    predicted[batch["weights"] == 0] = 0  # unweighted tokens may be anything
    sums = metrics.eval_sums(
        _logits_for(predicted, 259), batch["targets"], batch["weights"], batch["task"],
        num_tasks=2,
    )  # fmt: skip
    counts = np.bincount(batch["task"][:6], minlength=2)
    np.testing.assert_array_equal(np.asarray(sums["answers"]), counts)
    np.testing.assert_array_equal(np.asarray(sums["answers_correct"]), counts)
    # Break the last answer token of row 0.
    last = np.flatnonzero(batch["weights"][0])[-1]
    predicted[0, last] = (predicted[0, last] + 1) % 256
    sums = metrics.eval_sums(
        _logits_for(predicted, 259), batch["targets"], batch["weights"], batch["task"],
        num_tasks=2,
    )  # fmt: skip
    want = counts.copy()
    want[batch["task"][0]] -= 1
    np.testing.assert_array_equal(np.asarray(sums["answers_correct"]), want)
    out = metrics.summarize(sums, ("read", "compare"))
    assert out["questions"] == 6
    assert out["answer_accuracy"] == pytest.approx(5 / 6)
