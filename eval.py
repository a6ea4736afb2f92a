r"""Evaluates a checkpoint of a training run on held-out data.

  python eval.py --workdir=runs/x                       # newest checkpoint
  python eval.py --workdir=runs/x --step=500 --seq_lens=256,512,1024
  python eval.py --workdir=runs/x --fallback            # skip damaged newest steps
  python eval.py --workdir=runs/x --generate --prompt="ROMEO:" --max_new_tokens=200

Writes <workdir>/eval_<step>.json: per context length, loss (nats/token), perplexity,
bits per byte, token count and top-1 accuracy on --split. Context lengths beyond
training measure extrapolation. --splits (default `eval.splits`) adds one entry per
named split at the training length: the held-out generalisation splits of multimodal
data, with answer accuracy overall and per task.
With --generate it instead prints the prompt and its continuation (greedy, or sampled
with --temperature > 0), decoded with a key/value cache, up to the first EOS.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags, logging
from flax import nnx

from rope_jax import checkpoint, data, generate, training

FLAGS = flags.FLAGS


def define_flags():
    flags.DEFINE_string("workdir", None, "Training run directory.")
    flags.DEFINE_integer("step", None, "Checkpoint step; default the newest.")
    flags.DEFINE_list("seq_lens", [], "Context lengths; default training + eval.seq_lens.")
    flags.DEFINE_string("split", None, "Data split; default config.data.eval_split.")
    flags.DEFINE_list("splits", None, "Extra splits at the training length; default eval.splits.")
    flags.DEFINE_integer("num_batches", None, "Batches per length; 0 = whole split.")
    flags.DEFINE_bool("fallback", False, "If a checkpoint is damaged, use the newest good.")
    flags.DEFINE_bool("generate", False, "Print a continuation of --prompt instead.")
    flags.DEFINE_string("prompt", "", "Text to continue with --generate ('' = a new document).")
    flags.DEFINE_integer("max_new_tokens", 200, "Tokens (bytes) to generate.")
    flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.")
    flags.DEFINE_integer("seed", 0, "Sampling seed.")


def _restore(workdir: str, run, step: int | None, fallback: bool):
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
    run = training.build(config)
    step, state = _restore(workdir, run, step, fallback)
    split = split or config.data.eval_split
    num_batches = config.eval.num_batches if num_batches is None else num_batches
    result = {"step": int(step), "split": split, "train_seq_len": config.data.seq_len}
    for seq_len in seq_lens:
        result[str(seq_len)] = training.evaluate(
            run, state["params"], config, split=split, seq_len=seq_len, num_batches=num_batches
        )
        logging.info("step %d, seq_len %d: %s", step, seq_len, result[str(seq_len)])
    for name in config.eval.get("splits", ()) if splits is None else splits:
        result[name] = training.evaluate(
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
    run = training.build(config)
    step, state = _restore(workdir, run, step, fallback)
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


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS.workdir:
        sys.exit("error: --workdir is required")
    try:
        if FLAGS.generate:
            generate_text(
                FLAGS.workdir,
                prompt=FLAGS.prompt,
                max_new_tokens=FLAGS.max_new_tokens,
                step=FLAGS.step,
                temperature=FLAGS.temperature,
                seed=FLAGS.seed,
                fallback=FLAGS.fallback,
            )
            return
        evaluate_checkpoint(
            FLAGS.workdir,
            step=FLAGS.step,
            seq_lens=FLAGS.seq_lens,
            split=FLAGS.split,
            splits=FLAGS.splits,
            num_batches=FLAGS.num_batches,
            fallback=FLAGS.fallback,
        )
    except ValueError as e:  # CheckpointError, DataSourceError and config errors
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
