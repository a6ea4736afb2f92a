"""Tests for rope_jax.layouts: docs/maths.md#multimodal-layouts identities, Qwen2-VL parity."""

import dataclasses
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rope_jax import layouts
from rope_jax.layouts import Image, Text, Video

SCHEMES = ["flat", "mrope", "rope_tie", "rope_tie_frac", "rope_tv", "videorope"]
FAST = settings(max_examples=60, deadline=None)

# --------------------------------------------------------------------- strategies

SIDE = st.integers(1, 6)
TEXT = st.builds(Text, st.integers(1, 8))
IMAGE = st.builds(Image, SIDE, SIDE)
VIDEO = st.builds(Video, st.integers(1, 4), SIDE, SIDE)
VISUAL_2D = IMAGE
VISUAL_3D = st.one_of(IMAGE, VIDEO)


@st.composite
def separated(draw, visual):
    """Segment lists where text sits between any two visual segments (as [IMG] markers
    do); the list may open or close with a visual segment."""
    visuals = draw(st.lists(visual, min_size=1, max_size=4))
    segs = [draw(TEXT)] if draw(st.booleans()) else []
    for i, v in enumerate(visuals):
        segs += ([draw(TEXT)] if i else []) + [v]
    return segs + ([draw(TEXT)] if draw(st.booleans()) else [])


def any_order(visual):
    """Any interleaving, visual segments possibly adjacent or absent."""
    return st.lists(st.one_of(TEXT, visual), max_size=8)


def _spans(segs):
    """(segment, first token index, one past its last token index) for every segment."""
    start = 0
    for seg in segs:
        yield seg, start, start + seg.num_tokens
        start += seg.num_tokens


def _neighbours(segs, scheme, num_axes):
    """For each visual segment: (segment, before, first, last, after) positions [A] in
    float64, `before`/`after` being the tokens around it (virtual at the ends)."""
    pos = layouts.positions(segs, scheme, num_axes).astype(np.float64)
    nxt = layouts.next_position(segs, scheme, num_axes)
    T = len(pos)
    out = []
    for seg, a, b in _spans(segs):
        if isinstance(seg, Text):
            continue
        before = pos[a - 1] if a > 0 else np.full(num_axes, -1.0)
        after = pos[b] if b < T else np.full(num_axes, nxt)
        out.append((seg, before, pos[a], pos[b - 1], after))
    return out


def test_schemes_and_settings_registries():
    assert list(layouts.SCHEMES) == SCHEMES
    assert layouts.SETTINGS == {"tokens_per_second": ("mrope",), "delta": ("videorope",)}


def _grid(block, seg, num_axes):
    """Block [P, A] of one visual segment -> [t, h, w, A] (images have t = 1)."""
    t = seg.t if isinstance(seg, Video) else 1
    return block.reshape(t, seg.h, seg.w, num_axes)


# ------------------------------------------------------------ 1. compatibility


@FAST
@given(st.lists(TEXT, max_size=5))
def test_text_only_is_rope_1d(segs):
    T = layouts.num_tokens(segs)
    for scheme in SCHEMES:
        for num_axes in (1, 2, 3, 4):
            pos = layouts.positions(segs, scheme, num_axes)
            assert pos.shape == (T, num_axes) and pos.dtype == np.float32
            np.testing.assert_array_equal(pos, np.repeat(np.arange(T)[:, None], num_axes, 1))
            assert layouts.next_position(segs, scheme, num_axes) == T


def test_golden_small_examples():
    # Text(2), Image(h=2, w=3), Text(1): L = 1, computed by hand (docs/maths.md).
    segs = [Text(2), Image(h=2, w=3), Text(1)]
    text = [[0, 0], [1, 1]]
    expected = {
        "flat": [[i, i] for i in range(9)],
        "mrope": text + [[2, 2], [2, 3], [2, 4], [3, 2], [3, 3], [3, 4], [5, 5]],
        "rope_tie": text + [[5, 4], [5, 7], [5, 10], [9, 4], [9, 7], [9, 10], [13, 13]],
        "rope_tie_frac": text
        + [[1 + r * 7 / 3, 1 + c * 7 / 4] for r in (1, 2) for c in (1, 2, 3)]
        + [[8, 8]],
        "rope_tv": text + [[4, 3.5], [4, 4.5], [4, 5.5], [5, 3.5], [5, 4.5], [5, 5.5], [8, 8]],
    }
    for scheme, want in expected.items():
        got = layouts.positions(segs, scheme, 2)
        np.testing.assert_allclose(got, np.array(want, np.float32), rtol=0, atol=1e-6)
    # Video(t=2, h=1, w=2) after one token, 3-D rope_tv: L = 0, n = 4,
    # b = (t, h, w) offsets (1, 1.5, 1).
    got = layouts.positions([Text(1), Video(2, 1, 2), Text(1)], "rope_tv", 3)
    want = [[0, 0, 0], [2, 2.5, 2], [2, 2.5, 3], [3, 2.5, 2], [3, 2.5, 3], [5, 5, 5]]
    np.testing.assert_array_equal(got, np.array(want, np.float32))
    # mrope on 3 axes: video at L + (f, r, c); next text at L + max(t, h, w) + 1.
    got = layouts.positions([Text(1), Video(3, 1, 2), Text(1)], "mrope", 3)
    want = [[0, 0, 0], [1, 1, 1], [1, 1, 2], [2, 1, 1], [2, 1, 2], [3, 1, 1], [3, 1, 2]]
    np.testing.assert_array_equal(got, np.array(want + [[4, 4, 4]], np.float32))


