r"""Evaluates a checkpoint of a training run on held-out data.

  python eval.py --workdir=runs/x                       # newest checkpoint
  python eval.py --workdir=runs/x --step=500 --seq_lens=256,512,1024
  python eval.py --workdir=runs/x --fallback            # skip damaged newest steps
  python eval.py --workdir=runs/x --splits=test --tag=test   # eval_<step>_test.json
  python eval.py --workdir=runs/x --seq_lens=128,512 --tasks=loss,passkey --examples=100
  python eval.py --workdir=runs/x --tasks=niah_single_1,vt,cwe --lengths=512,1024,2048 \
      --examples=100 --out=runs/x/ruler                # RULER-style suite: a cell per task, length
  python eval.py --workdir=runs/x --data=linux8k_docs --tag=docs   # another dataset
  python eval.py --workdir=runs/x --generate --prompt="ROMEO:" --max_new_tokens=200
  python eval.py --hf=path/to/hf_model --workdir=runs/m [--config=configs/lm.py] [--generate]

Writes <workdir>/eval_<step>.json (eval_<step>_<tag>.json with --tag): per context
length, loss (nats/token), perplexity, bits per byte, token count and top-1 accuracy
on --split, and the settings it was made with. Context lengths beyond training
measure extrapolation. --splits (default `eval.splits`) adds one entry per named
split at the training length: the held-out generalisation splits of multimodal data,
with answer accuracy overall and per task. An existing file made with other settings
is never replaced unless --overwrite. The checkpoint is verified against its checksums.
--data (and --data_dir) evaluate on another prepared dataset than training's, one with
the run's tokenizer (checked first), e.g. one part of the training corpus. --data,
--rope_scaling and --max_position_embeddings need --tag: eval_<step>.json is the run's
own result, the one its sweep's table reads. A flag of the other mode (--seq_lens with
--generate, --prompt without it) is refused, not ignored, and so is a
--max_position_embeddings that the rule in use reads at no length (default, linear).
--tasks (default `eval.tasks`, "loss") names the evaluation tasks of `harness.evals` scored
at every length: loss, passkey, and RULER's synthetic tasks (niah_single_1 ... niah_multiquery,
vt, cwe, fwe; "ruler" = all of them), which a model answers by greedy decoding; --examples
sets the examples per length of the tasks that have examples. --seq_lens and --lengths are
one setting (the first named like `eval.seq_lens`, the second like the suite's cells; the
committed pages' commands use both). eval_<step>.json is a checkpoint's own record, the one
a sweep's table reads; --out=DIR is a resumable directory for a long suite, its examples
and heatmaps: both exist because a sweep reads the first and a researcher the second.
With --out=DIR it runs the suite instead (`harness.suite`): DIR/results.json
(per task and length: the score, examples, settings, commit) and
DIR/examples/<task>_<length>.jsonl are written as each cell finishes, a rerun resumes at the
first unfinished cell, and DIR/results.md (task x length) and DIR/heatmap.png close it.
With --generate it instead prints the prompt and its continuation (greedy, or sampled
with --temperature > 0), decoded with a key/value cache, up to the first EOS; under
--rope_scaling a continuation past the training length decodes with that rule.
With --hf, a Hugging Face model directory is first imported into --workdir as a run at
step 0 (once; `rope_jax.hf`, docs/hf.md), whose data, eval and mesh sections come from
--config (default: the defaults, configs/lm.py's) and whose tokenizer is the model's tokenizer.json.
A long evaluation prints a progress line on stderr every --progress_s seconds. Ctrl-C
or SIGTERM stops it at once: one line on stderr, exit status 130 or 143; a result file
is written only when every length and split is scored, so none is left half-written.
Several processes run it like train.py (`srun python eval.py ...`; docs/cluster.md):
each scores its own rows of every batch, the numbers are those of one process.
"""

from __future__ import annotations

import os

from rope_jax import signals

if __name__ == "__main__":  # first: a Ctrl-C while JAX imports (seconds) waits for main
    signals.hold_signals()

import jax
from absl import app, flags
from ml_collections import config_flags

from rope_jax.experiments import suite_page
from rope_jax.harness import cli, console, distributed, evals, suite
from rope_jax.harness.evaluate import (
    Progress,
    check_tagged,
    evaluate_checkpoint,
    generate_text,
    parse_rope_scaling,
    parse_seq_lens,
)
from rope_jax.hf import run as hf_run

FLAGS = flags.FLAGS


