"""From a text model to a multimodal one: bad requests, the committed page, a tiny run."""

import json
import os
import subprocess
import sys

import pytest

from rope_jax import provenance
from rope_jax.experiments import text_to_multimodal as ttm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("extra, match", [
    (["--rows=flat,spiral"], "error: --rows: unknown spiral; known: nope, flat, mrope"),
    (["--target=1.5"], "error: --target=1.5 must lie in (0, 1]"),
    (["--steps=0"], "error: --steps=0 must be >= 1"),
    (["--set", "model.num_layers=x"], "error: "),
    (["--out=/dev/null/page"], "error: --out=/dev/null/page is not writable: Not a directory"),
])  # fmt: skip
def test_a_bad_request_is_one_line_before_anything_runs(tmp_path, capsys, extra, match):
    assert ttm.main([f"--workdir={tmp_path / 'w'}", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(match) and err.count("\n") == 1, err
    assert not (tmp_path / "w").exists()


def test_the_committed_page_is_what_its_json_renders():
    path = os.path.join(ROOT, "results", "research", "text_to_multimodal")
    with open(path + ".json") as f:
        result = json.load(f)
    with open(path + ".md") as f:
        assert f.read() == ttm.render_markdown(result, result.pop("command"))


@pytest.mark.slow
def test_a_tiny_transfer_trains_scores_and_skips_what_is_done(
    data_dir, tmp_path, capsys, monkeypatch
):
    """The command trains the text LM and both runs and scores them; the same command
    again (in-process: `main`, as `python -m` runs it) skips all three."""
    out = tmp_path / "results" / "t"
    # every run (the text LM's and both multimodal ones) at D = 32, 4 sequences a batch
    small = ("model.embed_dim=32,model.num_heads=2,model.num_kv_heads=1,model.head_dim=16,"
             "model.mlp_dim=64,data.global_batch_size=4,eval.batch_size=4")  # fmt: skip
    argv = [f"--workdir={tmp_path / 'w'}", f"--out={out}", "--rows=flat", "--layers=1",
            "--text_steps=4", "--steps=4", "--eval_every=2", "--text_batches=1",
            "--set", f"eval.num_batches=1,data.data_dir={data_dir},{small}"]  # fmt: skip
    cmd = [sys.executable, "-m", "rope_jax.experiments.text_to_multimodal", *argv]
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    lines = (first.stdout + first.stderr).splitlines()
    # the progress lines alone: the evaluations' notes and logs went to each eval.log
    assert [x.split()[0] for x in lines if not x.startswith("    ")] == [
        "[1/3]", "[2/3]", "[3/3]", "wrote"], lines  # fmt: skip
    result = json.loads(out.with_suffix(".json").read_text())
    assert [(r["row"], r["init"], r["seed"]) for r in result["runs"]] == [
        ("flat", "scratch", 0), ("flat", "text", 0)]  # fmt: skip
    for run in result["runs"]:  # scored on every split, and back on Shakespeare
        assert set(run["accuracy"]) == set(result["splits"]) and run["text_loss"] > 0
    for init in ("scratch", "text"):
        log = (tmp_path / "w" / "flat" / init / "seed_0" / "eval.log").read_text()
        assert "evaluated step 4" in log
    page = out.with_suffix(".md").read_text()
    here = provenance.describe(provenance.code_version())  # the text LM's and both runs'
    assert result["code"] == [here] and f"Device: {provenance.devices()}; code: {here}." in page
    assert page == ttm.render_markdown(result, result.pop("command"))
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")  # what `main` sets for its jobs: undone after
    capsys.readouterr()
    assert ttm.main(argv) == 0
    again = capsys.readouterr().out
    assert again.count("done, skipped") == 3, again
    assert out.with_suffix(".md").read_text() == page
