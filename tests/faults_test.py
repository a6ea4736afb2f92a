"""Faults a run meets, each made real: damaged checkpoints, full and read-only disks,
two writers, stale locks, Ctrl-C, changed configs, tiny splits, bad command lines.

Every model here is `train_test.tiny` (1 layer, D=32, 20 steps). Training runs in
subprocesses (`train.py`, the real entry point) that share one persistent XLA cache
and compile at a low XLA optimisation level, so the train step compiles once for the
module; in-process calls only restore and evaluate (one more compile, also cached).
Disk-full and read-only cases mount small tmpfs filesystems (root); where mounting is
impossible they are skipped with the reason.
"""

import ast
import concurrent.futures
import glob
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import jax
import pytest

import eval as eval_lib
import train
from rope_jax import data, harness, signals
from rope_jax.harness import checkpoint, metrics, runfiles
from rope_jax.harness import workdir as workdir_lib
from tests.train_test import tiny

# One test worker runs the module (its tests share module-scoped training runs, built once).
pytestmark = pytest.mark.xdist_group("faults")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ABSL_LOG_LINE = re.compile(r"^[IWEF]\d{4} |^(INFO|WARNING|ERROR):absl:")


# ------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def cache_env(shared_compilation_cache):
    """The environment of this module's subprocesses: the worker's (conftest sets the
    compilation cache and the XLA flags of every test process), output unbuffered."""
    return dict(os.environ, PYTHONUNBUFFERED="1")


# The module's first run (`watched`, `trained`): a progress line per step and an evaluation
# every 10 steps, the default preset's shape (20 progress lines, 2 evaluations, 2 saves).
WATCHED = {"train.log_every_steps": 1, "train.eval_every_steps": 10}


@pytest.fixture(scope="module")
def watched(data_dir, cache_env, tmp_path_factory):
    """A tiny run of train.py watched from its first line to its last: stopped (SIGSTOP)
    once it says it compiles, while a second train.py in its workdir tries to start, then
    left to finish. {"workdir", "pid", "announced_s" (from its start to that line),
    "head" (its lines up to that one), "second" (returncode, stdout, stderr of the
    second), "returncode", "rest" (its stdout after the head), "err" (its stderr)}."""
    workdir = str(tmp_path_factory.mktemp("trained") / "run")
    command = ["train.py", *flags(tiny(data_dir, **WATCHED)), f"--workdir={workdir}"]
    began = time.time()
    first = start(command, cache_env)
    try:
        head = read_until(first, r"compiling the train step", 60)
        announced_s = time.time() - began
        first.send_signal(signal.SIGSTOP)  # holds the lock while the second one tries
        try:
            second = run_all([command], cache_env)[0]
        finally:
            first.send_signal(signal.SIGCONT)
        rest, err = first.communicate(timeout=240)
    finally:
        if first.poll() is None:
            first.kill()
    return {"workdir": workdir, "pid": first.pid, "announced_s": announced_s, "head": head,
            "second": second, "returncode": first.returncode, "rest": rest, "err": err}  # fmt: skip


@pytest.fixture(scope="module")
def trained(watched):
    """A finished tiny run of train.py (checkpoints at steps 10 and 20: `watched`'s);
    copy it before damaging it. Also fills the compilation cache for the other
    subprocesses (the first train.py of the module)."""
    assert watched["returncode"] == 0, watched["rest"] + watched["err"]
    return watched["workdir"]


@pytest.fixture(scope="module")
def saved(data_dir, cache_env, tmp_path_factory):
    """A workdir as a tiny run leaves it (config.json, checkpoints at steps 10 and 20 of
    the initial state, with their checksums), made without compiling a train step."""
    config = tiny(data_dir)
    workdir = str(tmp_path_factory.mktemp("saved") / "run")
    run = harness.build(config)
    state = jax.jit(run.init_fn, out_shardings=run.shardings)()
    position = data.make_train_iterator(config.data, seed=0, batch_size=8).get_state()
    mngr = checkpoint.Manager(workdir)
    for step in (10, 20):
        mngr.save(step, state, {"data": position, "step": step})
    mngr.close()
    runfiles.save_config(workdir, config)
    return workdir


def copy_run(source, tmp_path, name="run"):
    target = str(tmp_path / name)
    shutil.copytree(source, target)
    return target


class MountError(RuntimeError):
    pass


class Mounts:
    """Small tmpfs filesystems (needs root); unmounted at the end of the test."""

    def __init__(self):
        self.points = []

    def tmpfs(self, path, size: int, options: str = "") -> str:
        os.makedirs(path, exist_ok=True)
        opts = f"size={size}" + (f",{options}" if options else "")
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
                              capture_output=True, text=True)  # fmt: skip
        if proc.returncode != 0:
            raise MountError(f"cannot mount a tmpfs here: {proc.stderr.strip() or proc.returncode}")
        self.points.append(str(path))
        return str(path)

    def tmpfs_or_skip(self, path, size: int, options: str = "") -> str:
        try:
            return self.tmpfs(path, size, options)
        except MountError as e:
            print(e)
            pytest.skip(str(e))

    def remount_read_only(self, path) -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)

    def close(self):
        for point in reversed(self.points):
            if subprocess.run(["umount", point], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", point], capture_output=True)


@pytest.fixture
def mounts():
    m = Mounts()
    yield m
    m.close()


# -------------------------------------------------------------------------- helpers


def flags(config) -> list[str]:
    """--config=... and one --config.<field>=<value> per leaf of `config`."""
    out = ["--config=configs/lm.py:size=tiny"]

    def walk(node, prefix):
        for key, value in node.items():
            if hasattr(value, "items"):
                walk(value, f"{prefix}{key}.")
            elif isinstance(value, tuple):
                text = ",".join(map(repr, value)) + ("," if len(value) == 1 else "")
                out.append(f"--config.{prefix}{key}=({text})")
            else:
                out.append(f"--config.{prefix}{key}={value}")

    walk(config, "")
    return out


def start(args, env, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)  # fmt: skip


def run_all(commands, env, parallel=4, timeout=240) -> list[tuple[int, str, str]]:
    """Runs the commands, up to `parallel` at a time (each spends seconds importing on
    one core); (returncode, stdout, stderr) of each, in order."""

    def run(args):
        proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, text=True,
                              capture_output=True, timeout=timeout)  # fmt: skip
        return proc.returncode, proc.stdout, proc.stderr

    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
        return list(pool.map(run, commands))


def one_error_line(rc: int, out: str, err: str) -> str:
    """The single `error: ...` line of a failed command (and nothing else on stderr)."""
    assert rc != 0, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def read_until(proc, pattern: str, deadline_s: float, stream: str = "stdout") -> list[str]:
    """Lines of a running process's `stream` up to the first that matches `pattern`."""
    lines, end = [], time.time() + deadline_s
    while time.time() < end:
        line = getattr(proc, stream).readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if re.search(pattern, line):
            return lines
    proc.kill()
    raise AssertionError(f"no line matching {pattern!r}: {lines} {proc.communicate()}")


def largest_array_file(workdir, step) -> str:
    files = glob.glob(os.path.join(workdir, "checkpoints", str(step), "state", "**", "*"),
                      recursive=True)  # fmt: skip
    return max((f for f in files if os.path.isfile(f)), key=os.path.getsize)


# The two ways a damaged array is named. Orbax compresses each chunk (zstd): bytes flipped
# inside a chunk's payload restore silently and the checksum names the array; flipped in a
# chunk's frame header, or a file cut short, TensorStore cannot read it and the message
# names the array from TensorStore's key. Which one a flip in the middle of a file meets
# depends on the order Orbax wrote the arrays in.
DAMAGED_ARRAY = re.compile(r"is damaged: array (params|opt)\.\S+ "
                           r"(does not match its checksum|cannot be read \(.+\))")  # fmt: skip


def flip_bytes(path: str, at: float = 0.5, count: int = 4) -> None:
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        i = int(len(data) * at)
        data[i : i + count] = bytes(b ^ 0xFF for b in data[i : i + count])
        f.seek(0)
        f.write(data)


def truncate(path: str, keep: float = 0.5) -> None:
    with open(path, "r+b") as f:
        f.truncate(int(os.path.getsize(path) * keep))


