"""rope_jax.sweep: the table maths, bad requests, and a real 2-row x 2-seed sweep."""

import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time

import pytest
from ml_collections.config_flags import tuple_parser

from configs import common
from rope_jax import provenance
from rope_jax.experiments import failures, launch, plan, sweep
from rope_jax.experiments import report as report_lib
from rope_jax.harness import workdir as workdir_lib

# One test worker runs the module (its tests share one module-scoped sweep, built once).
pytestmark = pytest.mark.xdist_group("sweep")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ("model.num_layers=1,model.embed_dim=32,model.num_heads=2,model.num_kv_heads=1,"
        "model.head_dim=16,model.mlp_dim=64,data.seq_len=32,data.global_batch_size=8,"
        "train.num_steps=10,train.log_every_steps=5,train.eval_every_steps=5,"
        "train.ckpt_every_steps=5,eval.num_batches=1,eval.batch_size=8")  # fmt: skip
RUNS = [("nope", 0), ("vo", 0), ("nope", 1), ("vo", 1)]  # seed by seed, rows in order


def test_mean_std_and_ranks():
    assert report_lib.mean_std([1.0, 2.0, 3.0]) == (2.0, 1.0)  # sample std (ddof=1)
    assert report_lib.mean_std([2.5]) == (2.5, None)  # one seed: no std, no crash
    ranked = report_lib.ranks({"a": 3.0, "b": 1.0, "c": 2.0, "d": 1.0})
    assert ranked == {"a": 4, "b": 1, "c": 3, "d": 1}


def test_kendall_tau_on_known_permutations():
    ours = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}
    tau, p, n = report_lib.kendall(ours, {"a": 10, "b": 20, "c": 30, "d": 40, "extra": 0})
    assert (tau, n) == (1.0, 4) and p == pytest.approx(2 / 24)  # exact: 2 of 4! orders
    assert report_lib.kendall(ours, {"a": 4, "b": 3, "c": 2, "d": 1})[0] == -1.0
    # One adjacent swap: 5 concordant, 1 discordant pair of 6 -> tau = 4/6.
    assert report_lib.kendall(ours, {"a": 2, "b": 1, "c": 3, "d": 4})[0] == pytest.approx(2 / 3)
    assert report_lib.kendall(ours, {"a": 1, "zz": 2}) == (None, None, 1)
    assert report_lib.kendall({"a": 1.0, "b": 1.0}, {"a": 1, "b": 2})[:2] == (None, None)  # ties


def test_resolved_pairs_compare_each_gap_with_the_combined_seed_std():
    means = {"c": 1.12, "a": 1.0, "b": 1.1}
    pairs = report_lib.resolved_pairs(means, {"a": 0.03, "b": 0.04, "c": 0.01})
    assert [(q["better"], q["worse"]) for q in pairs] == [("a", "b"), ("b", "c")]
    assert pairs[0]["noise"] == pytest.approx(0.05) and pairs[0]["resolved"] is True
    assert pairs[1]["gap"] == pytest.approx(0.02) and pairs[1]["resolved"] is False
    single = report_lib.resolved_pairs(means, {"a": None, "b": None, "c": None})
    assert [q["resolved"] for q in single] == [None, None]


def test_command_reconstruction_round_trips_through_the_shell():
    argv = ["--config=configs/lm.py:size=tiny", "--seeds=3", "--set", "model.rope.sites=",
            "--set", "data.files=my texts/*.txt"]  # fmt: skip
    command = plan.format_command(argv)
    prefix = "python -m rope_jax.experiments.sweep --config=configs/lm.py:size=tiny "
    assert command.startswith(prefix)
    assert shlex.split(command)[3:] == argv


def test_set_values_take_the_field_type_and_reach_train_py_intact():
    assert plan.split_sets(["a.b=1,c.d=(1, 2)", "e=", "f.g=x,y"]) == [
        ("a.b", "1"), ("c.d", "(1, 2)"), ("e", ""), ("f.g", "x,y")]  # fmt: skip
    assert plan.parse_value("2", 1) == 2 and isinstance(plan.parse_value("2", 1.0), float)
    assert plan.parse_value("false", True) is False
    assert plan.parse_value("", "qk") == ""
    assert plan.parse_value("(64,128)", ()) == (64, 128) == plan.parse_value("64,128", ())
    assert plan.parse_value("", (1,)) == () and plan.parse_value("64", ()) == (64,)
    with pytest.raises(ValueError):
        plan.parse_value("two", 1)
    # Unset optional fields (placeholders) parse as their declared type; "none" unsets.
    assert plan.parse_value("4", None, float) == 4.0 and plan.parse_value("none", None, int) is None
    types = plan.field_types(common.base_config("tiny"))
    assert types["model.rope.scaling.factor"] is float and types["model.num_layers"] is int
    # What train.py's config_flags parses back from the flag text:
    for value in [(), (64,), (64, 128), (("batch", "data"),)]:
        assert tuple_parser.TupleParser().parse(plan.flag_value(value)) == value
    assert plan.flag_value(True) == "true" and plan.flag_value("") == ""


def test_one_seed_table_says_std_is_na_and_rows_outside_the_article_get_a_dash(tmp_path):
    def run(loss):
        return {"seed": 0, "step": 10, "loss": {"32": loss, "64": loss + 1},
                "eval_curve": [[5, loss + 0.5], [10, loss]]}  # fmt: skip

    report = {"config": "c.py", "title": "", "date": "d",
              "command": "python -m rope_jax.experiments.sweep",
              "jax": "0", "device": "cpu", "settings": {}, "seeds": [0], "seq_lens": ["32", "64"],
              "eval_split": "validation", "article_loss": {"a": 2.0, "b": 1.0},
              "rows": {}}  # fmt: skip
    for name, base, loss in [("a", 1, 3.0), ("b", 2, 3.5), ("new", 3, 3.2)]:
        report["rows"][name] = {"overrides": {"model.rope.base": base}, "runs": [run(loss)]}
    md = report_lib.render_markdown(report)
    assert "| row | sites or overrides | loss @32 (T) mean ± std | loss @64 (2T) mean ± std |" in md
    assert "| a | `model.rope.base=1` | 3.0000 ± n/a | 4.0000 ± n/a | 1 | 2.000 | 2 |" in md
    assert "| new | `model.rope.base=3` | 3.2000 ± n/a | 4.2000 ± n/a | 2 | — | — |" in md
    assert "mean of one seed, so std is n/a" in md and "over the 2 rows in both: -1.000" in md
    assert "- a < new: gap 0.2000, n/a (one seed)" in md
    del report["rows"]["a"], report["rows"]["b"]  # no row of the article's: no tau line
    md = report_lib.render_markdown(report)  # nor its columns, which would be all dashes
    assert "Kendall tau" not in md and "article" not in md
    report_lib.plot(report, str(tmp_path / "one_seed.png"))  # no error bars to draw: no crash
    assert (tmp_path / "one_seed.png").stat().st_size > 10_000


