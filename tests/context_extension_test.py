"""The context-extension experiment: its plan, its verdicts, bad requests, and a real run."""

import json
import os
import subprocess
import sys

import pytest

from rope_jax import provenance
from rope_jax.experiments import context_extension as ce
from rope_jax.experiments import plan, report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ("model.num_layers=1,model.embed_dim=32,model.num_heads=2,model.num_kv_heads=1,"
        "model.head_dim=16,model.mlp_dim=64,data.seq_len=72,data.global_batch_size=4,"
        "train.num_steps=4,train.log_every_steps=2,train.eval_every_steps=0,"
        "train.ckpt_every_steps=4,eval.batch_size=4,eval.num_batches=1")  # fmt: skip


def _args(tmp_path, *extra):
    return ce.parse_args([f"--workdir={tmp_path}", f"--set={TINY}", *extra])


def test_rules_are_hf_rope_parameters_from_the_training_length():
    assert ce.rule_scaling("none", 4.0, 128) is None
    assert ce.rule_scaling("linear", 4.0, 128) == {"rope_type": "linear", "factor": 4.0}
    yarn = ce.rule_scaling("yarn", 4.0, 128)
    assert yarn == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    assert ce.rule_scaling("llama3", 2.0, 64)["original_max_position_embeddings"] == 64


def test_rows_are_the_configs_rows_and_the_learned_axis(tmp_path):
    """k comes from configs/lm.py's sweep, freqs from the experiment's own axis; a fixed
    rotation takes every rule, NoPE and a learned one `none` only."""
    cases, meta = ce.make_plan(_args(tmp_path, "--rows=qk,k,vo,nope,freqs"))
    rules = {row: sorted({c.rule for c in cases if c.row == row}) for row in meta["rows"]}
    assert rules["qk"] == rules["k"] == rules["vo"] == sorted(ce.RULES)
    assert rules["nope"] == rules["freqs"] == ["none"]
    k = next(c for c in cases if c.row == "k")
    assert "--config.model.rope.sites=k" in k.train_flags
    with pytest.raises(plan.SweepError, match="--rows: unknown qq"):
        ce.make_plan(_args(tmp_path, "--rows=qk,qq"))


def test_plan_lists_each_base_evaluation_and_fine_tune(tmp_path):
    cases, meta = ce.make_plan(_args(tmp_path, "--rows=qk,nope", "--rules=none,yarn", "--seeds=2"))
    assert meta["lengths"] == [72, 144, 288, 576] and meta["finetune_len"] == 288
    keys = [(c.row, c.seed, c.rule, c.finetuned) for c in cases]
    assert len(keys) == len(set(keys)) == 2 * 2 * 2 + 2 * 2  # qk: 2 rules x 2; nope: 1 x 2
    base = [c for c in cases if c.row == "qk" and c.seed == 1 and not c.finetuned]
    assert {c.workdir for c in base} == {str(tmp_path / "qk" / "seed_1" / "base")}
    assert [c.tag for c in base] == ["none", "yarn"] and base[1].scaling["factor"] == 4.0
    ft = next(c for c in cases if c.row == "qk" and c.rule == "yarn" and c.finetuned)
    flags = dict(f.split("=", 1) for f in ft.train_flags)
    assert flags["--config.data.seq_len"] == "288" and flags["--config.train.num_steps"] == "100"
    assert flags["--config.train.init_from"] == str(tmp_path / "qk" / "seed_0" / "base")
    assert flags["--config.model.rope.scaling.rope_type"] == "yarn"
    assert flags["--config.model.rope.max_position_embeddings"] == "72"
    assert flags["--config.data.passkey_rate"] == "0.5" and flags["--config.seed"] == "0"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--rows=qk,bogus"], "--rows: unknown bogus"),
        (["--rules=ntk"], "--rules: unknown ntk"),
        (["--factor=1"], "--factor=1.0 must be > 1"),
        (["--seeds=0"], "--seeds=0 must be >= 1"),
        (["--set=data.seq_len=32"], "at least"),
        (["--set=model.rope.basee=5"], "no config field 'model.rope.basee'"),
        (["--rows=qk,vo,qk"], "--rows lists qk twice"),
        (["--rules=yarn,yarn"], "--rules lists yarn twice"),
        (["--finetune_lr=0"], r"fine-tuned under .*: optim.lr=0.0 must be > 0"),  # after the base
        (["--tasks=niah_singel_1"], "--tasks: unknown evaluation task 'niah_singel_1'"),
        (["--tasks=vt", "--passkey=4", "--examples=5"], "one count of examples"),
        (["--tasks=vt", "--passkey=0"], "--tasks: vt: length 72 is too short"),
    ],
)
def test_bad_requests_fail_before_anything_runs(tmp_path, extra, message):
    with pytest.raises(ValueError, match=message):
        ce.make_plan(_args(tmp_path, *extra))
    assert not os.listdir(tmp_path)


