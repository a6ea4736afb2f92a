"""The training loop: `train_and_evaluate(config, workdir)` trains (or resumes) a run.

Restarting in the same workdir resumes from the newest checkpoint (parameters,
optimiser, data position). SIGTERM saves a checkpoint and returns cleanly; a
non-finite loss stops the run at that step and keeps the last good checkpoint.
"""

from __future__ import annotations

import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from rope_jax import data, sharding
from rope_jax.harness import checkpoint, feed, metrics, setup


class NonFiniteLoss(RuntimeError):
    """The loss became NaN/inf; the message names the step and the last good checkpoint."""


def print_dry_run(config) -> dict:
    report = setup.dry_run(config)
    gib = 2.0**30
    print(f"parameters: {report['parameters']:,}  devices: {report['devices']}  "
          f"mesh: {report['mesh']}")  # fmt: skip
    for key in ("params", "opt", "temp"):
        print(f"  {key:>6} per device: {report[key + '_bytes_per_device'] / gib:9.3f} GiB")
    return report


def train_and_evaluate(config, workdir: str) -> dict:
    """Trains (or resumes) `config` in `workdir`; returns the final eval metrics."""
    run = setup.build(config)
    data.prepare(config.data)
    checkpoint.save_config(workdir, config)
    ckpt = checkpoint.Manager(workdir, keep=config.train.ckpt_keep)
    train_iter = data.make_train_iterator(
        config.data,
        seed=config.seed,
        batch_size=config.data.global_batch_size // jax.process_count(),
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    writer = metrics.MetricWriter(workdir)
    stop = {"signal": None}
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: stop.update(signal=sig))
    try:
        with sharding.use_mesh(run.mesh, run.rules):
            start = ckpt.latest_step()
            if start is None:
                state, start = jax.jit(run.init_fn, out_shardings=run.shardings)(), 0
            else:
                state, extra = ckpt.restore(start, run.abstract)
                train_iter.set_state(extra["data"])
                logging.info("resumed from step %d in %s", start, ckpt.directory)
            batches = feed.Prefetch(train_iter, run.batch_sharding)  # placed ahead
            try:
                return loop(config, run, state, start, batches, ckpt, writer, stop)
            finally:
                batches.close()
    finally:
        signal.signal(signal.SIGTERM, previous)
        ckpt.wait()
        ckpt.close()
        writer.close()


def loop(config, run, state, start, batches, ckpt, writer, stop) -> dict:
    """Steps from `start` to `train.num_steps`: logs, evaluates, checkpoints, stops on
    SIGTERM (`stop["signal"]` set) after saving. Returns the last eval metrics."""
    num_steps = config.train.num_steps
    tokens_per_step = config.data.global_batch_size * config.data.seq_len
    pending, last_good, t0, t0_step, result = [], start, time.time(), start, None

    def evaluate(step):
        out = setup.evaluate(run, state["params"], config, split=config.data.eval_split,
                                num_batches=config.eval.num_batches)  # fmt: skip
        writer.write(step, out, prefix="eval/")
        logging.info("step %d  eval on %s: %s", step, config.data.eval_split, _fmt(out))
        return out

    for step in range(start + 1, num_steps + 1):
        batch = next(batches)  # on devices already
        state, step_metrics = run.train_step(state, batch)
        pending.append(step_metrics["loss"])
        stopping = stop["signal"] is not None  # read once: the signal may land mid-step
        log = step % config.train.log_every_steps == 0 or step == num_steps
        every = config.train.ckpt_every_steps
        save = step == num_steps or stopping or (every and step % every == 0)
        if log or save:  # one host sync per log/save: check every pending step's loss
            losses = np.asarray(jax.device_get(jnp.stack(pending)))
            bad = np.flatnonzero(~np.isfinite(losses))
            if bad.size:
                raise NonFiniteLoss(
                    f"non-finite loss ({losses[bad[0]]}) at step {step - len(losses) + 1 + bad[0]};"
                    f" last good checkpoint: step {last_good} in {ckpt.directory}"
                )
            pending.clear()
        if log:
            rate = (step - t0_step) * tokens_per_step / max(time.time() - t0, 1e-9)
            eta = (num_steps - step) * tokens_per_step / max(rate, 1e-9)
            writer.write(step, {"loss": losses[-1], "tokens_per_s": rate,
                                "grad_norm": step_metrics["grad_norm"]})  # fmt: skip
            logging.info("step %d/%d  loss %.4f  %.0f tok/s  ETA %s", step, num_steps,
                         losses[-1], rate, _hms(eta))  # fmt: skip
            t0, t0_step = time.time(), step
        if step == num_steps or (config.train.eval_every_steps
                                 and step % config.train.eval_every_steps == 0):  # fmt: skip
            result = evaluate(step)
        if save:
            ckpt.save(step, state, {"data": batches.get_state(), "step": step})
            last_good = step
        if stopping:
            logging.warning("SIGTERM: saved step %d, exiting", step)
            return result
    return result if result is not None else evaluate(start)


def _fmt(result: dict) -> str:
    return "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                     for k, v in result.items())  # fmt: skip


def _hms(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
