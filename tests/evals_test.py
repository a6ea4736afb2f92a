"""The evaluation registry (`harness.evals`): names, checks, and one task reaching every
evaluation (in training, eval_<step>.json, the suite) through the registry alone."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from configs import lm
from rope_jax import defaults, ruler
from rope_jax.experiments import suite_page
from rope_jax.harness import checks, evals, metrics, suite
from rope_jax.harness.evals import generated
from rope_jax.harness.evaluate import evaluate_checkpoint
from rope_jax.harness.loop import train_and_evaluate
from tests import train_test


def test_parse_expands_groups_once_and_names_the_nearest_task():
    assert evals.parse("loss, passkey,loss") == ("loss", "passkey")
    ruler = evals.parse("ruler")
    assert ruler == evals.GROUPS["ruler"] and "niah_single_1" in ruler and "vt" in ruler
    assert evals.parse(["vt", "ruler"])[0] == "vt" and len(evals.parse(["vt", "ruler"])) == len(
        ruler
    )
    for bad, hint in (("niah_single1", "niah_single_1"), ("pasky", "passkey"), ("", None)):
        with pytest.raises(ValueError) as e:
            evals.parse(bad)
        assert "\n" not in str(e.value) and (hint is None or repr(hint) in str(e.value))


def test_every_registered_task_has_the_fields_the_evaluations_read():
    for name, task in evals.TASKS.items():
        assert task.name == name and isinstance(task.primary, str)
        assert isinstance(task.settings(10), dict)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("eval.tasks", "loss", "must be a tuple of task names"),
        ("eval.tasks", (), "must be a tuple of task names"),
        ("eval.examples", 0, "eval.examples=0 must be > 0"),
        ("eval.answer_tokens", -1, "eval.answer_tokens=-1 must be >= 0"),
        ("data.task_template", "long", "data.task_template='long' is not one of"),
    ],
)
def test_the_task_fields_of_a_config_are_checked_in_one_line(field, value, message):
    config = defaults.config()
    with config.ignore_type():
        config.update_from_flattened_dict({field: value})
    with pytest.raises(ValueError, match=message) as e:
        checks.check_config(config)
    assert "\n" not in str(e.value)


def test_check_refuses_what_a_task_cannot_score_in_one_line():
    from configs import multimodal

    text = checks.resolve(lm.get_config("size=tiny"))
    with pytest.raises(ValueError, match="--examples=0 must be a number of examples"):
        evals.check(text, ["loss"], lengths=[128], examples=0)
    with pytest.raises(ValueError, match="unknown evaluation task 'nia'"):
        evals.check(text, ["nia"], lengths=[128], examples=1)
    grids = checks.resolve(multimodal.get_config())
    with pytest.raises(ValueError, match="needs byte-level text") as e:
        evals.check(grids, ["passkey"], lengths=[128], examples=1)
    assert "\n" not in str(e.value)


class Probe:
    """A task added the way a new one is: it scores the length and counts its calls."""

    name, primary = "probe", "probe"

    def __init__(self):
        self.calls = []

    def check(self, config, *, split, lengths, examples):
        if 999 in lengths:
            raise ValueError("probe: 999 is not a length it takes")

    def settings(self, examples):
        return {"probe_examples": examples}

    def score(self, ctx, length):
        length = length or ctx.config.data.seq_len
        self.calls.append((ctx.split, length, ctx.examples))
        records = tuple({"input": str(i), "score": float(i % 2)} for i in range(ctx.examples))
        return evals.Cell({"probe": float(length), "probe_examples": ctx.examples}, records)


def tiny(data_dir, **overrides):
    """train_test's 1-layer model, 4 steps, evaluated at steps 2 and 4."""
    steps = {"train.num_steps": 4, "train.log_every_steps": 2, "train.eval_every_steps": 2,
             "train.ckpt_every_steps": 4, "eval.num_batches": 1}  # fmt: skip
    return train_test.tiny(data_dir, **{**steps, **overrides})