def test_extrapolation_is_reported_per_run_with_seed_noise_verdicts():
    def run(seed, at_t, at_4t):
        return {"seed": seed, "step": 10, "loss": {"32": at_t, "128": at_4t},
                "eval_curve": [[10, at_t]]}  # fmt: skip

    rows = {"qk": [(0, 1.80, 2.50), (1, 1.82, 2.12)],  # grows +0.70 and +0.30: noisy
            "vo": [(0, 1.90, 2.40), (1, 1.92, 2.44)],  # +0.50 and +0.52: steady
            "nope": [(0, 2.30, 2.40), (1, 2.31, 2.42)]}  # +0.10 and +0.11  # fmt: skip
    report = {"config": "c.py", "title": "", "command": "x", "date": "d", "jax": "0",
              "device": "cpu", "settings": {}, "seeds": [0, 1], "seq_lens": ["32", "128"],
              "eval_split": "validation", "article_loss": None,
              "rows": {n: {"overrides": {"model.rope.sites": n}, "runs": [run(*x) for x in r]}
                       for n, r in rows.items()}}  # fmt: skip
    md = report_lib.render_markdown(report)
    assert "| qk | `qk` | 1.8100 ± 0.0141 | 2.3100 ± 0.2687 | 1 |" in md
    assert "- nope: +0.1050 ± 0.0071" in md and "- qk: +0.5000 ± 0.2828" in md
    assert "- nope < qk: gap 0.3950, resolved" in md
    assert "- qk < vo: gap 0.0100, within seed noise" in md  # qk's seeds disagree


def test_plots_give_up_to_twenty_rows_distinct_colours_and_one_seed_no_error_bars(
    monkeypatch, tmp_path
):
    for n in (3, 10, 12, 16, 20):
        assert len(set(report_lib.row_colours(n))) == n
    calls = {}
    import matplotlib.axes

    real_bar = matplotlib.axes.Axes.bar

    def bar(self, *args, **kwargs):
        calls.update(yerr=kwargs.get("yerr"))
        return real_bar(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "bar", bar)
    run = lambda loss: {"loss": {"8": loss}, "eval_curve": [[1, loss]]}  # noqa: E731
    for seeds, expect_bars in (([0], False), ([0, 1], True)):
        report = {"config": "c", "seeds": seeds, "seq_lens": ["8"], "article_loss": None,
                  "rows": {r: {"overrides": {}, "runs": [run(v + 0.1 * s) for s in seeds]}
                           for r, v in (("a", 1.0), ("b", 2.0))}}  # fmt: skip
        report_lib.plot(report, str(tmp_path / "plot.png"))
        assert (calls["yerr"] is not None) == expect_bars


def test_results_of_another_plan_are_never_overwritten(tmp_path):
    """The sweep refuses before running anything; --overwrite replaces."""
    Job = plan.Job
    runs = [Job("qk", 0, "w", [], 10, [8], ())]
    context = {"overrides": {"qk": {"model.rope.sites": "qk"}}, "seeds": [0],
               "settings": {"train.num_steps": 10}}  # fmt: skip
    results = str(tmp_path / "table")
    sweep.check_results(results, runs, context)  # nothing there yet
    saved = {"rows": {"qk": {"overrides": {"model.rope.sites": "qk"}}}, "seeds": [0],
             "settings": {"train.num_steps": 10}}  # fmt: skip
    (tmp_path / "table.json").write_text(json.dumps(saved))
    sweep.check_results(results, runs, context)  # the same plan again: fine
    other = dict(context, seeds=[0, 1], settings={"train.num_steps": 2})
    with pytest.raises(plan.SweepError, match=r"another plan \(different seeds, settings\)"):
        sweep.check_results(results, runs, other)
    # a second seed or another row added later keeps everything the table held: fine
    more = [*runs, Job("qk", 1, "w", [], 10, [8], ()), Job("vo", 0, "w", [], 10, [8], ())]
    overrides = dict(context["overrides"], vo={"model.rope.sites": "vo"})
    sweep.check_results(results, more, dict(context, seeds=[0, 1], overrides=overrides))
    fewer = dict(context, seeds=[1])  # seed 0 would be dropped from the table
    with pytest.raises(plan.SweepError, match=r"different seeds"):
        sweep.check_results(results, runs, fewer)
    retuned = dict(context, overrides={"qk": {"model.rope.sites": "qk", "optim.lr": 1.0}})
    with pytest.raises(plan.SweepError, match=r"different rows"):
        sweep.check_results(results, runs, retuned)


def _main(argv, capsys):
    """sweep.main in-process: (exit message or None, stdout, stderr, seconds)."""
    start, message = time.time(), None
    try:
        sweep.main(argv)
    except SystemExit as e:
        message = str(e.code)
    out, err = capsys.readouterr()
    return message, out, err, time.time() - start


