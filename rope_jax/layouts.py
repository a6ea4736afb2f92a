"""Position ids for interleaved text / image / video sequences (host NumPy).

A sequence is a list of segments: `Text(n)`, `Image(h, w)` and `Video(t, h, w)`,
sizes in patches. Patches are ordered row-major (frame, row, column). Markers such
as `[IMG]` / `[/IMG]` are ordinary text tokens. Every scheme gives text token `n`
the position `(n, ..., n)`, so text-only input is plain RoPE-1D, and the first text
token sits at 0. Axis order is `(t, h, w)` for 3 axes and `(h, w)` for 2 axes.

Schemes (docs/maths.md#multimodal-layouts; `L` is the 1-D position of the last token before a
visual segment, `-1` if it opens the sequence; `f, r, c` are 1-based frame, row and
column of a patch):

  flat           every token and patch takes the next integer, on every axis.
  mrope          Qwen2-VL M-RoPE: patch at `L + (f, r, c)`; next text at the
                 segment's largest coordinate + 1.
  rope_tie       RoPE-Tie (2-D, images): patch at `(L + r s, L + c t)`, `s = w + 1`,
                 `t = h + 1`; next text at `L + (w + 1)(h + 1)`.
  rope_tie_frac  RoPE-Tie with `s = (wh + 1)/(h + 1)`, `t = (wh + 1)/(w + 1)`; next
                 text at `L + wh + 1`.
  rope_tv        RoPE-Tie-v2: patch at `L + (n - dims)/2 + (f, r, c)` with `n` the
                 number of patches; next text at `L + n + 1`. An image on 3 axes is a
                 video with `t = 1`.
  videorope      VideoRoPE's diagonal layout with temporal spacing `delta` (default
                 2): frame f at `tau = L + 1 + delta (f - 1)`, patch at
                 `(tau, tau + r - 1 - (h - 1) // 2, tau + c - 1 - (w - 1) // 2)`, the
                 grid centred on its frame's time id; next text at `tau_last + 1`. An
                 image is one frame; on 2 axes it keeps only the `(h, w)` ids.

Settings (keywords of `positions`, `next_position` and `batch_positions`; `SETTINGS`
names the schemes that read each; None = unset; docs/maths.md#multimodal-rope-variants):

  tokens_per_second  mrope: Qwen2.5-VL time-aligned temporal ids. A video with
                     `seconds_per_frame` s puts frame f at temporal id
                     `L + 1 + floor((f - 1) s tokens_per_second)` instead of `L + f`.
  delta              videorope: the temporal id step between frames (default 2).

Shape letters: B batch, T tokens, A position axes.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Sequence

import numpy as np

TEXT, IMAGE, VIDEO = 0, 1, 2  # token-type ids returned by `modality`


def _check_sizes(seg, *fields: str) -> None:
    for field in fields:
        value = getattr(seg, field)
        ok = isinstance(value, int | np.integer) and not isinstance(value, bool)
        if not ok or value < 1:
            raise ValueError(
                f"{type(seg).__name__}.{field} must be a positive integer (patches or "
                f"tokens), got {value!r}"
            )
        object.__setattr__(seg, field, int(value))


@dataclasses.dataclass(frozen=True)
class Text:
    """`n` consecutive text tokens."""

    n: int

    def __post_init__(self):
        _check_sizes(self, "n")

    @property
    def num_tokens(self) -> int:
        return self.n


@dataclasses.dataclass(frozen=True)
class Image:
    """An image of `h` rows by `w` columns of patches."""

    h: int
    w: int

    def __post_init__(self):
        _check_sizes(self, "h", "w")

    @property
    def num_tokens(self) -> int:
        return self.h * self.w


def _positive_number(name: str, value) -> float:
    ok = isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)
    if not ok or not 0 < value < float("inf"):
        raise ValueError(f"{name}={value!r} must be a positive number")
    return float(value)


@dataclasses.dataclass(frozen=True)
class Video:
    """A video of `t` frames of `h` rows by `w` columns of patches.

    `seconds_per_frame` is the time between consecutive frames of patches (Qwen2.5-VL's
    `second_per_grid_t`); None = unknown. Only `mrope` with `tokens_per_second` reads it.
    """

    t: int
    h: int
    w: int
    seconds_per_frame: float | None = None

    def __post_init__(self):
        _check_sizes(self, "t", "h", "w")
        if self.seconds_per_frame is not None:
            spf = _positive_number("Video.seconds_per_frame", self.seconds_per_frame)
            object.__setattr__(self, "seconds_per_frame", spf)

    def __repr__(self) -> str:
        spf = self.seconds_per_frame
        timed = "" if spf is None else f", seconds_per_frame={spf}"
        return f"Video(t={self.t}, h={self.h}, w={self.w}{timed})"

    @property
    def num_tokens(self) -> int:
        return self.t * self.h * self.w


Segment = Text | Image | Video
# A scheme places one visual segment: (segment, L, num_axes, **its settings) ->
# (positions [P, A] float64, 1-D position of the next token).
Scheme = Callable[..., tuple[np.ndarray, float]]


def _dims_and_coords(seg: Image | Video, num_axes: int) -> tuple[np.ndarray, np.ndarray]:
    """Grid sizes [A] and 1-based patch coordinates [P, A] on `num_axes` (2 or 3) axes."""
    return _grid(seg.t if isinstance(seg, Video) else 1, seg.h, seg.w, num_axes)


@functools.lru_cache(maxsize=1024)
def _grid(t: int, h: int, w: int, num_axes: int) -> tuple[np.ndarray, np.ndarray]:
    dims = np.array((t, h, w), np.float64)[3 - num_axes :]
    coords = np.indices((t, h, w)).reshape(3, -1).T[:, 3 - num_axes :] + 1.0  # (f, r, c)
    dims.flags.writeable = coords.flags.writeable = False  # shared by the cache
    return dims, coords


def _require_axes(
    scheme: str, seg: Segment, num_axes: int, allowed: tuple[int, ...], why: str
) -> None:
    if num_axes not in allowed:
        need = f"num_axes={allowed[0]}" if len(allowed) == 1 else f"num_axes in {allowed}"
        raise ValueError(
            f"scheme {scheme!r} cannot place {seg} with num_axes={num_axes}: {why}, "
            f"so it needs {need}"
        )


def _visual_axes(scheme: str, seg: Segment, num_axes: int) -> None:
    """Checks a (t, h, w)-style scheme: images on 2 or 3 axes, videos on 3."""
    if isinstance(seg, Video):
        _require_axes(scheme, seg, num_axes, (3,), "a video has axes (t, h, w)")
    else:
        _require_axes(
            scheme, seg, num_axes, (2, 3), "an image has axes (h, w), or (t, h, w) with t = 1"
        )


def _flat(seg: Segment, L: float, num_axes: int) -> tuple[np.ndarray, float]:
    n = seg.num_tokens
    return text_positions(L + 1.0, n, num_axes), L + 1.0 + n


def _frame_steps(seg: Segment, tokens_per_second: float | None) -> np.ndarray | None:
    """Qwen2.5-VL temporal offsets [t] of a video's frames, floor(f s tokens_per_second)
    for f = 0..t-1 (s its seconds_per_frame); None unless both are set."""
    spf = seg.seconds_per_frame if isinstance(seg, Video) else None
    if spf is None or tokens_per_second is None:
        return None
    return np.floor(np.arange(seg.t, dtype=np.float64) * spf * tokens_per_second)


def _mrope(
    seg: Segment, L: float, num_axes: int, *, tokens_per_second: float | None = None
) -> tuple[np.ndarray, float]:
    _visual_axes("mrope", seg, num_axes)
    dims, coords = _dims_and_coords(seg, num_axes)
    steps = _frame_steps(seg, tokens_per_second) if num_axes == 3 else None
    if steps is None:
        return L + coords, L + dims.max() + 1.0
    coords = coords.copy()  # the cached grid is shared
    coords[:, 0] = np.repeat(steps, seg.h * seg.w) + 1.0
    return L + coords, L + max(steps[-1] + 1.0, seg.h, seg.w) + 1.0


def _rope_tie_scheme(*, frac: bool) -> Scheme:
    name = "rope_tie_frac" if frac else "rope_tie"

    def place(seg: Segment, L: float, num_axes: int) -> tuple[np.ndarray, float]:
        if isinstance(seg, Video):
            raise ValueError(
                f"scheme {name!r} is defined for images only (2-D), got {seg}; "
                "use rope_tv or mrope for video"
            )
        _require_axes(name, seg, num_axes, (2,), f"{name} is 2-D, axes (h, w)")
        h, w = seg.h, seg.w
        if frac:
            steps = np.array(((w * h + 1) / (h + 1), (w * h + 1) / (w + 1)))
            span = w * h + 1
        else:
            steps = np.array((w + 1, h + 1), np.float64)
            span = (w + 1) * (h + 1)
        _, coords = _dims_and_coords(seg, 2)
        return L + coords * steps, L + float(span)

    return place


def _rope_tv(seg: Segment, L: float, num_axes: int) -> tuple[np.ndarray, float]:
    _visual_axes("rope_tv", seg, num_axes)
    dims, coords = _dims_and_coords(seg, num_axes)
    n = float(np.prod(dims))  # an image on 2 axes: wh; on 3 axes: wh * 1
    return L + (n - dims) / 2 + coords, L + n + 1.0


VIDEOROPE_DELTA = 2.0  # VideoRoPE's temporal spacing when `delta` is unset


def _videorope(
    seg: Segment, L: float, num_axes: int, *, delta: float | None = None
) -> tuple[np.ndarray, float]:
    _visual_axes("videorope", seg, num_axes)
    delta = VIDEOROPE_DELTA if delta is None else delta
    t = seg.t if isinstance(seg, Video) else 1
    _, coords = _grid(t, seg.h, seg.w, 3)  # 1-based (f, r, c)
    tau = L + 1.0 + delta * (coords[:, 0] - 1.0)  # the frame's time id
    rows = tau + coords[:, 1] - 1.0 - (seg.h - 1) // 2
    cols = tau + coords[:, 2] - 1.0 - (seg.w - 1) // 2
    pos = np.stack([tau, rows, cols], axis=-1)[:, 3 - num_axes :]
    return pos, L + 2.0 + delta * (t - 1)


SCHEMES: dict[str, Scheme] = {
    "flat": _flat,
    "mrope": _mrope,
    "rope_tie": _rope_tie_scheme(frac=False),
    "rope_tie_frac": _rope_tie_scheme(frac=True),
    "rope_tv": _rope_tv,
    "videorope": _videorope,
}
# Setting -> the schemes that read it (keywords of `positions` and friends).
SETTINGS: dict[str, tuple[str, ...]] = {
    "tokens_per_second": ("mrope",),
    "delta": ("videorope",),
}


def check_settings(scheme: str, **settings) -> dict[str, float]:
    """The settings that are set (not None), checked: each a positive number read by
    `scheme`. Raises ValueError naming the setting."""
    out = {}
    for name, value in settings.items():
        if name not in SETTINGS:
            raise ValueError(f"unknown layout setting {name!r}; allowed: {', '.join(SETTINGS)}")
        if value is None:
            continue
        value = _positive_number(name, value)
        if scheme not in SETTINGS[name]:
            readers = ", ".join(map(repr, SETTINGS[name]))
            raise ValueError(f"{name}={value!r} is read by scheme {readers} only, not {scheme!r}")
        out[name] = value
    return out


def _check_args(
    segments: Sequence[Segment], scheme: str, num_axes: int, settings: dict | None = None
) -> Scheme:
    """The scheme's placing function, its settings bound; ValueError on a bad argument."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown layout scheme {scheme!r}; allowed: {', '.join(SCHEMES)}")
    if isinstance(num_axes, bool) or not isinstance(num_axes, int | np.integer) or num_axes < 1:
        raise ValueError(f"num_axes must be a positive integer, got {num_axes!r}")
    for i, seg in enumerate(segments):
        if not isinstance(seg, Text | Image | Video):
            raise ValueError(f"segment {i} is {seg!r}; expected Text, Image or Video")
    settings = check_settings(scheme, **(settings or {}))
    return functools.partial(SCHEMES[scheme], **settings) if settings else SCHEMES[scheme]