@pytest.mark.slow
def test_a_registered_task_reaches_training_eval_files_and_the_suite(
    data_dir, tmp_path, monkeypatch
):
    probe = Probe()
    monkeypatch.setitem(evals.TASKS, "probe", probe)
    workdir = str(tmp_path / "run")
    config = tiny(data_dir, **{"eval.tasks": ("loss", "probe"), "eval.examples": 3})
    train_and_evaluate(config, workdir)
    evals_seen = [r for r in metrics.read_jsonl(workdir) if "eval/probe" in r]
    assert [r["eval/probe"] for r in evals_seen] == [32.0, 32.0]  # steps 2 and 4, at T
    assert all("eval/loss" in r for r in evals_seen)

    result = evaluate_checkpoint(workdir, seq_lens=[32, 64], num_batches=1)
    assert result["64"]["probe"] == 64.0 and result["64"]["probe_examples"] == 3
    assert result["64"]["loss"] > 0  # the loss task's entry shares the length
    saved = json.load(open(os.path.join(workdir, "eval_4.json")))
    assert (
        saved["settings"]["tasks"] == ["loss", "probe"] and saved["settings"]["probe_examples"] == 3
    )
    with pytest.raises(ValueError, match="999 is not a length"):
        evaluate_checkpoint(workdir, seq_lens=[999], tag="x")

    out = str(tmp_path / "suite")
    results = suite.run(workdir, out, tasks=("probe",), lengths=[32, 48], examples=4)
    assert {k: v["score"] for k, v in results["cells"]["probe"].items()} == {"32": 32.0, "48": 48.0}
    lines = open(suite.examples_path(out, "probe", 48)).read().splitlines()
    assert [json.loads(x)["score"] for x in lines] == [0.0, 1.0, 0.0, 1.0]
    calls = len(probe.calls)
    again = suite.run(workdir, out, tasks=("probe",), lengths=[32, 48, 64], examples=4)
    assert len(probe.calls) == calls + 1 and set(again["cells"]["probe"]) == {"32", "48", "64"}
    with pytest.raises(ValueError, match="made with other settings .*examples: 4 -> 5") as e:
        suite.run(workdir, out, tasks=("probe",), lengths=[32], examples=5)
    assert "\n" not in str(e.value)


@pytest.mark.slow  # two decoding programs compile (~10 s)
def test_greedy_answers_in_batches_equal_the_full_forward_argmax():
    """Batched greedy decoding through the cache (5 prompts in batches of 2: the last one
    padded; each answer cut at its first EOS) picks what the full forward's argmax picks."""
    import types

    import jax
    import jax.numpy as jnp
    import ml_collections
    from flax import nnx

    from rope_jax.nn import model as model_lib
    from tests.generate_test import cfg

    model = model_lib.Decoder(cfg("separate", "qk"), rngs=nnx.Rngs(3))
    graphdef, params = nnx.split(model)
    config = ml_collections.ConfigDict({"eval": {"batch_size": 2}})
    ctx = evals.Context(types.SimpleNamespace(graphdef=graphdef), params, config, split="x")
    prompts = np.random.default_rng(0).integers(0, 19, (5, 7)).astype(np.int32)
    pos = jnp.broadcast_to(jnp.arange(13.0)[None, :, None], (5, 13, 1))
    forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t, pos))
    tokens = np.concatenate([prompts, np.zeros((5, 6), np.int32)], axis=1)  # [5, 13]
    for i in range(7, 13):  # causal: the zeros after position i do not reach it
        tokens[:, i] = np.argmax(np.asarray(forward(params, tokens))[:, i - 1], axis=-1)
    naive = tokens[:, 7:].tolist()
    eos = naive[1][3]
    answers = generated.greedy(ctx, prompts, max_new_tokens=6, eos_id=eos, what="t")
    for row, answer in zip(naive, answers, strict=True):
        cut = row.index(eos) if eos in row else len(row)
        assert list(answer) == row[:cut]
    assert len(answers[1]) <= 3


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    """A tiny run trained 4 steps at T = 256 bytes (RULER's short wording fits)."""
    workdir = str(tmp_path_factory.mktemp("ruler") / "run")
    overrides = {"data.seq_len": 256, "data.task_template": "short", "eval.answer_tokens": 12,
                 "train.eval_every_steps": 0}  # fmt: skip
    train_and_evaluate(tiny(data_dir, **overrides), workdir)
    return workdir


