"""Frequency surgery without training (`experiments.frequency_surgery`): the pair scores,
the four partial-RoPE choices, evaluation under other pairs, and the study end to end on an
imported HF fixture."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rope_jax.experiments import frequency_surgery as fs
from rope_jax.experiments import report
from rope_jax.nn import model as model_lib
from rope_jax.nn import probe
from tests.model_test import tiny_cfg, tokens
from tests.position_loss_test import imported  # noqa: F401 (a fixture: an imported HF model)


def test_the_four_choices_keep_the_pairs_mha2mla_keeps():
    assert fs.strategy_pairs("high", 3, 8)["index"] == (0, 1, 2)
    assert fs.strategy_pairs("low", 3, 8)["index"] == (5, 6, 7)
    assert fs.strategy_pairs("uniform", 4, 32)["index"] == (0, 8, 16, 24)
    scores = np.array([[[5, 1, 4, 3], [0, 9, 8, 1]], [[1, 2, 3, 4], [4, 3, 2, 1]]], float)
    got = fs.strategy_pairs("2norm", 2, 4, scores)
    assert got == {"rule": "heads", "index": (((0, 2), (1, 2)), ((2, 3), (0, 1)))}
    mask = fs.turning(got, 8, 2, 2)
    assert mask.shape == (2, 2, 4) and mask.sum() == 8 and mask[0, 1, 1] and not mask[0, 1, 0]
    for bad, said in [
        (("uniform", 3, 8), "uniform needs r dividing P=8"),
        (("high", 9, 8), "must be in 1..8"),
        (("mid", 2, 8), "is not one of"),
    ]:
        with pytest.raises(ValueError, match=said):
            fs.strategy_pairs(*bad, scores)  # fmt: skip


def test_pair_scores_are_the_mean_pair_lengths_of_q_and_k_summed_over_the_group():
    cfg = tiny_cfg()
    model = model_lib.Decoder(cfg, rngs=nnx.Rngs(0))
    tok = tokens()
    q_norms, k_norms = probe.pair_norms(model, tok)
    assert q_norms.shape == (2, 4, 4) and k_norms.shape == (2, 2, 4)
    # layer 0 by hand: its input is the embedding, normed
    block = model.blocks[0]
    x = jnp.take(model.embed[...], tok, axis=0)
    h = block.attn_norm(x)
    q = np.asarray(jnp.einsum("btd,dnh->btnh", h, block.attn.q_proj[...]))
    half = lambda a: np.sqrt(a[..., :4] ** 2 + a[..., 4:] ** 2).mean((0, 1))  # layout "half"
    np.testing.assert_allclose(np.asarray(q_norms[0]), half(q), rtol=1e-5)
    scores = np.asarray(probe.pair_scores(q_norms, k_norms))
    want = (np.asarray(q_norms).reshape(2, 2, 2, 4) * np.asarray(k_norms)[:, :, None]).sum(2)
    np.testing.assert_allclose(scores, want, rtol=1e-6)


def test_wilson_intervals_hold_the_rate_and_stay_inside_zero_one():
    assert report.wilson(0, 20) == (0.0, pytest.approx(0.161, abs=1e-3))
    assert report.wilson(20, 20) == (pytest.approx(0.839, abs=1e-3), 1.0)
    low, high = report.wilson(10, 20)
    assert low == pytest.approx(0.299, abs=1e-3) and high == pytest.approx(0.701, abs=1e-3)
    assert report.rate_line(17, 20) == "0.85 [0.64, 0.95] (n=20)"
    with pytest.raises(ValueError, match="at least one trial"):
        report.wilson(0, 0)


@pytest.mark.slow
def test_the_study_scores_every_variant_and_resumes(imported, tmp_path, capsys):  # noqa: F811
    out = str(tmp_path / "fs")
    args = [f"--workdir={imported}", f"--out={out}", "--keep=2,8", "--strategies=high,2norm",
            "--p=0.25", "--length=512", "--bucket=256", "--calibration=256",
            "--needle_lengths=512", "--examples=2", "--needle_variants=full,nope"]  # fmt: skip
    fs.main(args)
    got = json.load(open(os.path.join(out, "frequency_surgery.json")))
    cells = got["cells"]
    assert list(cells) == ["full", "high_2", "2norm_2", "high_8", "2norm_8", "p_0.25", "nope"]
    assert np.asarray(got["scores"]["scores"]).shape == (2, 2, 8)
    assert got["turning"]["high_2"] == 0.25 and got["turning"]["nope"] == 0.0
    # every pair kept is the run as trained; p = 0.25 is high at r = 2; freezing changes it
    for same in ("high_8", "2norm_8"):
        assert cells[same]["buckets"] == pytest.approx(cells["full"]["buckets"], abs=1e-5)
    assert cells["p_0.25"]["buckets"] == pytest.approx(cells["high_2"]["buckets"], abs=1e-6)
    assert abs(cells["nope"]["mean"] - cells["full"]["mean"]) > 1e-4
    assert set(got["needle"]) == {"full", "nope"} and got["needle"]["nope"]["512"]["examples"] == 2
    page = open(os.path.join(out, "frequency_surgery.md")).read()
    assert "| 2norm_2 | 25% |" in page and "(n=2)" in page and "not run" in page
    capsys.readouterr()
    fs.main(args)  # every cell is there: nothing is scored again
    assert "loss" in capsys.readouterr().out
    mtime = os.path.getmtime(os.path.join(out, "cells", "high_2.json"))
    fs.main(args)
    assert os.path.getmtime(os.path.join(out, "cells", "high_2.json")) == mtime


def test_bad_flags_are_one_line_before_anything_loads(tmp_path):
    for flags, said in [(["--strategies=mid"], "is not one of"), (["--p=1.5"], "in (0, 1)"),
                        (["--keep=a"], "comma-separated"),
                        (["--needle_variants=mid_8"], "'mid_8' is not a variant")]:  # fmt: skip
        with pytest.raises(SystemExit) as err:
            fs.main([f"--workdir={tmp_path}", f"--out={tmp_path / 'o'}", *flags])
        assert said in str(err.value) and "\n" not in str(err.value)