# -------------------------------------------- 2. rope_tv symmetry and equivalence


@FAST
@given(separated(VISUAL_2D), separated(VISUAL_3D))
def test_rope_tv_symmetry_and_equivalence(segs2, segs3):
    for segs, num_axes in ((segs2, 2), (segs3, 3)):
        for seg, before, first, last, after in _neighbours(segs, "rope_tv", num_axes):
            L = before[0]
            np.testing.assert_array_equal(before, np.full(num_axes, L))  # text: (L, ..., L)
            np.testing.assert_array_equal(first - before, after - last)  # symmetry
            np.testing.assert_array_equal(after, np.full(num_axes, L + seg.num_tokens + 1))


# ----------------------------------------------------------- 3. rope_tie


@FAST
@given(separated(VISUAL_2D))
def test_rope_tie_integer_symmetry_and_next_text(segs):
    pos = layouts.positions(segs, "rope_tie", 2)
    np.testing.assert_array_equal(pos, np.round(pos))  # all ids integers
    for seg, before, first, last, after in _neighbours(segs, "rope_tie", 2):
        L = before[0]
        np.testing.assert_array_equal(first - before, after - last)
        np.testing.assert_array_equal(first - before, [seg.w + 1, seg.h + 1])  # (s, t)
        np.testing.assert_array_equal(after, np.full(2, L + (seg.w + 1) * (seg.h + 1)))


@FAST
@given(separated(VISUAL_2D))
def test_rope_tie_frac_symmetry_and_next_text(segs):
    for seg, before, first, last, after in _neighbours(segs, "rope_tie_frac", 2):
        L, h, w = before[0], seg.h, seg.w
        np.testing.assert_array_equal(after, np.full(2, L + w * h + 1))  # equivalence
        np.testing.assert_allclose(first - before, after - last, atol=1e-4)
        np.testing.assert_allclose(
            first - before, [(w * h + 1) / (h + 1), (w * h + 1) / (w + 1)], atol=1e-4
        )


@FAST
@given(separated(VISUAL_3D))
def test_mrope_next_text_is_max_plus_one(segs):
    for num_axes in (2, 3):
        use = [s for s in segs if num_axes == 3 or not isinstance(s, Video)]
        pos = layouts.positions(use, "mrope", num_axes)
        for seg, a, b in _spans(use):
            if not isinstance(seg, Text):
                L = pos[a - 1, 0] if a else -1.0
                np.testing.assert_array_equal(pos[a], np.full(num_axes, L + 1))
                nxt = pos[b, 0] if b < len(pos) else layouts.next_position(use, "mrope", num_axes)
                assert nxt == pos[a:b].max() + 1


# ----------------------------------------------------------- 4. steps in an image


@FAST
@given(any_order(VISUAL_3D))
def test_steps_between_neighbouring_patches(segs):
    for num_axes, scheme in [(2, s) for s in SCHEMES] + [(3, s) for s in ("mrope", "rope_tv")]:
        use = [s for s in segs if num_axes == 3 or not isinstance(s, Video)]
        pos = layouts.positions(use, scheme, num_axes).astype(np.float64)
        for seg, a, b in _spans(use):
            if isinstance(seg, Text):
                continue
            g = _grid(pos[a:b], seg, num_axes)  # [t, h, w, A]
            unit = np.eye(num_axes)
            if scheme == "flat":
                row, col = np.full(num_axes, seg.w), np.ones(num_axes)
            elif scheme == "rope_tie":
                row, col = [seg.w + 1, 0], [0, seg.h + 1]
            elif scheme == "rope_tie_frac":
                k = seg.h * seg.w + 1
                row, col = [k / (seg.h + 1), 0], [0, k / (seg.w + 1)]
            else:  # mrope, rope_tv, videorope
                row, col = unit[-2], unit[-1]
            np.testing.assert_allclose(
                np.diff(g, axis=1), np.broadcast_to(row, g[:, 1:].shape), atol=1e-4
            )
            np.testing.assert_allclose(
                np.diff(g, axis=2), np.broadcast_to(col, g[:, :, 1:].shape), atol=1e-4
            )
            if num_axes == 3:
                np.testing.assert_array_equal(
                    np.diff(g, axis=0), np.broadcast_to(unit[0], g[1:].shape)
                )


# ------------------------------------------------------ 5. Qwen2-VL parity

# Special token ids of the Qwen2-VL config; ordinary text ids are drawn below 1000.
VISION_START_ID, VISION_END_ID, IMAGE_ID, VIDEO_ID = 151652, 151653, 151655, 151656


