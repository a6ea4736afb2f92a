"""The sweep on SLURM (`--launcher=slurm`): batch scripts, job bookkeeping, and a real
sweep on the local cluster.

Quick tests (no cluster): the text of a job's batch script, the flag checks, the
parsing of squeue/sacct, which runs are submitted, left alone or skipped, and the
one-line errors, with stand-in `sbatch` / `squeue` / `sacct` programs on PATH.

Slow tests, on the single-node cluster of `scripts/local_slurm.sh` (skipped, with the
reason, where it cannot start): 2 rows x 1 seed x 20 steps of the tiny LM, each run
one job of 2 tasks (2 processes x 1 CPU device), submitted with --wait. The first
job gets `scancel --signal=TERM` mid-training (what `--signal=TERM@<grace>` and a
preemption notice deliver): both processes save one step, the job requeues itself
and resumes. The table must match a local-launcher run of the same plan (one process,
2 devices) to 1e-5 in loss, and the interrupted run must end with exactly the
parameters of the uninterrupted one.
"""

import json
import os
import re
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

from rope_jax.experiments import launch, plan, slurm, sweep
from tests.slurm_helpers import ROOT, final_params, run_env, wait_for_idle_node

# One test worker runs both SLURM modules, one after the other: they share the cluster.
pytestmark = pytest.mark.xdist_group("slurm")
SET = ("train.num_steps=20,data.seq_len=32,data.global_batch_size=8,eval.batch_size=8,"
       "eval.num_batches=2,train.log_every_steps=5,train.ckpt_every_steps=10,"
       "model.num_layers=1,model.embed_dim=32,model.num_heads=2,model.num_kv_heads=1,"
       "model.head_dim=16,model.mlp_dim=64")  # fmt: skip
SLURM = ["--launcher=slurm", "--tasks_per_node=2", "--cpus_per_task=1"]


def sweep_argv(workdir, data_dir, *extra) -> list[str]:
    """The sweep of these tests: rows qk and vo, one seed, 20 steps, eval at T and 2T."""
    return ["--config=configs/lm.py:size=tiny", f"--workdir={workdir}", "--rows=qk,vo",
            "--extrapolate=2", "--set", SET, "--set", f"data.data_dir={data_dir}",
            *extra]  # fmt: skip


def job(row="qk", seed=0, workdir="/w/qk/seed_0", final_step=20) -> plan.Job:
    flags = ["--config=/r/configs/lm.py:size=tiny", f"--workdir={workdir}", f"--config.seed={seed}"]
    return plan.Job(row, seed, workdir, flags, final_step, [32, 64], ())


def slurm_args(*extra):
    args = sweep.parse_args(["--config=c.py", "--workdir=/w", "--launcher=slurm", *extra])
    slurm.check_options(args)
    return args


def main(argv, capsys) -> tuple[str | None, str]:
    """sweep.main in-process: (exit message or None, stdout)."""
    message = None
    try:
        sweep.main(argv)
    except SystemExit as e:
        message = str(e.code)
    return message, capsys.readouterr().out


# ------------------------------------------------------------------ quick: the script