def define_flags():
    flags.DEFINE_string("workdir", None, "Training run directory.")
    flags.DEFINE_integer("step", None, "Checkpoint step; default the newest.", lower_bound=0)
    flags.DEFINE_list("seq_lens", [], "Context lengths; default training + eval.seq_lens.")
    flags.DEFINE_list("lengths", [], "The same as --seq_lens (the suite's name for it).")
    flags.DEFINE_list("tasks", None, "Evaluation tasks (harness.evals); default eval.tasks; "
                      "'ruler' = every RULER task.")  # fmt: skip
    flags.DEFINE_integer("examples", None, "Examples per length of the example-based tasks; "
                         "default eval.examples.", lower_bound=1)  # fmt: skip
    flags.DEFINE_string("out", None, "Run the task suite into this directory (results.json, "
                        "examples/, results.md, heatmap.png); resumable.")  # fmt: skip
    flags.DEFINE_string("split", None, "Data split; default config.data.eval_split.")
    flags.DEFINE_integer(
        "answer_tokens",
        None,
        "With --out: the example tasks' answer budget in tokens; default eval.answer_tokens "
        "(0 = each task's own).",
    )
    flags.DEFINE_string(
        "data", None, "Another dataset (data.name) with the run's tokenizer; use with --tag."
    )
    flags.DEFINE_string("data_dir", None, "With --data: its data.data_dir (default the run's).")
    flags.DEFINE_list("splits", None, "Extra splits at the training length; default eval.splits.")
    flags.DEFINE_integer("num_batches", None, "Batches per length; 0 = whole split.", lower_bound=0)
    flags.DEFINE_float("progress_s", 10.0, "Seconds between progress lines on stderr "
                       "(0: every batch).", lower_bound=0.0)  # fmt: skip
    flags.DEFINE_bool("fallback", False, "If a checkpoint is damaged, use the newest good.")
    flags.DEFINE_string("tag", "", "Write eval_<step>_<tag>.json instead of eval_<step>.json.")
    flags.DEFINE_bool("overwrite", False, "Replace an eval JSON made with other settings.")
    flags.DEFINE_string(
        "rope_scaling",
        None,
        "JSON object replacing model.rope.scaling for "
        'this evaluation or continuation, e.g. \'{"rope_type": "yarn", "factor": 4}\'; '
        "an evaluation needs --tag.",
    )
    flags.DEFINE_integer(
        "max_position_embeddings",
        None,
        "Replaces model.rope.max_position_embeddings for this evaluation or continuation.",
        lower_bound=1,
    )
    flags.DEFINE_bool("generate", False, "Print a continuation of --prompt instead.")
    flags.DEFINE_string("prompt", "", "Text to continue with --generate ('' = a new document).")
    flags.DEFINE_integer("max_new_tokens", 200, "Tokens (bytes) to generate.", lower_bound=1)
    flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.", lower_bound=0.0)
    flags.DEFINE_integer("seed", 0, "Sampling seed.")
    flags.DEFINE_string(
        "hf", None, "A Hugging Face model directory, imported into --workdir first."
    )
    config_flags.DEFINE_config_file(
        "config",
        None,
        "With --hf: the run config giving data/eval/mesh; default: the defaults (configs/lm.py's).",
    )
    distributed.define_flags()


def main(argv):
    signals.release_signals()  # one that came while the modules imported: stops it here
    if len(argv) > 1:
        cli.fail(f"unexpected arguments: {argv[1:]}", cli.USAGE_ERROR)
    if not FLAGS.workdir:
        cli.fail("--workdir is required", cli.USAGE_ERROR)
    try:  # the flags absl cannot check: one line naming the flag, before anything starts
        check_modes()
        if FLAGS.temperature != FLAGS.temperature:  # nan passes absl's lower bound
            raise ValueError("--temperature=nan must be a number >= 0 (0 = greedy)")
        parse_seq_lens(lengths())
        asked_tasks()
        rope_scaling = parse_rope_scaling(FLAGS.rope_scaling)
        if not FLAGS.generate and not FLAGS.out:  # no eval_<step>.json written
            check_tagged(FLAGS.tag, rope_scaling=rope_scaling, data=FLAGS.data,
                         max_position_embeddings=FLAGS.max_position_embeddings)  # fmt: skip
    except ValueError as e:
        cli.fail(e, cli.USAGE_ERROR)
    distributed.start()  # several processes: before anything touches a device
    try:
        with signals.StopAtOnce() as stop:
            _run(Progress(FLAGS.progress_s, check=stop.check), rope_scaling)
    except signals.Interrupted as e:
        whole = "" if FLAGS.generate else "a result file is written only once complete"
        os._exit(signals.interrupted(e, whole))  # as `cli.abort`: no teardown under XLA
    except ValueError as e:  # CheckpointError, DataSourceError, WorkdirError, config errors
        cli.fail(e)
    except jax.errors.JaxRuntimeError as e:
        if (line := cli.out_of_memory(e)) is None:
            raise
        cli.fail(f"{line} (no result file is written)")