def test_an_out_that_cannot_be_written_stops_before_anything_runs(tmp_path, capsys):
    workdir = tmp_path / "w"
    assert ce.main([f"--workdir={workdir}", f"--set={TINY}", "--out=/dev/null/page"]) == 2
    assert capsys.readouterr().err == (
        "error: --out=/dev/null/page is not writable: Not a directory\n"
    )
    assert not workdir.exists()


def _result(losses: dict, keys: dict | None = None) -> dict:
    """A result of qk under two rules at T = 10 (one seed), for the verdicts."""
    cells = []
    for (rule, finetuned), row_losses in losses.items():
        cell = {"row": "qk", "rule": rule, "finetuned": finetuned, "seeds": 1}
        cell["loss"] = {
            str(n): [v, 0.01] for n, v in zip((10, 20, 40, 80), row_losses, strict=True)
        }
        cell["passkey"] = cell["digits"] = {
            str(n): [v, 0.01] for n, v in (keys or {}).get((rule, finetuned), {}).items()
        }
        cells.append(cell)
    return {"train_len": 10, "finetune_len": 40, "lengths": [10, 20, 40, 80], "cells": cells}


def test_verdicts_say_which_claims_hold_and_skip_what_was_not_run():
    losses = {("none", False): [1.0, 1.5, 2.0, 2.5], ("linear", False): [1.2, 1.3, 1.4, 2.0],
              ("linear", True): [1.1, 1.1, 1.1, 1.8]}  # fmt: skip
    result = _result(losses,
                     {("linear", True): {40: 0.9}, ("linear", False): {40: 0.1}})  # fmt: skip
    lines = ce.verdicts(result)
    assert any("does not extrapolate" in v and "**holds**" in v for v in lines)
    assert any("needs fine-tuning, then works" in v and "**holds**" in v for v in lines)
    assert any("passkey digits at 40" in v and "linear" in v and "**holds**" in v for v in lines)
    assert not any("YaRN" in v or "NoPE" in v for v in lines)  # not run: no verdict
    flat = _result({("none", False): [1.0, 0.9, 2.0, 2.5]})
    assert "**does not hold**" in ce.verdicts(flat)[0]
    noisy = _result({("none", False): [1.0, 1.1, 2.0, 2.5]})
    noisy["cells"][0]["loss"]["10"][1] = noisy["cells"][0]["loss"]["20"][1] = 0.2
    assert "**not resolved**" in ce.verdicts(noisy)[0]


# The real experiment's settings: T = 160, above the 136 bytes niah_single_1's short
# template needs, so that one run answers both tests below.
REAL = TINY.replace("data.seq_len=72", "data.seq_len=160") + (
    ",data.task_template=short,eval.answer_tokens=12"
)


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    """One real experiment through `python -m rope_jax.experiments.context_extension`: row
    qk under rules none and yarn, trained, fine-tuned at 4T, every cell evaluated for the
    loss, passkey and RULER's niah_single_1 at T..8T. Its argv, workdir, and the process."""
    root = tmp_path_factory.mktemp("context_extension")
    argv = [f"--workdir={root / 'runs'}", f"--out={root / 'results' / 'ctx'}", "--rows=qk",
            "--rules=none,yarn", "--finetune_steps=2", "--passkey=2", "--num_batches=1",
            f"--set={REAL}", "--tasks=niah_single_1", "--examples=2"]  # fmt: skip
    cmd = [sys.executable, "-m", "rope_jax.experiments.context_extension", *argv]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    return argv, root, done