def test_the_batch_script_trains_requeues_itself_when_stopped_then_evaluates():
    args = slurm_args("--tasks_per_node=2", "--cpus_per_task=4", "--partition=gpu",
                      "--time=1-00:00:00", "--account=lab", "--slurm_extra=--qos=high")  # fmt: skip
    run = job()
    text = slurm.script_text(args, run, "/w", "python -m rope_jax.experiments.sweep ...",
                             python="/venv/bin/python", environ={})  # fmt: skip
    options = [line.split(" ", 1)[1] for line in text.splitlines() if line.startswith("#SBATCH")]
    assert options == ["--job-name=w.qk.s0", "--output=/w/qk/seed_0/slurm.log",
                       "--open-mode=append", "--requeue", "--signal=TERM@120", "--nodes=1",
                       "--ntasks-per-node=2", "--cpus-per-task=4", "--partition=gpu",
                       "--time=1-00:00:00", "--account=lab", "--qos=high"]  # fmt: skip
    lines = text.splitlines()
    srun = "srun --kill-on-bad-exit=1 --cpus-per-task=4 "
    train = srun + " ".join(launch.train_command(run, "/venv/bin/python"))
    evaluate = srun + " ".join(launch.eval_command(run, "/venv/bin/python"))
    assert lines[-4:] == [evaluate, "status=$?",
                          '(( status == 143 )) && requeue "eval.py ended by SIGTERM" $status',
                          "exit $status"]  # fmt: skip
    assert "--seq_lens=32,64" in evaluate and "--step=20" in evaluate
    start = lines.index("if [[ ! -d $RUN/checkpoints/$FINAL ]]; then")
    assert lines[start + 1 : start + 7] == [
        f"  {train}",  # the local launcher's commands, one owner
        "  status=$?",
        '  (( status == 143 )) && requeue "train.py ended by SIGTERM" $status',
        "  (( status == 0 )) || exit $status",
        '  [[ -d $RUN/checkpoints/$FINAL ]] || requeue "train.py stopped before step $FINAL" 0',
        "fi",
    ]
    assert "RUN=/w/qk/seed_0" in lines and "FINAL=20" in lines
    assert f"cd {ROOT} || exit 1" in lines and "export PYTHONUNBUFFERED=1" in lines
    assert "export JAX_COMPILATION_CACHE_DIR=/w/jax_cache" in lines
    assert '  [[ $state == RUNNING ]] && exec scontrol requeue "$SLURM_JOB_ID"' in lines
    bash = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
    assert bash.returncode == 0, bash.stderr  # valid shell


def test_gpu_jobs_bind_each_tasks_gpus_and_tell_jax_their_numbers():
    args = slurm_args("--tasks_per_node=4", "--gpus_per_task=2", "--signal_grace=300")
    text = slurm.script_text(args, job(), "/w", "c", python="p", environ={})
    assert "#SBATCH --gpus-per-task=2" in text and "#SBATCH --signal=TERM@300" in text
    assert "export JAX_LOCAL_DEVICE_IDS=0,1" in text
    assert text.count("srun --kill-on-bad-exit=1 --gpu-bind=per_task:2 ") == 2
    assert "#SBATCH --partition" not in text and "#SBATCH --time" not in text  # the cluster's
    cache = {"JAX_COMPILATION_CACHE_DIR": "x"}
    own = slurm.script_text(slurm_args(), job(), "/w", "c", environ=cache)
    assert "JAX_COMPILATION_CACHE_DIR" not in own and "JAX_LOCAL_DEVICE_IDS" not in own


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--partition=gpu"], "--partition needs --launcher=slurm"),
        (["--wait", "--nodes=2"], "--nodes, --wait need --launcher=slurm"),
        (["--launcher=slurm", "--tasks_per_node=0"], "--tasks_per_node=0 must be >= 1"),
        (["--launcher=slurm", "--gpus_per_task=-1"], "--gpus_per_task=-1 must be >= 0"),
        (["--launcher=slurm", "--time=2h"], "--time='2h' is not a SLURM time"),
        (["--launcher=slurm", "--time=1:00"], "--signal_grace=120 s must be shorter than"),
        (["--launcher=slurm", "--status", "--wait"], "--status only prints"),
        (["--launcher=slurm", "--slurm_extra=qos=high"], "must be one sbatch option"),
    ],
)
def test_bad_flag_combinations_are_one_line(extra, message):
    args = sweep.parse_args(["--config=c.py", "--workdir=/w", *extra])
    with pytest.raises(plan.SweepError, match=re.escape(message)) as e:
        slurm.check_options(args)
    assert "\n" not in str(e.value)


