"""End-to-end: train.py / eval.py on a tiny config over the real Shakespeare corpus."""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import eval as eval_lib
import train
from configs import lm
from rope_jax import harness, provenance
from rope_jax.harness import checkpoint, metrics, resume
from tests.slurm_helpers import xla_flags

# End-to-end training runs; one test worker runs the module (its tests share the finished
# runs of `finished`, trained once, and the worker's compilation cache).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("train")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny(data_dir, **overrides):
    """A 1-layer model that trains a step in milliseconds."""
    config = lm.get_config("size=tiny")
    m = config.model
    m.num_layers, m.embed_dim, m.num_heads, m.num_kv_heads = 1, 32, 2, 1
    m.head_dim, m.mlp_dim = 16, 64
    config.data.data_dir = data_dir
    config.data.seq_len, config.data.global_batch_size = 32, 8
    config.optim.warmup_steps = 5
    config.train.num_steps = 20
    config.train.log_every_steps = 5
    config.train.eval_every_steps = 0
    config.train.ckpt_every_steps = 10
    config.eval.num_batches, config.eval.batch_size = 2, 8
    config.update_from_flattened_dict(overrides)
    return config


@pytest.fixture(scope="module")
def finished(data_dir, tmp_path_factory):
    """finished(**overrides): the workdir of a finished run of `tiny(data_dir, **overrides)`,
    trained in process once for the module (the tests that read the same run share it);
    copy it (`copy_of`) before changing it."""
    runs = {}

    def get(**overrides) -> str:
        config = tiny(data_dir, **overrides)
        key = json.dumps(_flat(config), sort_keys=True, default=str)
        if key not in runs:
            runs[key] = str(tmp_path_factory.mktemp("finished") / "run")
            train.train_and_evaluate(config, runs[key])
        return runs[key]

    return get


def copy_of(workdir, tmp_path, name="run") -> str:
    """A copy of a finished run's workdir, to change."""
    return shutil.copytree(workdir, str(tmp_path / name))


def final_params(workdir, config):
    run = harness.build(config)
    mngr = checkpoint.Manager(workdir, read_only=True)
    state, extra = mngr.restore(mngr.latest_step(), run.abstract)
    mngr.close()
    return jax.tree.leaves(jax.device_get(state["params"])), extra


def test_loss_falls_and_outputs_are_written(data_dir, tmp_path):
    config = tiny(data_dir, **{"train.num_steps": 60, "optim.lr": 1e-2})
    result = train.train_and_evaluate(config, str(tmp_path))
    records = metrics.read_jsonl(str(tmp_path))
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < losses[0] - 1.0, losses  # bytes: ~5.5 nats at init
    assert result["loss"] < 4.0 and result["tokens"] == 2 * 8 * 32
    assert any("eval/loss" in r for r in records)
    assert os.listdir(tmp_path / "tb")  # TensorBoard event files
    assert json.load(open(tmp_path / "config.json"))["model"]["rope"]["sites"] == "qk"
    assert checkpoint.Manager(str(tmp_path), read_only=True).steps() == [40, 50, 60]  # keep 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_resume_ends_with_exactly_the_same_parameters(data_dir, tmp_path, dtype, capsys, finished):
    """Bit-identical on one machine, bfloat16 matmuls included (provenance.jsonl names
    the processor: other CPUs take other bfloat16 kernels). The run is killed while
    saving step 20: Orbax writes a step under a temporary name and renames it once
    complete, so the kill leaves `20.orbax-checkpoint-tmp`, which the resume removes.
    The killed run is a copy of the straight one (training is deterministic: a second
    run from step 0 writes the same step 10), so only the resume trains here."""
    config = tiny(data_dir, **{"model.dtype": dtype})
    straight = finished(**{"model.dtype": dtype})  # trained from step 0 to 20 unbroken
    interrupted = copy_of(straight, tmp_path)  # as if a second run, to be killed at step 20
    ckpts = os.path.join(interrupted, "checkpoints")
    os.rename(os.path.join(ckpts, "20"), os.path.join(ckpts, "20.orbax-checkpoint-tmp"))
    capsys.readouterr()
    train.train_and_evaluate(config, interrupted)  # resumes from step 10
    assert "removed 20.orbax-checkpoint-tmp in " in capsys.readouterr().out
    assert sorted(os.listdir(ckpts)) == ["10", "20"]  # the leftover's disk space is back
    a, extra_a = final_params(straight, config)
    b, extra_b = final_params(interrupted, config)
    assert extra_a == extra_b  # data iterator position included
    starts = provenance.read_starts(interrupted)  # a line for each start, the resume's too
    assert [r["step"] for r in starts][0] == 0 and starts[-1]["step"] == 10, starts
    here = provenance.describe(provenance.code_version())
    assert {r["code"] for r in starts} == {here} and starts[-1]["jax"] == jax.__version__
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_resume_under_other_code_says_so_in_one_line(data_dir, tmp_path, capsys, finished):
    config = tiny(data_dir)
    workdir = copy_of(finished(), tmp_path)  # checkpoints at steps 10 and 20
    capsys.readouterr()
    with open(os.path.join(workdir, provenance.FILE), "a") as f:  # as if a later commit ran
        f.write(json.dumps({"step": 10, "code": "abc1234", "jax": jax.__version__,
                            "devices": provenance.devices()}) + "\n")  # fmt: skip
    shutil.rmtree(os.path.join(workdir, "checkpoints", "20"))  # resumes at step 10
    train.train_and_evaluate(config, workdir)
    here = provenance.describe(provenance.code_version())
    warnings = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning:")]
    assert warnings == [
        f"warning: step 10 resumes under other code or devices than the run's last start "
        f"(code abc1234 -> {here}); provenance.jsonl keeps each"
    ]
    train.train_and_evaluate(config.copy_and_resolve_references(), workdir)  # done: no start
    assert "warning" not in capsys.readouterr().err