def _layout(
    segments: Sequence[Segment], scheme: str, num_axes: int, settings: dict | None = None
) -> tuple[np.ndarray, float]:
    """Positions [T, A] float64 and the 1-D position of the next token."""
    place = _check_args(segments, scheme, num_axes, settings)
    num_axes = int(num_axes)
    blocks, start = [np.zeros((0, num_axes))], 0.0
    for seg in segments:
        fn = _flat if isinstance(seg, Text) else place
        block, start = fn(seg, start - 1.0, num_axes)
        blocks.append(block)
    return np.concatenate(blocks, axis=0), float(start)


def positions(segments: Sequence[Segment], scheme: str, num_axes: int, **settings) -> np.ndarray:
    """Position ids of every token and patch of one sequence.

    Args:
      segments: the sequence, e.g. `[Text(5), Image(h=3, w=4), Text(2)]`.
      scheme: a name from `SCHEMES`.
      num_axes: A, the number of position axes (`(h, w)` for 2, `(t, h, w)` for 3).
      **settings: the scheme's settings (`SETTINGS`: tokens_per_second for mrope,
        delta for videorope); None = unset.

    Returns:
      positions [T, A] float32, T = `num_tokens(segments)`; first text token at 0.

    Raises:
      ValueError: unknown scheme, a segment the scheme cannot place on `num_axes`, or a
        setting that is not a positive number read by the scheme.
    """
    return _layout(segments, scheme, num_axes, settings)[0].astype(np.float32)


