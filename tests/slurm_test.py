"""Multi-process training and evaluation under a real SLURM scheduler.

A single-node cluster on this machine (`scripts/local_slurm.sh up`: root, installs
slurm-wlm and munge with apt-get if missing) runs the real entry points as `srun -n 2`:
two processes of 2 CPU devices each (4 global devices) that `harness.distributed`
starts from SLURM's variables, with cross-process collectives over gloo. Where the
cluster cannot start (not root, no apt-get, a daemon fails) the slow tests are skipped
with the reason.

  parity   the per-step losses of `srun -n 2 train.py` are those of one process with
           the same global batch and 4 devices (1e-5), and so is the final evaluation
  kill -9  one task killed after the first checkpoint is on disk; the same submission
           again resumes from it and ends with exactly the parameters of an
           uninterrupted run
  SIGTERM  `scancel --signal=TERM` of the job: both processes save the same step (the
           first log step after the signal) and exit 0; the same command resumes from
           it and ends with exactly the parameters of an uninterrupted run
  eval     `srun -n 2 eval.py` gives the numbers of a single-process eval.py, and
           `--generate` prints one process's text, the single-process text

The quick tests check when `harness.distributed` starts a multi-process run, and that
bad explicit flags are one line, without a cluster.
"""

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from rope_jax.harness import distributed, metrics
from tests.slurm_helpers import JOB_NAME, ROOT, final_params, run_env, wait_for_idle_node, xla_flags

# One test worker runs both SLURM modules, one after the other: they share the cluster.
pytestmark = pytest.mark.xdist_group("slurm")
NUM_STEPS, CKPT_EVERY = 12, 4
SLURM_JOB = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_NTASKS": "2",
             "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}  # fmt: skip


def train_flags(data_dir: str, workdir: str) -> list[str]:
    """The tiny LM (1 layer, D=32), 12 steps of 8 x 32 tokens, checkpoints every 4."""
    return [
        "--config=configs/lm.py:size=tiny",
        "--config.model.num_layers=1",
        "--config.model.embed_dim=32",
        "--config.model.num_heads=2",
        "--config.model.num_kv_heads=1",
        "--config.model.head_dim=16",
        "--config.model.mlp_dim=64",
        f"--config.data.data_dir={data_dir}",
        "--config.data.seq_len=32",
        "--config.data.global_batch_size=8",
        f"--config.train.num_steps={NUM_STEPS}",
        "--config.train.log_every_steps=1",
        f"--config.train.ckpt_every_steps={CKPT_EVERY}",
        "--config.train.eval_every_steps=0",
        "--config.eval.batch_size=8",
        "--config.eval.num_batches=2",
        f"--workdir={workdir}",
    ]


def srun(tasks: int = 2) -> list[str]:
    """srun of `tasks` tasks of one CPU each, once the node is idle; the whole step ends
    when one task fails (-K), and it gives up when the node stays busy for a minute (-I60)."""
    wait_for_idle_node()
    return ["srun", f"--ntasks={tasks}", "--cpus-per-task=1", "--kill-on-bad-exit=1",
            "--immediate=60", f"--job-name={JOB_NAME}"]  # fmt: skip


def run(command: list[str], env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, env=env, text=True, capture_output=True,
                          timeout=timeout)  # fmt: skip


def gloo_free(text: str) -> str:
    """`text` without gloo's "[Gloo] Rank i is connected to j peer ranks. Expected number
    of connected peer ranks is : j" lines (CPU collectives print them, on stderr once the
    harness moved them there, from every process at once, so one process's line may be
    cut by the other's: a line holding either part of the message goes)."""
    gloo = ("[Gloo]", "connected peer ranks")
    return "\n".join(line for line in text.splitlines() if not any(g in line for g in gloo))


def losses(workdir: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics.read_jsonl(workdir) if "loss" in r}


def eval_numbers(workdir: str) -> dict:
    return {r["step"]: r for r in metrics.read_jsonl(workdir) if "eval/loss" in r}


