"""train.py's advice on bfloat16 where this CPU's bfloat16 products are measured slower
than float32's (harness.cpuspeed), with the measurement injected."""

import json
import os
import subprocess
import sys

import pytest

from rope_jax.harness import cpuspeed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLOWER = {"bf16_gflops": 100.0, "f32_gflops": 167.0}  # an EPYC without AVX-512
FASTER = {"bf16_gflops": 390.0, "f32_gflops": 158.0}  # one with AVX512-BF16


def counting(result):
    calls = []

    def measure():
        calls.append(1)
        return dict(result)

    return measure, calls


def test_bf16_measured_slower_gives_one_line_naming_float32(tmp_path):
    measure, calls = counting(SLOWER)
    line = cpuspeed.bf16_advice("bfloat16", backend="cpu", measure_fn=measure,
                                directory=str(tmp_path))  # fmt: skip
    assert line is not None and "\n" not in line
    assert "100 GFLOP/s against float32's 167" in line
    assert line.endswith("--config.model.dtype=float32 would be faster here")
    assert calls == [1]


def test_bf16_measured_faster_or_not_asked_gives_nothing(tmp_path):
    measure, calls = counting(FASTER)
    kw = dict(measure_fn=measure, directory=str(tmp_path))
    assert cpuspeed.bf16_advice("bfloat16", backend="cpu", **kw) is None
    assert calls == [1]
    slower, never = counting(SLOWER)
    for dtype, backend in (("float32", "cpu"), ("bfloat16", "gpu"), ("bfloat16", "tpu")):
        assert cpuspeed.bf16_advice(dtype, backend=backend, measure_fn=slower,
                                    directory=str(tmp_path)) is None  # fmt: skip
    assert never == []  # nothing measured unless bf16 on a CPU is asked for


def test_the_measurement_is_cached_per_cpu(tmp_path, monkeypatch):
    measure, calls = counting(SLOWER)
    first = cpuspeed.cached_measure(measure, str(tmp_path))
    again = cpuspeed.cached_measure(measure, str(tmp_path))
    assert calls == [1] and first == again and first["bf16_gflops"] == 100.0
    with open(tmp_path / cpuspeed.FILE) as f:
        assert list(json.load(f)) == [cpuspeed.cpu_key()]
    monkeypatch.setattr(cpuspeed, "cpu_key", lambda: "another CPU")
    cpuspeed.cached_measure(counting(FASTER)[0], str(tmp_path))
    with open(tmp_path / cpuspeed.FILE) as f:
        assert len(json.load(f)) == 2  # the first CPU's entry kept


def test_an_unwritable_cache_still_answers(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    measure, calls = counting(SLOWER)
    assert cpuspeed.cached_measure(measure, str(blocker / "dir"))["f32_gflops"] == 167.0


def test_the_measurement_runs_in_a_fraction_of_a_second():
    import time

    start = time.perf_counter()
    speed = cpuspeed.measure(shape=(256, 128, 128), repeats=2)
    assert set(speed) == {"bf16_gflops", "f32_gflops"}
    assert all(v > 0 for v in speed.values())
    assert time.perf_counter() - start < 30  # compile included, on a busy machine


@pytest.mark.slow
@pytest.mark.parametrize("speed, lines", [(SLOWER, 1), (FASTER, 0)])
def test_train_py_says_it_once_at_start(data_dir, tmp_path, speed, lines):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / cpuspeed.FILE).write_text(json.dumps({cpuspeed.cpu_key(): speed}))
    # one evaluation batch at the end (eval.num_batches=0 would score the whole split)
    small = ["--config.model.num_layers=1", "--config.model.embed_dim=32",
             "--config.model.num_heads=2", "--config.model.num_kv_heads=1",
             "--config.model.head_dim=16", "--config.model.mlp_dim=64",
             "--config.data.seq_len=32", "--config.data.global_batch_size=4",
             "--config.train.num_steps=4", "--config.train.log_every_steps=1",
             "--config.train.eval_every_steps=0", "--config.train.ckpt_every_steps=0",
             "--config.eval.num_batches=1"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "train.py", "--config=configs/lm.py:size=tiny",
         f"--config.data.data_dir={data_dir}", "--config.model.dtype=bfloat16",
         *small, f"--workdir={tmp_path / 'run'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, ROPE_JAX_CACHE_DIR=str(cache)),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = [x for x in proc.stderr.splitlines() if "would be faster here" in x]
    assert len(said) == lines, proc.stderr[-2000:]
    if lines:
        assert said[0].startswith("warning: model.dtype=bfloat16 on this CPU")