NO_SWEEP = "from configs.lm import get_config  # noqa: F401\n"


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--rows=vo,bogus"], "unknown bogus; known: nope, q, k, v, o, qk, vo"),
        (["--rows=vo,qk,vo"], "--rows lists vo twice"),
        (["--set", "model.num_layer=1"], "did you mean model.num_layers"),
        (["--set", "train.num_steps=ten"], "train.num_steps=ten"),
        (["--set", "model.rope.sites=q"], "set per run by nope, q, k"),
        (["--set", "seed=3"], "the sweep sets each run's seed"),
        (["--set", "model.head_dim=15"], "head_dim"),
        (["--config=NO_SWEEP"], "defines no sweep(add)"),
        (["--config=configs/lm.py:size=huge"], "size='huge'"),
        (["--results=NO_SWEEP/table"], "/table is not writable: Not a directory"),  # a file
    ],
)
def test_bad_requests_fail_with_one_line_before_running_anything(tmp_path, capsys, extra, match):
    config = tmp_path / "no_sweep.py"
    config.write_text(NO_SWEEP)
    extra = [str(a).replace("NO_SWEEP", str(config)) for a in extra]
    workdir = tmp_path / "runs"
    argv = ["--config=configs/lm.py:size=tiny", f"--workdir={workdir}", *extra]
    message, out, _, seconds = _main(argv, capsys)
    assert message and message.startswith("error: ") and "\n" not in message, message
    assert match in message, message
    assert not workdir.exists() and "[1/" not in out and seconds < 10


def test_config_flags_as_train_py_takes_them_are_set_overrides(tmp_path, capsys):
    """`--config.a.b=v` (train.py's spelling) is `--set a.b=v`; a mistake in one is the
    same one line."""
    base = ["--config=configs/lm.py:size=tiny", f"--workdir={tmp_path}", "--rows=qk,vo"]
    args = sweep.parse_args([*base, "--config.train.num_steps=7", "--set", "optim.lr=0.01"])
    assert args.set == ["train.num_steps=7", "optim.lr=0.01"]
    runs, context = plan.plan(args)
    assert all("--config.train.num_steps=7" in run.flags for run in runs)
    assert context["settings"]["train.num_steps"] == 7 and runs[0].final_step == 7
    message, _, _, _ = _main([*base, "--config.model.num_layer=1"], capsys)
    assert message.startswith("error: --set: no config field 'model.num_layer'; did you mean "
                              "model.num_layers"), message  # fmt: skip
    with pytest.raises(SystemExit) as e:
        sweep.parse_args([*base, "--bogus=1"])
    assert e.value.code == 2 and "unrecognized arguments: --bogus=1" in capsys.readouterr()[1]


def test_a_second_sweep_on_a_workdir_in_use_stops_at_once_naming_the_first(tmp_path, capsys):
    workdir = tmp_path / "runs"
    argv = ["--config=configs/lm.py:size=tiny", f"--workdir={workdir}", "--rows=qk", "--set", TINY]
    with workdir_lib.Lock(str(workdir)):  # the first sweep, still running
        message, out, _, seconds = _main(argv, capsys)
        assert message and message.startswith("error: workdir ") and "\n" not in message
        assert "is in use by another run" in message and f"pid {os.getpid()}" in message
        assert "[1/" not in out and seconds < 10
    assert not workdir.exists()  # nothing started; the lock's file and empty dir are gone


def test_report_only_tabulates_the_finished_runs_while_a_sweep_holds_the_workdir(tmp_path, capsys):
    """Three of four runs done (eval json of the final step), the fourth started: the
    table has them, says it is partial, names the fourth; the lock of the running sweep
    does not stop it, and nothing trains."""
    workdir = tmp_path / "runs"
    argv = ["--config=configs/lm.py:size=tiny", f"--workdir={workdir}", "--seeds=2",
            "--rows=nope,vo", f"--results={tmp_path}/table", "--set", TINY,
            "--report_only"]  # fmt: skip
    message, _, _, _ = _main(argv, capsys)
    assert message == ("error: no run of the 4 planned has finished yet, so there is no table "
                       "to write (--status lists them)")  # fmt: skip
    assert not (tmp_path / "table.md").exists()
    for k, (row, seed) in enumerate(RUNS[:3]):
        run = workdir / row / f"seed_{seed}"
        run.mkdir(parents=True)
        loss = 2.0 + k / 10
        evals = {t: {"loss": loss + i / 10} for i, t in enumerate(("32", "64", "128"))}
        (run / "eval_10.json").write_text(json.dumps({"step": 10, **evals}))
    (workdir / "vo" / "seed_1").mkdir()
    with workdir_lib.Lock(str(workdir)):  # the sweep, still training vo seed 1
        message, out, _, _ = _main(argv, capsys)
    assert message is None, message
    assert out.strip().endswith("table.json (3 of 4 runs finished)") and "[1/" not in out
    md = (tmp_path / "table.md").read_text()
    report = json.loads((tmp_path / "table.json").read_text())
    assert md == report_lib.render_markdown(report)
    assert report["rows"]["vo"]["pending"] == [{"seed": 1, "state": "partial"}]
    assert "--rows=nope,vo" in report["command"] and "--report_only" not in report["command"]
    assert "**Partial:** written while the sweep goes on, from the 3 runs finished; 1 not" in md
    lines = {ln.split(" | ")[0]: ln for ln in md.splitlines() if ln.startswith("| ")}
    assert lines["| nope"].startswith("| nope | NoPE | 2 of 2 | 2.1000 ± 0.1414 |")
    assert lines["| vo"].startswith("| vo | `vo` | 1 of 2 | 2.1000 ± n/a |")
    assert md.rstrip().endswith("- vo seed 1: started")
    assert sorted(os.listdir(workdir / "vo" / "seed_1")) == []  # nothing trained it


