"""End-to-end on the digit-grid tasks: train.py, eval.py's held-out splits, the sweep report."""

import json
import math
import os

import pytest

import eval as eval_lib
import train
from configs import multimodal
from rope_jax import data, harness
from rope_jax.experiments import report as report_lib
from rope_jax.experiments import sweep
from rope_jax.harness import metrics

pytestmark = pytest.mark.slow  # end-to-end training runs and a sweep

TINY = {"model.num_layers": 1, "model.embed_dim": 32, "model.num_heads": 2,
        "model.num_kv_heads": 1, "model.head_dim": 16, "model.mlp_dim": 64,
        "data.global_batch_size": 8, "train.num_steps": 6, "train.log_every_steps": 3,
        "train.eval_every_steps": 3, "train.ckpt_every_steps": 3, "eval.num_batches": 2,
        "eval.batch_size": 8}  # fmt: skip


def tiny(data_dir, arg="row=rope_tv", **overrides):
    config = multimodal.get_config(arg)
    config.update_from_flattened_dict(TINY)
    config.data.data_dir = data_dir
    config.update_from_flattened_dict(overrides)
    return config


def test_training_logs_answer_accuracy_and_eval_scores_every_held_out_split(data_dir, tmp_path):
    # checkpoints at the evaluations only (every 3 steps would be 13 saves)
    steps = {"train.num_steps": 40, "optim.lr": 1e-2, "train.eval_every_steps": 20,
             "train.ckpt_every_steps": 20}  # fmt: skip
    config = tiny(data_dir, **steps)
    train.train_and_evaluate(config, str(tmp_path))
    records = metrics.read_jsonl(str(tmp_path))
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < losses[0] - 1.0  # from ~log(259) towards the answers' entropy
    evals = [r for r in records if "eval/answer_accuracy" in r]
    assert [r["step"] for r in evals] == [20, 40]
    tasks = data.multimodal.tasks(config.data)
    assert all(f"eval/answer_accuracy/{t}" in evals[-1] for t in tasks)
    assert evals[-1]["eval/questions"] == 16  # eval.num_batches x eval.batch_size

    result = eval_lib.evaluate_checkpoint(str(tmp_path))
    assert list(result)[4:] == list(multimodal.HELD_OUT)  # after step, split, train_seq_len, T
    for split in multimodal.HELD_OUT:
        scores = result[split]
        assert scores["questions"] == 16 and 0.0 <= scores["answer_accuracy"] <= 1.0
        per_task = [scores[f"answer_accuracy/{t}"] for t in tasks]
        assert all(math.isnan(a) or 0.0 <= a <= 1.0 for a in per_task)
    saved = json.loads((tmp_path / "eval_40.json").read_text())
    assert saved["larger"]["loss"] == pytest.approx(result["larger"]["loss"])
    # The same checkpoint scored again gives the same numbers: held-out splits are fixed.
    again = eval_lib.evaluate_checkpoint(str(tmp_path), splits=["aspect"], tag="aspect")
    assert again["aspect"] == result["aspect"]


def test_video_rows_train_on_three_axes(data_dir, tmp_path):
    config = tiny(data_dir, "video=true,row=mrope", **{"train.num_steps": 3})
    out = train.train_and_evaluate(config, str(tmp_path))
    assert out["questions"] == 16 and set(data.kind(config.data).task_names) == {
        "video_lookup", "video_lookup_before"}  # fmt: skip


@pytest.mark.parametrize(
    "arg, overrides, match",
    [
        ("video=true,row=mrope", {"data.scheme": "rope_tie"}, "defined for images only"),
        ("row=mrope", {"eval.splits": ("test", "huge")}, "eval.splits names unknown split"),
        ("row=mrope", {"model.patch_dim": 16}, "model.patch_dim=16 must be 64"),
        ("row=flat", {"data.tasks": ("lookup", "read")}, "unknown task"),
    ],
)
def test_bad_multimodal_configs_fail_before_compiling(data_dir, tmp_path, arg, overrides, match):
    config = tiny(data_dir, arg, **overrides)
    with pytest.raises(ValueError, match=match):
        train.train_and_evaluate(config, str(tmp_path))
    assert not os.listdir(tmp_path)  # nothing written


def test_dry_run_of_a_multimodal_config(data_dir):
    report = harness.dry_run(tiny(data_dir))
    assert report["parameters"] > 0 and report["temp_bytes_per_device"] > 0


def test_sweep_scores_rows_by_answer_accuracy_on_each_split(data_dir, tmp_path, capsys):
    """The sweep (`sweep.main` in-process, as tests/sweep_test.py runs it; its runs are
    train.py and eval.py processes) ranks the rows by answer accuracy on every split."""
    workdir = tmp_path / "runs"
    argv = ["--config=configs/multimodal.py", f"--workdir={workdir}", "--rows=nope,rope_tv",
            f"--results={tmp_path}/table", "--set", ",".join(f"{k}={v}" for k, v in TINY.items()),
            "--set", f"data.data_dir={data_dir}"]  # fmt: skip
    sweep.main(argv)  # a failed run: SystemExit with the error line
    assert "answer accuracy test" in capsys.readouterr().out
    report = json.loads((tmp_path / "table.json").read_text())
    assert report["splits"] == list(multimodal.HELD_OUT) and report["seq_lens"] == ["48"]
    for row in ("nope", "rope_tv"):
        (run,) = report["rows"][row]["runs"]
        saved = json.loads((workdir / row / "seed_0" / "eval_6.json").read_text())
        assert run["accuracy"] == {s: saved[s]["answer_accuracy"] for s in multimodal.HELD_OUT}
    md = (tmp_path / "table.md").read_text()
    assert md == report_lib.render_splits_markdown(report)
    assert "| row | overrides | test acc | larger acc | aspect acc | long_prefix acc |" in md
    assert "## Answer accuracy per task" in md and (tmp_path / "table.png").stat().st_size > 0
    ranked = report_lib.split_summary(report)
    tests = [r["acc"]["test"][0] for r in ranked]
    assert tests == sorted(tests, reverse=True) and [r["rank"] for r in ranked] == [1, 2]