@pytest.mark.slow
@pytest.mark.xdist_group("context_extension_run")
def test_a_real_experiment_trains_fine_tunes_evaluates_and_resumes(experiment, capsys, monkeypatch):
    """The command trains, fine-tunes and evaluates every cell; the same command again
    (in-process: `main`, as `python -m` runs it) finds everything done."""
    argv, root, done = experiment
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((root / "results" / "ctx.json").read_text())
    cells = {(c["row"], c["rule"], c["finetuned"]): c for c in result["cells"]}
    assert set(cells) == {("qk", r, f) for r in ("none", "yarn") for f in (False, True)}
    for cell in cells.values():
        assert set(cell["loss"]) == set(cell["passkey"]) == {"160", "320", "640", "1280"}
        assert set(cell["digits"]) == set(cell["loss"])
        assert all(0 <= v[0] <= 1 for m in ("passkey", "digits") for v in cell[m].values())
    # The yarn evaluation of the base run was made under yarn; as trained it was not.
    base = root / "runs" / "qk" / "seed_0" / "base"
    yarn = json.loads((base / "eval_4_yarn.json").read_text())
    assert yarn["settings"]["rope_scaling"]["rope_type"] == "yarn"
    assert json.loads((base / "eval_4_none.json").read_text())["settings"]["rope_scaling"] is None
    assert (
        cells[("qk", "none", False)]["loss"]["160"] != cells[("qk", "yarn", False)]["loss"]["160"]
    )
    ft = json.loads((root / "runs" / "qk" / "seed_0" / "finetune_yarn" / "config.json").read_text())
    assert ft["data"]["seq_len"] == 640 and ft["model"]["rope"]["scaling"]["rope_type"] == "yarn"
    assert ft["train"]["init_from"] == str(base)
    page = (root / "results" / "ctx.md").read_text()
    assert "## The published claims at this scale" in page
    here = provenance.describe(provenance.code_version())  # base and fine-tuned runs alike
    assert result["code"] == [here] and f"Device: {provenance.devices()}; code: {here}." in page
    assert (root / "results" / "ctx.png").stat().st_size > 10_000
    # Again: everything is done, nothing retrains (the results are written again).
    stamp = os.path.getmtime(base / "checkpoints" / "4")
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")  # what `main` sets for its jobs: undone after
    capsys.readouterr()
    assert ce.main(argv) == 0 and capsys.readouterr().out.count("done, skipped") == 4
    assert os.path.getmtime(base / "checkpoints" / "4") == stamp


@pytest.mark.slow
@pytest.mark.xdist_group("context_extension_run")
def test_ruler_tasks_are_scored_at_every_length(experiment):
    """--tasks: RULER's tasks beside the loss in every cell, at every length."""
    _, root, done = experiment
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((root / "results" / "ctx.json").read_text())
    assert len(result["cells"]) == 4
    for cell in result["cells"]:
        scores = cell["niah_single_1"]
        assert set(scores) == {"160", "320", "640", "1280"}
        assert all(0 <= v[0] <= 1 for v in scores.values())
    assert "RULER's `niah_single_1`" in (root / "results" / "ctx.md").read_text()


def test_a_task_added_to_a_finished_experiment_evaluates_its_runs_again(tmp_path):
    case = ce.Case("qk", 0, "none", False, str(tmp_path), (), 4, None, "none")
    meta = {"lengths": [8, 16], "tasks": []}
    entry = {"loss": 1.0, "tokens": 8}
    (tmp_path / "eval_4_none.json").write_text(json.dumps({"8": entry, "16": entry}))
    assert ce._done(case, meta)
    assert not ce._done(case, {**meta, "tasks": ["vt"]})
    both = {"8": {**entry, "vt": 0.5}, "16": {**entry, "vt": 0.0}}
    (tmp_path / "eval_4_none.json").write_text(json.dumps(both))
    assert ce._done(case, {**meta, "tasks": ["vt"]})


def test_report_only_writes_the_cases_evaluated_so_far_and_names_the_rest(tmp_path, capsys):
    """Two of qk's six cases (seed 0, rule none, as trained; and fine-tuned) evaluated:
    the page is marked partial, has their cells with a seeds column, lists the four not
    done; nothing trains; with none evaluated, one line."""
    out = tmp_path / "out" / "ctx"
    argv = [f"--workdir={tmp_path / 'runs'}", f"--set={TINY}", "--rows=qk", "--seeds=2",
            "--rules=none,yarn", "--passkey=0", f"--out={out}", "--report_only"]  # fmt: skip
    assert ce.main(argv) == 2
    assert capsys.readouterr().err.strip() == (
        "error: none of the 8 cases is evaluated yet, so there is nothing to write"
    )
    cases, meta = ce.make_plan(ce.parse_args(argv))
    for case in cases[:2]:
        os.makedirs(case.workdir, exist_ok=True)
        evals = {str(n): {"loss": 2.0 + n / 1000} for n in meta["lengths"]}
        with open(case.eval_path, "w") as f:
            json.dump(evals, f)
    assert ce.main(argv) == 0, capsys.readouterr().err
    page, result = (
        out.with_suffix(".md").read_text(),
        json.loads(out.with_suffix(".json").read_text()),
    )
    assert "--report_only" not in result["command"] and "--rows=qk" in result["command"]
    assert "**Partial:** written while the experiment goes on, from 2 of 8 cases evaluated" in page
    assert "| qk | none | no | 1 of 2 | 2.072 | 2.144 | 2.288 | 2.576 |" in page
    assert "| qk | none | yes | 1 of 2 | 2.072 |" in page
    assert len(result["cells"]) == 2 and result["planned"] == 8
    assert result["pending"][0] == "qk seed=0 rule=yarn as trained"
    assert page.rstrip().endswith("- qk seed=1 rule=yarn fine-tuned")
    assert sorted(os.listdir(tmp_path / "runs" / "qk")) == ["seed_0"]  # nothing trained
    assert sorted(os.listdir(tmp_path / "runs" / "qk" / "seed_0" / "base")) == ["eval_4_none.json"]


