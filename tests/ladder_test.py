"""The ladder report: several sweeps side by side, tau with a bootstrap interval."""

import json

import pytest

from rope_jax.experiments import ladder

REFERENCE = {"a": 1.0, "b": 2.0, "c": 3.0, "nope": 4.0}


def sweep(losses: dict, layers=2, seq_len=8) -> dict:
    """A sweep report like rope_jax.experiments.sweep writes: row -> per-seed losses at T."""
    t = str(seq_len)
    return {
        "settings": {"model.num_layers": layers, "model.embed_dim": 16,
                     "data.seq_len": seq_len, "train.num_steps": 10},
        "seq_lens": [t, str(2 * seq_len)], "article_loss": REFERENCE,
        "seeds": list(range(max(map(len, losses.values())))),
        "command": "python -m rope_jax.experiments.sweep ...",
        "rows": {r: {"runs": [{"loss": {t: v, str(2 * seq_len): v + 1}} for v in vals]}
                 for r, vals in losses.items()},
    }  # fmt: skip


def test_tau_is_exact_when_seeds_agree_and_its_interval_is_a_point():
    rung = ladder.rung(sweep({r: [v] * 3 for r, v in REFERENCE.items()}), list(REFERENCE))
    assert rung["tau"] == pytest.approx(1.0) and rung["tau_ci"] == [1.0, 1.0]
    assert rung["nope_rank"] == 4 and rung["ranks"]["a"] == 1


def test_one_seed_per_row_gives_no_interval():
    rung = ladder.rung(sweep({r: [v] for r, v in REFERENCE.items()}), list(REFERENCE))
    assert rung["tau"] == pytest.approx(1.0) and rung["tau_ci"] == [None, None]
    assert "| L2 D16 T8 10 steps | — | 1 | 1.000 | — (one seed) |" in ladder.render([rung], "cmd")


def test_a_rung_with_a_second_seed_for_some_rows_says_so():
    """Rows with two seeds beside rows with one: no interval, and the seed count by row."""
    losses = {r: [v, v + 0.01] if r in ("a", "nope") else [v] for r, v in REFERENCE.items()}
    rung = ladder.rung(sweep(losses), list(REFERENCE))
    assert rung["tau_ci"] == [None, None] and rung["stats"]["8"]["a"][1] is not None
    page = ladder.render([rung], "cmd")
    assert "| L2 D16 T8 10 steps | — | 1-2 (by row) | 1.000 | — (rows with one seed) |" in page


@pytest.mark.slow
def test_noisy_seeds_widen_the_interval_and_reversed_order_gives_minus_one():
    noisy = {"a": [1.0, 2.6, 1.1], "b": [2.0, 1.2, 2.1], "c": [3.0, 3.1, 2.9], "nope": [4.0] * 3}
    rung = ladder.rung(sweep(noisy), list(REFERENCE))
    low, high = rung["tau_ci"]
    assert low < rung["tau"] <= high and high - low > 0.3
    reversed_ = ladder.rung(sweep({r: [-v] * 3 for r, v in REFERENCE.items()}), list(REFERENCE))
    assert reversed_["tau"] == pytest.approx(-1.0)


def test_mean_and_std_at_every_length():
    rung = ladder.rung(sweep({"a": [1.0, 2.0, 3.0], "b": [2.0] * 3}), ["a", "b", "missing"])
    assert rung["rows"] == ["a", "b"]
    assert rung["stats"]["8"]["a"] == (2.0, 1.0) and rung["stats"]["16"]["a"][0] == 3.0


def test_growth_from_t_to_the_longest_length_and_a_label_that_names_size_and_corpus():
    report = sweep({"a": [1.0, 2.0], "nope": [4.0, 4.0]})
    for run in report["rows"]["a"]["runs"]:
        run["loss"]["16"] = run["loss"]["8"] + 0.5  # a grows by 0.5, nope by 1.0 (sweep's +1)
    rung = ladder.rung(report, ["a", "nope"])
    assert rung["growth"] == {"a": (0.5, 0.0), "nope": (1.0, 0.0)}
    assert "| a | +0.500 ± 0.000 |" in ladder.render([rung], "cmd")
    report["seq_lens"] = ["8"]  # evaluated at T alone: nothing to grow, no table
    assert ladder.rung(report, ["a", "nope"])["growth"] == {}
    report["settings"].update({"data.global_batch_size": 4, "data.name": "linux8k"})
    assert ladder.label(report) == "L2 D16 T8 320 tok linux8k"
    for run in report["rows"]["a"]["runs"] + report["rows"]["nope"]["runs"]:
        run["tokenizer"] = "bpe8000-feaa960e"  # a prepared corpus's own tokenizer
    assert ladder.label(report) == "L2 D16 T8 320 tok linux8k BPE 8000"
    report["settings"].update({"train.num_steps": 50_000, "data.tokenizer": "train:8000"})
    assert ladder.label(report) == "L2 D16 T8 1.6M tok linux8k BPE 8000"