def _qwen2vl_get_rope_index(input_ids, image_grid_thw, video_grid_thw, spatial_merge_size=2):
    """NumPy port of Qwen2-VL's `get_rope_index` for one unpadded sequence.

    input_ids [T] int; *_grid_thw [N, 3] vision-encoder grids (before the 2x2 merge).
    Returns position ids [3, T] (axes t, h, w).
    """
    vision_start = np.flatnonzero(input_ids == VISION_START_ID)
    vision_tokens = input_ids[vision_start + 1]
    image_nums = int((vision_tokens == IMAGE_ID).sum())
    video_nums = int((vision_tokens == VIDEO_ID).sum())
    input_tokens = input_ids.tolist()
    llm_pos_ids_list = []
    st_ = 0
    image_index = video_index = 0
    remain_images, remain_videos = image_nums, video_nums
    for _ in range(image_nums + video_nums):
        if IMAGE_ID in input_tokens and remain_images > 0:
            ed_image = input_tokens.index(IMAGE_ID, st_)
        else:
            ed_image = len(input_tokens) + 1
        if VIDEO_ID in input_tokens and remain_videos > 0:
            ed_video = input_tokens.index(VIDEO_ID, st_)
        else:
            ed_video = len(input_tokens) + 1
        if ed_image < ed_video:
            t, h, w = image_grid_thw[image_index]
            image_index += 1
            remain_images -= 1
            ed = ed_image
        else:
            t, h, w = video_grid_thw[video_index]
            video_index += 1
            remain_videos -= 1
            ed = ed_video
        llm_t, llm_h, llm_w = int(t), int(h) // spatial_merge_size, int(w) // spatial_merge_size
        text_len = ed - st_
        st_idx = llm_pos_ids_list[-1].max() + 1 if llm_pos_ids_list else 0
        llm_pos_ids_list.append(np.broadcast_to(np.arange(text_len), (3, text_len)) + st_idx)
        t_index = np.repeat(np.arange(llm_t), llm_h * llm_w)
        h_index = np.tile(np.repeat(np.arange(llm_h), llm_w), llm_t)
        w_index = np.tile(np.arange(llm_w), llm_t * llm_h)
        llm_pos_ids_list.append(np.stack([t_index, h_index, w_index]) + text_len + st_idx)
        st_ = ed + llm_t * llm_h * llm_w
    if st_ < len(input_tokens):
        st_idx = llm_pos_ids_list[-1].max() + 1 if llm_pos_ids_list else 0
        text_len = len(input_tokens) - st_
        llm_pos_ids_list.append(np.broadcast_to(np.arange(text_len), (3, text_len)) + st_idx)
    return np.concatenate(llm_pos_ids_list, axis=1)


def _qwen2vl_inputs(segs, rng):
    """Token ids and encoder grids for a Qwen2-VL prompt with the LLM grids of `segs`."""
    ids, images, videos = [], [], []
    for i, seg in enumerate(segs):
        if isinstance(seg, Text):
            text = rng.integers(0, 1000, seg.n)
            if i + 1 < len(segs) and not isinstance(segs[i + 1], Text):
                text[-1] = VISION_START_ID
            if i > 0 and not isinstance(segs[i - 1], Text) and seg.n > 1:
                text[0] = VISION_END_ID
            ids += text.tolist()
        elif isinstance(seg, Image):
            ids += [IMAGE_ID] * seg.num_tokens
            images.append((1, 2 * seg.h, 2 * seg.w))
        else:
            ids += [VIDEO_ID] * seg.num_tokens
            videos.append((seg.t, 2 * seg.h, 2 * seg.w))
    return np.array(ids), np.array(images).reshape(-1, 3), np.array(videos).reshape(-1, 3)


@st.composite
def qwen_prompts(draw):
    """Text with interleaved images (t = 1) and videos (t > 1), each visual segment
    preceded by text ending in <|vision_start|>."""
    visual = st.one_of(IMAGE, st.builds(Video, st.integers(2, 4), SIDE, SIDE))
    segs = []
    for v in draw(st.lists(visual, max_size=4)):
        segs += [draw(TEXT), v]
    return segs + ([draw(TEXT)] if draw(st.booleans()) or not segs else [])


@FAST
@given(qwen_prompts(), st.integers(0, 2**31 - 1))
def test_mrope_matches_qwen2vl_get_rope_index(segs, seed):
    ids, image_grid, video_grid = _qwen2vl_inputs(segs, np.random.default_rng(seed))
    ref = _qwen2vl_get_rope_index(ids, image_grid, video_grid).T.astype(np.float64)  # [T, 3]
    pos = layouts.positions(segs, "mrope", 3).astype(np.float64)
    assert pos.shape == ref.shape
    shift = pos[0, 0] - ref[0, 0]
    np.testing.assert_array_equal(pos, ref + shift)
    # Decoding continues at max + 1 (Qwen2-VL's rope delta).
    assert layouts.next_position(segs, "mrope", 3) == ref.max() + 1 + shift


def test_qwen2vl_reference_port_golden():
    # The documented example: a 3x2x2 video (LLM grid) after 3 text tokens.
    segs = [Text(3), Video(3, 2, 2), Text(5)]
    ids, image_grid, video_grid = _qwen2vl_inputs(segs, np.random.default_rng(0))
    ref = _qwen2vl_get_rope_index(ids, image_grid, video_grid)
    np.testing.assert_array_equal(ref[0, 3:], [3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 6, 7, 8, 9, 10])
    np.testing.assert_array_equal(ref[1, 3:], [3, 3, 4, 4] * 3 + [6, 7, 8, 9, 10])
    np.testing.assert_array_equal(ref[2, 3:], [3, 4, 3, 4] * 3 + [6, 7, 8, 9, 10])