def next_position(segments: Sequence[Segment], scheme: str, num_axes: int, **settings) -> float:
    """1-D position a text token appended after `segments` takes (for decoding)."""
    return _layout(segments, scheme, num_axes, settings)[1]


def timed(segments: Sequence[Segment], seconds_per_frame: float | None) -> list[Segment]:
    """`segments` with every video given `seconds_per_frame` (None: returned as they are)."""
    if seconds_per_frame is None:
        return list(segments)
    _positive_number("seconds_per_frame", seconds_per_frame)
    return [
        dataclasses.replace(s, seconds_per_frame=seconds_per_frame) if isinstance(s, Video) else s
        for s in segments
    ]


def text_positions(start, length: int, num_axes: int, *, xp=np):
    """Text continuing from `start`: position start + k on every axis, k < length.

    The one rule for text (and padding) positions, shared by the data, the model's
    default positions and decoding. `xp` is the array module (`numpy` on the host,
    `jax.numpy` inside traced code).

    Args:
      start: [B] (or a scalar) first position.

    Returns:
      float32 [B, length, A] ([length, A] for a scalar start).
    """
    start = xp.asarray(start, xp.float32)
    pos = start[..., None] + xp.arange(length, dtype=xp.float32)  # [..., length]
    return xp.broadcast_to(pos[..., None], (*pos.shape, num_axes))