def listing(path) -> dict:
    """{relative path: bytes} of every file under `path`."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            out[os.path.relpath(full, path)] = open(full, "rb").read()
    return out


# ------------------------------------------------- commands that end with one line


@pytest.fixture(scope="module")
def commands(data_dir, trained, cache_env, tmp_path_factory):
    """The faults that end a command, each set up in its own workdir, then every command
    run together: {name: (returncode, stdout, stderr, workdir)}. A case that cannot be
    set up here is (None, "", reason, None)."""
    root, config, mounts = tmp_path_factory.mktemp("commands"), tiny(data_dir), Mounts()
    train_cmd = lambda workdir, *extra: ["train.py", *flags(config), f"--workdir={workdir}", *extra]
    flipped = {}
    for name in ("eval_flipped", "train_flipped", "train_flipped_fallback"):
        flipped[name] = copy_run(trained, root, name)
        flip_bytes(largest_array_file(flipped[name], 20))
    cases = {
        "eval_flipped": (["eval.py", f"--workdir={flipped['eval_flipped']}", "--num_batches=1"],
                         flipped["eval_flipped"]),
        "train_flipped": (train_cmd(flipped["train_flipped"]), flipped["train_flipped"]),
        "train_flipped_fallback": (train_cmd(flipped["train_flipped_fallback"], "--fallback"),
                                   flipped["train_flipped_fallback"]),
    }  # fmt: skip
    nan = explosive_run(config, trained, root / "nan")
    cases["train_nan"] = (train_cmd(nan), nan)
    never = str(root / "never")
    cases["unknown_field"] = (["train.py", "--config=configs/lm.py:size=tiny", f"--workdir={never}",
                               "--config.model.rope.sties=qk"], never)  # fmt: skip
    cases["missing_config"] = (["train.py", "--config=configs/lmm.py:size=tiny",
                                f"--workdir={never}"], never)  # fmt: skip
    untagged = copy_run(trained, root, "untagged")
    cases["untagged_scaling"] = (["eval.py", f"--workdir={untagged}", "--num_batches=1",
                                  '--rope_scaling={"rope_type": "linear", "factor": 2}'],
                                 untagged)  # fmt: skip
    cases["generate_with_seq_lens"] = (["eval.py", f"--workdir={untagged}", "--generate",
                                        "--seq_lens=64"], untagged)  # fmt: skip
    skipped = {}
    try:
        full = os.path.join(mounts.tmpfs(root / "disk", room_for_one_save(config)), "run")
        cases["train_disk_full"] = (train_cmd(full), full)
    except MountError as e:
        skipped["train_disk_full"] = (None, "", str(e), None)
    results = run_all([args for args, _ in cases.values()], cache_env)
    yield {name: (*result, workdir) for (name, (_, workdir)), result
           in zip(cases.items(), results, strict=True)} | skipped  # fmt: skip
    mounts.close()


def explosive_run(config, trained, workdir) -> str:
    """A copy of `trained` whose only checkpoint (step 10) holds finite parameters 1e30
    times too large: the next step's loss is NaN/inf."""
    workdir = copy_run(trained, workdir.parent, workdir.name)
    run = harness.build(config)
    mngr = checkpoint.Manager(workdir)
    state, extra = mngr.restore(10, run.abstract)
    for step in (10, 20):
        shutil.rmtree(mngr.step_dir(step))
    mngr.close()
    state["params"] = jax.tree.map(lambda x: x * 1e30, state["params"])
    mngr = checkpoint.Manager(workdir)
    mngr.save(10, state, extra)
    mngr.close()
    return workdir


def room_for_one_save(config) -> int:
    """A disk size with room for the first save (checked against the state's size in
    memory, which Orbax compresses) but not for a second one beside it."""
    run = harness.build(config)
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(run.abstract))
    return (state_bytes + 160 * 1024) // 4096 * 4096


# --------------------------------------------------------------- checkpoint integrity


@pytest.mark.slow
def test_every_step_carries_checksums_written_after_it(saved):
    for step in (10, 20):
        step_dir = os.path.join(saved, "checkpoints", str(step))
        sums = json.load(open(os.path.join(step_dir, "checksums.process_0.json")))
        assert sums["step"] == step and sums["algorithm"] == "crc32"
        assert "params.embed" in sums["arrays"] and "step" in sums["arrays"]
        newest_orbax_file = max(os.path.getmtime(f) for f in glob.glob(
            os.path.join(step_dir, "state", "**", "*"), recursive=True))  # fmt: skip
        written = os.path.getmtime(os.path.join(step_dir, "checksums.process_0.json"))
        assert written >= newest_orbax_file


@pytest.mark.slow
def test_a_flipped_byte_is_named_and_fallback_uses_the_previous_step(
    data_dir, trained, tmp_path, commands
):
    workdir = copy_run(trained, tmp_path)
    flip_bytes(largest_array_file(workdir, 20))
    # In process: the exception names the step and the first bad array.
    with pytest.raises(checkpoint.CheckpointError) as info:
        eval_lib.evaluate_checkpoint(workdir, num_batches=1)
    message = str(info.value)
    assert "checkpoint step 20" in message and "\n" not in message
    assert DAMAGED_ARRAY.search(message), message
    assert eval_lib.evaluate_checkpoint(workdir, num_batches=1, fallback=True)["step"] == 10
    assert json.load(open(os.path.join(workdir, "eval_10.json")))["step"] == 10

    # On the command line: one line each; train.py --fallback resumes from step 10.
    for name in ("eval_flipped", "train_flipped"):
        line = one_error_line(*commands[name][:3])
        assert "checkpoint step 20" in line and DAMAGED_ARRAY.search(line), line
        assert "--fallback" in line
    rc, out, err, resumed = commands["train_flipped_fallback"]
    assert rc == 0, err
    assert "resumed from step 10" in out and "step 20/20" in out
    assert "checkpoint step 20" in err and "damaged_checkpoints" in err
    assert os.listdir(os.path.join(resumed, "damaged_checkpoints")) == ["20"]
    assert checkpoint.Manager(resumed, read_only=True).steps() == [10, 20]
    run = harness.build(tiny(data_dir))
    checkpoint.Manager(resumed, read_only=True).restore(20, run.abstract)  # verifies


@pytest.mark.slow
def test_a_truncated_file_stops_train_and_eval_naming_the_step(data_dir, saved, tmp_path):
    config = tiny(data_dir)
    workdir = copy_run(saved, tmp_path)
    truncate(largest_array_file(workdir, 20))
    unreadable = r"checkpoint step 20 .* is damaged: array (params|opt)\.\S+ cannot be read"
    with pytest.raises(checkpoint.CheckpointError, match=unreadable):
        eval_lib.evaluate_checkpoint(workdir, num_batches=1)
    before = listing(workdir)
    with pytest.raises(checkpoint.CheckpointError, match=unreadable + ".*--fallback"):
        train.train_and_evaluate(config, workdir)
    assert listing(workdir) == before  # the failed resume wrote nothing
    run = harness.build(config)
    mngr = checkpoint.Manager(workdir, read_only=True)
    step, _, _, skipped = mngr.restore_latest_good(run.abstract)
    assert step == 10 and [s for s, _ in skipped] == [20]


@pytest.mark.slow
@pytest.mark.parametrize("at", [0.0, 0.5])
def test_a_flip_in_a_chunk_header_or_payload_names_the_array(data_dir, saved, tmp_path, at):
    """At 0: the first chunk's zstd frame header, which TensorStore cannot decode; at 0.5
    (most often) inside a payload, which decodes to wrong values the checksum catches."""
    workdir = copy_run(saved, tmp_path)
    flip_bytes(largest_array_file(workdir, 20), at=at)
    abstract = harness.build(tiny(data_dir)).abstract
    mngr = checkpoint.Manager(workdir, read_only=True)
    with pytest.raises(checkpoint.CheckpointError) as info:
        mngr.restore(20, abstract)
    message = str(info.value)
    assert message.startswith("checkpoint step 20 ") and "\n" not in message, message
    assert DAMAGED_ARRAY.search(message), message
    if at == 0.0:
        assert "cannot be read (ZSTD" in message, message
    assert mngr.restore_latest_good(abstract)[0] == 10


def test_an_incomplete_step_is_not_restored(data_dir, saved, tmp_path):
    workdir = copy_run(saved, tmp_path)
    os.remove(os.path.join(workdir, "checkpoints", "20", "checksums.process_0.json"))
    run = harness.build(tiny(data_dir))
    mngr = checkpoint.Manager(workdir, read_only=True)
    with pytest.raises(checkpoint.CheckpointError, match="step 20 .* is incomplete"):
        mngr.restore(20, run.abstract)
    assert mngr.restore_latest_good(run.abstract)[0] == 10


@pytest.mark.slow
def test_non_finite_loss_names_a_checkpoint_that_exists_and_verifies(data_dir, commands):
    *result, workdir = commands["train_nan"]
    line = one_error_line(*result)
    match = re.fullmatch(r"error: non-finite loss \(\S+\) at step (\d+); last good checkpoint: "
                         r"step (\d+) in (\S+)", line)  # fmt: skip
    assert match and int(match.group(1)) > 10 and match.group(2) == "10", line
    run = harness.build(tiny(data_dir))
    checkpoint.Manager(workdir, read_only=True).restore(10, run.abstract)


# ---------------------------------------------------------------- saves fail loudly


@pytest.mark.slow
def test_disk_full_stops_at_the_save_with_the_free_space_and_keeps_the_last_step(
    data_dir, commands
):
    rc, out, err, workdir = commands["train_disk_full"]
    if rc is None:
        print(err)
        pytest.skip(err)
    line = one_error_line(rc, out, err)
    assert re.search(r"not enough free space for checkpoint step 20 in \S+: [\d.]+ KiB free, "
                     r"[\d.]+ KiB needed \(step 10's size\)", line), line  # fmt: skip
    assert line.endswith("(the newest checkpoint, step 10, is kept)")
    assert "step 15/20" in out and "step 20/20" in out  # it stopped at step 20's save
    assert checkpoint.Manager(workdir, read_only=True).steps() == [10]
    run = harness.build(tiny(data_dir))
    checkpoint.Manager(workdir, read_only=True).restore(10, run.abstract)  # still intact