# ------------------------------------------ 6. Qwen2.5-VL time-aligned M-RoPE


def test_time_aligned_mrope_by_hand():
    # Text(3), a 3-frame 2x2 video one second per frame at 2 ids a second, Text(2): L = 2,
    # frames at t = 3, 5, 7 (offsets floor(f * 1 * 2)), rows / columns at 3, 4; the
    # text continues at the largest id plus one, 8.
    segs = [Text(3), Video(3, 2, 2, seconds_per_frame=1.0), Text(2)]
    got = layouts.positions(segs, "mrope", 3, tokens_per_second=2)
    grid = [[t, r, c] for t in (3, 5, 7) for r in (3, 4) for c in (3, 4)]
    want = [[0, 0, 0], [1, 1, 1], [2, 2, 2], *grid, [8, 8, 8], [9, 9, 9]]
    np.testing.assert_array_equal(got, np.array(want, np.float32))
    assert layouts.next_position(segs, "mrope", 3, tokens_per_second=2) == 10
    # Fractional steps are cut to integers as the reference's int cast does:
    # 0.5 s a frame at 3 ids a second gives offsets 0, 1.5 -> 1, 3.
    segs = [Text(1), Video(3, 1, 1, seconds_per_frame=0.5), Text(1)]
    got = layouts.positions(segs, "mrope", 3, tokens_per_second=3)
    want = [[0, 0, 0], [1, 1, 1], [2, 1, 1], [4, 1, 1], [5, 5, 5]]
    np.testing.assert_array_equal(got, np.array(want, np.float32))
    # A short clip sampled fast: the time ids stay below the grid's, text after the grid.
    segs = [Video(2, 3, 3, seconds_per_frame=0.25), Text(1)]
    got = layouts.positions(segs, "mrope", 3, tokens_per_second=2)
    np.testing.assert_array_equal(got[[0, 9, 17, 18]], [[0, 0, 0], [0, 0, 0], [0, 2, 2], [3] * 3])


def test_time_alignment_needs_both_settings_and_leaves_the_rest_alone():
    plain = [Text(2), Video(3, 2, 2), Image(2, 3), Text(1)]
    timed = layouts.timed(plain, 1.0)
    assert timed[1] == Video(3, 2, 2, seconds_per_frame=1.0) and timed[2] is plain[2]
    base = layouts.positions(plain, "mrope", 3)
    np.testing.assert_array_equal(layouts.positions(plain, "mrope", 3, tokens_per_second=2), base)
    np.testing.assert_array_equal(layouts.positions(timed, "mrope", 3), base)
    np.testing.assert_array_equal(
        layouts.positions(timed, "mrope", 3, tokens_per_second=1), base
    )  # one id per frame, as mrope
    aligned = layouts.positions(timed, "mrope", 3, tokens_per_second=2)
    video = slice(2, 14)  # L = 1: t ids 2, 4, 6 instead of 2, 3, 4; rows and columns kept
    np.testing.assert_array_equal(np.unique(aligned[video, 0]), [2, 4, 6])
    np.testing.assert_array_equal(aligned[video, 1:], base[video, 1:])
    np.testing.assert_array_equal(aligned[14:] - base[14:], 2)  # the rest moves by 2
    for scheme in ("flat", "rope_tv", "videorope"):  # seconds_per_frame is read by mrope only
        np.testing.assert_array_equal(
            layouts.positions(timed, scheme, 3), layouts.positions(plain, scheme, 3)
        )


def _qwen25vl_get_rope_index(input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts,
                             tokens_per_second, spatial_merge_size=2):  # fmt: skip
    """NumPy port of Qwen2.5-VL's `get_rope_index` for one unpadded sequence: as
    Qwen2-VL's, but a video's frame f sits at int(f * second_per_grid_t * tokens_per_second)."""
    input_tokens = input_ids.tolist()
    llm_pos_ids_list, st_ = [], 0
    image_index = video_index = 0
    vision_start = np.flatnonzero(input_ids == VISION_START_ID)
    kinds = input_ids[vision_start + 1]
    remain_images, remain_videos = int((kinds == IMAGE_ID).sum()), int((kinds == VIDEO_ID).sum())
    for _ in range(remain_images + remain_videos):
        ed_image = input_tokens.index(IMAGE_ID, st_) if remain_images else len(input_tokens) + 1
        ed_video = input_tokens.index(VIDEO_ID, st_) if remain_videos else len(input_tokens) + 1
        if ed_image < ed_video:
            (t, h, w), second_per_grid_t = image_grid_thw[image_index], 0.0
            image_index, remain_images, ed = image_index + 1, remain_images - 1, ed_image
        else:
            (t, h, w), second_per_grid_t = video_grid_thw[video_index], 1.0
            if second_per_grid_ts is not None:
                second_per_grid_t = second_per_grid_ts[video_index]
            video_index, remain_videos, ed = video_index + 1, remain_videos - 1, ed_video
        llm_t, llm_h, llm_w = int(t), int(h) // spatial_merge_size, int(w) // spatial_merge_size
        text_len = ed - st_
        st_idx = llm_pos_ids_list[-1].max() + 1 if llm_pos_ids_list else 0
        llm_pos_ids_list.append(np.broadcast_to(np.arange(text_len), (3, text_len)) + st_idx)
        expanded = np.repeat(np.arange(llm_t), llm_h * llm_w)
        t_index = (expanded * second_per_grid_t * tokens_per_second).astype(np.int64)
        h_index = np.tile(np.repeat(np.arange(llm_h), llm_w), llm_t)
        w_index = np.tile(np.arange(llm_w), llm_t * llm_h)
        llm_pos_ids_list.append(np.stack([t_index, h_index, w_index]) + text_len + st_idx)
        st_ = ed + llm_t * llm_h * llm_w
    if st_ < len(input_tokens):
        st_idx = llm_pos_ids_list[-1].max() + 1 if llm_pos_ids_list else 0
        text_len = len(input_tokens) - st_
        llm_pos_ids_list.append(np.broadcast_to(np.arange(text_len), (3, text_len)) + st_idx)
    return np.concatenate(llm_pos_ids_list, axis=1)


