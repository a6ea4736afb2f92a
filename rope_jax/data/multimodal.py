"""Interleaved text + image (or video) questions about grids of real handwritten digits.

Each example is one question. An image is an h x w grid of cells, each cell one 8x8
digit from `rope_jax.data.digits` (one patch of 64 ink values); a video is t frames of
such a grid, the cells changing from frame to frame. Text is bytes; `[`/`]` open and
close an image and `{`/`}` a video, as ordinary text tokens. Rows and columns are
1-based. A random lowercase filler of a split-dependent length stands before the
image ("text before the image"). Answers are the scored tokens.

Image tasks (`data.name = "digit_grids"`, 2 position axes (h, w)):
  lookup_after   `<fill>[<image>]r2c3:7`       question after the image
  lookup_before  `r2c3:<fill>[<image>]=7`      question before, answer after the image
  read           `<fill>[<image>]read:5071`    every cell, row by row
  compare        `<fill>[<a>][<b>]r1c2?r2c1:<` cell of a vs cell of b: one of < = >
Video tasks (`data.name = "digit_videos"`, 3 position axes (t, h, w)):
  video_lookup         `<fill>{<video>}f2r1c3:4`
  video_lookup_before  `f2r1c3:<fill>{<video>}=4`

Splits (`SPLITS`): `train` / `validation` / `test` draw cells from the digits split of
that name, with the training grid shapes and a filler of 0..8 bytes. The held-out
generalisation splits use test digits and change one thing each: `larger` grids,
unseen `aspect` ratios, `long_prefix` (a filler of 24..32 bytes). Questions name only
rows, columns and frames up to 3 (seen in training), so a miss on a held-out split is
the layout's doing, not an unseen index token.

Batch (all numpy; `inputs`, `targets`, `weights` as for text):
  inputs     int32   [B, T]     byte ids; PAD where the slot holds a patch
  targets    int32   [B, T]     next token (PAD when the next slot is a patch)
  weights    float32 [B, T]     1 on answer tokens, else 0
  patches    float32 [B, T, E]  E = 64 ink values scaled to [-1, 1]; 0 on text
  is_patch   bool    [B, T]
  positions  float32 [B, T, A]  from `layouts.batch_positions` for `data.scheme` (and
                                `data.seconds_per_frame`, `tokens_per_second`, `delta`)
  task       int32   [B]        index into the family's `tasks`; -1 on padding rows
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from collections.abc import Callable

import grain
import numpy as np

from rope_jax import layouts
from rope_jax.data import digits
from rope_jax.data.byte_ids import PAD_ID

PATCH_DIM = digits.SIZE * digits.SIZE
MAX_INDEX = 3  # questions name rows / columns / frames 1..3 only
_LETTERS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ", np.uint8)


@dataclasses.dataclass(frozen=True)
class Split:
    """Where a split's cells come from and what its sequences look like."""

    images: str  # digits split filling the cells: train | validation | test
    shapes: tuple[tuple[int, ...], ...]  # grid shapes (h, w), or (t, h, w) for video
    fill: tuple[int, int]  # filler length range before the image, inclusive


# ----------------------------------------------------------------------- sequences


class Question:
    """Builds one example: tokens and patches in stream order, segments, answer mask."""

    def __init__(self):
        self.segments, self.tokens, self.patches, self.answer = [], [], [], []

    def text(self, s: str | bytes, *, answer: bool = False) -> None:
        data = s.encode() if isinstance(s, str) else s
        if not data:
            return
        if self.segments and isinstance(self.segments[-1], layouts.Text):
            self.segments[-1] = layouts.Text(self.segments[-1].n + len(data))
        else:
            self.segments.append(layouts.Text(len(data)))
        self.tokens.extend(data)
        self.patches.extend([None] * len(data))
        self.answer.extend([answer] * len(data))

    def visual(self, cells: np.ndarray) -> None:
        """cells: uint8 [h, w, 8, 8] (image) or [t, h, w, 8, 8] (video), row-major."""
        grid = cells.shape[:-2]
        seg = layouts.Image(*grid) if len(grid) == 2 else layouts.Video(*grid)
        self.segments.append(seg)
        flat = cells.reshape(-1, PATCH_DIM).astype(np.float32) * (2.0 / digits.MAX_INK) - 1.0
        self.tokens.extend([PAD_ID] * len(flat))
        self.patches.extend(flat)
        self.answer.extend([False] * len(flat))

    def __len__(self) -> int:
        return len(self.tokens)