@pytest.mark.slow
def test_command_line_writes_table_plot_and_json(tmp_path):
    paths = []
    for layers in (2, 4):
        losses = {r: [v + 0.01 * s for s in range(3)] for r, v in REFERENCE.items()}
        path = tmp_path / f"L{layers}.json"
        device = "cpu (AMD EPYC) x1" if layers == 2 else "NVIDIA H200"  # where each rung ran
        path.write_text(json.dumps(dict(sweep(losses, layers=layers), device=device)))
        paths.append(str(path))
    out = tmp_path / "ladder"
    ladder.main([f"--sweeps={','.join(paths)}", "--rows=a,b,c,nope", f"--out={out}"])
    md = (tmp_path / "ladder.md").read_text()
    assert "| L2 D16 T8 10 steps | cpu (AMD EPYC) x1 | 3 | 1.000 |" in md
    assert "| L4 D16 T8 10 steps | NVIDIA H200 | 3 |" in md
    assert (tmp_path / "ladder.png").stat().st_size > 0
    assert len(json.loads((tmp_path / "ladder.json").read_text())["rungs"]) == 2
    with pytest.raises(SystemExit, match="no file"):
        ladder.main([f"--sweeps={tmp_path}/none.json", f"--out={out}"])


def test_what_a_ladder_cannot_use_is_one_line_before_anything_is_written(tmp_path):
    one = tmp_path / "one.json"
    one.write_text(json.dumps(sweep({"a": [1.0], "zz": [2.0]})))  # one of the rows compared
    bad, other = tmp_path / "bad.json", tmp_path / "other.json"
    bad.write_text("not json")
    other.write_text('{"a": 1}')
    (tmp_path / "file").write_text("")
    good = tmp_path / "good.json"
    good.write_text(json.dumps(sweep({r: [v] for r, v in REFERENCE.items()})))
    out = f"--out={tmp_path / 'l'}"
    for argv, match in [
        ([f"--sweeps={good},{one}", out], rf"^error: --sweeps: {one} holds 1 of the rows compared"),
        ([f"--sweeps={bad}", out], r"is not a sweep's results JSON \(Expecting value"),
        ([f"--sweeps={other}", out], r"is not a sweep's results JSON \(no rows, seq_lens\)$"),
        (["--sweeps=,", out], r"give one or more"),
        ([f"--sweeps={good}", f"--out={tmp_path / 'file' / 'l'}"], r"is not writable: Not a dir"),
        ([f"--sweeps={good},{one},{good}", out], rf"^error: --sweeps lists {good} twice"),
        ([f"--sweeps={good}", out, "--rows=a,zz,yy"],
         r"^error: --rows: zz, yy in none of the sweeps \(their rows: a, b, c, nope\)$"),
        ([f"--sweeps={good}", out, "--rows=a,"], r"^error: --rows=a,: a rung orders two or"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit, match=match):
            ladder.main(["--rows=a,b,c,nope", *argv])
    assert not (tmp_path / "l.md").exists()


def test_a_rung_without_nope_or_article_losses_shows_dashes():
    report = dict(sweep({"a": [1.0], "b": [2.0]}), article_loss={})
    rung = ladder.rung(report, ["a", "b"])
    assert rung["tau"] is None and rung["nope_rank"] is None
    assert "| 1 | — | — (one seed) | — | — |" in ladder.render([rung], "cmd")


def test_a_rung_cut_short_shows_dashes_for_its_missing_rows_whichever_comes_first():
    full = ladder.rung(sweep({r: [v] for r, v in REFERENCE.items()}, layers=2), list(REFERENCE))
    short = ladder.rung(sweep({"a": [1.0], "nope": [0.5]}, layers=4), list(REFERENCE))
    for rungs in ([short, full], [full, short]):  # a short first rung used to drop rows
        md = ladder.render(rungs, "cmd")
        assert md.count("| c (3) |") == 1 and (
            "| c (3) | — | 3 |" in md or "| c (3) | 3 | — |" in md
        )
        assert "| nope | 0.500 | 1.500 |" in md


def test_a_sweep_with_failed_runs_shows_a_failed_row_as_failed_never_as_a_number():
    """Row c failed at every seed, row a at one of two: c is out of tau and ranks and
    shown as failed; a's numbers are over its finished seed."""
    report = sweep({"a": [1.0, 1.2], "b": [2.0, 2.0], "c": [3.0, 3.0], "nope": [4.0, 4.0]})
    failed = lambda seed: {"seed": seed, "reason": "non-finite loss", "log": "l"}  # noqa: E731
    report["rows"]["c"] = {"runs": [], "failed": [failed(0), failed(1)]}
    report["rows"]["a"]["runs"].pop()
    report["rows"]["a"]["failed"] = [failed(1)]
    rung = ladder.rung(report, list(REFERENCE))
    assert rung["rows"] == ["a", "b", "nope"] and rung["failed"] == {"c": [0, 1]}
    assert rung["tau"] == pytest.approx(1.0) and rung["nope_rank"] == 3
    assert rung["stats"]["8"]["a"] == (1.0, None) and rung["fewest_seeds"] == 1
    page = ladder.render([rung], "cmd")
    assert "| c (3) | failed |" in page and "| c | failed | failed |" in page
    assert "| c | +" not in page and "| c | 3" not in page
    assert "3 failed run(s)" in page and "rows with no finished run: c" in page
    # a partial sweep page (`--report_only`): c not finished yet, which is not failed
    report["rows"]["c"] = {"runs": [], "pending": [{"seed": 0, "state": "new"}]}
    page = ladder.render([ladder.rung(report, list(REFERENCE))], "cmd")
    assert "| c (3) | not finished |" in page and "| c | not finished | not finished |" in page
    report["rows"]["b"] = {"runs": [], "failed": [failed(0)]}
    with pytest.raises(ValueError, match="holds 1 of the rows compared"):
        ladder.rung(report, ["a", "b", "c"])