SECONDS = st.sampled_from([0.25, 0.5, 1.0, 2.0, 4.0 / 3.0])


@FAST
@given(qwen_prompts(), st.lists(SECONDS, min_size=4, max_size=4), st.sampled_from([1, 2, 3, 25]))
def test_time_aligned_mrope_matches_qwen25vl_get_rope_index(segs, seconds, tokens_per_second):
    videos = iter(seconds)
    segs = [dataclasses.replace(s, seconds_per_frame=next(videos)) if isinstance(s, Video) else s
            for s in segs]  # fmt: skip
    ids, image_grid, video_grid = _qwen2vl_inputs(segs, np.random.default_rng(0))
    per_video = [s.seconds_per_frame for s in segs if isinstance(s, Video)]
    ref = _qwen25vl_get_rope_index(ids, image_grid, video_grid, per_video, tokens_per_second)
    pos = layouts.positions(segs, "mrope", 3, tokens_per_second=tokens_per_second)
    np.testing.assert_array_equal(pos.astype(np.float64), ref.T.astype(np.float64))
    nxt = layouts.next_position(segs, "mrope", 3, tokens_per_second=tokens_per_second)
    assert nxt == ref.max() + 1


# ------------------------------------------------------------- 7. VideoRoPE


def test_videorope_by_hand():
    # Text(2), a 2-frame 2x3 video, Text(1); delta 2: L = 1, frames at tau = 2, 4; rows at
    # tau + (0, 1) (offset (2 - 1) // 2 = 0), columns at tau + (-1, 0, 1); next text tau + 1.
    segs = [Text(2), Video(2, 2, 3), Text(1)]
    frame = lambda tau: [[tau, tau + r, tau + c] for r in (0, 1) for c in (-1, 0, 1)]
    want = [[0, 0, 0], [1, 1, 1], *frame(2), *frame(4), [5, 5, 5]]
    np.testing.assert_array_equal(layouts.positions(segs, "videorope", 3), want)
    want = [[0, 0, 0], [1, 1, 1], *frame(2), *frame(5), [6, 6, 6]]
    np.testing.assert_array_equal(layouts.positions(segs, "videorope", 3, delta=3), want)
    # A 3x3 image: one frame centred on tau = L + 1; on 2 axes the (h, w) part of it.
    segs = [Text(1), Image(3, 3), Text(1)]
    grid = [[1 + r, 1 + c] for r in (-1, 0, 1) for c in (-1, 0, 1)]
    np.testing.assert_array_equal(layouts.positions(segs, "videorope", 2), [[0, 0], *grid, [2, 2]])
    got3 = layouts.positions(segs, "videorope", 3)
    np.testing.assert_array_equal(got3[1:10], [[1, h, w] for h, w in grid])


def _videorope_get_rope_index(input_ids, image_grid_thw, video_grid_thw, scale_factor,
                              spatial_merge_size=2):  # fmt: skip
    """NumPy port of VideoRoPE's position ids (its `get_t_scale_rope_index`) for one
    unpadded sequence: frame f at tau = start + f * scale_factor, rows and columns
    shifted to tau minus half the grid ((n - 1) // 2), text resuming after the last tau."""
    input_tokens = input_ids.tolist()
    llm_pos_ids_list, st_ = [], 0
    image_index = video_index = 0
    vision_start = np.flatnonzero(input_ids == VISION_START_ID)
    kinds = input_ids[vision_start + 1]
    remain_images, remain_videos = int((kinds == IMAGE_ID).sum()), int((kinds == VIDEO_ID).sum())
    for _ in range(remain_images + remain_videos):
        ed_image = input_tokens.index(IMAGE_ID, st_) if remain_images else len(input_tokens) + 1
        ed_video = input_tokens.index(VIDEO_ID, st_) if remain_videos else len(input_tokens) + 1
        if ed_image < ed_video:
            t, h, w = image_grid_thw[image_index]
            image_index, remain_images, ed = image_index + 1, remain_images - 1, ed_image
        else:
            t, h, w = video_grid_thw[video_index]
            video_index, remain_videos, ed = video_index + 1, remain_videos - 1, ed_video
        llm_t, llm_h, llm_w = int(t), int(h) // spatial_merge_size, int(w) // spatial_merge_size
        text_len = ed - st_
        st_idx = llm_pos_ids_list[-1][0].max() + 1 if llm_pos_ids_list else 0
        llm_pos_ids_list.append(np.broadcast_to(np.arange(text_len), (3, text_len)) + st_idx)
        t_index = np.repeat(np.arange(llm_t), llm_h * llm_w).astype(np.float64)
        h_index = np.tile(np.repeat(np.arange(llm_h), llm_w), llm_t) - (llm_h - 1) // 2
        w_index = np.tile(np.arange(llm_w), llm_t * llm_h) - (llm_w - 1) // 2
        t_index = t_index * scale_factor + text_len + st_idx
        llm_pos_ids_list.append(np.stack([t_index, h_index + t_index, w_index + t_index]))
        st_ = ed + llm_t * llm_h * llm_w
    if st_ < len(input_tokens):
        st_idx = llm_pos_ids_list[-1][0].max() + 1 if llm_pos_ids_list else 0
        text_len = len(input_tokens) - st_
        llm_pos_ids_list.append(np.broadcast_to(np.arange(text_len), (3, text_len)) + st_idx)
    return np.concatenate(llm_pos_ids_list, axis=1)


