"""The multimodal RoPE variants as experiment rows: Qwen3-VL interleaved M-RoPE, Qwen2.5-VL
time-aligned temporal ids and VideoRoPE (configs/multimodal.py VIDEO_ONLY_ROWS)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import multimodal as mm_config
from rope_jax import layouts, rotary
from rope_jax.data import multimodal
from rope_jax.experiments import plan
from rope_jax.harness import checks
from rope_jax.nn import model as model_lib

NEW_ROWS = ("mrope_interleaved", "mrope_time", "videorope")
# A smaller body with the tiny preset's head_dim (the rows' sections are per head_dim).
SMALL_BODY = {"model.num_layers": 1, "model.embed_dim": 32, "model.num_heads": 2,
              "model.num_kv_heads": 1, "model.mlp_dim": 64}  # fmt: skip
SEGMENTS = [layouts.Text(3), layouts.Video(3, 2, 2), layouts.Text(4)]


def _config(row, **overrides):
    config = mm_config.get_config(f"video=true,row={row}")
    config.update_from_flattened_dict(overrides)
    return config


def _positions(config, segments=SEGMENTS):
    """The row's positions [1, T, 3] as the data places them (data.* layout settings)."""
    seconds_per_frame, settings = multimodal.layout_settings(config.data)
    timed = layouts.timed(segments, seconds_per_frame)
    pos, _ = layouts.batch_positions([timed], config.data.scheme, 3, layouts.num_tokens(timed),
                                     **settings)  # fmt: skip
    return pos


def test_rows_are_video_only_and_named():
    assert tuple(mm_config.VIDEO_ONLY_ROWS) == NEW_ROWS
    assert set(NEW_ROWS) <= set(mm_config.VIDEO_ROWS)
    assert not set(NEW_ROWS) & set(mm_config.ROWS)
    with pytest.raises(ValueError, match="row='videorope' is not one of"):
        mm_config.get_config("video=false,row=videorope")


@pytest.mark.parametrize("size", ["tiny", "small", "1b"])
def test_each_new_row_builds_a_config_that_passes_check_config(size):
    for row in NEW_ROWS:
        config = mm_config.get_config(f"video=true,row={row},size={size}")
        checks.check_config(config)
        leaves = plan.leaves(config)
        for key, value in mm_config.row_overrides(row, size, True).items():
            assert leaves[key] == value, (row, key)
        spec = model_lib.rotation(config.model, 3, train_seq_len=config.data.seq_len)
        head_dim = config.model.head_dim
        axes = rotary.axis_of_pair(head_dim, spec, num_axes=3)
        if spec.allocation != "alternating":
            assert spec.sections == rotary.reference_sections(spec.allocation, head_dim, 3)
            np.testing.assert_array_equal(np.bincount(axes, minlength=3), spec.sections)


def test_rows_place_positions_as_their_models_do():
    """Hand-derived ids of text:3, video:3x2x2, text:4 under each row (L = 2)."""
    grid = lambda ts: [[t, 3 + r, 3 + c] for t in ts for r in (0, 1) for c in (0, 1)]
    text = lambda start, n: [[start + k] * 3 for k in range(n)]
    want = {
        "mrope": text(0, 3) + grid((3, 4, 5)) + text(6, 4),
        "mrope_interleaved": text(0, 3) + grid((3, 4, 5)) + text(6, 4),
        # one second a frame at 2 ids a second: frames 2 ids apart
        "mrope_time": text(0, 3) + grid((3, 5, 7)) + text(8, 4),
        # diagonal: each 2x2 frame at (tau, tau + r, tau + c) (offset (2 - 1) // 2 = 0),
        # frames delta = 2 apart, text resuming at the last tau + 1
        "videorope": text(0, 3)
        + [[t, t + r, t + c] for t in (3, 5, 7) for r in (0, 1) for c in (0, 1)]
        + text(8, 4),
    }
    for row, ids in want.items():
        np.testing.assert_array_equal(_positions(_config(row))[0], ids, err_msg=row)


@pytest.mark.slow  # ~10 s on 2 CPU cores: the first eager call compiles every op
def test_tiny_forward_pass_with_each_rows_positions():
    for row in NEW_ROWS:
        config = _config(row, **SMALL_BODY)
        checks.check_config(config)
        model = model_lib.Decoder(config.model, num_axes=3, train_seq_len=config.data.seq_len,
                                  rngs=nnx.Rngs(0))  # fmt: skip
        pos = _positions(config)
        t = pos.shape[1]
        is_patch = np.asarray(layouts.modality(SEGMENTS) > 0)[None]
        patches = np.random.default_rng(0).normal(size=(1, t, config.model.patch_dim))
        tokens = jnp.arange(t, dtype=jnp.int32)[None] % 50
        logits = model(tokens, jnp.asarray(pos), patches=jnp.asarray(patches, jnp.float32),
                       is_patch=jnp.asarray(is_patch))  # fmt: skip
        assert logits.shape == (1, t, config.model.vocab_size)
        assert np.isfinite(np.asarray(logits)).all()
        # Relative: moving every position by one id leaves the logits unchanged.
        moved = model(tokens, jnp.asarray(pos + 1.0), patches=jnp.asarray(patches, jnp.float32),
                      is_patch=jnp.asarray(is_patch))  # fmt: skip
        np.testing.assert_allclose(moved, logits, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize(
    "row, overrides, match",
    [
        ("mrope_time", {"data.scheme": "rope_tv"}, r"data\.tokens_per_second=2\.0 is read by"),
        ("mrope_time", {"data.seconds_per_frame": 0.0}, r"data\.seconds_per_frame=0\.0 must be"),
        ("videorope", {"data.delta": -1.0}, r"data\.delta=-1\.0 must be a positive number"),
        ("videorope", {"data.scheme": "mrope"}, r"data\.delta=2\.0 is read by scheme 'videorope'"),
        ("videorope", {"model.rope.sections": (4, 7, 5)},
         r"model\.rope\.sections=\(4, 7, 5\) do not fit allocation='videorope'"),
        ("mrope_interleaved", {"model.rope.sections": (4, 6, 6)},
         r"model\.rope\.sections=\(4, 6, 6\) do not fit allocation='mrope_interleaved'"),
        ("mrope_interleaved", {"model.rope.allocation": "mrope3"},
         r"model\.rope\.allocation='mrope3' is not one of .*'mrope_interleaved', 'videorope'"),
    ],
)  # fmt: skip
def test_bad_settings_fail_check_config_naming_the_field(row, overrides, match):
    with pytest.raises(ValueError, match=match):
        checks.check_config(_config(row, **overrides))


def test_data_batches_carry_each_rows_positions(data_dir):
    """The digit-video batches place patches with the row's layout settings."""
    for row in ("mrope_time", "videorope"):
        config = _config(row, **{"data.data_dir": data_dir})
        examples = multimodal.Examples(config.data, split="train", seed=0)
        batch = examples(np.arange(8))
        seconds_per_frame, settings = multimodal.layout_settings(config.data)
        assert settings and (seconds_per_frame is not None) == (row == "mrope_time")
        changed = False
        for i in range(8):
            _, seq = examples.example(i)
            segments = layouts.timed(seq.segments, seconds_per_frame)
            want = layouts.positions(segments, config.data.scheme, 3, **settings)
            n = min(len(want), batch["positions"].shape[1])
            np.testing.assert_array_equal(batch["positions"][i, :n], want[:n])
            changed |= not np.array_equal(want, layouts.positions(seq.segments, "mrope", 3))
        assert changed  # some video has 2 frames: its ids differ from plain mrope
