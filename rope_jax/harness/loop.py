"""The training loop: `train_and_evaluate(config, workdir)` trains (or resumes) a run.

Before anything compiles: the workdir is locked (one writer, `harness.workdir`) and
checked writable, the config is checked, every split the run will evaluate is checked
to hold tokens, and a resumed run's config is compared with its config.json
(`resume.check_resume`). config.json is written only once the run has started
(first step done, or checkpoint restored), so a run that fails at once leaves the
workdir as it was. Then the metric files drop what the checkpoint does not cover (rows
of later steps, from before a restart: `metrics.MetricWriter`), and provenance.jsonl
gains a line naming the code this start runs (`provenance.record_start`).

Restarting in the same workdir resumes from the newest checkpoint (parameters,
optimiser, data position), verified against its checksums; with `fallback`, damaged
newer steps are moved aside and the run resumes from the newest intact one. SIGTERM
and a first Ctrl-C save at the end of the current step and return cleanly; a second
Ctrl-C aborts at once (`signals.Aborted`). A non-finite loss stops the run at that
step, naming the newest checkpoint that verifies. A failed save stops the run at that
step (`checkpoint.SaveError`).

Output (stdout, process 0): a first line saying what runs and where its outputs go,
"compiling the train step...", a progress line per `train.log_every_steps`, the
evaluations, and a summary naming the checkpoint and metric files.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from rope_jax import data, provenance, sharding
from rope_jax.harness import (
    checkpoint,
    checks,
    checksums,
    console,
    distributed,
    evals,
    evaluate,
    feed,
    hostmem,
    metrics,
    resume,
    runfiles,
    setup,
    transfer,
)
from rope_jax.harness import workdir as workdir_lib
from rope_jax.signals import Interrupts


class NonFiniteLoss(RuntimeError):
    """The loss became NaN/inf; the message names the step and the last good checkpoint."""


def print_dry_run(config, *, sources: transfer.Sources | None = None) -> dict:
    """Prints the run's sizes, memory and cost plan (process 0 of several); `sources` as
    in `train_and_evaluate`."""
    # init_from=hf:DIR: the checkpoint's architecture; then filled, checked and frozen once,
    # with the data's vocabulary (the plan's FLOPs count its head)
    config = checks.settle_vocab(transfer.prepare(config, sources))
    report = setup.dry_run(config)
    gib = 2.0**30
    lines = [f"parameters: {report['parameters']:,}  devices: {report['devices']}  "
             f"mesh: {report['mesh']}"]  # fmt: skip
    for key in ("params", "opt", "temp"):
        lines.append(f"  {key:>6} per device: {report[key + '_bytes_per_device'] / gib:9.3f} GiB")
    if line := hostmem.dry_run_line(report):
        lines.append(f"  {line}")
    from rope_jax.harness import cost  # not at the top: `python -m rope_jax.harness.cost`

    lines += [f"  {line}" for line in cost.format_plan(config)]
    console.say("\n".join(lines))
    return report


def train_and_evaluate(config, workdir: str, *, fallback: bool = False,
                       allow_config_change: bool = False,
                       sources: transfer.Sources | None = None) -> dict | None:  # fmt: skip
    """Trains (or resumes) `config` in `workdir`; returns the final eval metrics.

    Args:
      fallback: resume from the newest intact checkpoint when newer ones are damaged
        (they are moved to <workdir>/damaged_checkpoints/).
      allow_config_change: resume although a field that changes what the checkpoints
        mean (`resume.RESUME_FIELDS`) differs from config.json; the old config is
        kept as config.<step>.json.
      sources: the readers of `train.init_from` values other than a workdir, by prefix
        (`transfer.Source`): train.py passes `rope_jax.hf.run.SOURCES` (hf:DIR).
    """
    # init_from=hf:DIR: the checkpoint's architecture; then filled, checked and frozen, once
    config = checks.resolve(transfer.prepare(config, sources))
    console.say(_headline(config, workdir))
    lock = workdir_lib.Lock(workdir, enabled=jax.process_index() == 0)
    with lock, Interrupts() as stop:
        if lock.stale:
            console.warn("took over the lock of a run that is gone "
                         f"({workdir_lib.describe_holder(lock.stale)})")  # fmt: skip
        try:
            return _train(config, workdir, stop, fallback, allow_config_change, sources)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
                raise workdir_lib.WorkdirError(
                    f"{e.strerror}: {e.filename or workdir} "
                    f"({workdir_lib.format_bytes(workdir_lib.free_bytes(workdir))} free)"
                ) from e
            raise


def _train(config, workdir, stop, fallback, allow_config_change, sources):
    workdir_lib.check_writable(workdir)
    if config.train.init_from:
        transfer.check(config.train.init_from, sources)
    distributed.process_0_first(data.ensure_built, config.data)  # no concurrent builds
    config = checks.settle_vocab(config)  # model.vocab_size from the data's tokenizer
    run = setup.build(config)
    hostmem.check_train(run, config)  # on CPU: a run that cannot fit is refused, not killed
    runfiles.check_tokenizer(workdir, data.kind(config.data).tokenizer())
    changes = resume.check_resume(workdir, config, allow_change=allow_config_change)
    train_iter = setup.train_iterator(config)
    evaluate.check_splits(config, [config.data.eval_split, *config.eval.splits])
    evals.check(config, config.eval.tasks, lengths=[config.data.seq_len],
                examples=config.eval.examples)  # fmt: skip
    ckpt = checkpoint.Manager(workdir, keep=config.train.ckpt_keep)
    session = _Session(config, run, workdir, ckpt, stop, changes)
    try:
        with sharding.use_mesh(run.mesh, run.rules):
            state, start = _restore_or_init(run, ckpt, train_iter, fallback,
                                            config.train.init_from, sources)  # fmt: skip
            if start:
                session.begin(start)
            batches = feed.Prefetch(train_iter, run.batch_sharding)  # placed ahead
            try:
                result = loop(session, state, start, batches)
            finally:
                batches.close()
    except BaseException:
        session.close(quietly=True)
        raise
    session.close()
    session.summary(result)
    return result


def _restore_or_init(run, ckpt, train_iter, fallback, init_from="", sources=None):
    """(state, step): the newest checkpoint (or with `fallback`, the newest intact one,
    the damaged ones moved aside), or a fresh state at step 0 (with `init_from`, holding
    that run's matching parameters, read with `sources`: `transfer`)."""
    for name, size in ckpt.remove_unfinished():  # a save killed part way: never read
        console.say(f"removed {name} in {ckpt.directory}, left by a save that was "
                    f"interrupted ({workdir_lib.format_bytes(size)})")  # fmt: skip
    steps = ckpt.steps()
    if not steps:
        state = jax.jit(run.init_fn, out_shardings=run.shardings)()
        if init_from:
            state, line = transfer.apply(state, init_from, sources)
            console.say(line)
        checkpoint.collect_garbage()  # the initialisation's garbage: gigabytes at 1b
        return state, 0
    try:
        state, extra = ckpt.restore(steps[-1], run.abstract)
        start = steps[-1]
    except checkpoint.CheckpointError as e:
        if not fallback:
            raise checkpoint.CheckpointError(
                f"{e}; --fallback resumes from the newest intact step"
            ) from e
        start, state, extra, skipped = ckpt.restore_latest_good(run.abstract)
        for bad, why in skipped:
            console.warn(f"{why}; moved it to {ckpt.set_aside(bad)}")
    if "data" in extra:
        train_iter.set_state(extra["data"])
    elif start:  # only an import's step 0 (`hf.run.import_run`) has none: nothing read yet
        raise checkpoint.CheckpointError(
            f"checkpoint step {start} in {ckpt.directory} holds no data position, so the "
            "run cannot go on where it stopped"
        )
    console.say(f"resumed from step {start} in {ckpt.directory}")
    return state, start


class _Session:
    """What one call of `train_and_evaluate` writes: config.json and the metric files
    (both only once the run has started), checkpoints, progress lines, the summary."""

    def __init__(self, config, run, workdir, ckpt, stop, changes):
        self.config, self.run, self.workdir, self.ckpt = config, run, workdir, ckpt
        self.stop, self.changes = stop, changes
        self.writer = None
        self.tokens_per_step = config.data.global_batch_size * config.data.seq_len
        self.t_start = time.time()
        self.compile_s = None  # the first step of this session: compile + run
        self.t_first = None  # when that step had finished
        self.t_end = None
        self.paused = 0.0  # seconds spent evaluating and saving, not training
        self.start = self.final_step = None
        self.last_loss = None
        self._mark = (self.t_start, 0, 0.0)  # (time, step, paused) of the last progress line

    def mark(self, step: int) -> None:
        """Starts the interval the next progress line's tokens/s is measured over."""
        self._mark = (time.time(), step, self.paused)

    def first_step_done(self, step: int) -> None:
        """The first step of this session compiled and ran: the run has started."""
        self.t_first = time.time()
        self.compile_s = self.t_first - self._mark[0]
        self.begin(self.start)
        self.mark(step)

    def log(self, step: int, loss: float, grad_norm) -> None:
        """One progress line and metrics record; tokens/s since the last one, leaving
        out time spent evaluating and saving."""
        t, at, paused = self._mark
        seconds = time.time() - t - (self.paused - paused)
        rate = (step - at) * self.tokens_per_step / max(seconds, 1e-9)
        self.write(step, {"loss": loss, "tokens_per_s": rate, "grad_norm": grad_norm})
        num_steps = self.config.train.num_steps
        console.say(f"step {step}/{num_steps}  loss {loss:.4f}  "
                    + _speed(rate, num_steps - step, self))  # fmt: skip
        self.mark(step)

    def step_done(self, step: int, paused_s: float) -> None:
        self.final_step, self.t_end = step, time.time()
        self.paused += paused_s

    def begin(self, step: int) -> None:
        """The run has started at `step`: write config.json, open the metric files."""
        if self.writer is not None:
            return
        kept = runfiles.save_config(
            self.workdir, self.config, keep_old_as=step if self.changes else None
        )
        runfiles.save_tokenizer(self.workdir, data.kind(self.config.data).tokenizer())
        moved = provenance.record_start(self.workdir, step)
        if moved and step:  # a resume whose later steps may not match one made without a move
            console.warn(f"step {step} resumes under other code or devices than the run's "
                         f"last start ({moved}); provenance.jsonl keeps each")  # fmt: skip
        if self.changes:
            console.warn(f"config changed at step {step} ({'; '.join(self.changes)}); "
                         f"the previous config is kept in {kept}")  # fmt: skip
        self.writer = metrics.MetricWriter(self.workdir, resumed_at=step)

    def write(self, step: int, values: dict, prefix: str = "") -> None:
        self.writer.write(step, values, prefix=prefix)

    def close(self, quietly: bool = False) -> None:
        closers = [self.ckpt.wait, self.ckpt.close]
        if self.writer is not None:
            closers.append(self.writer.close)
        for close in closers:
            if quietly:  # an error is already on its way: do not replace it
                with contextlib.suppress(Exception):
                    close()
            else:
                close()

    def summary(self, result: dict | None) -> None:
        """The last lines: where the run got to, its losses and speed, its files."""
        steps = self.final_step - self.start
        timed = steps - 1  # the first step compiled
        seconds = (self.t_end or time.time()) - (self.t_first or time.time()) - self.paused
        parts = [f"{steps} steps in {console.hms(time.time() - self.t_start)}"]
        if self.compile_s is not None:
            parts[0] += f" (compile {self.compile_s:.0f} s)"
        if self.last_loss is not None:
            parts.append(f"train loss {self.last_loss:.4f}")
        if result is not None:
            parts.append(f"eval loss {result['loss']:.4f} on {self.config.data.eval_split}")
        if timed > 0 and seconds > 0:
            parts.append(f"{timed * self.tokens_per_step / seconds:,.0f} tokens/s")
        how = f"stopped ({self.stop.name})" if self.stop.signal is not None else "done"
        console.say(f"{how} at step {self.final_step}/{self.config.train.num_steps}: "
                    + ", ".join(parts))  # fmt: skip
        ckpt_step = self.ckpt.latest_step()
        if ckpt_step is not None:
            console.say(f"checkpoint: {self.ckpt.step_dir(ckpt_step)}")
        if self.writer is not None:
            workdir = os.path.abspath(self.workdir)
            console.say(
                f"metrics: {os.path.join(workdir, 'metrics.jsonl')} "
                f"(TensorBoard: {os.path.join(workdir, 'tb')})"
            )


def loop(session: _Session, state, start: int, batches) -> dict | None:
    """Steps from `start` to `train.num_steps`: logs, evaluates, checkpoints, stops on
    SIGTERM / Ctrl-C (`session.stop.signal` set) after saving. Returns the last eval
    metrics."""
    config, run = session.config, session.run
    num_steps, every = config.train.num_steps, config.train.ckpt_every_steps
    pending, result = [], None
    session.start = session.final_step = start
    session.mark(start)

    def evaluate(step):
        ctx = evals.Context(run, state["params"], config, split=config.data.eval_split,
                            num_batches=config.eval.num_batches, examples=config.eval.examples,
                            step=step)  # fmt: skip
        out = evals.score(ctx, evals.parse(config.eval.tasks), None)  # the training length
        session.write(step, out, prefix="eval/")
        console.say(f"step {step}  eval on {config.data.eval_split}: {_fmt(out)}")
        return out

    if start < num_steps:
        console.say(f"compiling the train step ({_size(run)})...")
    several = jax.process_count() > 1
    for step in range(start + 1, num_steps + 1):
        session.stop.check()
        if session.stop.signal is not None and step == start + 1 and not several:
            console.say(f"{session.stop.name} before the first step: nothing to save")
            return result
        state, step_metrics = run.train_step(state, next(batches))  # batches: on devices
        pending.append(step_metrics["loss"])
        if step == start + 1:
            jax.block_until_ready(step_metrics["loss"])
            session.first_step_done(step)
        log = step % config.train.log_every_steps == 0 or step == num_steps
        stopping = session.stop.signal is not None  # read once: it may land mid-step
        if several:  # a signal may reach the processes at different steps: all stop at the
            stopping = log and distributed.any_process(stopping)  # first log step after it
        save = step == num_steps or stopping or (every and step % every == 0)
        if log or save:  # one host sync per log/save: check every pending step's loss
            session.last_loss = _checked_losses(pending, step, session)[-1]
            pending.clear()
        if log:
            session.log(step, session.last_loss, step_metrics["grad_norm"])
        t_pause = time.time()
        if step == num_steps or (config.train.eval_every_steps
                                 and step % config.train.eval_every_steps == 0):  # fmt: skip
            result = evaluate(step)
        session.stop.check()  # a second Ctrl-C during the step: no save
        if save:
            _save(session, state, step, batches)
        session.step_done(step, time.time() - t_pause)
        if stopping:
            console.say(f"{session.stop.name}: saved step {step} in {session.ckpt.directory}; "
                        "the same command resumes")  # fmt: skip
            break
    if result is None and session.stop.signal is None:
        result = evaluate(start)
    return result


def _checked_losses(pending: list, step: int, session: _Session) -> np.ndarray:
    """The losses of the steps up to `step` on the host; NonFiniteLoss at the first
    NaN/inf, naming the newest checkpoint that verifies."""
    losses = np.asarray(jax.device_get(jnp.stack(pending)))
    bad = np.flatnonzero(~np.isfinite(losses))
    if bad.size:
        at = step - len(losses) + 1 + bad[0]
        raise NonFiniteLoss(f"non-finite loss ({losses[bad[0]]}) at step {at}; "
                            f"{_last_good(session.ckpt, session.run)}")  # fmt: skip
    return losses


def _save(session: _Session, state, step: int, batches) -> None:
    """Checkpoints `step`, refusing non-finite parameters (they would not restore)."""
    bad = checksums.non_finite_params(state)
    if bad:
        raise NonFiniteLoss(f"parameter {bad} became NaN/inf at step {step}; "
                            f"{_last_good(session.ckpt, session.run)}")  # fmt: skip
    session.ckpt.save(step, state, {"data": batches.get_state(), "step": step})


def _speed(rate: float, steps_left: int, session: _Session) -> str:
    """`12,345 tok/s  ETA 0:01:02`, or the compile time on the first step's line."""
    if rate <= 0:
        return f"(first step, compile included: {session.compile_s:.1f} s)"
    eta = steps_left * session.tokens_per_step / rate
    return f"{rate:,.0f} tok/s  ETA {console.hms(eta)}"


def _last_good(ckpt, run) -> str:
    """Names the newest checkpoint that restores and verifies (checked now)."""
    step = ckpt.newest_intact(run.abstract)
    if step is None:
        return f"last good checkpoint: none in {ckpt.directory}"
    return f"last good checkpoint: step {step} in {ckpt.directory}"


def _headline(config, workdir: str) -> str:
    """The first line: what runs, and where its outputs go."""
    m, d = config.model, config.data
    source = d.files or d.name
    sites = m.rope.sites or "none (NoPE)"
    return (f"training a {m.num_layers}-layer D={m.embed_dim} decoder (rotary sites "
            f"{sites}) on {source} for {config.train.num_steps} steps; outputs in "
            f"{os.path.abspath(workdir)}")  # fmt: skip


def _size(run) -> str:
    count = setup.num_elements(run.abstract["params"])
    devices = jax.device_count()
    kind = jax.devices()[0].platform
    return f"{count / 1e6:.2f} M parameters, {devices} {kind} device{'s' * (devices > 1)}"


def _fmt(result: dict) -> str:
    return "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                     for k, v in result.items())  # fmt: skip