@FAST
@given(qwen_prompts(), st.sampled_from([1.0, 2.0, 0.5, 3.0]))
def test_videorope_matches_its_reference_position_ids(segs, delta):
    ids, image_grid, video_grid = _qwen2vl_inputs(segs, np.random.default_rng(0))
    ref = _videorope_get_rope_index(ids, image_grid, video_grid, delta).T  # [T, 3]
    pos = layouts.positions(segs, "videorope", 3, delta=delta).astype(np.float64)
    np.testing.assert_array_equal(pos, ref)
    assert layouts.next_position(segs, "videorope", 3, delta=delta) == ref[:, 0].max() + 1


@FAST
@given(separated(VISUAL_3D), st.sampled_from([None, 1.0, 2.0, 0.5, 3.0]))
def test_videorope_diagonal_layout_and_temporal_spacing(segs, delta):
    step = layouts.VIDEOROPE_DELTA if delta is None else delta
    pos = layouts.positions(segs, "videorope", 3, delta=delta).astype(np.float64)
    nxt = layouts.next_position(segs, "videorope", 3, delta=delta)
    for seg, a, b in _spans(segs):
        if isinstance(seg, Text):
            continue
        L = pos[a - 1, 0] if a else -1.0
        g = _grid(pos[a:b], seg, 3)  # [t, h, w, 3]
        tau = g[:, 0, 0, 0]
        # Adjustable temporal spacing: frames delta apart from L + 1; text after at +1.
        np.testing.assert_array_equal(tau, L + 1 + step * np.arange(len(tau)))
        np.testing.assert_array_equal(g[..., 0], np.broadcast_to(tau[:, None, None], g.shape[:3]))
        after = pos[b, 0] if b < len(pos) else nxt
        assert after == tau[-1] + 1
        # Diagonal layout: every frame is the same grid, moved along the diagonal by tau,
        # and centred on it: the offsets run from -((n - 1) // 2) to n // 2.
        offsets = g[..., 1:] - tau[:, None, None, None]
        np.testing.assert_array_equal(offsets, np.broadcast_to(offsets[:1], offsets.shape))
        rows, cols = offsets[0, :, 0, 0], offsets[0, 0, :, 1]
        np.testing.assert_array_equal(rows, np.arange(seg.h) - (seg.h - 1) // 2)
        np.testing.assert_array_equal(cols, np.arange(seg.w) - (seg.w - 1) // 2)
        assert rows.sum() in (0, seg.h // 2) and cols.sum() in (0, seg.w // 2)  # centred


def test_settings_errors():
    segs = [Text(1), Video(2, 2, 2, seconds_per_frame=1.0)]
    cases = [
        ("mrope", dict(tokens_per_second=0), r"tokens_per_second=0 must be a positive number"),
        ("mrope", dict(tokens_per_second=True), r"tokens_per_second=True must be a positive"),
        ("videorope", dict(delta=-2.0), r"delta=-2\.0 must be a positive number"),
        ("mrope", dict(delta=2.0), r"delta=2\.0 is read by scheme 'videorope' only, not 'mrope'"),
        ("rope_tv", dict(tokens_per_second=2), r"read by scheme 'mrope' only, not 'rope_tv'"),
        ("mrope", dict(fps=2), r"unknown layout setting 'fps'; allowed: tokens_per_second, delta"),
    ]
    for scheme, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            layouts.positions(segs, scheme, 3, **kw)
        with pytest.raises(ValueError, match=match):
            layouts.next_position(segs, scheme, 3, **kw)
        with pytest.raises(ValueError, match=match):
            layouts.batch_positions([segs], scheme, 3, 16, **kw)
    for bad in (0, -1.0, "1", float("nan"), float("inf")):
        with pytest.raises(ValueError, match="seconds_per_frame=.* must be a positive number"):
            Video(2, 2, 2, seconds_per_frame=bad)
        with pytest.raises(ValueError, match="seconds_per_frame=.* must be a positive number"):
            layouts.timed(segs, bad)
    # Unset settings (None) are no settings, for any scheme.
    np.testing.assert_array_equal(
        layouts.positions(segs, "rope_tv", 3, tokens_per_second=None, delta=None),
        layouts.positions(segs, "rope_tv", 3),
    )


def test_batch_positions_pass_the_settings():
    batch = [[Text(2), Video(3, 2, 2, seconds_per_frame=1.0), Text(1)], [Text(3)]]
    for scheme, kw in (("mrope", dict(tokens_per_second=2)), ("videorope", dict(delta=3))):
        pos, mask = layouts.batch_positions(batch, scheme, 3, 20, **kw)
        for b, segs in enumerate(batch):
            n = layouts.num_tokens(segs)
            np.testing.assert_array_equal(pos[b, :n], layouts.positions(segs, scheme, 3, **kw))
            nxt = layouts.next_position(segs, scheme, 3, **kw)
            np.testing.assert_array_equal(pos[b, n:, 0], nxt + np.arange(20 - n))
        assert mask.sum() == sum(map(layouts.num_tokens, batch))


# ---------------------------------------------- continuation and translation


@FAST
@given(any_order(VISUAL_3D), st.integers(1, 5))
def test_appending_keeps_prefix_and_continues_at_next_position(segs, k):
    for scheme in SCHEMES:
        for num_axes in (2, 3):
            use = _placeable(segs, scheme, num_axes)
            pos = layouts.positions(use, scheme, num_axes)
            longer = layouts.positions(use + [Text(k)], scheme, num_axes)
            np.testing.assert_array_equal(longer[: len(pos)], pos)
            nxt = layouts.next_position(use, scheme, num_axes)
            want = np.repeat(nxt + np.arange(k)[:, None], num_axes, 1)
            np.testing.assert_array_equal(longer[len(pos) :], want.astype(np.float32))


def _placeable(segs, scheme, num_axes):
    """The segments of `segs` that `scheme` accepts on `num_axes` axes."""
    if scheme in ("rope_tie", "rope_tie_frac"):
        return (
            [s for s in segs if isinstance(s, Text)]
            if num_axes != 2
            else [s for s in segs if not isinstance(s, Video)]
        )
    if num_axes == 1 and scheme != "flat":
        return [s for s in segs if isinstance(s, Text)]
    return [s for s in segs if num_axes >= 3 or not isinstance(s, Video)]


@FAST
@given(any_order(VISUAL_3D), st.integers(0, 30), st.integers(0, 30))
def test_translation_only_shifts_ids(tail, a, b):
    for scheme in SCHEMES:
        for num_axes in (1, 2, 3):
            use = _placeable(tail, scheme, num_axes)
            pa = layouts.positions(([Text(a)] if a else []) + use, scheme, num_axes)
            pb = layouts.positions(([Text(b)] if b else []) + use, scheme, num_axes)
            np.testing.assert_allclose(pb[b:], pa[a:] + (b - a), rtol=0, atol=1e-3)


# ----------------------------------------------------------- helpers and batch


@FAST
@given(any_order(VISUAL_3D))
def test_num_tokens_modality_and_dtype(segs):
    T = layouts.num_tokens(segs)
    kinds = layouts.modality(segs)
    assert kinds.shape == (T,) and kinds.dtype == np.int8
    for seg, a, b in _spans(segs):
        want = {Text: layouts.TEXT, Image: layouts.IMAGE, Video: layouts.VIDEO}[type(seg)]
        assert (kinds[a:b] == want).all()
    for num_axes in (1, 3, 4):
        pos = layouts.positions(segs, "flat", num_axes)
        assert pos.dtype == np.float32 and pos.shape == (T, num_axes)
        np.testing.assert_array_equal(pos, np.repeat(np.arange(T)[:, None], num_axes, 1))


@FAST
@given(
    st.lists(any_order(VISUAL_3D), min_size=1, max_size=4),
    st.integers(1, 80),
    st.sampled_from(["flat", "mrope", "rope_tv"]),
)
def test_batch_positions_pads_with_continuing_text(batch, seq_len, scheme):
    lengths = [layouts.num_tokens(s) for s in batch]
    if max(lengths) > seq_len:
        with pytest.raises(ValueError, match=f"seq_len={seq_len}"):
            layouts.batch_positions(batch, scheme, 3, seq_len)
    pos, mask = layouts.batch_positions(batch, scheme, 3, seq_len, truncate=True)
    assert pos.shape == (len(batch), seq_len, 3) and pos.dtype == np.float32
    assert mask.shape == (len(batch), seq_len) and mask.dtype == np.bool_
    for i, segs in enumerate(batch):
        n = min(lengths[i], seq_len)
        assert mask[i, :n].all() and not mask[i, n:].any()
        np.testing.assert_array_equal(pos[i, :n], layouts.positions(segs, scheme, 3)[:n])
        nxt = layouts.next_position(segs, scheme, 3)
        pad = np.repeat(nxt + np.arange(seq_len - n)[:, None], 3, 1)
        np.testing.assert_array_equal(pos[i, n:], pad.astype(np.float32))


TIMED_VIDEO = st.builds(Video, st.integers(1, 4), SIDE, SIDE, st.one_of(st.none(), SECONDS))


@FAST
@given(any_order(st.one_of(IMAGE, TIMED_VIDEO)))
def test_parse_format_round_trip(segs):
    spec = layouts.format_segments(segs)
    assert layouts.parse_segments(spec) == segs


def test_parse_segments_example_and_whitespace():
    got = layouts.parse_segments(" text:4, Image:3x5 ,video:2 x 3 x 3,text:3, video:2x1x1 @ 0.5")
    assert got == [Text(4), Image(h=3, w=5), Video(t=2, h=3, w=3), Text(3),
                   Video(2, 1, 1, seconds_per_frame=0.5)]  # fmt: skip
    assert layouts.parse_segments("") == []
    assert layouts.format_segments(got[-1:]) == "video:2x1x1@0.5"
    assert repr(got[2]) == "Video(t=2, h=3, w=3)"
    assert repr(got[-1]) == "Video(t=2, h=1, w=1, seconds_per_frame=0.5)"


def test_batch_positions_is_fast():
    rng = np.random.default_rng(0)
    batch = []
    for _ in range(256):
        segs = []
        while layouts.num_tokens(segs) < 2048:
            side = rng.integers(1, 9, 3).tolist()
            segs.append([Text(side[0] * 4), Image(*side[:2]), Video(*side)][rng.integers(3)])
        batch.append(segs)
    t0 = time.perf_counter()
    pos, mask = layouts.batch_positions(batch, "rope_tv", 3, 2048, truncate=True)
    assert time.perf_counter() - t0 < 2.0  # target well under a second; loose for slow CI
    assert mask.all() and pos.shape == (256, 2048, 3)


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "segs, scheme, num_axes, match",
    [
        ([Text(3)], "rope_3d", 3, r"unknown layout scheme 'rope_3d'.*rope_tv"),
        ([Text(3)], "flat", 0, r"num_axes must be a positive integer, got 0"),
        ([Video(2, 2, 2)], "mrope", 2, r"'mrope'.*Video\(t=2, h=2, w=2\).*num_axes=3"),
        ([Video(2, 2, 2)], "rope_tv", 2, r"'rope_tv'.*Video.*num_axes=2.*num_axes=3"),
        ([Video(2, 2, 2)], "rope_tie", 2, r"'rope_tie' is defined for images only"),
        ([Video(1, 2, 2)], "rope_tie_frac", 3, r"'rope_tie_frac' is defined for images only"),
        ([Image(2, 3)], "rope_tie", 3, r"'rope_tie'.*rope_tie is 2-D.*num_axes=2"),
        ([Image(2, 3)], "mrope", 4, r"'mrope'.*num_axes=4.*num_axes in \(2, 3\)"),
        ([Text(1), "image"], "flat", 1, r"segment 1 is 'image'; expected Text, Image or Video"),
    ]
    + [
        ([Text(1), Image(2, 3)], s, 1, rf"'{s}' cannot place Image\(h=2, w=3\) with num_axes=1")
        for s in SCHEMES[1:]
    ],
)
def test_layout_errors(segs, scheme, num_axes, match):
    with pytest.raises(ValueError, match=match):
        layouts.positions(segs, scheme, num_axes)
    with pytest.raises(ValueError, match=match):
        layouts.batch_positions([segs], scheme, num_axes, 64)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Text(0), r"Text\.n must be a positive integer.*got 0"),
        (lambda: Image(0, 3), r"Image\.h .*got 0"),
        (lambda: Image(2, -1), r"Image\.w .*got -1"),
        (lambda: Video(1, 0, 2), r"Video\.h .*got 0"),
        (lambda: Video(-3, 1, 2), r"Video\.t .*got -3"),
        (lambda: Image(2.5, 3), r"Image\.h .*got 2\.5"),
        (lambda: Text(True), r"Text\.n .*got True"),
    ],
)
def test_non_positive_sizes(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    "spec",
    [
        "text",
        "text:",
        "text:4,",
        "img:3x4",
        "image:3",
        "image:3x4x5",
        "video:2x3",
        "text:-1",
        "text:0",
        "image:axb",
        "text:4;image:3x3",
        "image:0x3",
        ",",
        "image:3x3@0.5",
        "text:3@1",
        "video:2x2x2@",
        "video:2x2x2@fast",
        "video:2x2x2@-1",
        "video:2x2x2@0",
    ],
)
def test_parse_segments_rejects_bad_strings(spec):
    with pytest.raises(ValueError, match="bad segment"):
        layouts.parse_segments(spec)


def test_batch_positions_rejects_bad_seq_len_and_counts_mask():
    with pytest.raises(ValueError, match="seq_len must be a positive integer, got 0"):
        layouts.batch_positions([[Text(1)]], "flat", 1, 0)
    pos, mask = layouts.batch_positions([[Text(2), Image(1, 2)], [Text(1)]], "rope_tv", 2, 5)
    np.testing.assert_array_equal(mask.sum(1), [4, 1])
    # rope_tv image 1x2 after L = 1: b = (1.5, 1); next text 4; padding continues at 4.
    np.testing.assert_array_equal(pos[0], [[0, 0], [1, 1], [2.5, 2], [2.5, 3], [4, 4]])
    np.testing.assert_array_equal(pos[1, :, 0], [0, 1, 2, 3, 4])