class Pool:
    """Digit images of one split, indexed by label for balanced sampling."""

    def __init__(self, images: np.ndarray, labels: np.ndarray):
        self.images = images
        self.by_label = [np.flatnonzero(labels == d) for d in range(digits.NUM_CLASSES)]

    def cells(self, rng: np.random.Generator, labels: np.ndarray) -> np.ndarray:
        """One random image per label: uint8 [*labels.shape, 8, 8]."""
        picks = [rng.choice(self.by_label[d]) for d in labels.ravel()]
        return self.images[picks].reshape(*labels.shape, digits.SIZE, digits.SIZE)


def _fill(rng: np.random.Generator, split: Split) -> str:
    n = int(rng.integers(split.fill[0], split.fill[1] + 1))
    return _LETTERS[rng.integers(0, len(_LETTERS), n)].tobytes().decode()


def _shape(rng: np.random.Generator, split: Split) -> tuple[int, ...]:
    return split.shapes[int(rng.integers(len(split.shapes)))]


def _cell(rng: np.random.Generator, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A 1-based coordinate per axis, each at most MAX_INDEX."""
    return tuple(int(rng.integers(1, min(n, MAX_INDEX) + 1)) for n in shape)


def _grid(rng, pool: Pool, shape) -> tuple[np.ndarray, np.ndarray]:
    labels = rng.integers(0, digits.NUM_CLASSES, shape)
    return labels, pool.cells(rng, labels)


def _name(cell: tuple[int, ...]) -> str:
    return "".join(f"{a}{i}" for a, i in zip("frc"[3 - len(cell) :], cell, strict=True))


def _lookup(*, before: bool, video: bool) -> Callable:
    open_, close = "{}" if video else "[]"

    def task(rng, pool: Pool, split: Split) -> Question:
        shape = _shape(rng, split)
        labels, cells = _grid(rng, pool, shape)
        cell = _cell(rng, shape)
        seq, question = Question(), _name(cell) + ":"
        if before:
            seq.text(question)
        seq.text(_fill(rng, split) + open_)
        seq.visual(cells)
        seq.text(close + ("=" if before else question))
        seq.text(str(labels[tuple(i - 1 for i in cell)]), answer=True)
        return seq

    return task


def _read(rng, pool: Pool, split: Split) -> Question:
    labels, cells = _grid(rng, pool, _shape(rng, split))
    seq = Question()
    seq.text(_fill(rng, split) + "[")
    seq.visual(cells)
    seq.text("]read:")
    seq.text("".join(map(str, labels.ravel())), answer=True)
    return seq


def _compare(rng, pool: Pool, split: Split) -> Question:
    shapes = _shape(rng, split), _shape(rng, split)
    cells = [_cell(rng, s) for s in shapes]
    relation = int(rng.integers(3))  # 0 <, 1 =, 2 > (balanced)
    if relation == 0:
        a = int(rng.integers(0, 9))
        b = int(rng.integers(a + 1, 10))
    elif relation == 1:
        a = b = int(rng.integers(0, 10))
    else:
        a = int(rng.integers(1, 10))
        b = int(rng.integers(0, a))
    seq = Question()
    seq.text(_fill(rng, split))
    for shape, cell, digit in zip(shapes, cells, (a, b), strict=True):
        labels = rng.integers(0, digits.NUM_CLASSES, shape)
        labels[tuple(i - 1 for i in cell)] = digit
        seq.text("[")
        seq.visual(pool.cells(rng, labels))
        seq.text("]")
    seq.text(f"{_name(cells[0])}?{_name(cells[1])}:")
    seq.text("<=>"[relation], answer=True)
    return seq


def _shapes(hs, ws, *, skip=()) -> tuple[tuple[int, int], ...]:
    return tuple((h, w) for h in hs for w in ws if (h, w) not in skip)


_TRAIN_IMAGE = _shapes((1, 2, 3), (1, 2, 3), skip=((1, 3), (3, 1)))  # 7 shapes, aspect <= 2
_FILL, _LONG_FILL = (0, 8), (24, 32)


def _splits(train, larger, aspect) -> dict[str, Split]:
    return {
        "train": Split("train", train, _FILL),
        "validation": Split("validation", train, _FILL),
        "test": Split("test", train, _FILL),
        "larger": Split("test", larger, _FILL),
        "aspect": Split("test", aspect, _FILL),
        "long_prefix": Split("test", train, _LONG_FILL),
    }


@dataclasses.dataclass(frozen=True)
class Family:
    """A dataset name: its tasks, splits and number of position axes."""

    tasks: dict[str, Callable]
    splits: dict[str, Split]
    num_axes: int


FAMILIES = {
    "digit_grids": Family(
        tasks={
            "lookup_after": _lookup(before=False, video=False),
            "lookup_before": _lookup(before=True, video=False),
            "read": _read,
            "compare": _compare,
        },
        splits=_splits(
            _TRAIN_IMAGE,
            larger=((4, 4), (3, 4), (4, 3), (2, 4), (4, 2)),
            aspect=((1, 3), (3, 1), (1, 4), (4, 1)),
        ),
        num_axes=2,
    ),
    "digit_videos": Family(
        tasks={
            "video_lookup": _lookup(before=False, video=True),
            "video_lookup_before": _lookup(before=True, video=True),
        },
        splits=_splits(
            tuple((t, h, w) for t in (1, 2) for h, w in _TRAIN_IMAGE),
            larger=((3, 2, 2), (3, 3, 2), (3, 3, 3), (2, 4, 4)),
            aspect=tuple((t, h, w) for t in (1, 2) for h, w in ((1, 3), (3, 1), (1, 4), (4, 1))),
        ),
        num_axes=3,
    ),
}


# ---------------------------------------------------------------------- config checks


def family(data_config) -> Family:
    return FAMILIES[data_config.name]


def tasks(data_config) -> tuple[str, ...]:
    """The configured tasks (`data.tasks`; () = all of the family's), validated."""
    fam = family(data_config)
    chosen = tuple(data_config.tasks) or tuple(fam.tasks)
    bad = [t for t in chosen if t not in fam.tasks]
    if bad:
        raise ValueError(
            f"data.tasks={chosen} has unknown task(s) {', '.join(bad)} for "
            f"data.name={data_config.name!r}; allowed: {', '.join(fam.tasks)}"
        )
    return chosen


def _probe_segments(split: Split, num_axes: int) -> list:
    """The largest sequence a split produces: two visual segments of its largest shape."""
    big = max(split.shapes, key=lambda s: (int(np.prod(s)), s))
    seg = layouts.Image(*big) if len(big) == 2 else layouts.Video(*big)
    return [layouts.Text(split.fill[1] + 1), seg, layouts.Text(2), seg, layouts.Text(12)]


def check_config(data_config, model_config, eval_splits=()) -> None:
    """Checks the data fields against the model: tasks, patch width, axes, layout, length,
    and that the eval split and `eval_splits` exist.

    Raises ValueError naming the field; runs no model code.
    """
    fam = family(data_config)
    chosen = tasks(data_config)
    scheme = data_config.scheme
    if model_config.patch_dim != PATCH_DIM:
        raise ValueError(
            f"model.patch_dim={model_config.get('patch_dim', 0)} must be {PATCH_DIM} for "
            f"data.name={data_config.name!r} (8x8 digit patches)"
        )
    train_split = data_config.train_split
    for field, names in (("data.train_split", (train_split,)),
                         ("data.eval_split", (data_config.eval_split,)),
                         ("eval.splits", tuple(eval_splits))):  # fmt: skip
        bad = [n for n in names if n not in fam.splits]
        if bad:
            raise ValueError(
                f"{field} names unknown split(s) {', '.join(map(repr, bad))} of "
                f"data.name={data_config.name!r}; splits: {', '.join(fam.splits)}"
            )
    seconds_per_frame, settings = layout_settings(data_config)
    for split in fam.splits.values():
        probe = layouts.timed(_probe_segments(split, fam.num_axes), seconds_per_frame)
        try:  # impossible layouts fail here, before anything compiles
            layouts.positions(probe, scheme, fam.num_axes, **settings)
        except ValueError as e:
            raise ValueError(f"data.scheme={scheme!r}: {e}") from None
    longest = max(_max_length(task, fam.splits[train_split]) for task in chosen)
    if longest - 1 > data_config.seq_len:
        raise ValueError(
            f"data.seq_len={data_config.seq_len} is too short for data.train_split="
            f"{train_split!r}: its longest example needs {longest - 1} input tokens"
        )


def layout_settings(data_config) -> tuple[float | None, dict]:
    """(data.seconds_per_frame of every video, the `layouts.positions` settings
    data.tokens_per_second and data.delta), checked against data.scheme; None = unset."""
    seconds_per_frame = data_config.seconds_per_frame
    settings = {k: data_config[k] for k in layouts.SETTINGS}
    try:
        layouts.timed((), seconds_per_frame)  # checks the value
        settings = layouts.check_settings(data_config.scheme, **settings)
    except ValueError as e:
        raise ValueError(f"data.{e}") from None
    return seconds_per_frame, settings


def eval_seq_len(data_config) -> int:
    """One padded length that fits every split's examples: the longest rounded up to a
    multiple of 8, or data.seq_len if longer; all splits then share one compiled step."""
    fam = family(data_config)
    longest = max(_max_length(t, s) for t in tasks(data_config) for s in fam.splits.values())
    return max(int(data_config.seq_len), -(-(longest - 1) // 8) * 8)


def _max_length(task: str, split: Split) -> int:
    """Upper bound of an example's length (tokens + patches, answer included)."""
    big = max(int(np.prod(s)) for s in split.shapes)
    fill = split.fill[1]
    return {
        "lookup_after": fill + big + 2 + 5 + 1,
        "lookup_before": 5 + fill + big + 3 + 1,
        "read": fill + big + 7 + big,
        "compare": fill + 2 * (big + 2) + 10 + 1,
        "video_lookup": fill + big + 2 + 7 + 1,
        "video_lookup_before": 7 + fill + big + 3 + 1,
    }[task]


# ------------------------------------------------------------------------- batches


def batch_fields(data_config) -> dict:
    """Fields a batch has beyond inputs/targets/weights: name -> (shape after B, dtype)."""
    t, a = int(data_config.seq_len), family(data_config).num_axes
    return {"patches": ((t, PATCH_DIM), np.float32), "is_patch": ((t,), np.bool_),
            "positions": ((t, a), np.float32), "task": ((), np.int32)}  # fmt: skip


class Examples:
    """Grain map: example indices [process_count * B] -> a batch dict (this process's B rows).

    Example `i` of a split is generated from `numpy.random.default_rng((seed, i))`, so
    it is the same on every machine, in any order, and resumes exactly.
    """

    def __init__(self, data_config, *, split: str, seed: int, limit: int | None = None,
                 shard: tuple[int, int] = (0, 1)):  # fmt: skip
        fam = family(data_config)
        self.split, self.seed, self.limit, self.shard = fam.splits[split], seed, limit, shard
        self.tasks = [fam.tasks[t] for t in tasks(data_config)]
        self.pool = Pool(*digits.load_split(data_dir(data_config), self.split.images))
        self.scheme, self.num_axes = data_config.scheme, fam.num_axes
        self.seconds_per_frame, self.layout_settings = layout_settings(data_config)
        self.seq_len = int(data_config.seq_len)

    def example(self, i: int) -> tuple[int, Question]:
        rng = np.random.default_rng((self.seed, int(i)))
        k = int(rng.integers(len(self.tasks)))
        return k, self.tasks[k](rng, self.pool, self.split)

    def __call__(self, indices) -> dict[str, np.ndarray]:
        index, count = self.shard
        indices = np.asarray(indices, np.int64).reshape(count, -1)[index]
        b, t = len(indices), self.seq_len
        out = {
            "inputs": np.full((b, t), PAD_ID, np.int32),
            "targets": np.full((b, t), PAD_ID, np.int32),
            "weights": np.zeros((b, t), np.float32),
            "patches": np.zeros((b, t, PATCH_DIM), np.float32),
            "is_patch": np.zeros((b, t), bool),
            "task": np.full((b,), -1, np.int32),
        }
        segments = []
        for row, i in enumerate(indices):
            k, seq = self.example(i)
            n = len(seq) - 1  # inputs drop the last token, targets the first
            if n > t:
                raise ValueError(f"an example of {len(seq)} tokens does not fit seq_len={t}")
            segments.append(layouts.timed(seq.segments, self.seconds_per_frame))
            tokens = np.asarray(seq.tokens, np.int32)
            out["inputs"][row, :n], out["targets"][row, :n] = tokens[:-1], tokens[1:]
            patch = np.array([p is not None for p in seq.patches])
            out["is_patch"][row, :n] = patch[:-1]
            where = np.flatnonzero(patch[:-1])
            out["patches"][row, where] = np.stack([seq.patches[j] for j in where])
            if self.limit is None or i < self.limit:  # rows past an eval split's end: weight 0
                out["weights"][row, :n] = np.asarray(seq.answer[1:], np.float32)
                out["task"][row] = k
        out["positions"], _ = layouts.batch_positions(
            segments, self.scheme, self.num_axes, t + 1, truncate=True, **self.layout_settings
        )
        out["positions"] = np.ascontiguousarray(out["positions"][:, :t])
        return out


def data_dir(data_config) -> str | None:
    """`data.data_dir` with `~` expanded; None = the TFDS default."""
    path = data_config.data_dir
    return os.path.expanduser(path) if path else None


def _split_seed(name: str) -> int:
    """Held-out examples are the same for every run: seeded by the split's name only."""
    return zlib.crc32(name.encode()) + 1_000_003


def make_train_iterator(data_config, *, seed: int, batch_size: int, shard: tuple[int, int]):
    """Infinite, checkpointable iterator of training batches (fresh examples forever)."""
    examples = Examples(data_config, split=data_config.train_split,
                        seed=int(seed), shard=shard)  # fmt: skip
    ds = grain.MapDataset.range(2**62).batch(batch_size * shard[1]).map(examples)
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=4)))


def make_eval_iterator(data_config, *, split: str, batch_size: int, num_examples: int,
                       shard: tuple[int, int]):  # fmt: skip
    """The first `num_examples` examples of `split` in whole batches (padding rows have
    weight 0 and task -1); the same examples for every seed and run."""
    examples = Examples(data_config, split=split, seed=_split_seed(split), limit=num_examples,
                        shard=shard)  # fmt: skip
    global_batch = batch_size * shard[1]
    rows = -(-num_examples // global_batch) * global_batch
    ds = grain.MapDataset.range(rows).batch(global_batch).map(examples)
    return ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=4))