def test_slurm_times_and_the_processes_that_must_divide_the_batch():
    times = ("90", "5:30", "4:00:00", "1-12", "1-0:30", "2-1:2:3")
    assert [slurm.parse_time(t) for t in times] == [5400, 330, 14400, 129600, 88200, 176523]
    args = slurm_args("--nodes=2", "--tasks_per_node=3")
    context = {"settings": {"data.global_batch_size": 8}}
    with pytest.raises(plan.SweepError, match="global_batch_size=8 is not divisible by the 6"):
        slurm.check_processes(args, context)
    slurm.check_processes(slurm_args("--tasks_per_node=4"), context)
    assert slurm.describe(args) == "slurm jobs of 2 node(s) x 3 task(s)"


# ---------------------------------------------------------------- quick: bookkeeping


def test_scheduler_output_and_what_is_done_with_each_run():
    squeue = "31|RUNNING|None\n32|PENDING|BeginTime\n33|COMPLETED|None\n"
    sacct = "40|CANCELLED by 0|None\n40.batch|CANCELLED|\n41|TIMEOUT|\n42|PREEMPTED|\n"
    states = {**slurm.parse_table(squeue), **slurm.parse_table(sacct)}
    assert states["32"] == ("PENDING", "BeginTime") and states["40"] == ("CANCELLED", "")
    assert "40.batch" not in states
    state = lambda job_id, done=False: slurm.scheduler_state(  # noqa: E731
        {"job_id": job_id} if job_id else None, states, done)  # fmt: skip
    assert [state(j) for j in ("31", "32", "33", "41")] == [
        "RUNNING", "PENDING (BeginTime)", "COMPLETED", "TIMEOUT"]  # fmt: skip
    assert state(None) == "-" and state("99") == "ENDED" and state("99", done=True) == "COMPLETED"
    decide = slurm.decide
    assert decide(True, "RUNNING") == "done" and decide(True, "FAILED") == "done"
    assert decide(False, "RUNNING") == decide(False, "PENDING (BeginTime)") == "wait"
    for ended in ("-", "ENDED", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED",
                  "NODE_FAIL", "OUT_OF_MEMORY"):  # fmt: skip
        assert decide(False, ended) == "submit", ended


def test_submissions_are_recorded_and_the_newest_job_of_a_run_counts(tmp_path):
    runs = [job("qk", 0, str(tmp_path / "qk/seed_0")), job("vo", 0, str(tmp_path / "vo/seed_0"))]
    assert slurm.load_jobs(str(tmp_path)) == []
    for run, job_id in ((runs[0], "7"), (runs[1], "8"), (runs[0], "9")):
        slurm.record_job(str(tmp_path), run, job_id, run.workdir + "/job.sbatch")
    saved = json.loads((tmp_path / "slurm_jobs.json").read_text())["jobs"]
    assert [(j["row"], j["seed"], j["job_id"]) for j in saved] == [
        ("qk", 0, "7"), ("vo", 0, "8"), ("qk", 0, "9")]  # fmt: skip
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d", j["submitted"])
               for j in saved)  # fmt: skip
    latest = slurm.latest_jobs(saved)
    assert latest["qk", 0]["job_id"] == "9" and latest["vo", 0]["job_id"] == "8"
    (tmp_path / "slurm_jobs.json").write_text("{")
    with pytest.raises(plan.SweepError, match="is not a job list of this sweep"):
        slurm.load_jobs(str(tmp_path))


def fake_slurm(tmp_path, monkeypatch) -> dict:
    """Stand-in sbatch (job ids from 101 up; fails with sbatch's words when FAIL is
    there), squeue (prints the file SQUEUE; exits 1 with stderr of DOWN) and sacct (no
    accounting) first on PATH; returns their files."""
    bin_dir, files = tmp_path / "bin", {n: tmp_path / n for n in ("SQUEUE", "FAIL", "DOWN", "N")}
    bin_dir.mkdir()
    scripts = {
        "sbatch": f"""[[ -e {files["FAIL"]} ]] && {{ cat {files["FAIL"]} >&2; exit 1; }}
n=$(( $(cat {files["N"]} 2>/dev/null || echo 100) + 1 )); echo $n > {files["N"]}; echo $n""",
        "squeue": f"""[[ -e {files["DOWN"]} ]] && {{ cat {files["DOWN"]} >&2; exit 1; }}
cat {files["SQUEUE"]} 2>/dev/null; exit 0""",
        "sacct": 'echo "Slurm accounting storage is disabled"',
    }  # fmt: skip
    for name, body in scripts.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body + "\n")
        (bin_dir / name).chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return files


