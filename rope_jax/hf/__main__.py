r"""Hugging Face checkpoints from the command line (docs/hf.md).

  python -m rope_jax.hf export --workdir=runs/x [--step=500] --out=hf/x [--overwrite]
  python -m rope_jax.hf import --hf=path/to/model --workdir=runs/m [--config=configs/lm.py]

export: checkpoint --step (default the newest) of the run in --workdir as config.json,
model.safetensors, tokenizer.json (a byte-level run's: the same 259 ids) and
tokenizer_config.json (its special tokens by name), which
`transformers.AutoModelForCausalLM.from_pretrained` loads (LlamaForCausalLM; Qwen2 /
Qwen3 for q/k/v biases / q/k norms; Mistral for sliding windows on every layer,
GraniteSWA for sinks or sliding and full layers mixed). A run HF's classes cannot
express (rotation sites other than qk, tied K/V, learned rotations, NoPE layers, N-D
positions, sinks or windows with q/k/v biases or q/k norms) is refused with one line
naming the setting.

import: the HF model directory --hf as a run in --workdir (config.json, tokenizer/, a
step-0 checkpoint); --config gives its data, eval and mesh sections (default: every
field at its default, `run.default_config`, as configs/lm.py gives without an arg).
`eval.py --hf=DIR` does this itself.

A mistake (a missing file, a shape or dtype that does not fit, an unsupported
architecture or rope type) is one line on stderr, `error: ...`, exit status 1.
"""

from __future__ import annotations

from absl import app, flags
from ml_collections import config_flags

from rope_jax import signals
from rope_jax.harness import cli, console
from rope_jax.hf import run

FLAGS = flags.FLAGS
COMMANDS = ("export", "import")


def define_flags():
    flags.DEFINE_string("workdir", None, "The run directory (export: read; import: written).")
    flags.DEFINE_integer(
        "step", None, "export: the checkpoint step; default the newest.", lower_bound=0
    )
    flags.DEFINE_string("out", None, "export: the Hugging Face model directory to write.")
    flags.DEFINE_bool("overwrite", False, "export: replace a model already in --out.")
    flags.DEFINE_string("hf", None, "import: the Hugging Face model directory to read.")
    config_flags.DEFINE_config_file(
        "config",
        None,
        "import: the run config giving data/eval/mesh; default: the defaults (configs/lm.py's).",
    )


def main(argv):
    signals.release_signals()  # one that came while the modules imported: stops it here
    if len(argv) != 2 or argv[1] not in COMMANDS:
        cli.fail(f"give one command, {' or '.join(COMMANDS)}; got {argv[1:]}", cli.USAGE_ERROR)
    need = {"export": ("workdir", "out"), "import": ("hf", "workdir")}[argv[1]]
    for name in need:
        if not FLAGS[name].value:
            cli.fail(f"{argv[1]} needs --{name}", cli.USAGE_ERROR)
    try:
        if argv[1] == "export":
            run.export_run(FLAGS.workdir, FLAGS.out, step=FLAGS.step, overwrite=FLAGS.overwrite)
        else:
            config = FLAGS.config or run.default_config()
            console.say(run.import_run(FLAGS.hf, FLAGS.workdir, config))
    except ValueError as e:  # HFError, CheckpointError, config errors: one line
        cli.fail(e)
    except OSError as e:  # a write that failed part way (a full disk): config.json comes last
        cli.fail(f"{argv[1]} failed: {e.strerror or e}: {e.filename or ''} (nothing complete "
                 "was left there)")  # fmt: skip


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.parse_flags)