def num_tokens(segments: Sequence[Segment]) -> int:
    """T, the number of tokens and patches in `segments`."""
    return sum(seg.num_tokens for seg in segments)


def modality(segments: Sequence[Segment]) -> np.ndarray:
    """Token types [T] int8: `TEXT` (0), `IMAGE` (1) patch or `VIDEO` (2) patch."""
    kinds = [
        TEXT if isinstance(s, Text) else IMAGE if isinstance(s, Image) else VIDEO for s in segments
    ]
    sizes = [seg.num_tokens for seg in segments]
    return np.repeat(np.array(kinds, np.int8), np.array(sizes, np.int64))


def batch_positions(
    batch: Sequence[Sequence[Segment]],
    scheme: str,
    num_axes: int,
    seq_len: int,
    *,
    truncate: bool = False,
    **settings,
) -> tuple[np.ndarray, np.ndarray]:
    """Positions of a batch of sequences, padded (or cut) to `seq_len`.

    Padded slots continue the text after the sequence (`next_position + k` on every
    axis, k = 0, 1, ...), so they sit where ordinary trailing tokens would.

    Args:
      batch: B segment lists.
      scheme: a name from `SCHEMES`.
      num_axes: A.
      seq_len: T, the padded length.
      truncate: cut sequences longer than `seq_len` instead of raising.
      **settings: the scheme's settings, as in `positions`.

    Returns:
      (positions [B, T, A] float32, mask [B, T] bool, True on real tokens).
    """
    _check_args((), scheme, num_axes, settings)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int | np.integer) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
    out = np.empty((len(batch), seq_len, int(num_axes)), np.float32)
    mask = np.zeros((len(batch), seq_len), bool)
    for b, segments in enumerate(batch):
        pos, start = _layout(segments, scheme, num_axes, settings)
        n = len(pos)
        if n > seq_len:
            if not truncate:
                raise ValueError(
                    f"sequence {b} has {n} tokens, more than seq_len={seq_len}; "
                    "pass truncate=True to cut it"
                )
            pos, n = pos[:seq_len], seq_len
        out[b, :n] = pos
        out[b, n:] = text_positions(start, seq_len - n, num_axes)
        mask[b, :n] = True
    return out, mask