def test_submit_leave_alone_resubmit_and_status_with_stand_in_commands(
    tmp_path, capsys, monkeypatch
):
    files = fake_slurm(tmp_path, monkeypatch)
    workdir = tmp_path / "runs"
    argv = ["--config=configs/lm.py:size=tiny", f"--workdir={workdir}", "--rows=qk,vo",
            "--set", SET, *SLURM]  # fmt: skip
    message, out = main(argv, capsys)
    assert message is None, message
    assert "[1/2] row=qk seed=0  new  submitted: job 101" in out
    assert "[2/2] row=vo seed=0  new  submitted: job 102" in out
    assert "2 job(s) queued or running" in out and not (workdir / "results.md").exists()
    assert (workdir / "qk/seed_0/job.sbatch").read_text().startswith("#!/bin/bash\n")

    files["SQUEUE"].write_text("101|RUNNING|None\n102|PENDING|Resources\n")
    message, out = main(argv, capsys)
    assert "job 101 RUNNING, left alone" in out and "job 102 PENDING (Resources), left alone" in out
    message, out = main([*argv, "--status"], capsys)
    assert message is None and len(out.splitlines()) == 3, out
    assert re.search(r"qk  seed 0  job +101  RUNNING +partial \(no checkpoint\) ", out), out
    assert re.search(r"vo  seed 0  job +102  PENDING \(Resources\) +partial", out), out
    assert "2 runs: 0 done, 2 queued or running, 0 to submit" in out

    files["SQUEUE"].write_text("101|FAILED|NonZeroExitCode\n")  # 102: gone, no accounting
    (workdir / "qk/seed_0/slurm.log").write_text("=== job 101\nerror: non-finite loss (nan)\n")
    message, out = main(argv, capsys)
    assert "row=qk seed=0  failed (step 0/20)  job 101 FAILED, resubmitted: job 103" in out
    assert "row=vo seed=0  failed (step 0/20)  job 102 ENDED, resubmitted: job 104" in out
    jobs = json.loads((workdir / "slurm_jobs.json").read_text())["jobs"]
    assert [j["job_id"] for j in jobs] == ["101", "102", "103", "104"]
    rec = json.loads((workdir / "qk/seed_0/failed.json").read_text())
    assert rec["reason"] == "job 101 FAILED: non-finite loss (nan)" and rec["failures"] == 1

    # Both fail again: not retried (failed twice), the table is not blocked by them; the
    # status lists them with the reason.
    files["SQUEUE"].write_text("103|FAILED|NonZeroExitCode\n104|OUT_OF_MEMORY|None\n")
    (workdir / "qk/seed_0/slurm.log").write_text("=== job 103\nerror: non-finite loss (inf)\n")
    message, out = main([*argv, "--status"], capsys)
    assert "failed 2 time(s), not retried: job 103 FAILED: non-finite loss (inf); log: " in out
    assert "failed 2 time(s), not retried: job 104 OUT_OF_MEMORY; log: " in out
    assert "2 runs: 0 done, 0 queued or running, 0 to submit, 2 failed and not retried" in out
    message, out = main(argv, capsys)
    assert "[1/2] row=qk seed=0  failed, not retried (failed 2 times" in out
    assert message.startswith("error: 2 of 2 runs failed (row=qk seed=0, row=vo seed=0): no run "
                              "finished, so no table")  # fmt: skip
    message, out = main([*argv, "--retries=2"], capsys)  # the user asks for one more try
    assert "job 103 FAILED, resubmitted: job 105" in out and "job 104 OUT_OF_MEMORY, resub" in out
    assert json.loads((workdir / "qk/seed_0/failed.json").read_text())["failures"] == 2

    files["SQUEUE"].write_text("")
    files["FAIL"].write_text("sbatch: error: invalid partition specified: bogus\n"
                             "sbatch: error: Batch job submission failed: Invalid partition "
                             "name specified\n")  # fmt: skip
    message, _ = main([*argv, "--retries=9"], capsys)
    assert message == (
        "error: sbatch refused row=qk seed=0: invalid partition specified: bogus; Batch job "
        "submission failed: Invalid partition name specified "
        f"(script: {workdir}/qk/seed_0/job.sbatch)")  # fmt: skip
    files["DOWN"].write_text("slurm_load_jobs error: Unable to contact slurm controller\n")
    message, _ = main(argv, capsys)
    assert message == ("error: squeue failed (is the cluster up?): slurm_load_jobs error: "
                       "Unable to contact slurm controller")  # fmt: skip