def test_a_write_that_runs_out_of_space_is_one_line_and_leaves_no_half_step(
    data_dir, saved, tmp_path, mounts, monkeypatch
):
    config = tiny(data_dir)
    run = harness.build(config)
    source = checkpoint.Manager(saved, read_only=True)
    state, extra = source.restore(20, run.abstract)
    source.close()
    files = glob.glob(os.path.join(saved, "checkpoints", "10", "**", "*"), recursive=True)
    pages = sum(-(-os.path.getsize(f) // 4096) * 4096 for f in files if os.path.isfile(f))
    disk = mounts.tmpfs_or_skip(tmp_path / "disk", int(pages * 1.5) // 4096 * 4096)
    workdir = os.path.join(disk, "run")  # room for one step, not two
    monkeypatch.setattr(workdir_lib, "free_bytes", lambda path: 1 << 40)  # no pre-check
    mngr = checkpoint.Manager(workdir)
    mngr.save(10, state, extra)
    with pytest.raises(checkpoint.SaveError) as info:
        mngr.save(20, state, extra)  # Orbax itself runs out of space
    message = str(info.value)
    assert message.startswith("saving checkpoint step 20 to ") and "\n" not in message
    assert "No space left on device" in message and "step 10, is kept" in message
    # every Orbax writer of the failed save had ended before its files were removed
    writers = [t for t in threading.enumerate() if type(t).__module__.startswith("orbax")]
    assert not writers
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["10"]  # no tmp dir
    mngr.restore(10, run.abstract)
    mngr.close()


def test_a_read_only_workdir_fails_before_anything_compiles(data_dir, saved, tmp_path, mounts):
    read_only = mounts.tmpfs_or_skip(tmp_path / "ro", 64 * 1024, "ro")
    start_time = time.time()
    with pytest.raises(workdir_lib.WorkdirError, match="is not writable: Read-only file system"):
        train.train_and_evaluate(tiny(data_dir), read_only)
    with pytest.raises(workdir_lib.WorkdirError, match="cannot create workdir"):
        train.train_and_evaluate(tiny(data_dir), os.path.join(read_only, "run"))
    # eval.py on a finished run whose disk became read-only: before evaluating.
    disk = mounts.tmpfs_or_skip(tmp_path / "disk", 4 << 20)
    workdir = copy_run(saved, tmp_path / "disk")
    mounts.remount_read_only(disk)
    with pytest.raises(workdir_lib.WorkdirError, match="is not writable: Read-only"):
        eval_lib.evaluate_checkpoint(workdir, num_batches=1)
    assert time.time() - start_time < 5


def test_a_workdir_that_is_a_file_or_device_is_one_line(data_dir, tmp_path):
    path = tmp_path / "afile"
    path.write_text("notes")
    match = r"^cannot create workdir .*: it exists and is not a directory$"
    for workdir in (str(path), os.devnull):  # makedirs alone says "File exists"
        with pytest.raises(workdir_lib.WorkdirError, match=match):
            train.train_and_evaluate(tiny(data_dir), workdir)
    assert path.read_text() == "notes"


# ------------------------------------------------------------------ one writer only


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    workdir = str(tmp_path / "run")
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, workdir_lib.__file__, workdir],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(workdir_lib.WorkdirError, match=rf"in use by .*pid {holder.pid}"):
        workdir_lib.Lock(workdir).acquire()
    holder.kill()  # SIGKILL: no cleanup, the lock file stays
    holder.wait()
    assert os.path.exists(os.path.join(workdir, workdir_lib.LOCK_FILE))
    with workdir_lib.Lock(workdir) as lock:
        assert lock.stale["pid"] == holder.pid
        with pytest.raises(workdir_lib.WorkdirError, match=rf"pid {os.getpid()}"):
            workdir_lib.Lock(workdir).acquire()  # a second open file: flock refuses it
    assert not os.path.exists(os.path.join(workdir, workdir_lib.LOCK_FILE))


LOCK_HOLDER = r"""
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("workdir", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.Lock(sys.argv[2]).acquire()
print("locked", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_a_second_run_is_refused_naming_the_first_which_finishes_quietly(watched):
    """Also the output of a run: few lines, what runs and where first, files last. The
    first run is `watched` (the module's `trained`, WATCHED's settings)."""
    steps = 20
    workdir = watched["workdir"]
    line = one_error_line(*watched["second"])
    assert f"pid {watched['pid']}" in line and f"host {socket.gethostname()}" in line, line
    assert "in use by another run" in line
    assert watched["returncode"] == 0, watched["err"]
    assert watched["err"] == ""  # no absl/Orbax/TFDS logs, no warnings
    lines = watched["head"] + watched["rest"].splitlines()
    assert len(lines) < 30 and not any(ABSL_LOG_LINE.search(x) for x in lines), lines
    assert workdir in lines[0] and lines[0].startswith("training a 1-layer")
    assert lines[1].startswith("compiling the train step") and watched["announced_s"] < 30
    assert sum(bool(re.match(r"step \d+/20  loss [\d.]+  ", x)) for x in lines) == 20
    assert sum(" eval on validation" in x for x in lines) == 2
    assert re.match(rf"done at step {steps}/{steps}: {steps} steps .*train loss [\d.]+, "
                    r"eval loss [\d.]+ on validation, [\d,]+ tokens/s$", lines[-3])  # fmt: skip
    assert lines[-2] == f"checkpoint: {os.path.join(workdir, 'checkpoints', str(steps))}"
    assert lines[-1].startswith(f"metrics: {os.path.join(workdir, 'metrics.jsonl')}")
    assert not os.path.exists(os.path.join(workdir, workdir_lib.LOCK_FILE))


# ------------------------------------------------------------------------- signals


def _wait_for_training(workdir, proc, deadline_s=120):
    end = time.time() + deadline_s
    while not any("loss" in r for r in metrics.read_jsonl(workdir)):
        assert proc.poll() is None and time.time() < end, proc.communicate()
        time.sleep(0.1)


def test_a_second_ctrl_c_dropped_inside_a_finalizer_still_aborts(capsys):
    """Python drops (and prints) an exception raised in a `__del__` or a garbage-collector
    callback; a second Ctrl-C whose handler runs there is kept, silently, and raised
    again at the loop's next check."""

    class Finalized:
        def __del__(self):
            stop._handle(signal.SIGINT, None)  # as if the signal landed in here

    before = signal.getsignal(signal.SIGINT), sys.unraisablehook
    with signals.Interrupts() as stop:
        stop._handle(signal.SIGINT, None)  # the first Ctrl-C: save at the end of the step
        stop.check()  # not aborted
        Finalized()  # dropped at once: its __del__ takes the second Ctrl-C
        with pytest.raises(KeyboardInterrupt):
            stop.check()
    assert "KeyboardInterrupt" not in capsys.readouterr().err
    assert (signal.getsignal(signal.SIGINT), sys.unraisablehook) == before  # restored


def test_an_evaluation_stops_at_the_first_signal_and_again_where_a_finalizer_dropped_it(
    capsys,
):
    """eval.py's handler: Ctrl-C or SIGTERM raises at once (nothing to save); one that
    Python drops inside a `__del__` is raised again by `check`, which runs per batch."""

    class Finalized:
        def __del__(self):
            stop._handle(signal.SIGTERM, None)  # as if the signal landed in here

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with signals.StopAtOnce() as stop:
        stop.check()  # no signal yet
        with pytest.raises(signals.Interrupted) as raised:
            stop._handle(signal.SIGINT, None)
        assert (raised.value.name, raised.value.exit_code) == ("Ctrl-C", 130)
    with signals.StopAtOnce() as stop:
        Finalized()  # dropped at once: its __del__ takes the signal, and Python drops it
        with pytest.raises(signals.Interrupted) as raised:
            stop.check()
        assert (raised.value.name, raised.value.exit_code) == ("SIGTERM", 143)
    assert "Interrupted" not in capsys.readouterr().err
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_a_signal_wrapped_by_the_code_it_landed_in_escapes_as_the_signal():
    """A second Ctrl-C whose `Aborted` was raised inside a JAX cache key's __eq__ (called
    from C++) came out as "Equality of global cache key led to an exception", exit 1, in
    one of 18 runs of `scripts/abort_stress.py`; an evaluation's `Interrupted` likewise."""
    for handlers, sigs, error in (
        (signals.Interrupts, (signal.SIGINT,) * 2, signals.Aborted),
        (signals.StopAtOnce, (signal.SIGTERM,), signals.Interrupted),
    ):
        with pytest.raises(error) as raised, handlers() as stop:
            try:
                for sig in sigs:
                    stop._handle(sig, None)
            except KeyboardInterrupt as e:
                raise ValueError("Equality of global cache key led to an exception") from e
        assert isinstance(raised.value.__cause__, ValueError)
    with pytest.raises(ValueError), signals.Interrupts() as stop:
        stop._handle(signal.SIGTERM, None)  # saves at the end of the step: nothing raised
        raise ValueError("a real error")


@pytest.mark.slow
def test_a_ctrl_c_while_the_command_starts_is_held_then_acted_on(capsys):
    """`hold_signals` (an entry point's first line): a Ctrl-C while JAX imports is held
    and raised by `release_signals` (main's first line); one that Python then drops where
    it lands (JAX's garbage-collector callback) is delivered again, quietly, until it
    lands; `StopAtOnce` (eval.py) or `Interrupts` (train.py) act on one recorded before
    they were entered."""

    class Finalized:
        def __del__(self):
            signals._record(signal.SIGINT, None)  # as if the signal landed in here

    before = signal.getsignal(signal.SIGINT), sys.excepthook, sys.unraisablehook
    try:
        signals.release_signals()  # nothing was held: nothing changes (main called by a test)
        assert signal.getsignal(signal.SIGINT) is before[0]
        signals.hold_signals()
        signals._hold(signal.SIGINT, None)  # held: nothing raised while modules import
        with pytest.raises(KeyboardInterrupt):
            signals.release_signals()
        signals.release_signals()  # acted on once
        with pytest.raises(KeyboardInterrupt):
            Finalized()  # dropped in its __del__: delivered again, so raised in here
            time.sleep(1)  # where it lands: after the sleep (the next bytecode boundary)
        signals._early.append(signal.SIGINT)  # one recorded, not yet acted on
        with pytest.raises(signals.Interrupted) as raised, signals.StopAtOnce():
            pass
        assert raised.value.exit_code == 130
        assert signal.getsignal(signal.SIGINT) is signals._record  # restored on the way out
        signals._early.append(signal.SIGINT)
        with signals.Interrupts() as stop:
            assert stop.signal == signal.SIGINT and not stop.aborted  # save, then stop
        with signals.StopAtOnce() as stop:  # acted on once
            stop.check()
    finally:
        signal.signal(signal.SIGINT, before[0])
        sys.excepthook, sys.unraisablehook = before[1:]
        signals._holding.clear()
    out, err = capsys.readouterr()
    assert "KeyboardInterrupt" not in err
    assert out == "Ctrl-C: saving at the end of this step, then exiting (Ctrl-C again to abort " \
        "without saving)\n"  # fmt: skip


def test_a_signal_held_while_the_command_starts_stops_it_with_one_line():
    """Ctrl-C or SIGTERM (a scheduler's) while the entry point imports: held, then one
    line and 128 + the signal as `main` starts; before, a SIGTERM there ended the
    process with no line at all. After the release a SIGTERM raises as Ctrl-C does."""
    code = ("import signal, sys; from rope_jax import signals; signals.hold_signals(); "
            "signal.raise_signal(int(sys.argv[1])); print('held'); signals.release_signals(); "
            "print('not reached')")  # fmt: skip
    for sig, name in ((signal.SIGINT, "Ctrl-C"), (signal.SIGTERM, "SIGTERM")):
        proc = subprocess.run([sys.executable, "-c", code, str(int(sig))], cwd=ROOT,
                              capture_output=True, text=True)  # fmt: skip
        assert (proc.returncode, proc.stdout, proc.stderr) == (
            128 + sig, "held\n", f"error: interrupted by {name}\n")  # fmt: skip
    code = (
        "import signal, time; from rope_jax import signals; signals.hold_signals(); "
        "signals.release_signals(); signal.raise_signal(signal.SIGTERM); time.sleep(30)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert (proc.returncode, proc.stderr) == (143, "error: interrupted by SIGTERM\n")


@pytest.mark.slow
def test_a_ctrl_c_dropped_where_it_landed_is_delivered_again_and_stops_the_command():
    """Outside `Interrupts`/`StopAtOnce`: Python dropped a Ctrl-C raised in a `__del__`
    (as in JAX's garbage-collector callback) and the command ran on."""
    code = ("import time; from rope_jax import signals; signals.hold_signals(); "
            "signals.release_signals()\n"
            "class Finalized:\n    def __del__(self): signals._record(2, None)\n"
            "Finalized(); print('dropped', flush=True); time.sleep(2); print('on')")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        130, "dropped\n", "error: interrupted by Ctrl-C\n")  # fmt: skip


def main_modules() -> dict[str, ast.Module]:
    """Every module of the package that runs as `python -m rope_jax.<module>`."""
    found = {}
    for path in glob.glob(os.path.join(ROOT, "rope_jax", "**", "*.py"), recursive=True):
        with open(path) as f:
            text = f.read()
        try:
            tree = ast.parse(text)
        except SystemError:  # CPython's spurious "AST constructor recursion depth mismatch"
            tree = ast.parse(text)  # in a threaded process (python/cpython#106905): again
        if any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
               for node in tree.body):  # fmt: skip
            found[os.path.relpath(path, ROOT)] = tree
    return found


def test_every_module_entry_point_releases_the_ctrl_c_held_while_its_packages_import():
    """`python -m rope_jax.<module>` holds a Ctrl-C from the package's first line
    (`signals.hold_for_module`); a `main` that did not release it would ignore Ctrl-C."""
    modules = main_modules()
    assert {"rope_jax/data/prepare.py", "rope_jax/experiments/sweep.py",
            "rope_jax/hf/__main__.py"} <= set(modules)  # fmt: skip
    for path, tree in modules.items():
        (main,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
        body = [n for n in main.body if not isinstance(n, ast.Expr)
                or not isinstance(n.value, ast.Constant)]  # fmt: skip
        assert ast.unparse(body[0]) == "signals.release_signals()", path


def test_hold_for_module_holds_only_for_a_module_of_the_package_while_it_is_located():
    code = ("import signal, sys; from rope_jax import signals; sys.argv[0] = '-m'; "
            "sys.orig_argv = ['python', '-m', sys.argv[1]]; signals.hold_for_module(); "
            "print(signal.getsignal(signal.SIGINT) is signals._hold)")  # fmt: skip
    held = {}
    for module in ("rope_jax.data.prepare", "pytest"):
        proc = subprocess.run([sys.executable, "-c", code, module], cwd=ROOT,
                              capture_output=True, text=True, check=True)  # fmt: skip
        held[module] = proc.stdout.strip()
    assert held == {"rope_jax.data.prepare": "True", "pytest": "False"}


@pytest.mark.slow
def test_a_ctrl_c_at_any_moment_of_a_module_commands_start_stops_it_with_one_line(tmp_path):
    """`python -m rope_jax.data.prepare` (whose parent package imports JAX): before, a
    Ctrl-C while the packages imported ended in a traceback, or in no line at all."""
    # From 0.6 s: Python's start is done, even on a loaded machine (as for eval.py above)
    for k, delay_s in enumerate((0.6, 0.8, 1.0, 1.3, 1.6, 2.0)):
        cmd = [sys.executable, "-m", "rope_jax.data.prepare", "--source=python_stdlib",
               "--tokenizer=train:1000", "--tokenizer_train_bytes=3000000", "--name=lib",
               f"--data_dir={tmp_path / str(k)}", "--quiet"]  # fmt: skip
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)  # fmt: skip
        time.sleep(delay_s)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert (proc.returncode, out) == (130, ""), (delay_s, proc.returncode, err)
        assert re.fullmatch(r"error: interrupted by Ctrl-C(; the same command resumes)?\n",
                            err), (delay_s, err)  # fmt: skip
        assert not os.path.exists(tmp_path / str(k) / "lib" / "metadata.json")
    quick_bpe = [a for a in cmd[1:-2] if not a.startswith("--tokenizer_train_bytes=")]
    quick_bpe.append("--tokenizer_train_bytes=200000")  # on to tokenizing (seconds) sooner
    proc = start([*quick_bpe, f"--data_dir={tmp_path / 'term'}"], None)  # progress lines
    try:
        cue = read_until(proc, r"^prepare: \d+/\d+ docs ", 120, "stderr")
        proc.send_signal(signal.SIGTERM)  # as a scheduler does, while it tokenizes
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    *progress, last = cue + err.splitlines()
    assert (proc.returncode, out, last) == (
        143, "", "error: interrupted by SIGTERM; the same command resumes"), err  # fmt: skip
    assert all(line.startswith("prepare: ") for line in progress)


def test_eval_progress_counts_batches_from_the_compiled_one_and_checks_before_each(capsys):
    clock = iter([0.0, 5.0, 6.0, 7.5, 8.0]).__next__  # start, then after batches 1-4
    progress = eval_lib.Progress(0, clock=clock)
    assert list(progress.watch("abcd", "eval step 20, validation @64", total=4)) == list("abcd")
    assert capsys.readouterr().err.splitlines() == [  # batch 1 compiles: the ETA's rate is 2-4's
        "eval step 20, validation @64: batch 2/4 in 0:00:06  ETA 0:00:02",
        "eval step 20, validation @64: batch 3/4 in 0:00:07  ETA 0:00:01",
        "eval step 20, validation @64: batch 4/4 in 0:00:08",
    ]
    clock = iter([0.0, 5.0, 16.0, 20.0, 27.0]).__next__  # every 10 s; no total: no ETA
    list(eval_lib.Progress(10, clock=clock).watch("abcd", "eval step 20, test"))
    assert capsys.readouterr().err.splitlines() == [
        "eval step 20, test: batch 2 in 0:00:16",
        "eval step 20, test: batch 4 in 0:00:27",
    ]
    clock = iter([0.0, 5.0, 6.0, 7.0]).__next__  # a continuation: 1 token, then 32 a call
    watch = eval_lib.Progress(0, clock=clock).watch
    list(watch("abc", "generate step 20", total=70, unit="token", per=32, start=1))
    assert capsys.readouterr().err.splitlines() == [
        "generate step 20: token 65/70 in 0:00:06  ETA 0:00:00",
        "generate step 20: token 70/70 in 0:00:07",
    ]
    calls = []

    def check():
        calls.append(len(calls))
        if len(calls) == 3:
            raise signals.Interrupted(signal.SIGINT)

    with pytest.raises(signals.Interrupted):
        for _ in eval_lib.Progress(10, check=check).watch("abcd", "x"):
            pass
    assert calls == [0, 1, 2]  # before batches 1, 2 and 3: the third is never scored


@pytest.mark.slow
def test_a_signal_dropped_while_text_is_generated_stops_it_before_the_text_is_printed(
    saved, capsys
):
    """eval.py --generate: `StopAtOnce.check` runs before the text is printed, so a
    signal Python dropped while the tokens were generated stops it there, not after."""
    calls = []

    def check():
        calls.append(True)
        raise signals.Interrupted(signal.SIGINT)

    with pytest.raises(signals.Interrupted):
        eval_lib.generate_text(saved, prompt="ROMEO:", max_new_tokens=3,
                               progress=eval_lib.Progress(10, check=check))  # fmt: skip
    assert calls == [True] and capsys.readouterr().out == ""


@pytest.mark.slow
def test_ctrl_c_or_sigterm_stops_an_evaluation_at_once_with_one_line_and_no_result(
    saved, tmp_path, cache_env
):
    workdir = copy_run(saved, tmp_path)
    for sig, name in ((signal.SIGINT, "Ctrl-C"), (signal.SIGTERM, "SIGTERM")):
        proc = start(["eval.py", f"--workdir={workdir}", "--num_batches=0",
                      "--seq_lens=32,128,512", "--progress_s=0"], cache_env)  # fmt: skip
        try:
            cue = read_until(proc, r"^eval step 20, validation @32: batch 2 in ", 120, "stderr")
            proc.send_signal(sig)
            sent = time.time()
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
        assert proc.returncode == 128 + sig and time.time() - sent < 10, (proc.returncode, err)
        *progress, last = cue + err.splitlines()
        assert all(re.match(r"eval step 20, validation @\d+: batch \d+ in ", x) for x in progress)
        assert last == f"error: interrupted by {name}; a result file is written only once complete"
        assert out == ""
        assert not glob.glob(os.path.join(workdir, "*eval_20*"))  # no result, no lock left
        assert not glob.glob(os.path.join(workdir, ".*lock*"))


@pytest.mark.slow
def test_ctrl_c_stops_a_long_continuation_between_its_decoding_calls(saved, tmp_path, cache_env):
    """eval.py --generate decodes `generate.CHUNK` tokens per compiled call and checks for
    a signal between calls. Before, one scan of every token ran to its end first: a
    Ctrl-C 15 s into 30,000 tokens took 223 s to stop it (results/faults/faults.md)."""
    workdir = copy_run(saved, tmp_path)
    proc = start(["eval.py", f"--workdir={workdir}", "--generate", "--prompt=ROMEO:",
                  "--max_new_tokens=200000", "--progress_s=0"], cache_env)  # fmt: skip
    try:
        cue = read_until(proc, r"^generate step 20: token 65/200,000 in ", 120, "stderr")
        proc.send_signal(signal.SIGINT)
        sent = time.time()
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and time.time() - sent < 10, (proc.returncode, err)
    *progress, last = cue + err.splitlines()
    assert all(re.match(r"generate step 20: token [\d,]+/200,000 in .*ETA", x) for x in progress)
    assert last == "error: interrupted by Ctrl-C" and out == ""


@pytest.mark.slow
def test_a_ctrl_c_at_any_moment_of_an_evaluations_start_stops_it_with_one_line(
    saved, tmp_path, cache_env
):
    """While eval.py imports, restores and compiles: before, a Ctrl-C there ended in a
    traceback, in SIGABRT (an extension's import interrupted, then imported again), or
    was dropped in JAX's garbage-collector callback and the evaluation ran to its end."""
    workdir = copy_run(saved, tmp_path)
    # From 0.6 s: Python's start and `hold_signals` are done, even on a loaded machine;
    # six lengths over the whole split outlast the longest delay.
    for delay_s in (0.6, 0.9, 1.2, 1.5, 2.0, 2.5):
        proc = start(["eval.py", f"--workdir={workdir}", "--num_batches=0",
                      "--seq_lens=32,64,128,256,512,1024"], cache_env)  # fmt: skip
        time.sleep(delay_s)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, (delay_s, proc.returncode, err)
        assert re.fullmatch(r"error: interrupted by Ctrl-C(; a result file is written only "
                            r"once complete)?\n", err), (delay_s, err)  # fmt: skip
        assert out == "" and not glob.glob(os.path.join(workdir, "*eval_20*"))


@pytest.mark.slow
def test_ctrl_c_and_sigterm_save_and_exit_0_and_a_second_ctrl_c_aborts_at_once(
    data_dir, tmp_path, cache_env, trained
):
    # The step functions of `trained` (same shapes and schedule: cached), with an
    # evaluation after every step so that a run lasts long enough to be signalled.
    fast = tiny(data_dir, **{"train.log_every_steps": 1, "train.ckpt_every_steps": 0,
                             "train.eval_every_steps": 1, "eval.num_batches": 100})  # fmt: skip
    slow = tiny(data_dir, **{"train.log_every_steps": 1, "train.ckpt_every_steps": 0,
                             "train.eval_every_steps": 1, "eval.num_batches": 400})  # fmt: skip
    # Three runs abort: Python's teardown under the step XLA is still running crashed
    # (SIGSEGV) or hung in some aborts of concurrent runs, before `cli.abort`.
    aborted = [f"twice{k}" for k in range(3)]
    runs = {"Ctrl-C": (str(tmp_path / "int"), signal.SIGINT, fast),
            "SIGTERM": (str(tmp_path / "term"), signal.SIGTERM, fast),
            **{name: (str(tmp_path / name), signal.SIGINT, slow) for name in aborted}}  # fmt: skip
    procs = {name: start(["train.py", *flags(config), f"--workdir={workdir}"], cache_env)
             for name, (workdir, _, config) in runs.items()}  # fmt: skip
    everyone = list(procs.values())
    try:
        sent = {}
        for name, (workdir, sig, _) in runs.items():
            _wait_for_training(workdir, procs[name])
            procs[name].send_signal(sig)
            if name in aborted:  # the second Ctrl-C while the first one's step still evaluates
                read_until(procs[name], r"^Ctrl-C: saving at the end of this step", 60)
                procs[name].send_signal(signal.SIGINT)
                sent[name] = time.time()
        for name in aborted:
            twice = procs.pop(name)
            out, err = twice.communicate(timeout=60)
            took = time.time() - sent[name]
            assert twice.returncode == 130 and took < 10, (twice.returncode, took, out, err)
            line = one_error_line(twice.returncode, out, err)
            assert line == "error: aborted by a second Ctrl-C; the newest checkpoint is kept"
            assert not os.path.exists(os.path.join(runs[name][0], workdir_lib.LOCK_FILE))

        abstract = harness.build(fast).abstract
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0 and err == "", err
            assert f"{name}: saving at the end of this step, then exiting" in out
            mngr = checkpoint.Manager(runs[name][0], read_only=True)
            saved = mngr.steps()
            assert len(saved) == 1 and 0 < saved[0] < 20
            assert f"{name}: saved step {saved[0]} in " in out
            assert re.search(rf"stopped \({name}\) at step {saved[0]}/20", out), out
            mngr.restore(saved[0], abstract)  # and it verifies
    finally:  # none left running (a hung one would take a core from the rest)
        for proc in everyone:
            if proc.poll() is None:
                proc.kill()


# -------------------------------------------------------------------- resume checks


def test_a_resume_that_changes_the_meaning_is_refused_listing_the_fields(data_dir, saved, tmp_path):
    workdir = copy_run(saved, tmp_path)
    before = listing(workdir)
    changed = tiny(data_dir, **{"optim.lr": 0.01, "data.seq_len": 64, "train.num_steps": 30,
                                "train.log_every_steps": 2})  # fmt: skip
    with pytest.raises(checkpoint.CheckpointError) as info:
        train.train_and_evaluate(changed, workdir)
    message = str(info.value)
    assert "(data.seq_len: 32 -> 64; optim.lr: 0.003 -> 0.01; train.num_steps: 20 -> 30)" in (
        message
    ), message
    assert "--allow_config_change" in message and "\n" not in message
    assert listing(workdir) == before  # nothing written


@pytest.mark.slow
def test_an_allowed_change_keeps_the_old_config_beside_the_new(data_dir, saved, tmp_path):
    workdir = copy_run(saved, tmp_path)
    old = open(os.path.join(workdir, "config.json")).read()
    changed = tiny(data_dir, **{"optim.lr": 0.01, "seed": 7})
    train.train_and_evaluate(changed, workdir, allow_config_change=True)
    assert open(os.path.join(workdir, "config.20.json")).read() == old
    saved = json.load(open(os.path.join(workdir, "config.json")))
    assert saved["optim"]["lr"] == 0.01 and saved["seed"] == 7


def test_a_run_that_fails_at_once_leaves_no_trace(data_dir, tmp_path):
    workdir = str(tmp_path / "new")
    with pytest.raises(ValueError, match="head_dim"):
        train.train_and_evaluate(tiny(data_dir, **{"model.head_dim": 15}), workdir)
    assert not os.path.exists(workdir)


# ----------------------------------------------------------------------- eval files


@pytest.mark.slow
def test_eval_never_overwrites_results_made_with_other_settings(saved, tmp_path):
    workdir = copy_run(saved, tmp_path)
    first = eval_lib.evaluate_checkpoint(workdir, num_batches=1)
    path = os.path.join(workdir, "eval_20.json")
    saved = json.load(open(path))
    assert saved["settings"] == {"seq_lens": [32], "split": "validation", "splits": [],
                                 "num_batches": 1, "rope_scaling": None,
                                 "max_position_embeddings": None}  # fmt: skip
    assert eval_lib.evaluate_checkpoint(workdir, num_batches=1) == first  # same: may rewrite
    start_time = time.time()
    with pytest.raises(ValueError) as info:
        eval_lib.evaluate_checkpoint(workdir, num_batches=2)
    assert time.time() - start_time < 2  # refused before restoring or evaluating
    assert "num_batches: 1 -> 2" in str(info.value) and "--tag" in str(info.value)
    assert json.load(open(path)) == saved
    tagged = eval_lib.evaluate_checkpoint(workdir, num_batches=2, tag="more")
    assert json.load(open(os.path.join(workdir, "eval_20_more.json")))["32"] == tagged["32"]
    eval_lib.evaluate_checkpoint(workdir, num_batches=2, overwrite=True)
    assert json.load(open(path))["settings"]["num_batches"] == 2


# ------------------------------------------------------------------------- fail early


def _corpus(path, *, empty_validation: bool) -> str:
    """One file: short lines, then one long last line that spans the held-out part(s)."""
    short = "".join(f"line {i} of a small corpus\n" for i in range(400))
    tail_fraction = 0.12 if empty_validation else 0.07  # of the whole file (90/5/5 cuts)
    long_line = "x" * int(len(short) * tail_fraction / (1 - tail_fraction)) + "\n"
    with open(path, "w") as f:
        f.write(short + long_line)
    return str(path)


def test_a_split_too_small_to_evaluate_fails_before_training(data_dir, tmp_path):
    no_validation = _corpus(tmp_path / "a.txt", empty_validation=True)
    no_test = _corpus(tmp_path / "b.txt", empty_validation=False)
    cases = [
        (tiny(data_dir, **{"data.files": no_validation}), "'validation'"),
        (tiny(data_dir, **{"data.files": no_test, "eval.splits": ("test",)}), "'test'"),
    ]
    for config, split in cases:
        workdir = str(tmp_path / "run")
        start_time = time.time()
        with pytest.raises(ValueError, match=f"split {split} of data.files="):
            train.train_and_evaluate(config, workdir)
        assert time.time() - start_time < 5 and not os.path.exists(workdir)


# ------------------------------------------------------------------ the command line


@pytest.mark.slow
def test_command_line_mistakes_are_one_line_with_a_suggestion(commands):
    for name in ("unknown_field", "missing_config"):
        assert commands[name][0] == 2, commands[name]
    assert one_error_line(*commands["unknown_field"][:3]) == (
        "error: unknown config field 'model.rope.sties' (in --config.model.rope.sties=qk); "
        "did you mean model.rope.sites?"
    )
    assert one_error_line(*commands["missing_config"][:3]) == (
        "error: config file 'configs/lmm.py' not found (--config=configs/lmm.py:size=tiny); "
        "did you mean configs/lm.py?"
    )
    assert not os.path.exists(commands["unknown_field"][3])  # nothing was created


@pytest.mark.slow
def test_an_evaluation_of_another_model_needs_a_tag_and_no_flag_is_ignored(commands):
    """eval_<step>.json is the run's own result (a sweep's table reads it): --rope_scaling,
    --max_position_embeddings or --data without --tag used to write it. A flag of the
    other mode (--seq_lens with --generate) used to be ignored."""
    assert commands["untagged_scaling"][0] == 2, commands["untagged_scaling"]
    assert one_error_line(*commands["untagged_scaling"][:3]) == (
        "error: --rope_scaling evaluates another model than the run's: add --tag=NAME (the "
        "result goes to eval_<step>_NAME.json; eval_<step>.json stays the run's own, the one "
        "its sweep's table reads)"
    )
    assert commands["generate_with_seq_lens"][0] == 2
    assert one_error_line(*commands["generate_with_seq_lens"][:3]) == (
        "error: --seq_lens is not read by --generate"
    )
    workdir = commands["untagged_scaling"][3]
    assert not glob.glob(os.path.join(workdir, "eval_*"))  # nothing written


# ----------------------------------------------------------- evaluations beside others


def _wait_for(predicate, proc, deadline_s=120, what="the condition"):
    end = time.time() + deadline_s
    while not predicate():
        if proc.poll() is not None or time.time() > end:
            out, err = proc.communicate() if proc.poll() is not None else ("", "")
            proc.kill()
            raise AssertionError(f"no {what}: {out[-2000:]} {err[-2000:]}")
        time.sleep(0.05)


@pytest.mark.slow
def test_two_concurrent_evals_with_other_settings_never_replace_each_other(
    saved, tmp_path, cache_env
):
    # Started together: whichever comes second is refused, whatever the timing.
    workdir = copy_run(saved, tmp_path, "together")
    result = os.path.join(workdir, "eval_20.json")
    procs = [start(["eval.py", f"--workdir={workdir}", f"--num_batches={n}"], cache_env)
             for n in (1, 2)]  # fmt: skip
    outcomes = [(p.wait(timeout=240), *p.communicate()) for p in procs]
    winners = [i for i, (rc, _, _) in enumerate(outcomes) if rc == 0]
    assert len(winners) == 1, outcomes
    loser = outcomes[1 - winners[0]]
    line = one_error_line(*loser)
    assert "eval_20.json" in line and "--tag=NAME" in line, line
    assert json.load(open(result))["settings"]["num_batches"] == winners[0] + 1

    # Made to overlap: the first holds its result's lock, stopped, while the second runs.
    workdir = copy_run(saved, tmp_path, "overlap")
    result = os.path.join(workdir, "eval_20.json")
    first = start(["eval.py", f"--workdir={workdir}", "--num_batches=1"], cache_env)
    lock = os.path.join(workdir, ".eval_20.json.lock")
    _wait_for(lambda: os.path.exists(lock), first, what="result lock")
    first.send_signal(signal.SIGSTOP)
    try:
        rc, out, err = run_all([["eval.py", f"--workdir={workdir}", "--num_batches=2"]],
                               cache_env)[0]  # fmt: skip
        since = json.load(open(lock))["since"]
    finally:
        first.send_signal(signal.SIGCONT)
    assert one_error_line(rc, out, err) == (
        f"error: {result} is being made by another evaluation (host {socket.gethostname()}, "
        f"pid {first.pid}, since {since}): wait for it to finish, or pass --tag=NAME to "
        "write eval_<step>_NAME.json beside it"
    )
    out, err = first.communicate(timeout=240)
    assert first.returncode == 0, err
    assert err == f"evaluated step 20 of {workdir}/checkpoints; wrote {result}\n"
    assert json.loads(out)["step"] == 20  # stdout: the JSON only
    assert json.load(open(result))["settings"]["num_batches"] == 1
    assert not os.path.exists(lock)


@pytest.mark.slow
def test_a_pinned_step_outlives_rotation_until_the_reader_closes(data_dir, saved, tmp_path):
    workdir = copy_run(saved, tmp_path)  # steps 10 and 20
    run = harness.build(tiny(data_dir))
    writer = checkpoint.Manager(workdir, keep=1)
    state, extra = writer.restore(20, run.abstract)
    reader = checkpoint.Manager(workdir, read_only=True)
    assert reader.pin_newest() == 20
    reader.pin(10)
    writer.save(30, state, extra)  # keep=1: 10 and 20 would go, but they are pinned
    assert writer.steps() == [10, 20, 30]
    reader.restore(10, run.abstract)  # still whole: it verifies
    reader.close()
    writer.save(40, state, extra)
    assert writer.steps() == [40] and sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == [
        "40"
    ]
    assert not os.path.exists(os.path.join(workdir, checkpoint.PINS_DIR))  # nothing left
    with pytest.raises(checkpoint.StepGone, match="step 30 .* deleted by the running trainer"):
        reader.pin(30)  # listed by the reader's Orbax before it went
    writer.close()


@pytest.mark.slow
def test_eval_of_a_live_run_reads_a_pinned_complete_step_quietly(data_dir, tmp_path, cache_env):
    live = tiny(data_dir, **{"train.num_steps": 5000, "train.ckpt_every_steps": 1,
                             "train.ckpt_keep": 1, "train.log_every_steps": 100})  # fmt: skip
    workdir = str(tmp_path / "live")
    trainer = start(["train.py", *flags(live), f"--workdir={workdir}"], cache_env)
    ckpt_dir = os.path.join(workdir, "checkpoints")
    _wait_for(lambda: os.path.isdir(ckpt_dir) and any(n.isdigit() for n in os.listdir(ckpt_dir)),
              trainer, what="first checkpoint")  # fmt: skip
    try:
        evaluated = []
        for _ in range(3):
            rc, out, err = run_all([["eval.py", f"--workdir={workdir}", "--num_batches=1"]],
                                   cache_env)[0]  # fmt: skip
            assert rc == 0 and trainer.poll() is None, err
            step = json.loads(out)["step"]
            assert err == (
                f"evaluated step {step} of {ckpt_dir} (train.py is running there, host "
                f"{socket.gethostname()}, pid {trainer.pid}, since "
                f"{json.load(open(os.path.join(workdir, 'run.lock')))['since']}: its newest "
                "complete checkpoint, pinned against rotation while it was read); wrote "
                f"{os.path.join(workdir, f'eval_{step}.json')}\n"
            ), err  # one line: no damaged-checkpoint message, no Orbax noise
            assert json.load(open(os.path.join(workdir, f"eval_{step}.json")))["step"] == step
            evaluated.append(step)
        steps_now = [int(n) for n in os.listdir(ckpt_dir) if n.isdigit()]
        assert min(steps_now) > max(evaluated)  # rotation went on, and took them afterwards
    finally:
        trainer.send_signal(signal.SIGTERM)
        out, err = trainer.communicate(timeout=120)
    assert trainer.returncode == 0 and err == "", err
    assert len(set(evaluated)) == 3, evaluated  # three different steps of a moving run


# ------------------------------------------------------------------ restarts and logs


def _event_steps(workdir) -> list[list[tuple[str, int]]]:
    """(tag, step) of every scalar in each TensorBoard event file under WD/tb."""
    from tensorboardX.proto import event_pb2

    out = []
    for path in sorted(glob.glob(os.path.join(workdir, "tb", "events.out.tfevents.*"))):
        data, scalars, at = open(path, "rb").read(), [], 0
        while at + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            scalars += [(v.tag, event.step) for v in event.summary.value]
        out.append(scalars)
    return out


@pytest.mark.slow
def test_a_restart_logs_every_step_once(data_dir, tmp_path, cache_env, trained):
    # An evaluation after every step (the shapes of `trained`: cached) makes a run slow
    # enough to kill at a chosen step: about 70 ms a step, and the kill follows the step's
    # progress line (written after its metrics row) within milliseconds.
    config = tiny(data_dir, **{"train.log_every_steps": 1, "train.eval_every_steps": 1,
                               "eval.num_batches": 50})  # fmt: skip
    workdir = str(tmp_path / "run")
    command = ["train.py", *flags(config), f"--workdir={workdir}"]

    def reached(step: int) -> bool:
        path = os.path.join(workdir, "metrics.jsonl")
        text = open(path).read() if os.path.exists(path) else ""
        return any(f'"step": {step},' in line and '"loss"' in line for line in text.splitlines())

    def killed_after(step: int) -> None:
        proc = start(command, cache_env)
        read_until(proc, rf"^step {step}/20 ", 120)  # its metrics row is written first
        proc.kill()  # SIGKILL: nothing is saved on the way out
        proc.communicate()
        assert reached(step)

    killed_after(3)  # before the first checkpoint (step 10)
    assert not os.path.isdir(os.path.join(workdir, "checkpoints")) or not [
        n for n in os.listdir(os.path.join(workdir, "checkpoints")) if n.isdigit()
    ]
    killed_after(12)  # after it
    assert checkpoint.Manager(workdir, read_only=True).steps() == [10]
    rc, out, err = run_all([command], cache_env)[0]
    assert rc == 0 and "resumed from step 10" in out, err
    rows = metrics.read_jsonl(workdir)
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 21))
    assert [r["step"] for r in rows if "eval/loss" in r] == list(range(1, 21))
    (events,) = _event_steps(workdir)  # one event file
    losses = [step for tag, step in events if tag == "loss"]
    assert losses == list(range(1, 21)), losses


