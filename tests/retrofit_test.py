"""rope_jax.experiments.retrofit on hand-made sweep reports: gaps, when they close, the
control column, the page and plot, and one line for a missing input."""

import json
import subprocess
import sys

import pytest

from rope_jax.experiments import retrofit


def report(rows: dict, steps: int) -> dict:
    """A sweep report: row -> [(final loss, eval curve)] per seed."""
    return {"seq_lens": ["128"], "settings": {"train.num_steps": steps},
            "rows": {r: {"runs": [{"loss": {"128": final}, "eval_curve": curve}
                                  for final, curve in runs]}
                     for r, runs in rows.items()}}  # fmt: skip


SCRATCH = report({"qk": [(1.90, []), (1.92, [])], "vo": [(2.00, []), (2.02, [])]}, 500)
CONTINUED = report({
    "qk": [(1.80, [[50, 1.95], [100, 1.80]]), (1.82, [[50, 1.97], [100, 1.82]])],
    "vo": [(2.00, [[50, 2.40], [100, 2.00]]), (2.02, [[50, 2.44], [100, 2.02]])],
}, 100)  # fmt: skip


def test_gaps_close_when_within_the_combined_seed_std():
    out = retrofit.analyse(SCRATCH, CONTINUED)
    vo = out["rows"]["vo"]
    assert [c["step"] for c in vo["curve"]] == [50, 100]
    assert vo["curve"][0]["gap"] == pytest.approx(0.41) and not vo["curve"][0]["closed"]
    assert vo["curve"][1]["gap"] == pytest.approx(0.0) and vo["closed_at"] == 100
    assert out["rows"]["qk"]["closed_at"] == 100  # below scratch: closed
    assert vo["vs_control"][0] == pytest.approx(0.20)  # against the continued qk
    assert out["base_qk"][0] == pytest.approx(1.91)


def test_the_command_writes_page_plot_and_json(tmp_path):
    (tmp_path / "s.json").write_text(json.dumps(SCRATCH))
    (tmp_path / "c.json").write_text(json.dumps(CONTINUED))
    retrofit.main([f"--scratch={tmp_path / 's.json'}", f"--retrofit={tmp_path / 'c.json'}",
                   f"--out={tmp_path / 'r'}"])  # fmt: skip
    page = (tmp_path / "r.md").read_text()
    assert "| vo | 2.010 ± 0.014 |" in page and "+0.200" in page
    assert (tmp_path / "r.png").stat().st_size > 0
    assert json.loads((tmp_path / "r.json").read_text())["rows"]["vo"]["closed_at"] == 100


def test_a_missing_sweep_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rope_jax.experiments.retrofit",
                           f"--scratch={tmp_path / 'none.json'}", "--retrofit=x", "--out=y"],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1
    assert "error: --scratch: no file " in proc.stderr


def test_the_scratch_sweep_given_as_the_continued_one_is_one_line(tmp_path):
    (tmp_path / "s.json").write_text(json.dumps(SCRATCH))
    with pytest.raises(SystemExit, match=r"^error: --retrofit=.*/s.json is the --scratch sweep"):
        retrofit.main([f"--scratch={tmp_path / 's.json'}", f"--retrofit={tmp_path / 's.json'}",
                       f"--out={tmp_path / 'r'}"])  # fmt: skip
    assert not (tmp_path / "r.md").exists()


def test_a_row_whose_runs_all_failed_is_shown_as_failed(tmp_path):
    """A sweep that went on past a failed run: its row has no finished run ("runs": [],
    "failed": [...]); the page shows it as failed, never as a number."""
    continued = json.loads(json.dumps(CONTINUED))
    continued["rows"]["vo"] = {"runs": [], "failed": [{"seed": 0, "reason": "r", "log": "l"}]}
    out = retrofit.analyse(SCRATCH, continued)
    assert list(out["rows"]) == ["qk"] and out["failed"] == ["vo"]
    (tmp_path / "s.json").write_text(json.dumps(SCRATCH))
    (tmp_path / "c.json").write_text(json.dumps(continued))
    retrofit.main([f"--scratch={tmp_path / 's.json'}", f"--retrofit={tmp_path / 'c.json'}",
                   f"--out={tmp_path / 'r'}"])  # fmt: skip
    line = next(x for x in (tmp_path / "r.md").read_text().splitlines() if x.startswith("| vo"))
    assert line.startswith("| vo | failed | failed |") and not any(c.isdigit() for c in line)
    # a partial sweep page (`--report_only`): vo not finished yet, which is not failed
    continued["rows"]["vo"] = {"runs": [], "pending": [{"seed": 0, "state": "partial"}]}
    out = retrofit.analyse(SCRATCH, continued)
    assert out["failed"] == [] and out["not_finished"] == ["vo"]
    assert "| vo | not finished | not finished |" in retrofit.render(out, "cmd")