def test_no_slurm_client_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # neither sbatch nor squeue
    argv = ["--config=configs/lm.py:size=tiny", f"--workdir={tmp_path}/runs", "--rows=qk",
            *SLURM]  # fmt: skip
    message, out = main(argv, capsys)
    assert message == ("error: sbatch not found: no SLURM client here (a local test cluster: "
                       "sudo scripts/local_slurm.sh up)")  # fmt: skip
    assert not os.path.exists(f"{tmp_path}/runs") and out == ""


# ------------------------------------------------------------------- slow: the cluster


def wait_until(what: str, ready, proc=None, timeout: float = 240):
    """Polls `ready()` until it is truthy (returns it); fails after `timeout` s or when
    `proc` ended first."""
    deadline = time.time() + timeout
    while not (value := ready()):
        assert proc is None or proc.poll() is None, f"the sweep ended before {what}"
        assert time.time() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.1)
    return value


def read(path) -> str:
    return open(path).read() if os.path.exists(path) else ""


def job_id_of(workdir, row: str) -> str | None:
    """The first job id recorded for `row`, or None."""
    text = read(os.path.join(workdir, "slurm_jobs.json"))
    jobs = json.loads(text)["jobs"] if text else []
    return next((j["job_id"] for j in jobs if j["row"] == row), None)