# ------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The environment of every run: no SLURM variables of an enclosing job, a shared
    persistent compilation cache, unbuffered output, 2 CPU devices per process."""
    return run_env(str(tmp_path_factory.mktemp("xla_cache")), 2)


@pytest.fixture(scope="module")
def one_process(data_dir, env, tmp_path_factory):
    """A finished single-process run with the same global batch on 4 devices."""
    workdir = str(tmp_path_factory.mktemp("one") / "run")
    proc = run([sys.executable, "train.py", *train_flags(data_dir, workdir)],
               dict(env, XLA_FLAGS=xla_flags(4)))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return workdir


@pytest.fixture(scope="module")
def two_processes(cluster, data_dir, env, tmp_path_factory):
    """A finished `srun -n 2` run: (workdir, stdout)."""
    workdir = str(tmp_path_factory.mktemp("two") / "run")
    proc = run([*srun(), sys.executable, "train.py", *train_flags(data_dir, workdir)], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return workdir, proc.stdout


# ------------------------------------------------------------------------ slow tests


@pytest.mark.slow
def test_two_processes_train_like_one(one_process, two_processes):
    workdir, out = two_processes
    assert "4 cpu devices" in out, out  # 2 processes x 2 devices, one global mesh
    assert out.count("compiling the train step") == 1, out  # printed by process 0 only
    step_dir = os.path.join(workdir, "checkpoints", str(NUM_STEPS))
    assert sorted(map(os.path.basename, glob.glob(os.path.join(step_dir, "checksums.*")))) == [
        "checksums.process_0.json",
        "checksums.process_1.json",
    ]
    one, two = losses(one_process), losses(workdir)
    assert sorted(one) == sorted(two) == list(range(1, NUM_STEPS + 1))
    np.testing.assert_allclose([two[s] for s in one], [one[s] for s in one], rtol=0, atol=1e-5)
    (e1,), (e2,) = eval_numbers(one_process).values(), eval_numbers(workdir).values()
    assert e1["eval/tokens"] == e2["eval/tokens"] == 2 * 8 * 32
    np.testing.assert_allclose(e2["eval/loss"], e1["eval/loss"], rtol=1e-5)


@pytest.mark.slow
def test_kill_9_of_one_task_then_the_same_submission_resumes_exactly(
    cluster, data_dir, env, two_processes, tmp_path
):
    workdir = str(tmp_path / "run")
    pids = str(tmp_path / "pid")
    task = ["bash", "-c", f'echo $$ > {pids}.$SLURM_PROCID; exec "$@"', "task"]
    command = [*srun(), *task, sys.executable, "train.py", *train_flags(data_dir, workdir)]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    first = os.path.join(workdir, "checkpoints", str(CKPT_EVERY))
    sums = [os.path.join(first, f"checksums.process_{i}.json") for i in (0, 1)]
    try:
        deadline = time.time() + 180
        while not all(map(os.path.exists, sums)):
            assert proc.poll() is None, f"ended before a checkpoint: {proc.stdout.read()}"
            assert time.time() < deadline, "no first checkpoint after 180 s"
            time.sleep(0.02)
        with open(f"{pids}.1") as f:
            os.kill(int(f.read()), signal.SIGKILL)  # task 1, mid-run
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, out
    assert not os.path.exists(os.path.join(workdir, "checkpoints", str(NUM_STEPS))), out
    again = run([*srun(), sys.executable, "train.py", *train_flags(data_dir, workdir)], env)
    assert again.returncode == 0, again.stdout + again.stderr
    resumed = [line for line in again.stdout.splitlines() if line.startswith("resumed from")]
    assert len(resumed) == 1 and int(resumed[0].split()[3]) < NUM_STEPS, again.stdout
    step_a, a = final_params(two_processes[0])
    step_b, b = final_params(workdir)
    assert step_a == step_b == NUM_STEPS
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    after = int(resumed[0].split()[3])
    reference, rerun = losses(two_processes[0]), losses(workdir)
    assert all(rerun[s] == reference[s] for s in range(after + 1, NUM_STEPS + 1))


@pytest.mark.slow
def test_sigterm_of_a_two_task_step_saves_one_step_on_both_then_the_same_command_resumes(
    cluster, data_dir, env, two_processes, tmp_path
):
    """`scancel --signal=TERM <job>` signals the step's tasks (as a job's
    `--signal=TERM@<s>` and a preemption notice do): both processes agree on the first
    log step after it, both save that step and exit 0; the same command resumes from
    it to exactly the parameters of an uninterrupted run."""
    workdir, log, job = str(tmp_path / "run"), tmp_path / "out", tmp_path / "job_id"
    task = ["bash", "-c", f'echo $SLURM_JOB_ID > {job}; exec "$@"', "task"]
    command = [*srun(), *task, sys.executable, "train.py", *train_flags(data_dir, workdir)]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 180
        while "step 1/" not in log.read_text():  # trained past its first step
            assert proc.poll() is None, f"ended before step 1: {log.read_text()}"
            assert time.time() < deadline, "no step 1 after 180 s"
            time.sleep(0.02)
        subprocess.run(["scancel", "--signal=TERM", job.read_text().strip()], check=True)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = gloo_free(log.read_text())
    assert proc.returncode == 0, out
    assert out.count("SIGTERM: saving at the end of this step") == 2, out  # both processes
    saved = [int(w) for w in re.findall(r"SIGTERM: saved step (\d+) in .*the same command resumes",
                                        out)]  # fmt: skip
    assert len(saved) == 1 and 1 < saved[0] < NUM_STEPS, out
    step_dir = os.path.join(workdir, "checkpoints", str(saved[0]))
    steps = [int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit()]
    assert max(steps) == saved[0], steps
    for i in (0, 1):  # each process saved its shards of that step
        assert os.path.exists(os.path.join(step_dir, f"checksums.process_{i}.json")), out
    again = run([*srun(), sys.executable, "train.py", *train_flags(data_dir, workdir)], env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resumed from step {saved[0]} " in again.stdout, again.stdout
    (step_a, a), (step_b, b) = final_params(two_processes[0]), final_params(workdir)
    assert step_a == step_b == NUM_STEPS
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    reference, rerun = losses(two_processes[0]), losses(workdir)
    assert [rerun[s] for s in range(1, NUM_STEPS + 1)] == [
        reference[s] for s in range(1, NUM_STEPS + 1)]  # fmt: skip


@pytest.mark.slow
def test_two_process_eval_gives_the_single_process_numbers(two_processes, env):
    workdir, _ = two_processes
    flags = [f"--workdir={workdir}", "--seq_lens=32,64"]
    two = run([*srun(), sys.executable, "eval.py", *flags, "--tag=two"], env)
    assert two.returncode == 0, two.stdout + two.stderr
    one = run([sys.executable, "eval.py", *flags, "--tag=one"], env)
    assert one.returncode == 0, one.stdout + one.stderr
    assert json.loads(two.stdout)["step"] == NUM_STEPS  # stdout: process 0's JSON only
    assert "[Gloo]" not in two.stdout  # gloo's connection lines went to stderr
    a = json.load(open(os.path.join(workdir, f"eval_{NUM_STEPS}_one.json")))
    b = json.load(open(os.path.join(workdir, f"eval_{NUM_STEPS}_two.json")))
    for length in ("32", "64"):
        assert a[length]["tokens"] == b[length]["tokens"] > 0
        for key in ("loss", "accuracy", "bits_per_byte"):
            np.testing.assert_allclose(b[length][key], a[length][key], rtol=1e-5)


@pytest.mark.slow
def test_two_process_generate_prints_the_single_process_text_once(two_processes, env):
    workdir, _ = two_processes
    flags = [f"--workdir={workdir}", "--generate", "--prompt=ROMEO:", "--max_new_tokens=40"]
    two = run([*srun(), sys.executable, "eval.py", *flags], env)
    assert two.returncode == 0, two.stdout + two.stderr
    one = run([sys.executable, "eval.py", *flags], env)
    assert one.returncode == 0, one.stdout + one.stderr
    assert one.stdout.startswith("ROMEO:") and two.stdout == one.stdout  # process 0's only


@pytest.mark.slow
def test_two_process_suite_writes_the_single_process_cells(two_processes, env, tmp_path):
    """`srun -n 2 eval.py --out=DIR`: every process decodes every example; process 0
    writes the cells, the same answers as one process's."""
    workdir, _ = two_processes
    flags = [f"--workdir={workdir}", "--tasks=niah_single_1", "--lengths=1024", "--examples=2"]
    two = run([*srun(), sys.executable, "eval.py", *flags, f"--out={tmp_path}/two"], env)
    assert two.returncode == 0, two.stdout + two.stderr
    one = run([sys.executable, "eval.py", *flags, f"--out={tmp_path}/one"], env)
    assert one.returncode == 0, one.stdout + one.stderr
    rows = [[json.loads(x) for x in open(f"{tmp_path}/{n}/examples/niah_single_1_1024.jsonl")]
            for n in ("one", "two")]  # fmt: skip
    assert len(rows[0]) == 2 and rows[0] == rows[1]


