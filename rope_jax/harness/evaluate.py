"""Evaluating a run's checkpoint: held-out metrics at any context length, or generation.

`evaluate_checkpoint` restores a checkpoint into the abstract target of the config
saved in the workdir and writes <workdir>/eval_<step>.json; `generate_text` decodes
a continuation of a prompt with a key/value cache.
"""

from __future__ import annotations

import json
import os

from absl import logging
from flax import nnx

from rope_jax import data
from rope_jax.harness import checkpoint, setup
from rope_jax.nn import generate


def restore(workdir: str, run, step: int | None, fallback: bool):
    """(step, state) of a checkpoint restored into the run's abstract target."""
    ckpt = checkpoint.Manager(workdir, read_only=True)
    try:
        if not ckpt.steps():
            raise checkpoint.CheckpointError(f"no checkpoints in {ckpt.directory}")
        if step is None and fallback:
            step, state, _ = ckpt.restore_latest_good(run.abstract)
        else:
            step = ckpt.latest_step() if step is None else step
            state, _ = ckpt.restore(step, run.abstract)
    finally:
        ckpt.close()
    return step, state


def evaluate_checkpoint(
    workdir: str,
    *,
    step: int | None = None,
    seq_lens=(),
    split: str | None = None,
    splits=None,
    num_batches: int | None = None,
    fallback: bool = False,
) -> dict:
    """Restores a checkpoint into an abstract target and evaluates it; writes JSON."""
    config = checkpoint.load_config(workdir)
    seq_lens = [int(t) for t in seq_lens] or [config.data.seq_len, *config.eval.seq_lens]
    if any(t <= 0 for t in seq_lens):
        raise ValueError(f"--seq_lens={seq_lens} must be positive")
    run = setup.build(config)
    step, state = restore(workdir, run, step, fallback)
    split = split or config.data.eval_split
    num_batches = config.eval.num_batches if num_batches is None else num_batches
    result = {"step": int(step), "split": split, "train_seq_len": config.data.seq_len}
    for seq_len in seq_lens:
        result[str(seq_len)] = setup.evaluate(
            run, state["params"], config, split=split, seq_len=seq_len, num_batches=num_batches
        )
        logging.info("step %d, seq_len %d: %s", step, seq_len, result[str(seq_len)])
    for name in config.eval.get("splits", ()) if splits is None else splits:
        result[name] = setup.evaluate(
            run, state["params"], config, split=name, num_batches=num_batches
        )
        logging.info("step %d, split %s: %s", step, name, result[name])
    path = os.path.join(workdir, f"eval_{step}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    return result


def generate_text(
    workdir: str,
    *,
    prompt: str,
    max_new_tokens: int = 200,
    step: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    fallback: bool = False,
) -> str:
    """Restores a checkpoint and returns `prompt` + its continuation, cut at the first EOS."""
    config = checkpoint.load_config(workdir)
    run = setup.build(config)
    step, state = restore(workdir, run, step, fallback)
    net = nnx.merge(run.graphdef, state["params"])
    ids = data.encode(prompt) if prompt else data.encode("", eos=True)  # EOS ends a document
    new = generate.generate(
        net, ids[None], max_new_tokens=max_new_tokens, temperature=temperature, seed=seed
    )[0]
    new = list(map(int, new))
    if data.EOS_ID in new:
        new = new[: new.index(data.EOS_ID)]
    text = prompt + data.decode(new)
    logging.info("step %d: %d new tokens", step, len(new))
    print(text)
    return text