_KINDS = {"text": (Text, 1), "image": (Image, 2), "video": (Video, 3)}


_SEGMENT = re.compile(r"\s*([a-zA-Z]+)\s*:\s*(\d+(?:\s*x\s*\d+)*)\s*(?:@\s*([^\s,]+)\s*)?")


def parse_segments(spec: str) -> list[Segment]:
    """Parses `"text:4,image:3x5,video:2x3x3,text:3"` (image `HxW`, video `TxHxW`, or
    `TxHxW@S` for a video with S seconds per frame)."""
    if not spec.strip():
        return []
    segments = []
    for item in spec.split(","):
        match = _SEGMENT.fullmatch(item)
        kind = match and _KINDS.get(match.group(1).lower())
        sizes = [int(s) for s in match.group(2).split("x")] if match else []
        timed_ok = not (match and match.group(3)) or (kind and kind[0] is Video)
        if not kind or len(sizes) != kind[1] or not timed_ok:
            raise ValueError(
                f"bad segment {item.strip()!r} in {spec!r}: expected text:N, "
                "image:HxW or video:TxHxW[@seconds_per_frame] separated by commas"
            )
        try:
            extra = {"seconds_per_frame": float(match.group(3))} if match.group(3) else {}
            segments.append(kind[0](*sizes, **extra))
        except ValueError as e:
            raise ValueError(f"bad segment {item.strip()!r} in {spec!r}: {e}") from None
    return segments


def format_segments(segments: Sequence[Segment]) -> str:
    """Inverse of `parse_segments`."""
    return ",".join(_format(s) for s in segments)


def _format(seg: Segment) -> str:
    if isinstance(seg, Text):
        return f"text:{seg.n}"
    if isinstance(seg, Image):
        return f"image:{seg.h}x{seg.w}"
    spf = "" if seg.seconds_per_frame is None else f"@{seg.seconds_per_frame!r}"
    return f"video:{seg.t}x{seg.h}x{seg.w}{spf}"