def _niah_result() -> dict:
    """Rows a, b, c at T = 10, two seeds each, as trained under `none` (and a fine-tuned a):
    a's seed 0 learned the task, seed 1 did not; b learned it in both; c in neither."""
    niah = {("a", 0): [1.0, 0.6], ("a", 1): [0.1, 0.0], ("b", 0): [0.95, 0.9],
            ("b", 1): [0.9, 0.5], ("c", 0): [0.0, 0.0], ("c", 1): [0.2, 0.0]}  # fmt: skip
    loss = {"a": [1.0, 2.0], "b": [1.1, 1.5], "c": [1.2, 1.4]}
    runs = [{"row": row, "seed": seed, "rule": "none", "finetuned": False,
             "loss": dict(zip(("10", "20"), [v + 0.01 * seed for v in loss[row]], strict=True)),
             "niah": dict(zip(("10", "20"), scores, strict=True))}
            for (row, seed), scores in niah.items()]  # fmt: skip
    tuned = {"10": 0.5, "20": 0.5}
    runs += [{**r, "finetuned": True, "niah": tuned} for r in runs if r["row"] == "a"]
    cells = []
    for row, finetuned in (("a", False), ("b", False), ("c", False), ("a", True)):
        mine = [r for r in runs if (r["row"], r["finetuned"]) == (row, finetuned)]
        cells.append({"row": row, "rule": "none", "finetuned": finetuned, "seeds": len(mine),
                      "digits": {}, "passkey": {},
                      **{m: {n: list(report.mean_std([r[m][n] for r in mine]))
                             for n in ("10", "20")} for m in ("loss", "niah")}})  # fmt: skip
    return {"train_len": 10, "lengths": [10, 20], "runs": runs, "cells": cells,
            "tasks": ["niah"]}  # fmt: skip


def test_retrieval_is_read_in_the_runs_that_learned_it_and_against_the_loss_order(tmp_path):
    result = _niah_result()
    assert [ce.learned_seeds(result, "niah", row) for row in "abc"] == [[0], [0, 1], []]
    cells = {(c["row"], c["finetuned"]): c for c in ce.learned_cells(result, "niah")}
    assert cells["a", False]["niah"] == {"10": [1.0, None], "20": [0.6, None]}  # seed 0 only
    assert cells["a", True]["learned"] == 1 and cells["a", True]["niah"]["20"] == [0.5, None]
    assert cells["b", False]["niah"]["20"] == pytest.approx([0.7, 0.2828], abs=1e-4)
    assert cells["c", False]["learned"] == 0 and cells["c", False]["niah"] == {}
    # At 20: the loss orders c > b > a (c best), beyond the noise; b's score (0.7 +- 0.28)
    # beats c's (0.0 +- 0.0), a's (0.3 +- 0.42) ties with both.
    pairs = ce.order_pairs(result, "niah", 20)
    assert pairs["opposite"] == ["c > b"] and pairs["alike"] == []
    assert sorted(pairs["tied"]) == ["b > a", "c > a"]
    result.update(settings={}, sets={}, rows=list("abc"), rules=["none"], finetune_steps=1,
                  finetune_len=40, finetune_lr=1e-3, factor=4.0, num_batches=1,
                  passkey_examples=0, seeds=2, examples=2)  # fmt: skip
    page = ce.render_markdown(result)
    assert "Runs that learned it, per row: a 1 of 2, b 2 of 2, c 0 of 2." in page
    assert "- at 20: ordered alike none; oppositely (by loss first) c > b; 2 pair(s) tied" in page
    ce.plot(result, str(tmp_path / "page.png"))  # the retrieval panels: niah, no passkey
    assert (tmp_path / "page.png").stat().st_size > 10_000