def squeue_state(job_id: str) -> str:
    cmd = ["squeue", "--noheader", f"--jobs={job_id}", "--format=%T"]
    return subprocess.run(cmd, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def local_sweep(data_dir, tmp_path_factory):
    """The local launcher on the same plan: one process with 2 CPU devices per run."""
    base = tmp_path_factory.mktemp("local")
    env = run_env(str(base / "xla_cache"), 2)
    cmd = [sys.executable, "-m", "rope_jax.experiments.sweep", *sweep_argv(base / "runs", data_dir)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return base / "runs"


@pytest.fixture(scope="module")
def slurm_sweep(cluster, data_dir, tmp_path_factory):
    """`--launcher=slurm --wait`, 2 tasks (1 CPU device each) per job; the qk job gets
    SIGTERM once it logged step 5, saves, requeues itself; SLURM holds a requeued job
    for about 2 minutes before it may start again, which is skipped here
    (`scontrol update StartTime=now+3`: not within the second of the requeue, when the
    node still refuses the job's new credential, "Job credential revoked", and the
    start fails). Returns the workdir, the sweep's output, the
    interrupted job id."""
    wait_for_idle_node()
    base = tmp_path_factory.mktemp("slurm")
    workdir, out_path = base / "runs", base / "sweep.out"
    cmd = [sys.executable, "-m", "rope_jax.experiments.sweep", *sweep_argv(workdir, data_dir),
           *SLURM, "--wait", "--poll=1"]  # fmt: skip
    env = run_env(str(base / "xla_cache"), 1)  # sbatch passes it on to the jobs
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    log, job_id = workdir / "qk/seed_0/slurm.log", None
    try:
        job_id = wait_until("qk's job", lambda: job_id_of(workdir, "qk"), proc)
        wait_until("step 5 of qk", lambda: "step 5/20" in read(log), proc)
        subprocess.run(["scancel", "--signal=TERM", job_id], check=True)
        wait_until("qk requeued", lambda: squeue_state(job_id) == "PENDING", proc)
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now+3"], check=True)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        ids = [j["job_id"] for j in slurm.load_jobs(str(workdir))]
        subprocess.run(["scancel", *ids], capture_output=True) if ids else None
    output = read(out_path)
    assert proc.returncode == 0, output + "\n" + read(log)[-3000:]
    return {"workdir": workdir, "stdout": output, "job_id": job_id}


@pytest.mark.slow
def test_the_slurm_sweep_writes_the_table_of_the_local_launcher(slurm_sweep, local_sweep):
    workdir, out = slurm_sweep["workdir"], slurm_sweep["stdout"]
    assert re.search(r"\[1/2\] row=qk seed=0  new  submitted: job \d+", out), out
    assert f"wrote {workdir}/results.md" in out, out
    ours = json.loads((workdir / "results.json").read_text())
    theirs = json.loads((local_sweep / "results.json").read_text())
    assert list(ours["rows"]) == list(theirs["rows"]) == ["qk", "vo"]
    assert ours["seq_lens"] == theirs["seq_lens"] == ["32", "64"]
    for row in ("qk", "vo"):
        (a,), (b,) = ours["rows"][row]["runs"], theirs["rows"][row]["runs"]
        for t in ("32", "64"):
            np.testing.assert_allclose(a["loss"][t], b["loss"][t], rtol=0, atol=1e-5)
        assert [s for s, _ in a["train_curve"]] == [5, 10, 15, 20]
        np.testing.assert_allclose([v for _, v in a["train_curve"]],
                                   [v for _, v in b["train_curve"]], rtol=0, atol=1e-5)  # fmt: skip
    md = (workdir / "results.md").read_text()
    assert "| qk |" in md and "| vo |" in md and "slurm jobs of 1 node(s) x 2 task(s)" in md
    assert (workdir / "results.png").stat().st_size > 10_000


@pytest.mark.slow
def test_a_signalled_job_saves_requeues_itself_and_ends_as_if_uninterrupted(
    slurm_sweep, local_sweep
):
    """Exactly: both the interrupted qk and the uninterrupted vo end with the bitwise
    parameters of the local runs. Two devices either way (2 processes x 1, or 1 x 2),
    so each gradient all-reduce adds two partial sums, the same in either order."""
    workdir, job_id = slurm_sweep["workdir"], slurm_sweep["job_id"]
    log = "\n".join(ln for ln in read(workdir / "qk/seed_0/slurm.log").splitlines()
                    if not ln.startswith("[Gloo]"))  # fmt: skip
    assert log.count("SIGTERM: saving at the end of this step") == 2, log  # both processes
    saved = [int(s) for s in re.findall(r"SIGTERM: saved step (\d+) in", log)]
    assert len(saved) == 1 and saved[0] in (10, 15), log
    assert f"train.py stopped before step 20; job {job_id} is RUNNING" in log
    for i in (0, 1):
        assert (workdir / f"qk/seed_0/checkpoints/{saved[0]}/checksums.process_{i}.json").exists()
    assert f"job {job_id} (restart 1)" in log and f"resumed from step {saved[0]} " in log
    jobs = slurm.load_jobs(str(workdir))
    assert [(j["row"], j["job_id"]) for j in jobs][0] == ("qk", job_id) and len(jobs) == 2
    for row in ("qk", "vo"):
        (step_a, a), (step_b, b) = (final_params(str(w / f"{row}/seed_0"))
                                    for w in (workdir, local_sweep))  # fmt: skip
        assert step_a == step_b == 20
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)


@pytest.mark.slow
def test_the_same_command_again_only_collects_and_status_says_why(slurm_sweep, data_dir, capsys):
    workdir = slurm_sweep["workdir"]
    argv = [*sweep_argv(workdir, data_dir), *SLURM]
    message, out = main([*argv, "--status"], capsys)
    assert message is None and out.count("COMPLETED") == 2 and out.count(" done ") == 2, out
    assert "2 runs: 2 done, 0 queued or running, 0 to submit" in out
    before = (workdir / "slurm_jobs.json").read_text()
    message, out = main(argv, capsys)
    assert message is None and out.count("done, skipped") == 2, out
    assert f"wrote {workdir}/results.md" in out
    assert (workdir / "slurm_jobs.json").read_text() == before  # nothing submitted


@pytest.mark.slow
def test_a_bad_partition_is_sbatchs_own_message_in_one_line(cluster, tmp_path, capsys):
    argv = ["--config=configs/lm.py:size=tiny", f"--workdir={tmp_path}", "--rows=qk", *SLURM,
            "--partition=no_such_partition"]  # fmt: skip
    message, _ = main(argv, capsys)
    assert message.startswith("error: sbatch refused row=qk seed=0: invalid partition "), message
    assert "no_such_partition" in message and "\n" not in message
    assert slurm.load_jobs(str(tmp_path)) == []


DIVERGE = """from configs.lm import get_config  # noqa: F401


def sweep(add):
    add(name="diverge", **{"optim.lr": 1e6})  # the loss is non-finite within 5 steps
    add(name="good", **{"optim.lr": 3e-3})
"""


@pytest.mark.slow
def test_a_diverging_row_fails_alone_on_the_cluster_and_the_table_names_it(
    cluster, data_dir, tmp_path
):
    """One job per run (1 task): the diverging row's job fails, the good row's trains;
    the table names the failed run, exit 1. The same command again leaves the good row
    alone and resubmits the failed run once; the third time it is not resubmitted."""
    wait_for_idle_node()
    config, workdir = tmp_path / "diverge.py", tmp_path / "runs"
    config.write_text(DIVERGE)
    argv = [f"--config={config}:size=tiny", f"--workdir={workdir}", "--extrapolate=2",
            "--set", SET, "--set", f"data.data_dir={data_dir}", "--launcher=slurm",
            "--wait", "--poll=1"]  # fmt: skip
    cmd = [sys.executable, "-m", "rope_jax.experiments.sweep", *argv]
    env = run_env(str(tmp_path / "xla_cache"), 1)
    run = lambda: subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,  # noqa: E731
                                 timeout=300)  # fmt: skip
    try:
        first = run()
        assert first.returncode == 1, first.stdout + first.stderr[-3000:]
        last = first.stderr.strip().splitlines()[-1]
        assert last.startswith("error: 1 of 2 runs failed (row=diverge seed=0): the table names")
        report = json.loads((workdir / "results.json").read_text())
        (failed,) = report["rows"]["diverge"]["failed"]
        assert re.match(r"job \d+ FAILED: non-finite loss \(nan\) at step \d+;", failed["reason"])
        assert failed["log"] == str(workdir / "diverge/seed_0/slurm.log")
        assert report["rows"]["diverge"]["runs"] == [] and len(report["rows"]["good"]["runs"]) == 1
        md = (workdir / "results.md").read_text()
        assert "| diverge | `optim.lr=1000000.0` | 0 of 1 | failed |" in md
        assert "slurm jobs of 1 node(s) x 1 task(s)" in md

        second = run()
        assert second.returncode == 1, second.stdout + second.stderr[-3000:]
        assert "[2/2] row=good seed=0  done, skipped" in second.stdout
        assert re.search(r"\[1/2\] row=diverge seed=0  failed \(step 0/20\)  job \d+ FAILED, "
                         r"resubmitted: job \d+", second.stdout), second.stdout  # fmt: skip
        assert "does not run it again" in second.stderr.strip().splitlines()[-1]
        jobs = slurm.load_jobs(str(workdir))
        assert [j["row"] for j in jobs] == ["diverge", "good", "diverge"]

        third = run()
        assert third.returncode == 1 and "failed, not retried (failed 2 times" in third.stdout
        assert slurm.load_jobs(str(workdir)) == jobs  # nothing submitted
    finally:
        ids = [j["job_id"] for j in slurm.load_jobs(str(workdir))]
        subprocess.run(["scancel", *ids], capture_output=True) if ids else None