def test_sigterm_saves_and_the_rerun_matches_an_uninterrupted_run(data_dir, tmp_path):
    # A step takes about 4 ms here: 500 steps leave the signal, sent as soon as the first
    # progress line (step 5) is printed, two seconds or more to land before the run ends.
    # It lands within a step or two of the line (step 6 when measured).
    steps = 500
    config = tiny(data_dir, **{"train.num_steps": steps, "train.ckpt_every_steps": steps})
    straight = str(tmp_path / "straight")
    train.train_and_evaluate(config, straight)

    workdir = str(tmp_path / "killed")
    cmd = [sys.executable, "train.py", "--config=configs/lm.py:size=tiny", f"--workdir={workdir}"]
    cmd += [f"--config.{k}={v}" for k, v in _flat(config).items()]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), text=True)  # fmt: skip
    head = []
    for line in proc.stdout:  # training has begun at its first step's line
        head.append(line)
        if line.startswith("step "):
            break
    proc.send_signal(signal.SIGTERM)
    out = "".join(head) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    saved = checkpoint.Manager(workdir, read_only=True).steps()
    assert len(saved) == 1 and 0 < saved[0] < steps, (saved, out)

    train.train_and_evaluate(config, workdir)  # the same command again resumes
    for x, y in zip(final_params(straight, config)[0], final_params(workdir, config)[0],
                    strict=True):  # fmt: skip
        np.testing.assert_array_equal(x, y)