@pytest.mark.slow
def test_two_processes_import_an_hf_model_once_and_evaluate_it_as_one(cluster, data_dir, env,
                                                                        tmp_path):  # fmt: skip
    """`srun -n 2 eval.py --hf=DIR`: both processes build the import, one run in the
    workdir (one checkpoint, one config.json), the single-process numbers."""
    flags = [f"--hf={os.path.join(ROOT, 'tests', 'data', 'hf', 'llama')}",
             "--config=configs/lm.py", f"--config.data.data_dir={data_dir}",
             "--config.data.seq_len=32", "--config.eval.batch_size=8",
             "--config.eval.num_batches=2"]  # fmt: skip
    two = run([*srun(), sys.executable, "eval.py", f"--workdir={tmp_path}/two", *flags], env)
    assert two.returncode == 0, two.stdout + two.stderr
    one = run([sys.executable, "eval.py", f"--workdir={tmp_path}/one", *flags], env)
    assert one.returncode == 0, one.stdout + one.stderr
    assert gloo_free(two.stdout).count("imported ") == 1
    assert os.listdir(f"{tmp_path}/two/checkpoints") == ["0"]
    a, b = (json.load(open(f"{tmp_path}/{w}/eval_0.json")) for w in ("one", "two"))
    np.testing.assert_allclose(b["64"]["loss"], a["64"]["loss"], rtol=1e-5)  # T: the model's 64