@pytest.mark.slow
def test_the_command_line_exits_non_zero_with_one_line(tmp_path):
    cmd = [sys.executable, "-m", "rope_jax.experiments.sweep", "--config=configs/lm.py",
           f"--workdir={tmp_path}/runs", "--rows=nope,typo"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode != 0 and proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0 and "--rows: unknown typo" in proc.stderr


@pytest.mark.slow
def test_a_job_started_after_jax_was_imported_ends_with_its_parent_and_warns_of_nothing():
    """A tool that evaluates in its own process (jax imported, its threads running) then
    starts the next job: no fork warning, and the job is tied to this process."""
    import warnings

    import jax

    jax.numpy.zeros(2).block_until_ready()
    cmd = [sys.executable, "-c", "import os; print(os.getppid(), os.getsid(0))"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        proc = launch.start(cmd, stdout=subprocess.PIPE, text=True)
        out = proc.communicate(timeout=60)[0]
    assert not [w for w in caught if "fork" in str(w.message)], [str(w.message) for w in caught]
    parent, session = map(int, out.split())
    assert parent == os.getpid() and session == proc.pid  # its own session, for Ctrl-C


def test_a_run_that_fails_to_start_is_named_and_no_table_is_written(tmp_path, capsys):
    argv = ["--config=configs/lm.py:size=tiny", f"--workdir={tmp_path}", "--rows=qk", "--set", TINY]
    argv += ["--set", f"data.name=no_such_dataset_xyz,data.data_dir={tmp_path}"]
    message, out, err, _ = _main(argv, capsys)
    assert message.startswith("error: 1 of 1 runs failed (row=qk seed=0): no run finished, "
                              "so no table"), message  # fmt: skip
    assert "FAILED: train.py exited with status 1: " in out and "no_such_dataset_xyz" in out
    assert "no_such_dataset_xyz" in err  # the log's last lines
    assert not os.path.exists(tmp_path / "results.md")
    rec = json.loads((tmp_path / "qk/seed_0/failed.json").read_text())
    assert rec["failures"] == 1 and rec["log"] == str(tmp_path / "qk/seed_0/train.log")


def fake_runs(tmp_path, names):
    return [plan.Job(row, 0, str(tmp_path / row / "seed_0"), [], 10, [32], ()) for row in names]


def test_the_local_launcher_goes_on_past_a_failed_run_and_retries_it_once(
    tmp_path, capsys, monkeypatch
):
    """Three runs, the first crashing (killed as by the out-of-memory killer): the other
    two train; the next call retries it once, the one after leaves it alone."""
    ran = []

    def execute(run, env):
        ran.append(run.row)
        os.makedirs(run.workdir, exist_ok=True)
        if run.row == "a":
            raise plan.SweepError(failures.ended("train.py", -9))
        (tmp_path / run.row / "seed_0" / "eval_10.json").write_text('{"32": {"loss": 1.0}}')

    monkeypatch.setattr(launch, "execute", execute)
    monkeypatch.setattr(launch, "result_line", lambda run: "")
    runs = fake_runs(tmp_path, ["a", "b", "c"])
    failed = launch.run_all(runs, str(tmp_path))
    assert ran == ["a", "b", "c"] and [f["row"] for f in failed] == ["a"]
    assert failed[0]["reason"] == ("train.py was killed by SIGKILL (the out-of-memory killer, "
                                   "or kill -9)")  # fmt: skip
    assert [plan.status(r) for r in runs] == ["failed", "done", "done"]
    ran.clear()
    assert launch.run_all(runs, str(tmp_path))[0]["failures"] == 2 and ran == ["a"]
    ran.clear()
    failed = launch.run_all(runs, str(tmp_path))
    assert ran == [] and failed[0]["failures"] == 2
    assert (
        "failed, not retried (failed 2 times; --retries=2 runs it again)" in capsys.readouterr()[0]
    )
    assert launch.run_all(runs, str(tmp_path), retries=2) and ran == ["a"]
    ran.clear()
    assert launch.run_all(runs, str(tmp_path), retries=9, skip_failed=True) and ran == []


def test_a_killed_step_says_by_what_and_the_log_gives_the_reason(tmp_path):
    script = tmp_path / "oom.py"
    script.write_text("import os, signal\nprint('error: first')\nprint('error: the last line')\n"
                      "os.kill(os.getpid(), signal.SIGKILL)\n")  # fmt: skip
    log = str(tmp_path / "train.log")
    with open(log, "w") as f:
        f.write("error: an older command's line\n")
    with pytest.raises(plan.SweepError) as e:
        launch.launch([sys.executable, str(script)], log, dict(os.environ))
    assert str(e.value) == f"{script} was killed by SIGKILL (the out-of-memory killer, or kill -9)"
    assert failures.reason("x", log) == "x: the last line"  # this command's, not the older one
    assert failures.ended("eval.py", 3) == "eval.py exited with status 3"


def failed_report(seeds=(0, 1)):
    """A report whose row `bad` failed at every seed and `half` at seed 1."""

    def run(seed, loss):
        return {
            "seed": seed,
            "step": 10,
            "loss": {"8": loss, "16": loss + 0.5},
            "eval_curve": [[5, loss + 1], [10, loss]],
            "train_curve": [[5, 2.0], [10, 1.0]],
        }

    fail = lambda seed: {
        "seed": seed,
        "reason": f"train.py exited with status 1: non-finite "  # noqa: E731
        f"loss (nan) at step 4 [{seed}]",
        "log": f"/w/bad/seed_{seed}/train.log",
    }
    return {"config": "c.py", "title": "", "command": "python -m rope_jax.experiments.sweep",
            "date": "d", "jax": "j", "device": "cpu", "settings": {}, "seeds": list(seeds),
            "seq_lens": ["8", "16"], "splits": [], "eval_split": "validation",
            "article_loss": {"good": 2.0, "half": 2.5, "bad": 3.0},
            "rows": {"good": {"overrides": {"model.rope.sites": "qk"},
                              "runs": [run(s, 1.0 + s / 10) for s in seeds]},
                     "half": {"overrides": {"model.rope.sites": "vo"}, "runs": [run(0, 1.5)],
                              "failed": [dict(fail(1), log="/w/half/seed_1/train.log")]},
                     "bad": {"overrides": {"model.rope.sites": ""}, "runs": [],
                             "failed": [fail(s) for s in seeds]}}}  # fmt: skip


def test_a_table_names_each_failed_run_and_averages_finished_seeds_only(tmp_path):
    report = failed_report()
    md = report_lib.render_markdown(report)
    lines = {ln.split(" | ")[0]: ln for ln in md.splitlines() if ln.startswith("| ")}
    assert lines["| row"].startswith("| row | sites | seeds | loss @8 (T) mean ± std")
    assert lines["| good"].startswith("| good | `qk` | 2 of 2 | 1.0500 ± 0.0707 |")
    assert lines["| half"].startswith("| half | `vo` | 1 of 2 | 1.5000 ± n/a |")
    bad = lines["| bad"]
    assert bad.startswith("| bad | NoPE | 0 of 2 | failed |")
    assert not any(c.isdigit() for c in bad.removeprefix("| bad | NoPE | 0 of 2"))
    assert (
        "- bad seed 0: train.py exited with status 1: non-finite loss (nan) at step 4 [0] "
        "(log: `/w/bad/seed_0/train.log`)"
    ) in md
    assert "- half seed 1: " in md and "- bad seed 1: " in md
    assert "over the 2 rows in both" in md  # Kendall tau over the finished rows only
    saved = []
    monkey = report_lib.save_figure
    report_lib.save_figure = lambda fig, path, dpi: saved.append(fig)
    try:
        report_lib.plot(report, str(tmp_path / "x.png"))
    finally:
        report_lib.save_figure = monkey
    bars = saved[0].axes[0]
    assert [t.get_text() for t in bars.get_xticklabels()] == ["good", "half"]
    assert "bad" in bars.get_xlabel()


def test_a_row_with_no_finished_run_yet_reads_not_finished_not_failed():
    report = failed_report()
    report["rows"]["later"] = {"overrides": {"model.rope.sites": "k"}, "runs": [],
                               "pending": [{"seed": 0, "state": "partial"},
                                           {"seed": 1, "state": "new"}]}  # fmt: skip
    md = report_lib.render_markdown(report)
    assert "| later | `k` | 0 of 2 | not finished | not finished | not finished |" in md
    assert "| bad | NoPE | 0 of 2 | failed |" in md
    assert "Not finished when this page was written (2 of 8 runs;" in md
    assert md.rstrip().endswith("- later seed 0: started\n- later seed 1: not started")


def _curves_panel(report, tmp_path, monkeypatch):
    saved = []
    monkeypatch.setattr(report_lib, "save_figure", lambda fig, path, dpi: saved.append(fig))
    report_lib.plot(report, str(tmp_path / "x.png"))
    return saved[0].axes[1]


def test_the_plot_draws_the_training_loss_or_says_runs_were_too_short_for_curves(
    tmp_path, monkeypatch
):
    report = failed_report()
    ax = _curves_panel(report, tmp_path, monkeypatch)
    assert ax.get_ylabel() == "validation loss (mean over seeds)" and len(ax.lines) == 2
    for row in report["rows"].values():  # one evaluation (at the end): one dot per row
        for run in row["runs"]:
            run["eval_curve"] = run["eval_curve"][-1:]
    ax = _curves_panel(report, tmp_path, monkeypatch)
    assert ax.get_ylabel() == "training loss (mean over seeds)" and len(ax.lines) == 2
    assert "too short for validation curves" in ax.get_title()
    assert [list(line.get_xdata()) for line in ax.lines] == [[5, 10], [5, 10]]
    for row in report["rows"].values():
        for run in row["runs"]:
            run["train_curve"] = run["train_curve"][-1:]
    ax = _curves_panel(report, tmp_path, monkeypatch)
    assert not ax.lines and "runs too short for curves" in ax.texts[0].get_text()


DIVERGE = """from configs.lm import get_config  # noqa: F401


def sweep(add):
    add(name="diverge", **{"optim.lr": 1e6})  # the loss is non-finite within 5 steps
    add(name="good", **{"optim.lr": 3e-3})
"""


@pytest.mark.slow
def test_a_diverging_row_fails_alone_the_table_names_it_and_the_rerun_skips_the_good_row(
    tmp_path, capsys
):
    config = tmp_path / "diverge.py"
    config.write_text(DIVERGE)
    workdir = tmp_path / "runs"
    argv = [f"--config={config}:size=tiny", f"--workdir={workdir}", "--set", TINY,
            f"--config.data.data_dir={tmp_path / 'tfds'}"]  # fmt: skip
    message, out, _, _ = _main(argv, capsys)
    assert message.startswith(
        "error: 1 of 2 runs failed (row=diverge seed=0): the table names "
        "them; --status shows why; the same command runs 1 of them again"
    )
    assert "[2/2] row=good seed=0  new" in out and (workdir / "good/seed_0/eval_10.json").exists()
    report = json.loads((workdir / "results.json").read_text())
    (failed,) = report["rows"]["diverge"]["failed"]
    assert report["rows"]["diverge"]["runs"] == [] and failed["seed"] == 0
    assert "became NaN/inf at step 5" in failed["reason"] or "non-finite" in failed["reason"]
    assert failed["log"] == str(workdir / "diverge/seed_0/train.log")
    md = (workdir / "results.md").read_text()
    assert md == report_lib.render_markdown(report)
    assert "| diverge | `optim.lr=1000000.0` | 0 of 1 | failed |" in md
    assert f"- diverge seed 0: {failed['reason']} (log: `{failed['log']}`)" in md
    good_log = (workdir / "good/seed_0/train.log").read_text()

    message, out, _, _ = _main(argv, capsys)  # retried once: fails again, the table again
    assert "[1/2] row=diverge seed=0  failed before, retried" in out
    assert "[2/2] row=good seed=0  done, skipped" in out
    assert (workdir / "good/seed_0/train.log").read_text() == good_log  # not retrained
    assert "does not run it again" in message and (workdir / "results.md").exists()
    assert json.loads((workdir / "diverge/seed_0/failed.json").read_text())["failures"] == 2

    log = (workdir / "diverge/seed_0/train.log").read_text()
    message, out, _, seconds = _main(argv, capsys)  # a deterministic failure: not again
    assert "[1/2] row=diverge seed=0  failed, not retried (failed 2 times" in out
    assert (workdir / "diverge/seed_0/train.log").read_text() == log and seconds < 30
    assert message.startswith("error: 1 of 2 runs failed")
    message, out, _, _ = _main([*argv, "--status"], capsys)
    assert message is None and "2 runs: 1 done, 0 partial, 0 new, 1 failed" in out
    assert f"failed (2 times): {failed['reason'].split(':')[0]}" in out
    argv += ["--retries=5", "--skip_failed", "--rows=diverge", f"--results={tmp_path}/skip"]
    message, out, _, _ = _main(argv, capsys)
    assert "failed, not retried (--skip_failed)" in out and "no run finished" in message


def test_a_task_of_eval_tasks_gets_its_score_per_length_in_the_table(tmp_path):
    """A run evaluated with eval.tasks=('loss','passkey'): collect reads the task's headline
    score per length and its example count from its eval file; the page tables it by row
    with each seed's score at T, counts the seeds that learned it (>= 0.9 at T) and orders
    at T only the rows that some seed learned."""
    run_dir = tmp_path / "vo" / "seed_0"
    run_dir.mkdir(parents=True)
    entry = lambda loss, key: {"loss": loss, "bits_per_byte": 1.0, "passkey_accuracy": key}
    (run_dir / "eval_10.json").write_text(json.dumps(
        {"step": 10, "32": entry(2.0, 0.75), "64": entry(2.5, 0.25),
         "settings": {"tasks": ["loss", "passkey"], "examples": 40}}))  # fmt: skip
    record = report_lib.collect(plan.Job("vo", 0, str(run_dir), [], 10, [32, 64], ()))
    assert record["tasks"] == {"passkey": {"32": 0.75, "64": 0.25}}
    assert record["examples"] == {"passkey": 40}

    def run(seed, loss, keys):
        return {"seed": seed, "step": 10, "loss": {"32": loss, "64": loss + 1},
                "tasks": {"passkey": dict(zip(["32", "64"], keys, strict=True))},
                "examples": {"passkey": 40}}  # fmt: skip

    rows = {
        "qk": [run(0, 1.8, [0.2, 0.0]), run(1, 1.9, [0.4, 0.1])],  # 0.30 ± 0.14 at T
        "vo": [run(0, 2.0, [0.9, 0.5]), run(1, 2.1, [1.0, 0.3])],  # 0.95 ± 0.07
        "k": [run(0, 2.2, [0.95, 0.0]), run(1, 2.3, [0.35, 0.0])],  # 0.65 ± 0.42
        "q": [run(0, 2.4, [0.92, 0.0]), run(1, 2.5, [0.98, 0.0])],
    }  # 0.95 ± 0.04 fmt: skip
    report = {"config": "c.py", "title": "", "command": "x", "date": "d", "jax": "0",
              "device": "cpu", "settings": {}, "seeds": [0, 1], "seq_lens": ["32", "64"],
              "eval_split": "validation", "article_loss": None,
              "rows": {n: {"overrides": {"model.rope.sites": n}, "runs": r}
                       for n, r in rows.items()}}  # fmt: skip
    md = report_lib.render_markdown(report)
    assert (
        "| row | passkey @32 (1T) | passkey @64 (2T) | seeds @T (n = 40) | learned (>= 0.9 @T) |"
    ) in md
    assert "| qk | 0.30 ± 0.14 | 0.05 ± 0.07 | 0.20, 0.40 | not learned |" in md
    assert md.index("| qk | 0.30") < md.index("| vo | 0.95 ± 0.07 | 0.40 ± 0.14 | 0.90, 1.00 |")
    assert "| k | 0.65 ± 0.42 | 0.00 ± 0.00 | 0.95, 0.35 | 1 of 2 |" in md
    assert "- k > qk" not in md and "qk:" not in md.split("Adjacent pairs by")[1]
    assert "- vo > q: gap 0.00, within seed noise" in md
    assert "- q > k: gap 0.30, within seed noise (noise 0.43)" in md
    del rows["k"][1]["tasks"]  # a run scored without the task: no table for it
    assert "passkey @32" not in report_lib.render_markdown(report)


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """One real sweep (rows nope and vo, 2 seeds) through `python -m rope_jax.experiments.sweep`."""
    base = tmp_path_factory.mktemp("sweep")

    def argv(workdir):
        return ["--config=configs/lm.py:size=tiny", f"--workdir={workdir}", "--seeds=2",
                "--rows=nope,vo", f"--results={workdir}/out/table", "--set", TINY,
                "--set", f"data.data_dir={base / 'tfds'}"]  # fmt: skip

    workdir = base / "runs"
    cmd = [sys.executable, "-m", "rope_jax.experiments.sweep", *argv(workdir)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return {"workdir": workdir, "argv": argv, "stdout": proc.stdout}


def _snapshot(workdir):
    """Per run: checkpoint steps and the size of train.log."""
    out = {}
    for row, seed in RUNS:
        run = os.path.join(workdir, row, f"seed_{seed}")
        steps = sorted(int(d) for d in os.listdir(os.path.join(run, "checkpoints")) if d.isdigit())
        out[row, seed] = (steps, os.path.getsize(os.path.join(run, "train.log")))
    return out


@pytest.mark.slow
def test_sweep_trains_every_row_and_seed_and_writes_the_report(swept):
    workdir, stdout = swept["workdir"], swept["stdout"]
    for k, (row, seed) in enumerate(RUNS, 1):
        assert f"[{k}/4] row={row} seed={seed}  new" in stdout, stdout
        run = workdir / row / f"seed_{seed}"
        saved = json.loads((run / "eval_10.json").read_text())
        assert saved["step"] == 10 and saved["train_seq_len"] == 32
        assert [saved[t]["tokens"] for t in ("32", "64", "128")] == [8 * 32, 8 * 64, 8 * 128]
        config = json.loads((run / "config.json").read_text())
        assert config["seed"] == seed and config["model"]["num_layers"] == 1
        assert config["model"]["rope"]["sites"] == {"nope": "", "vo": "vo"}[row]  # "" reached
        assert "step 10/10" in (run / "train.log").read_text()
    assert stdout.count("ETA") == 4 and "held-out loss" in stdout
    assert len(stdout.splitlines()) < 20  # the training logs went to train.log

    report = json.loads((workdir / "out/table.json").read_text())
    assert report["seq_lens"] == ["32", "64", "128"] and list(report["rows"]) == ["nope", "vo"]
    for row in ("nope", "vo"):
        runs = report["rows"][row]["runs"]
        assert [r["seed"] for r in runs] == [0, 1]
        assert [s for s, _ in runs[0]["eval_curve"]] == [5, 10]
        assert [s for s, _ in runs[0]["train_curve"]] == [5, 10]
    here = provenance.describe(provenance.code_version())  # the code that trained the runs
    assert report["code"] == [here] and all(
        run["code"] == [here] for r in report["rows"].values() for run in r["runs"]
    )

    md = (workdir / "out/table.md").read_text()
    assert md == report_lib.render_markdown(report)  # the json regenerates the table
    assert "python -m rope_jax.experiments.sweep --config=configs/lm.py:size=tiny" in md
    assert "jax " in md and f"device: {provenance.devices()}; code: {here}." in md
    assert provenance.devices() == f"cpu ({provenance.cpu_name()}) x1"
    assert "model.num_layers=1" in md
    assert "| loss @32 (T) mean ± std | loss @64 (2T) mean ± std | loss @128 (4T) mean ± std" in md
    assert "article loss | article rank |" in md
    lines = {line.split(" | ")[0]: line for line in md.splitlines() if line.startswith("| ")}
    nope_losses = [r["loss"]["32"] for r in report["rows"]["nope"]["runs"]]
    mean, std = report_lib.mean_std(nope_losses)
    assert lines["| nope"].startswith(f"| nope | NoPE | {mean:.4f} ± {std:.4f} | ")
    assert lines["| nope"].endswith(" | 2.795 | 2 |") and lines["| vo"].endswith(" | 2.770 | 1 |")
    assert "Kendall tau between our mean loss @T and the article's loss, over the 2 rows" in md
    assert "- nope < vo: gap" in md or "- vo < nope: gap" in md
    png = (workdir / "out/table.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


@pytest.mark.slow
def test_the_same_command_again_skips_everything(swept, capsys):
    workdir = swept["workdir"]
    before = _snapshot(workdir)
    message, out, _, seconds = _main(swept["argv"](workdir), capsys)
    assert message is None, message
    assert out.count("done, skipped") == 4 and "ETA" not in out
    assert _snapshot(workdir) == before  # no training, no new checkpoints or log lines
    assert seconds < 30

    message, out, _, _ = _main([*swept["argv"](workdir), "--dry_run"], capsys)
    assert message is None, message
    assert out.count(" done ") == 4 and "4 runs: 4 done, 0 partial, 0 new" in out


@pytest.mark.slow
def test_an_interrupted_run_alone_is_redone_and_resumes(swept, tmp_path, capsys):
    workdir = tmp_path / "runs"
    shutil.copytree(swept["workdir"], workdir)
    victim = workdir / "vo" / "seed_1"
    os.remove(victim / "eval_10.json")
    shutil.rmtree(victim / "checkpoints" / "10")
    before = _snapshot(workdir)

    message, out, _, _ = _main([*swept["argv"](workdir), "--dry_run"], capsys)
    assert message is None and "3 done, 1 partial, 0 new" in out
    assert not (workdir / "vo" / "seed_1" / "eval_10.json").exists()

    message, out, _, _ = _main([*swept["argv"](workdir), "--report_only"], capsys)
    assert message is None and "(3 of 4 runs finished)" in out, message
    partial = json.loads((workdir / "out" / "table.json").read_text())
    assert [r["seed"] for r in partial["rows"]["vo"]["runs"]] == [0]
    assert partial["rows"]["vo"]["pending"] == [{"seed": 1, "state": "partial"}]
    assert _snapshot(workdir) == before  # nothing trained

    message, out, _, _ = _main(swept["argv"](workdir), capsys)
    assert message is None, message
    assert out.count("done, skipped") == 3 and "[4/4] row=vo seed=1  partial" in out
    after = _snapshot(workdir)
    assert {k: v for k, v in after.items() if k != ("vo", 1)} == {
        k: v for k, v in before.items() if k != ("vo", 1)}  # fmt: skip
    assert after["vo", 1][0][-1] == 10
    assert "resumed from step 5" in (victim / "train.log").read_text()
    new = json.loads((victim / "eval_10.json").read_text())
    old = json.loads((swept["workdir"] / "vo" / "seed_1" / "eval_10.json").read_text())
    assert math.isclose(new["32"]["loss"], old["32"]["loss"], rel_tol=1e-5)  # same run


def test_the_config_arg_reaches_sweep_so_matched_rows_follow_the_size():
    _, _, rows = plan.load_rows(os.path.join(ROOT, "configs", "lm.py"), "size=small")
    small = common.SIZES["small"]
    assert rows["separate_qk_cache"]["model.num_kv_heads"] == small["num_kv_heads"] // 2
    assert rows["separate_qk_params"]["model.mlp_dim"] < small["mlp_dim"]


def test_kv_cache_column_appears_when_rows_differ_in_cache_bytes():
    def report(kv_bytes):
        run = {"seed": 0, "step": 10, "loss": {"32": 3.0}, "eval_curve": [[10, 3.0]]}
        rows = {
            "qk": {"overrides": {"model.rope.sites": "qk"}, "runs": [run]},
            "tied": {"overrides": {"model.attention.kv": "tied"}, "runs": [run]},
        }
        return {"config": "c.py", "title": "", "command": "x", "date": "d", "jax": "0",
                "device": "cpu", "settings": {}, "seeds": [0], "seq_lens": ["32"],
                "eval_split": "validation", "article_loss": None, "kv_bytes": kv_bytes,
                "rows": rows}  # fmt: skip

    md = report_lib.render_markdown(report({"qk": 2048, "tied": 1024}))
    assert "| rank | KV cache B/token |" in md and "| 1 | 2,048 |" in md and "| 1 | 1,024 |" in md
    assert "KV cache" not in report_lib.render_markdown(report({"qk": 2048, "tied": 2048}))


def test_rows_that_differ_in_tokenizer_are_ranked_by_bits_per_byte():
    def run(tok, loss, bpb):
        return {"seed": 0, "step": 10, "loss": {"32": loss}, "bits_per_byte": {"32": bpb},
                "tokenizer": tok, "eval_curve": [[10, loss]]}  # fmt: skip

    def report(tok_b):
        rows = {
            "bytes": {"overrides": {"data.name": "a"}, "runs": [run("bytes", 1.0, 1.44)]},
            "bpe": {"overrides": {"data.name": "b"}, "runs": [run(tok_b, 3.0, 1.10)]},
        }
        return {"config": "c.py", "title": "", "command": "x", "date": "d", "jax": "0",
                "device": "cpu", "settings": {}, "seeds": [0], "seq_lens": ["32"],
                "eval_split": "validation", "article_loss": None, "rows": rows}  # fmt: skip

    md = report_lib.render_markdown(report("bpe8000-abcd"))
    assert "| bits/byte @32 mean ± std |" in md and "lowest bits/byte @T" in md
    assert "| bpe | `data.name=b` | 3.0000 ± n/a | 1.1000 ± n/a | 1 |" in md
    assert "- bpe < bytes: gap 0.3400" in md
    same = report_lib.render_markdown(report("bytes"))  # one tokenizer: nats/token rank
    assert "bits/byte" not in same and "| bytes | `data.name=a` | 1.0000 ± n/a | 1 |" in same


def test_plan_records_each_rows_kv_cache_bytes():
    args = sweep.parse_args(["--config=configs/lm.py:size=tiny", "--workdir=/tmp/unused",
                             "--rows=qk,tied_qkvo,separate_qk_cache"])  # fmt: skip
    _, context = plan.plan(args)
    kv = context["kv_bytes"]
    assert kv["qk"] == 2 * kv["tied_qkvo"] == 2 * kv["separate_qk_cache"]
    tiny = common.SIZES["tiny"]
    assert kv["qk"] == tiny["num_layers"] * tiny["num_kv_heads"] * tiny["head_dim"] * 2 * 4


def test_killing_the_sweep_outright_ends_its_child(tmp_path):
    """kill -9 of the sweep: its running child gets SIGTERM (train.py then saves and exits),
    so no orphan keeps writing and a rerun finds the workdir free."""
    child = (
        "import os, signal, sys, time\n"
        f"def term(*_):\n    open({str(tmp_path / 'term')!r}, 'w').close(); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, term)\n"
        f"open({str(tmp_path / 'pid')!r}, 'w').write(str(os.getpid()))\n"
        "time.sleep(120)\n"
    )
    sweep_like = (
        f"import os, sys\nsys.path.insert(0, {ROOT!r})\n"
        "from rope_jax.experiments import launch\n"
        f"launch.launch([sys.executable, '-c', {child!r}], {str(tmp_path / 'log')!r}, "
        "dict(os.environ))\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", sweep_like])
    deadline = time.time() + 60
    while not (tmp_path / "pid").exists() and time.time() < deadline:
        time.sleep(0.1)
    parent.kill()  # SIGKILL: the sweep cannot forward anything itself
    parent.wait()
    deadline = time.time() + 20
    while not (tmp_path / "term").exists() and time.time() < deadline:
        time.sleep(0.1)
    assert (tmp_path / "term").exists(), "the child did not get SIGTERM when the sweep died"


def test_seed_in_a_set_value_becomes_each_runs_seed():
    """A retrofit row starts from the base run of its own seed."""
    args = sweep.parse_args(["--config=configs/lm.py:size=tiny", "--workdir=/tmp/unused",
                             "--rows=vo", "--seeds=2",
                             "--set", "train.init_from=runs/base/qk/seed_{seed}"])  # fmt: skip
    runs, context = plan.plan(args)
    flags = {run.seed: [f for f in run.flags if "init_from" in f] for run in runs}
    assert flags == {0: ["--config.train.init_from=runs/base/qk/seed_0"],
                     1: ["--config.train.init_from=runs/base/qk/seed_1"]}  # fmt: skip


def test_the_eta_counts_the_steps_a_resumed_run_trained_not_whole_runs(tmp_path):
    """A resumed run with 250 of 1250 steps left took 100 s: the runs after it need 1250
    steps each at 0.4 s, not 100 s each."""
    from rope_jax.experiments import launch

    a, b, c = (str(tmp_path / name) for name in "abc")
    os.makedirs(os.path.join(a, "checkpoints", "1000"))
    eta = launch.Eta()
    assert eta.left([(a, 1250), (b, 1250)]) == "n/a"  # nothing timed yet
    eta.add(100.0, 1250 - 1000)
    os.makedirs(os.path.join(a, "checkpoints", "1250"))
    assert eta.left([(a, 1250), (b, 1250), (c, 1250), (b, 1250)]) == "0:16:40"  # b once


@pytest.mark.slow
def test_a_long_run_echoes_its_newest_progress_line_once_each_time_it_changes(tmp_path, capsys):
    """The sweep prints nothing of its own while a run trains (an hour at the L8 rung):
    every `heartbeat_s` it echoes the newest `step ...` line of the run's log if new."""
    from rope_jax.experiments import launch

    child = ("import time; print('step 1/2  loss 1.0', flush=True); time.sleep(2); "
             "print('step 2/2  loss 0.5', flush=True); time.sleep(2)")  # fmt: skip
    log = str(tmp_path / "train.log")
    launch.launch([sys.executable, "-c", child], log, dict(os.environ), heartbeat_s=0.3)
    assert capsys.readouterr().out.splitlines() == [
        "    step 1/2  loss 1.0",
        "    step 2/2  loss 0.5",
    ]
    assert launch.last_progress_line(str(tmp_path / "none.log")) is None