def _flat(config, prefix=""):
    """Config leaves as --config.* overrides (tuples/strings in flag syntax)."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if hasattr(value, "items"):
            out.update(_flat(value, name + "."))
        elif isinstance(value, tuple):
            out[name] = "(" + ",".join(map(repr, value)) + ("," if len(value) == 1 else "") + ")"
        else:
            out[name] = value
    return out


def test_eval_restores_into_an_abstract_target_and_extrapolates(tmp_path, finished):
    workdir = copy_of(finished(), tmp_path)
    result = eval_lib.evaluate_checkpoint(workdir, seq_lens=[32, 64, 128], num_batches=2)
    assert result["step"] == 20
    assert [result[k]["tokens"] for k in ("32", "64", "128")] == [2 * 8 * t for t in (32, 64, 128)]
    saved = json.load(open(os.path.join(workdir, "eval_20.json")))
    assert saved["32"]["loss"] == pytest.approx(result["32"]["loss"])
    assert saved["32"]["perplexity"] == pytest.approx(np.exp(saved["32"]["loss"]), rel=1e-6)
    assert saved["code"] == provenance.describe(provenance.code_version()) and "code" not in result


def test_damaged_and_mismatched_checkpoints_give_one_clear_line(data_dir, tmp_path, finished):
    workdir = copy_of(finished(), tmp_path)
    # Damage the newest step: every array file under it is truncated.
    for root, _, files in os.walk(os.path.join(workdir, "checkpoints", "20")):
        for name in files:
            if "state" in root and not name.endswith(".json"):
                open(os.path.join(root, name), "w").close()
    with pytest.raises(checkpoint.CheckpointError, match="step 20"):
        eval_lib.evaluate_checkpoint(workdir, num_batches=1)
    assert eval_lib.evaluate_checkpoint(workdir, num_batches=1, fallback=True)["step"] == 10

    bigger = tiny(data_dir, **{"model.embed_dim": 64})
    with pytest.raises(checkpoint.CheckpointError, match="model.embed_dim: 32 -> 64"):
        train.train_and_evaluate(bigger, workdir)
    wrong = str(tmp_path / "wrong")
    shutil.copytree(workdir, wrong)
    with open(os.path.join(wrong, "config.json")) as f:
        saved = json.load(f)
    saved["model"]["mlp_dim"] = 96  # the config no longer matches the arrays
    with open(os.path.join(wrong, "config.json"), "w") as f:
        json.dump(saved, f)
    with pytest.raises(checkpoint.CheckpointError, match="does not match the model"):
        eval_lib.evaluate_checkpoint(wrong, step=10, num_batches=1)


def test_configs_saved_before_the_attention_field_still_match(data_dir):
    config = tiny(data_dir)
    old = config.copy_and_resolve_references()
    del old.model["attention"]
    resume.check_same_model(old, config, where="config.json")  # kv defaults to separate
    tied = tiny(data_dir, **{"model.attention.kv": "tied", "model.rope.sites": "qkvo"})
    with pytest.raises(checkpoint.CheckpointError, match="model.attention"):
        resume.check_same_model(old, tied, where="config.json")


def test_generate_from_a_tied_checkpoint_in_process_and_on_the_command_line(data_dir, tmp_path):
    config = tiny(data_dir, **{"model.attention.kv": "tied", "model.rope.sites": "qkvo"})
    train.train_and_evaluate(config, str(tmp_path))
    text = eval_lib.generate_text(str(tmp_path), prompt="ROMEO:", max_new_tokens=12)
    assert text.startswith("ROMEO:") and len(text) <= len("ROMEO:") + 12
    kw = dict(prompt="ROMEO:", max_new_tokens=12, temperature=1.0)
    sampled = eval_lib.generate_text(str(tmp_path), seed=3, **kw)
    assert sampled == eval_lib.generate_text(str(tmp_path), seed=3, **kw)
    # under another context-scaling rule (positions 4x closer): other tokens, no file written
    linear = {"rope_type": "linear", "factor": 4.0}
    scaled = eval_lib.generate_text(str(tmp_path), prompt="ROMEO:", max_new_tokens=12,
                                    rope_scaling=linear)  # fmt: skip
    assert scaled != text
    cmd = [sys.executable, "eval.py", f"--workdir={tmp_path}", "--generate", "--prompt=ROMEO:",
           "--max_new_tokens=12", f"--rope_scaling={json.dumps(linear)}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == scaled + "\n"
    assert not glob.glob(os.path.join(tmp_path, "eval_*_*.json"))


def test_non_finite_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(data_dir, tmp_path):
    overrides = {"optim.name": "sgd", "optim.lr": 1e30, "optim.grad_clip_norm": 0.0,
                 "optim.warmup_steps": 0, "optim.schedule": "constant",
                 "train.ckpt_every_steps": 1, "train.log_every_steps": 1}  # fmt: skip
    config = tiny(data_dir, **overrides)
    with pytest.raises(train.NonFiniteLoss, match=r"at step (\d+); last good checkpoint: step"):
        train.train_and_evaluate(config, str(tmp_path))
    steps = checkpoint.Manager(str(tmp_path), read_only=True).steps()
    assert steps and steps[-1] < config.train.num_steps


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"model.rope.sites": "qx"}, "sites"),
        ({"model.head_dim": 15}, "head_dim"),
        ({"model.num_kv_heads": 3}, "num_kv_heads"),
        ({"model.rope.allocation": "sections", "model.rope.sections": (3, 4)}, "sections"),
        ({"data.scheme": "spiral"}, "data.scheme"),
        ({"optim.name": "lion"}, "optim.name"),
        ({"data.global_batch_size": 0}, "data.global_batch_size"),
        ({"data.seq_len": -3}, r"^data\.seq_len=-3"),  # named as the field the user set
        ({"data.max_documents": -1}, r"^data\.max_documents=-1"),  # was read as "all"
        ({"mesh.shape": (2, 1, 1)}, "mesh.shape"),
        ({"data.name": "no_such_dataset_xyz"}, "no_such_dataset_xyz"),
    ],
)
def test_bad_configs_fail_before_compiling_with_one_line(data_dir, tmp_path, overrides, match):
    config = tiny(data_dir, **overrides)
    start = time.time()
    with pytest.raises(ValueError, match=match) as info:
        train.train_and_evaluate(config, str(tmp_path))
    assert "\n" not in str(info.value)
    assert time.time() - start < 5
    assert not os.path.exists(tmp_path / "checkpoints")


def test_dry_run_counts_parameters_without_training(data_dir):
    config = tiny(data_dir)
    report = harness.dry_run(config)
    net = harness.create_model(config, 0)
    from rope_jax.nn import model

    assert report["parameters"] == model.count_params(net)
    assert report["params_bytes_per_device"] == 4 * report["parameters"]
    assert report["opt_bytes_per_device"] >= 2 * report["params_bytes_per_device"]
    assert report["temp_bytes_per_device"] > 0


SHARDED = r"""
import json, sys
sys.path.insert(0, ".")
import jax, train
from tests.train_test import tiny