# flags one mode reads and the other would ignore (--rope_scaling and
# --max_position_embeddings are read by both)
EVALUATION_ONLY = ("seq_lens", "lengths", "split", "splits", "num_batches", "tag", "overwrite",
                   "data", "data_dir", "tasks", "examples", "out",
                   "answer_tokens")  # fmt: skip
GENERATION_ONLY = ("prompt", "max_new_tokens", "temperature", "seed")
SUITE_UNREAD = ("splits", "tag")  # the suite scores tasks at lengths, into --out
SUITE_ONLY = ("answer_tokens",)  # eval_<step>.json takes the run's eval.answer_tokens


def check_modes() -> None:
    """A flag given for the other mode (evaluation or --generate) is a ValueError naming
    it, not ignored."""
    wrong = GENERATION_ONLY if not FLAGS.generate else EVALUATION_ONLY
    if FLAGS.out and not FLAGS.generate:
        wrong = (*wrong, *SUITE_UNREAD)
    elif not FLAGS.generate:
        wrong = (*wrong, *SUITE_ONLY)
    given = [name for name in wrong if FLAGS[name].present]
    if given:
        mode = ("--generate" if FLAGS.generate else "the suite (--out)" if FLAGS.out
                else "an evaluation (without --generate)")  # fmt: skip
        raise ValueError(f"--{given[0]} is not read by {mode}")
    if FLAGS.seq_lens and FLAGS.lengths:
        raise ValueError("--seq_lens and --lengths are one setting: give one of them")


def lengths() -> list:
    """--lengths or --seq_lens (strings; checked by `parse_seq_lens`)."""
    return FLAGS.lengths or FLAGS.seq_lens


def asked_tasks() -> tuple[tuple[str, ...] | None, int | None]:
    """(tasks, examples) the flags ask for (None: the run's eval.tasks / eval.examples).
    A ValueError names an unknown task."""
    tasks = evals.parse(FLAGS.tasks) if FLAGS.tasks is not None else None
    return tasks, FLAGS.examples


def _run(progress, rope_scaling):
    if FLAGS.hf:
        config = FLAGS.config or hf_run.default_config()
        console.say(hf_run.import_run(FLAGS.hf, FLAGS.workdir, config))
    if FLAGS.generate:
        generate_text(
            FLAGS.workdir,
            prompt=FLAGS.prompt,
            max_new_tokens=FLAGS.max_new_tokens,
            step=FLAGS.step,
            temperature=FLAGS.temperature,
            seed=FLAGS.seed,
            fallback=FLAGS.fallback,
            progress=progress,
            rope_scaling=rope_scaling,
            max_position_embeddings=FLAGS.max_position_embeddings,
        )
        return
    tasks, examples = asked_tasks()
    if FLAGS.out:
        suite.run(FLAGS.workdir, FLAGS.out, tasks=tasks, lengths=lengths(), examples=examples,
                  step=FLAGS.step, split=FLAGS.split, num_batches=FLAGS.num_batches,
                  fallback=FLAGS.fallback, overwrite=FLAGS.overwrite, rope_scaling=rope_scaling,
                  max_position_embeddings=FLAGS.max_position_embeddings, data_name=FLAGS.data,
                  data_dir=FLAGS.data_dir, answer_tokens=FLAGS.answer_tokens,
                  progress=progress)  # fmt: skip
        if jax.process_index() == 0:
            console.note("wrote " + " and ".join(suite_page.write(FLAGS.out)))
        return
    evaluate_checkpoint(
        FLAGS.workdir,
        step=FLAGS.step,
        seq_lens=lengths(),
        split=FLAGS.split,
        splits=FLAGS.splits,
        num_batches=FLAGS.num_batches,
        fallback=FLAGS.fallback,
        tag=FLAGS.tag,
        overwrite=FLAGS.overwrite,
        rope_scaling=rope_scaling,
        max_position_embeddings=FLAGS.max_position_embeddings,
        tasks=tasks,
        examples=examples,
        data_name=FLAGS.data,
        data_dir=FLAGS.data_dir,
        progress=progress,
    )


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.parse_flags)