@pytest.mark.slow
def test_the_suite_scores_ruler_tasks_into_cells_and_resumes(trained, tmp_path):
    out = str(tmp_path / "suite")
    # the run's budget (12) cannot hold vt's five names: the suite is asked for 29
    results = suite.run(trained, out, tasks=("niah_single_1", "vt"), lengths=[256, 320],
                        examples=3, answer_tokens=29)  # fmt: skip
    cells = results["cells"]
    assert set(cells) == {"niah_single_1", "vt"} and set(cells["vt"]) == {"256", "320"}
    for task, length in (("niah_single_1", 256), ("vt", 320)):
        rows = [json.loads(x) for x in open(suite.examples_path(out, task, length))]
        assert len(rows) == 3 and all(r["length_tokens"] == length for r in rows)
        # the score of the cell is the mean of its examples', each RULER's of its prediction
        assert cells[task][str(length)]["score"] == pytest.approx(
            np.mean([r["score"] for r in rows])
        )
        chars = cells[task][str(length)]["metrics"][f"{task}_chars"]
        assert chars == pytest.approx(np.mean([r["chars"] for r in rows]))
        for r in rows:
            assert r["score"] == ruler.score_one(task, r["prediction"], r["answers"])
            assert len(r["input"].encode()) == length - 29  # bytes: the prompt, exactly
    depths = [
        json.loads(x)["depths"][0] for x in open(suite.examples_path(out, "niah_single_1", 256))
    ]
    assert depths == sorted(depths) and depths[0] < 0.2 < 0.5 < depths[-1]  # asked 0, 1/2, 1
    saved = json.load(open(os.path.join(out, suite.RESULTS)))
    assert saved["cells"] == json.loads(json.dumps(cells)) and saved["step"] == 4
    # a rerun computes nothing; an added length only its cells
    before = os.path.getmtime(suite.examples_path(out, "vt", 256))
    suite.run(trained, out, tasks=("niah_single_1", "vt"), lengths=[256, 320], examples=3,
              answer_tokens=29)  # fmt: skip
    assert os.path.getmtime(suite.examples_path(out, "vt", 256)) == before
    md, png = suite_page.write(out)
    table = open(md).read()
    assert "| niah_single_1 |" in table and "| **average** |" in table
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_eval_py_runs_the_suite_and_refuses_bad_tasks_in_one_line(trained, tmp_path):
    """eval.py --out runs the suite; a bad flag is one line on stderr. The suite's own
    refusals (ValueErrors of `suite.run`, which eval.py prints as its one line: the
    niah_multiquery case shows it) are checked in-process, the flags' through eval.py."""
    out = str(tmp_path / "cli")
    cmd = [sys.executable, "eval.py", f"--workdir={trained}", "--tasks=niah_single_2",
           "--lengths=256", "--examples=2", f"--out={out}", "--answer_tokens=20"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.load(open(os.path.join(out, suite.RESULTS)))
    assert results["cells"]["niah_single_2"]["256"] and results["settings"]["answer_tokens"] == 20
    example = json.loads(open(suite.examples_path(out, "niah_single_2", 256)).readline())
    assert len(example["input"].encode()) == 256 - 20
    assert os.path.exists(os.path.join(out, "results.md"))
    for flags, message in (
        (
            ["--tasks=niah_singel_1"],
            "unknown evaluation task 'niah_singel_1' (did you mean 'niah_single_1'?)",
        ),
        (["--tasks=niah_multiquery", "--lengths=256"], "niah_multiquery: length 256 is too short"),
        (["--tasks=vt", "--examples=0"], "--examples"),
        (["--tasks=vt", "--tag=x"], "--tag is not read by the suite"),
    ):
        cmd = [sys.executable, "eval.py", f"--workdir={trained}", f"--out={out}2", *flags]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    for kwargs, message in (
        ({"lengths": [256]}, "vt: its answers alone"),  # the run's budget, 12
        ({"answer_tokens": -1}, "--answer_tokens"),
    ):
        with pytest.raises(ValueError, match=message) as e:
            suite.run(trained, f"{out}2", tasks=evals.parse("vt"), **kwargs)
        assert "\n" not in str(e.value)
    cmd = [sys.executable, "eval.py", f"--workdir={trained}", "--answer_tokens=20"]  # no --out
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert (proc.returncode, proc.stderr) == (
        2,
        "error: --answer_tokens is not read by an evaluation (without --generate)\n",
    )


@pytest.mark.slow
def test_the_suite_runs_on_an_imported_hf_model_in_its_own_tokenizer(data_dir, tmp_path):
    """A Hugging Face checkpoint (imported by eval.py --hf) asked in RULER's own wording,
    lengths counted in its tokenizer's tokens, haystacks from held-out Shakespeare."""
    from rope_jax.harness import runfiles
    from rope_jax.hf import run as hf_run

    workdir, out = str(tmp_path / "m"), str(tmp_path / "suite")
    config = lm.get_config()
    config.data.data_dir, config.data.seq_len = data_dir, 64
    config.eval.batch_size, config.eval.num_batches = 2, 1
    hf_run.import_run(os.path.join(ROOT, "tests", "data", "hf", "llama"), workdir, config)
    results = suite.run(workdir, out, tasks=("niah_single_2",), lengths=[700], examples=2)
    assert results["cells"]["niah_single_2"]["700"]["examples"] == 2
    tok = runfiles.load_tokenizer(workdir)
    for line in open(suite.examples_path(out, "niah_single_2", 700)):
        row = json.loads(line)
        assert row["input"].startswith("A special magic number is hidden within the following")
        assert row["input"].endswith("mentioned in the provided text is")
        assert len(tok.encode(row["input"])) <= 700 - 128  # RULER's budget; re-encoding may merge


@pytest.mark.slow
def test_the_evaluation_benchmark_times_prefill_and_decoding_apart():
    import importlib.util

    path = os.path.join(ROOT, "benchmarks", "eval_bench.py")
    spec = importlib.util.spec_from_file_location("eval_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    page = bench.main(["--size=tiny", "--lengths=64,96", "--batches=1,2", "--new=8",
                       "--repeats=1"])  # fmt: skip
    rows = [line.split("|")[1:-1] for line in page.splitlines() if line.startswith("| 64")
            or line.startswith("| 96")]  # fmt: skip
    assert [(int(r[0]), int(r[1])) for r in rows] == [(64, 1), (64, 2), (96, 1), (96, 2)]
    for r in rows:
        share = float(r[5])
        assert 0 < share < 1 and all(float(v.replace(",", "")) > 0 for v in r[2:5])