@pytest.mark.slow
def test_a_process_that_fails_alone_ends_the_step_at_once(cluster, env):
    """One process's error line used to leave it waiting in JAX's distributed shutdown
    (up to 300 s) for the other, which waited for it in a collective."""
    code = ("import jax; from jax.experimental import multihost_utils; "
            "from rope_jax.harness import cli, distributed; distributed.initialize(); "
            "multihost_utils.sync_global_devices('both'); "  # connected, as in a real run
            "cli.fail('process 1 alone') if jax.process_index() == 1 else "
            "multihost_utils.sync_global_devices('never reached by process 1')")  # fmt: skip
    start = time.time()
    proc = run([*srun(), sys.executable, "-c", code], env, timeout=120)
    assert proc.returncode != 0 and "error: process 1 alone" in proc.stderr, proc.stderr[-2000:]
    assert time.time() - start < 60


@pytest.mark.slow
def test_two_processes_print_one_dry_run_report(cluster, data_dir, env, tmp_path):
    flags = [*train_flags(data_dir, str(tmp_path / "never")), "--dry_run"]
    proc = run([*srun(), sys.executable, "train.py", *flags], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert gloo_free(proc.stdout).count("parameters: ") == 1 and "devices: 4" in proc.stdout
    assert not os.path.exists(tmp_path / "never")


# ----------------------------------------------------------------------- quick tests


def test_native_writes_on_stdout_go_to_stderr_and_python_prints_stay():
    code = ("import os; from rope_jax.harness import console; print('before'); "
            "console.native_stdout_to_stderr(); os.write(1, b'[native]\\n'); print('after'); "
            "console.native_stdout_to_stderr(); print('again')")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == "before\nafter\nagain\n"
    assert "[native]" in done.stderr


def test_a_plain_process_is_left_alone(monkeypatch):
    for name in [*SLURM_JOB, "JAX_COORDINATOR_ADDRESS"]:
        monkeypatch.delenv(name, raising=False)
    assert distributed.plan(environ={}) is None
    assert distributed.initialize() is None
    assert not jax.distributed.is_initialized() and jax.process_count() == 1


def test_when_a_run_is_several_processes():
    plan = distributed.plan
    assert plan(environ=SLURM_JOB) == ("slurm", {})
    assert plan(environ={**SLURM_JOB, "SLURM_NTASKS": "1"}) is None  # srun -n 1
    batch_shell = {k: v for k, v in SLURM_JOB.items() if k != "SLURM_STEP_NODELIST"}
    assert plan(environ=batch_shell) is None  # an sbatch script's own shell: not a task
    assert plan(environ={"JAX_COORDINATOR_ADDRESS": "h:1"}) == ("env", {})
    assert plan(environ={}, on_tpu_vm=True) == ("tpu", {})
    explicit = plan("10.0.0.1:1234", 2, 1, environ=SLURM_JOB)  # explicit flags win
    assert explicit == ("explicit", {"coordinator_address": "10.0.0.1:1234",
                                     "num_processes": 2, "process_id": 1})  # fmt: skip
    assert plan("10.0.0.1:1234", 1, 0, environ={}) is None  # one process: nothing to start


@pytest.mark.parametrize(
    "args, message",
    [
        ((None, 2, None), "--num_processes also needs --coordinator_address and --process_id"),
        (("h:1", 2, 2), r"--process_id=2 must lie in \[0, 2\)"),
        (("h:1", 0, 0), "--num_processes=0 must be >= 1"),
        (("h", 2, 0), "--coordinator_address='h' must be HOST:PORT"),
        (("h:70000", 2, 0), "port in 1-65535"),
    ],
)
def test_bad_explicit_flags_are_one_line(args, message):
    with pytest.raises(distributed.DistributedFlagError, match=message) as e:
        distributed.plan(*args, environ={})
    assert "\n" not in str(e.value)


def test_bad_explicit_flags_on_the_command_line_are_one_error_line():
    proc = run([sys.executable, "train.py", "--config=configs/lm.py:size=tiny",
                "--workdir=/nonexistent/never", "--process_id=1"],
               {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")})  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: --process_id also needs --coordinator_address and --num_processes "
        "(--coordinator_address, --num_processes and --process_id go together)"
    ]
