"""rope_jax.experiments.parts: a sweep's runs scored on other datasets, tabulated per
dataset (the evaluations themselves are eval.py --data, tested in corpus_test)."""

import json

import pytest

from rope_jax.experiments import parts

REFERENCE = {"qk": 1.0, "vo": 2.0, "nope": 3.0}


@pytest.fixture
def sweep(tmp_path):
    """A sweep report of 3 rows x 2 seeds whose runs already hold their evaluations on
    `code` (the reference order) and `tables` (the reverse)."""
    data_dir = tmp_path / "data"
    for name in ("code", "tables"):
        (data_dir / name).mkdir(parents=True)
        (data_dir / name / "metadata.json").write_text("{}")
    rows = {}
    for row, loss in REFERENCE.items():
        runs = []
        for seed in (0, 1):
            workdir = tmp_path / "runs" / row / f"seed_{seed}"
            workdir.mkdir(parents=True)
            for name, value in (("code", loss), ("tables", 10 - loss)):
                v = value + 0.01 * seed
                (workdir / f"eval_50_{name}.json").write_text(
                    json.dumps(
                        {"8": {"loss": v, "tokens": 640}, "32": {"loss": v + 0.5, "tokens": 640}}
                    )
                )
            runs.append(
                {
                    "seed": seed,
                    "workdir": str(workdir),
                    "step": 50,
                    "loss": {"8": loss, "16": loss, "32": loss + 1},
                }
            )
        rows[row] = {"runs": runs}
    report = {
        "rows": rows,
        "seeds": [0, 1],
        "seq_lens": ["8", "16", "32"],
        "article_loss": REFERENCE,
    }
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(report))
    return path, data_dir


def test_each_dataset_gets_its_order_tau_and_nope_rank(sweep, tmp_path):
    path, data_dir = sweep
    out = tmp_path / "parts"
    parts.main([f"--sweep={path}", "--data=code,tables", f"--data_dir={data_dir}", f"--out={out}"])
    result = json.loads((tmp_path / "parts.json").read_text())
    assert result["lengths"] == [8, 32]
    code, tables = result["parts"]["code"], result["parts"]["tables"]
    assert code["tau"] == pytest.approx(1.0) and tables["tau"] == pytest.approx(-1.0)
    assert code["ranks"]["nope"] == 3 and tables["ranks"]["nope"] == 1
    assert code["rows"]["vo"]["32"] == pytest.approx([2.505, 0.00707], abs=1e-4)
    assert result["parts"]["all"]["ranks"] == {"qk": 1, "vo": 2, "nope": 3}
    md = (tmp_path / "parts.md").read_text()
    assert "| tables | 640 | -1.000 |" in md and "| nope (3) | 1 | 7.005 ± 0.007 |" in md


def test_what_would_stop_it_is_one_line_before_anything_runs(sweep, tmp_path):
    path, data_dir = sweep
    out = f"--out={tmp_path / 'parts'}"
    with pytest.raises(SystemExit, match="no prepared dataset docs in"):
        parts.main([f"--sweep={path}", "--data=code,docs", f"--data_dir={data_dir}", out])
    for flags, match in (
        (["--data=code", "--seq_lens=8,x"], r"^error: --seq_lens=8,x: give positive integers"),
        (["--data=code", "--seq_lens=8,0"], r"^error: --seq_lens=8,0: give positive integers"),
        (["--data=code,docs,code"], r"^error: --data lists code twice$"),
        (["--data=,"], r"^error: --data=,: give one or more prepared dataset names$"),
        (["--data=code", "--num_batches=-1"], r"^error: --num_batches=-1 must be >= 0"),
    ):  # checked before the datasets (there are none in /nonexistent)
        with pytest.raises(SystemExit, match=match):
            parts.main([f"--sweep={path}", *flags, "--data_dir=/nonexistent", out])
    with pytest.raises(SystemExit, match="no file"):
        parts.main([f"--sweep={tmp_path / 'none.json'}", "--data=code", out])
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match=r"--out=.*/file/parts is not writable"):
        parts.main([f"--sweep={path}", "--data=code", f"--out={tmp_path / 'file' / 'parts'}"])
    assert not (tmp_path / "parts.md").exists()


def test_the_datasets_default_to_the_runs_data_dir(sweep, tmp_path):
    from configs import lm
    from rope_jax.harness import runfiles

    path, data_dir = sweep
    config = lm.get_config("size=tiny")
    config.data.data_dir = str(data_dir)
    report = json.loads(path.read_text())
    runfiles.save_config(parts.runs_of(report)[0]["workdir"], config)
    assert parts.problem(report, ["code", "tables"], None) is None
    assert f"no prepared dataset docs in {data_dir}" in parts.problem(report, ["docs"], None)


def test_an_eval_file_counts_as_done_only_with_every_length(sweep):
    from rope_jax.experiments import report as report_lib

    path, _ = sweep
    run = parts.runs_of(json.loads(path.read_text()))[0]
    assert report_lib.evaluated(parts.eval_file(run, "code"), [8, 32])
    assert not report_lib.evaluated(parts.eval_file(run, "code"), [8, 64])  # made at 8, 32
    assert not report_lib.evaluated(parts.eval_file(run, "docs"), [8])  # not there


def test_a_row_whose_runs_all_failed_or_not_finished_is_shown_so(sweep, tmp_path):
    """A sweep that went on past failed runs: row vo has none finished ("runs": [])."""
    path, data_dir = sweep
    report = json.loads(path.read_text())
    report["rows"]["vo"] = {"runs": [], "failed": [{"seed": 0, "reason": "r", "log": "l"}]}
    path.write_text(json.dumps(report))
    out = tmp_path / "parts"
    parts.main([f"--sweep={path}", "--data=code", f"--data_dir={data_dir}", f"--out={out}"])
    result = json.loads((tmp_path / "parts.json").read_text())
    assert result["parts"]["all"]["ranks"] == {"qk": 1, "nope": 2}
    lines = [x for x in (tmp_path / "parts.md").read_text().splitlines() if x.startswith("| vo")]
    assert lines == ["| vo (2) | failed | failed | failed |"] * 2  # "all" and "code"
    # a partial sweep page (`--report_only`): vo not finished yet, which is not failed
    report["rows"]["vo"] = {"runs": [], "pending": [{"seed": 0, "state": "partial"}]}
    path.write_text(json.dumps(report))
    parts.main([f"--sweep={path}", "--data=code", f"--data_dir={data_dir}", f"--out={out}"])
    lines = [x for x in (tmp_path / "parts.md").read_text().splitlines() if x.startswith("| vo")]
    assert lines == ["| vo (2) | not finished | not finished | not finished |"] * 2


def test_runs_moved_to_another_directory_are_found_by_the_sweeps_workdir(sweep, tmp_path):
    path, data_dir = sweep
    (tmp_path / "runs").rename(tmp_path / "moved")  # another machine, another checkout
    out = tmp_path / "parts"
    flags = [f"--sweep={path}", "--data=code", f"--data_dir={data_dir}", f"--out={out}"]
    with pytest.raises(SystemExit, match=r"runs/qk/seed_0 is not there \(6 missing\); --workdir"):
        parts.main(flags)
    parts.main([*flags, f"--workdir={tmp_path / 'moved'}"])
    result = json.loads((tmp_path / "parts.json").read_text())
    assert result["parts"]["code"]["ranks"] == {"qk": 1, "vo": 2, "nope": 3}
    with pytest.raises(SystemExit, match=r"elsewhere/qk/seed_0 is not there \(6 missing\)$"):
        parts.main([*flags, f"--workdir={tmp_path / 'elsewhere'}"])