# ----------------------------------------------------------------- preparing a corpus


def _text_corpus(path, files: int = 40, lines: int = 400) -> str:
    """`files` .txt documents of varied English-like lines (~25 KB each)."""
    os.makedirs(path, exist_ok=True)
    for i in range(files):
        with open(os.path.join(path, f"doc{i:03d}.txt"), "w") as f:
            f.writelines(f"line {j} of document {i}: {j * 7919 % 1000} words, {i * j}\n"
                         for j in range(lines))  # fmt: skip
    return os.path.join(str(path), "*.txt")


def _prepare_cmd(source, data_dir, *extra) -> list[str]:
    return ["-m", "rope_jax.data.prepare", f"--source={source}", "--tokenizer=bytes",
            "--name=x", f"--data_dir={data_dir}", "--shard_tokens=200000", *extra]  # fmt: skip


@pytest.mark.slow  # subprocesses
def test_a_second_preparation_of_one_dataset_waits_for_the_first(tmp_path):
    """The same prepare command twice at once: the second wrote into the first's staging
    files and ended in a traceback (FileNotFoundError ... .staging/train-00000.index.npy.tmp).
    Here the test holds the dataset's lock, as a first preparation does."""
    import fcntl

    source = _text_corpus(tmp_path / "corpus", files=4)
    out = tmp_path / "out"
    out.mkdir()
    with open(out / ".x.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        proc = subprocess.Popen([sys.executable, *_prepare_cmd(source, out)], cwd=ROOT, **pipes)
        first = proc.stderr.readline()  # while the lock is held
        waiting = f"another process is preparing {out}/x; waiting for it ({out}/.x.lock)"
        assert first == f"prepare: {waiting}\n", first
        assert not (out / "x" / "metadata.json").exists() and proc.poll() is None
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert stdout.strip() == f"{out}/x" and (out / "x" / "metadata.json").exists()
    again = subprocess.run([sys.executable, *_prepare_cmd(source, out)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert again.returncode == 0 and "is already prepared with these settings" in again.stderr


@pytest.mark.slow  # subprocesses
def test_a_full_disk_while_preparing_is_one_line_and_the_same_command_resumes(
    tmp_path, mounts, monkeypatch
):
    from rope_jax.data import preparation as prepare
    from rope_jax.data.preparation import space

    source = _text_corpus(tmp_path / "corpus")  # ~1 MB of text: 5 train shards of ~100 KiB
    disk = mounts.tmpfs_or_skip(tmp_path / "disk", 256 << 10)
    command = _prepare_cmd(source, disk)
    # The check before each shard: train shard 0 fits, a later one does not.
    proc = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True)
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    out = os.path.join(disk, "x")
    assert re.fullmatch(
        rf"error: not enough free space in {out}: shard train-0000\d needs about [\d.]+ KiB, "
        r"[\d.]+ KiB free \(about [\d.]+ [KM]iB still to write\); free some space or use "
        r"another --data_dir, then run the same command again: it resumes from the shards done",
        line,
    ), line
    done = sorted(f for f in os.listdir(os.path.join(out, ".staging")) if f.endswith(".json"))
    assert "train-00000.json" in done  # the shards written before are kept

    # A write that runs out of space (the check bypassed, as if the disk filled meanwhile).
    monkeypatch.setattr(space.Space, "check", lambda self, split, stem: None)
    settings = prepare.Settings(source=source, tokenizer="bytes", shard_tokens=200_000)
    with pytest.raises(prepare.OutOfSpace) as info:
        prepare.prepare(settings, "x", disk, progress=False)
    message = str(info.value)
    assert message.startswith(f"not enough free space in {out}: a write failed (No space left "
                              "on device") and "\n" not in message, message  # fmt: skip
    assert "the same command again: it resumes" in message
    assert not glob.glob(os.path.join(out, ".staging", "*.tmp"))  # no half shard left

    subprocess.run(["mount", "-o", "remount,size=8m", disk], check=True)  # room again
    proc = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "resuming train:" in proc.stderr  # complete shards kept, the rest written
    meta = json.load(open(os.path.join(out, "metadata.json")))
    total = sum(len(open(f, "rb").read()) for f in glob.glob(source))
    assert sum(s["bytes"] for s in meta["splits"].values()) == total


@pytest.mark.slow
def test_a_full_disk_while_train_py_prepares_is_one_line(data_dir, tmp_path, mounts, cache_env):
    disk = mounts.tmpfs_or_skip(tmp_path / "disk", 1 << 20)
    workdir = str(tmp_path / "run")
    rc, out, err = run_all([["train.py", "--config=configs/lm.py:size=tiny",
                             "--config.data.tokenizer=train:500", f"--config.data.data_dir={disk}",
                             f"--workdir={workdir}"]], cache_env)[0]  # fmt: skip
    progress = [x for x in err.splitlines() if x.startswith("prepare: ")]  # its own lines
    line = one_error_line(rc, out, "\n".join(x for x in err.splitlines() if x not in progress))
    assert "Traceback" not in err and len(progress) <= 2, err
    assert re.fullmatch(
        rf"error: not enough free space in {disk}/prepared/shakespeare-bpe500-\w+: shard "
        r"train-00000 needs about [\d.]+ [KM]iB, [\d.]+ KiB free \(about [\d.]+ MiB still to "
        r"write\); free some space or use another --data_dir, then run the same command "
        "again: it resumes from the shards done",
        line,
    ), line
    assert not os.path.exists(workdir)


@pytest.mark.slow  # subprocesses
def test_prepare_warns_of_binary_text_and_held_out_splits_too_small(tmp_path):
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "a.txt").write_bytes(bytes(range(256)) * 64)  # 16 KiB, half not UTF-8
    proc = subprocess.run([sys.executable, *_prepare_cmd(binary / "*.txt", tmp_path / "out"),
                           "--quiet"], cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    warnings = proc.stderr.strip().splitlines()
    assert warnings == [
        f"prepare: warning: 1 file(s) are not valid UTF-8 (binary?): 8,192 invalid byte "
        f"sequence(s) replaced by U+FFFD: {binary / 'a.txt'} (8,192)",
        "prepare: warning: the source has 1 document(s): each is cut at line ends into 90% "
        "train, 5% validation, 5% test; give 3 or more to hold out whole ones",
    ]  # fmt: skip
    # 60 short documents: 1% held out is one document each; --held_out_percent changes it.
    small = _text_corpus(tmp_path / "small", files=60, lines=2)
    args = _prepare_cmd(small, tmp_path / "out2", "--quiet")
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"the validation split holds a single document \([\d,]+ bytes\) of 60: "
                     r"raise --held_out_percent \(now 1\)", proc.stderr), proc.stderr  # fmt: skip
    proc = subprocess.run([sys.executable, *args, "--held_out_percent=10", "--name=y"],
                          cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    meta = json.load(open(tmp_path / "out2" / "y" / "metadata.json"))
    assert meta["splits"]["validation"]["documents"] > 1 and meta["splits"]["test"]["documents"] > 1


# ------------------------------------------------------------------ the command line, more


@pytest.mark.slow  # subprocesses
def test_settings_that_would_be_ignored_or_misread_are_one_line(tmp_path, cache_env):
    never = str(tmp_path / "never")
    cases = {
        "sections": ["train.py", "--config=configs/lm.py:size=tiny", f"--workdir={never}",
                     "--config.model.rope.sections=(3,5)"],
        "seq_lens": ["eval.py", f"--workdir={never}", "--seq_lens=abc"],
        "rope_scaling": ["eval.py", f"--workdir={never}", "--rope_scaling={rope_type: yarn}"],
        "progress_s": ["eval.py", f"--workdir={never}", "--progress_s=-1"],
        "num_batches": ["eval.py", f"--workdir={never}", "--num_batches=-2"],
        "max_new_tokens": ["eval.py", f"--workdir={never}", "--generate", "--max_new_tokens=0"],
        "temperature": ["eval.py", f"--workdir={never}", "--generate", "--temperature=-1"],
        "nan": ["eval.py", f"--workdir={never}", "--generate", "--temperature=nan"],
    }  # fmt: skip
    results = dict(zip(cases, run_all(list(cases.values()), cache_env), strict=True))
    assert one_error_line(*results["sections"]) == (
        "error: model.rope.sections=(3, 5) is not read by allocation='alternating' (it would "
        "be ignored); set allocation to one of sections, mrope_interleaved, videorope, or "
        "sections=()"
    )
    assert results["seq_lens"][0] == 2 and one_error_line(*results["seq_lens"]) == (
        "error: --seq_lens=abc must be positive integers, e.g. --seq_lens=256,1024"
    )
    line = one_error_line(*results["rope_scaling"])
    assert line.startswith("error: --rope_scaling={rope_type: yarn} is not valid JSON (") and (
        """e.g. --rope_scaling='{"rope_type": "yarn", "factor": 4}'""" in line
    ), line
    assert results["progress_s"][0] == 2 and one_error_line(*results["progress_s"]) == (
        "error: flag --progress_s=-1: -1.0 is not a non-negative number"
    )
    assert results["num_batches"][0] == 2 and one_error_line(*results["num_batches"]) == (
        "error: flag --num_batches=-2: -2 is not a non-negative integer"
    )
    # a continuation's flags are checked before a checkpoint is looked for
    assert results["max_new_tokens"][0] == 2 and one_error_line(*results["max_new_tokens"]) == (
        "error: flag --max_new_tokens=0: 0 is not a positive integer"
    )
    assert results["temperature"][0] == 2 and one_error_line(*results["temperature"]) == (
        "error: flag --temperature=-1: -1.0 is not a non-negative number"
    )
    assert results["nan"][0] == 2 and one_error_line(*results["nan"]) == (
        "error: --temperature=nan must be a number >= 0 (0 = greedy)"
    )
    assert not os.path.exists(never)


@pytest.mark.slow  # subprocesses
def test_a_run_too_big_for_this_machine_is_one_line_not_the_oom_killer(saved, data_dir, tmp_path,
                                                                        cache_env):  # fmt: skip
    """An evaluation at a million tokens (its scores alone are terabytes) and a training run
    at T = 100k stop before allocating, where they used to end in the kernel's OOM killer."""
    workdir, never = copy_run(saved, tmp_path), str(tmp_path / "never")
    big = tiny(data_dir, **{"data.seq_len": 100_000})
    results = run_all([["eval.py", f"--workdir={workdir}", "--seq_lens=1000000"],
                       ["train.py", *flags(big), f"--workdir={never}"]], cache_env)  # fmt: skip
    line = one_error_line(*results[0])
    pattern = (r"error: evaluation at seq_len=1000000 needs at least [\d.]+ GiB of host memory "
               r"\(state .*, logits .*, scores .*\), more than the [\d.]+ GiB free \(RAM and "
               r"swap\): use shorter --seq_lens .*")  # fmt: skip
    assert re.fullmatch(pattern, line), line
    assert not glob.glob(os.path.join(workdir, "eval_*.json"))
    line = one_error_line(*results[1])
    assert line.startswith("error: training needs at least ") and "train.microbatches" in line
    assert not os.path.exists(never)


def test_a_step_that_is_not_there_is_named_with_the_steps_that_are(saved, tmp_path):
    workdir = copy_run(saved, tmp_path)
    match = r"^no checkpoint at step 15 in .* \(steps there: 10, 20\)$"
    with pytest.raises(checkpoint.CheckpointError, match=match):
        eval_lib.evaluate_checkpoint(workdir, step=15, num_batches=1)


def test_a_split_that_is_not_there_is_named_before_an_existing_result_is(saved, tmp_path):
    """The file from an earlier evaluation used to answer first ('exists and was made with
    other settings'); the real mistake showed only on the second try, with --tag."""
    workdir = copy_run(saved, tmp_path)
    eval_lib.evaluate_checkpoint(workdir, num_batches=1)
    with pytest.raises(ValueError, match=r"^split 'bogus' is not in "):
        eval_lib.evaluate_checkpoint(workdir, num_batches=1, splits=["bogus"])
    with pytest.raises(ValueError, match="exists and was made with other settings"):
        eval_lib.evaluate_checkpoint(workdir, num_batches=2)  # a real difference: still said


def test_the_first_build_of_a_shipped_corpus_is_one_line_of_ours(tmp_path, capsys):
    config = data.default_config()
    config.data_dir = str(tmp_path / "tfds")
    data.ensure_built(config)  # TFDS prints "Downloading and preparing dataset Unknown size"
    where = os.path.join(config.data_dir, "rope_shakespeare", "1.0.0")
    assert capsys.readouterr().out == (
        f"built the rope_shakespeare dataset once, in {where} (nothing was downloaded; later "
        "runs read it)\n"
    )
    data.ensure_built(config)
    assert capsys.readouterr().out == ""


def test_every_flag_that_evaluates_another_model_or_dataset_needs_a_tag():
    for name, value, what in (("rope_scaling", {"rope_type": "linear", "factor": 2}, "model"),
                              ("max_position_embeddings", 512, "model"),
                              ("data", "python_stdlib", "dataset")):  # fmt: skip
        with pytest.raises(ValueError, match=f"^--{name} evaluates another {what} than the run's"):
            eval_lib.check_tagged("", **{name: value})
        eval_lib.check_tagged("x", **{name: value})
        eval_lib.check_tagged("", **{name: None})


@pytest.mark.slow  # subprocesses
@pytest.mark.parametrize("command", [["train.py"], ["eval.py"], ["-m", "rope_jax.hf"]])
def test_help_exits_0_and_names_no_directory_of_this_machine(command, tmp_path):
    """absl's --help exits 1, and under `python -m` heads the flags with the module's
    absolute path."""
    env = dict(os.environ, HOME=str(tmp_path))
    for flag in ("--help", "-?", "--helpfull"):
        proc = subprocess.run([sys.executable, *command, flag], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 0, (flag, proc.stdout[-500:], proc.stderr[-2000:])
        assert "--workdir" in proc.stdout, proc.stdout
        for where in (ROOT, sys.prefix, os.path.dirname(os.__file__)):
            assert where not in proc.stdout, (flag, where)


@pytest.mark.slow  # subprocesses
def test_preparation_workers_left_by_a_killed_command_exit_without_a_word(tmp_path):
    """kill -9 of `prepare --workers=2` while its workers tokenize: they printed four
    BrokenPipeError tracebacks and the resource tracker a leaked-semaphore warning onto
    the terminal the command had. Here stderr is a pipe: its end comes once every
    process that inherited it (workers, forkserver, resource tracker) has exited."""
    cmd = [
        sys.executable,
        "-m",
        "rope_jax.data.prepare",
        "--source=python_stdlib",
        "--tokenizer=train:1000",
        "--tokenizer_train_bytes=200000",  # the BPE in a second; tokenizing takes seconds
        "--name=x",
        f"--data_dir={tmp_path}",
        "--workers=2",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    lines = []
    for line in proc.stderr:  # the BPE is trained first (seconds), then the workers start
        lines.append(line)
        if "workers up" in line:
            break
    assert "workers up" in lines[-1], "".join(lines)
    time.sleep(1.0)  # tokenizing
    proc.kill()
    proc.wait()
    rest = []
    reader = threading.Thread(target=lambda: rest.extend(proc.stderr))
    reader.start()
    reader.join(timeout=60)
    assert not reader.is_alive(), "a process of the killed command is still running"
    assert not (tmp_path / "x" / "metadata.json").exists()
    assert "".join(rest) == "", "".join(rest)[-3000:]