config = tiny(sys.argv[1], **{"train.num_steps": 4, "train.log_every_steps": 1,
                              "mesh.shape": (4, 2, 1)})
assert jax.device_count() == 8
train.train_and_evaluate(config, sys.argv[2])
"""


def test_sharded_training_on_8_devices_matches_one_device(data_dir, tmp_path):
    config = tiny(data_dir, **{"train.num_steps": 4, "train.log_every_steps": 1})
    train.train_and_evaluate(config, str(tmp_path / "one"))
    env = dict(os.environ, XLA_FLAGS=xla_flags(8))
    proc = subprocess.run([sys.executable, "-c", SHARDED, data_dir, str(tmp_path / "eight")],
                          cwd=ROOT, env=env, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = [r["loss"] for r in metrics.read_jsonl(str(tmp_path / "one")) if "loss" in r]
    eight = [r["loss"] for r in metrics.read_jsonl(str(tmp_path / "eight")) if "loss" in r]
    assert len(one) == len(eight) == 4
    np.testing.assert_allclose(eight, one, rtol=2e-5, atol=2e-5)


def test_batch_not_divisible_by_data_parallel_size_is_named(data_dir):
    class FakeMesh:  # only .shape is read
        shape = {"data": 3, "fsdp": 2, "tensor": 1}

    with pytest.raises(ValueError, match=r"data.global_batch_size=8 is not divisible by .* 6"):
        harness.check_batch_fits_mesh(tiny(data_dir), FakeMesh())
    ok = tiny(data_dir, **{"data.global_batch_size": 12, "eval.batch_size": 6})
    harness.check_batch_fits_mesh(ok, FakeMesh())


def test_a_run_resumes_and_trains_on_from_its_saved_config(tmp_path, finished):
    """configs/saved.py: the config a run saved, its overrides included, whatever the
    config files say today; `--config=<workdir>/config.json` names that flag."""
    from configs import saved

    workdir = copy_of(finished(), tmp_path)  # 20 steps, checkpoints at steps 10 and 20
    again = saved.get_config(workdir)
    assert (again.model.num_layers, again.model.embed_dim) == (1, 32)  # not the preset's 2, 128
    again.train.num_steps = 25
    flag = f"--config=configs/saved.py:{workdir}"
    with pytest.raises(checkpoint.CheckpointError, match=f"train.num_steps: 20 -> 25.*{flag}"):
        train.train_and_evaluate(again, workdir)
    train.train_and_evaluate(again, workdir, allow_config_change=True)  # trains on from 20
    assert checkpoint.Manager(workdir, read_only=True).steps() == [10, 20, 25]
    assert saved.get_config(os.path.join(workdir, "config.json")).train.num_steps == 25
    proc = subprocess.run(
        [sys.executable, "train.py", f"--config={workdir}/config.json", f"--workdir={workdir}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"error: --config={workdir}/config.json: a config file is Python (configs/*.py); a "
        f"run's saved config is read with {flag}"
    )


def test_a_run_checks_its_config_once_and_saves_it_resolved(data_dir, tmp_path, monkeypatch):
    """The config is resolved at the entry: every rule runs once per run (the model's
    included), and config.json holds every field, filled from the defaults."""
    from rope_jax.harness import checks, runfiles
    from rope_jax.nn import model as model_lib

    calls = {"config": 0, "model": 0}
    check_config, check_model = checks.check_config, model_lib.check_config

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(checks, "check_config", counted("config", check_config))
    monkeypatch.setattr(model_lib, "check_config", counted("model", check_model))
    config = tiny(data_dir)
    del config.model["remat"], config.train["microbatches"]  # read as their defaults
    harness.train_and_evaluate(config, str(tmp_path))
    assert calls == {"config": 1, "model": 1}
    with open(os.path.join(tmp_path, runfiles.CONFIG_FILE)) as f:
        saved = json.load(f)  # as written, not as filled on reading
    assert saved["model"]["remat"] == "none" and saved["train"]["microbatches"] == 1
