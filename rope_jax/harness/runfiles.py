"""What a workdir holds beside its checkpoints: config.json (the run's config, in today's
layout with every field filled when read back) and tokenizer/ (the data's tokenizer;
evaluation and generation decode with it, and data of another tokenizer is refused).
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import jax
import ml_collections

from rope_jax import defaults
from rope_jax.data import tokenizers
from rope_jax.harness import workdir as workdir_lib
from rope_jax.harness.checkpoint import CheckpointError

CONFIG_FILE = "config.json"


TOKENIZER_DIR = "tokenizer"


def save_config(workdir: str, config, *, keep_old_as: int | None = None) -> str | None:
    """Writes config.json (process 0, atomically). With `keep_old_as`, an existing
    config.json is first copied to config.<keep_old_as>.json; returns that path."""
    path = os.path.join(workdir, CONFIG_FILE)
    kept = None
    if jax.process_index() != 0:
        return kept
    if keep_old_as is not None and os.path.exists(path):
        kept = os.path.join(workdir, f"config.{keep_old_as}.json")
        n = 1
        while os.path.exists(kept):
            kept, n = os.path.join(workdir, f"config.{keep_old_as}.{n}.json"), n + 1
        shutil.copy2(path, kept)
    workdir_lib.write_atomic(path, config.to_json_best_effort(indent=2, sort_keys=True))
    return kept


def _runs_below(directory: str) -> str:
    """Where runs lie one or two folders below `directory` (a sweep's ROW/seed_S), what
    to add to "not a training workdir": "; it holds N run(s), e.g. D/qk/seed_0"."""
    root = glob.escape(directory)
    runs = sorted(glob.glob(os.path.join(root, "*", CONFIG_FILE))
                  + glob.glob(os.path.join(root, "*", "*", CONFIG_FILE)))  # fmt: skip
    if not runs:
        return ""
    return f"; it holds {len(runs)} run(s), e.g. {os.path.dirname(runs[0])}"


def load_config(workdir: str) -> ml_collections.ConfigDict:
    """The run config saved in `workdir`, in today's layout with every field filled
    (`rope_jax.defaults`: fields added since the run was saved take their defaults,
    the values it used); unresolved, as a config file gives it."""
    path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.exists(path):
        raise CheckpointError(f"no {CONFIG_FILE} in {workdir!r}: not a training workdir"
                              + _runs_below(workdir))  # fmt: skip
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    try:
        return defaults.fill(defaults.migrate(raw))
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


def save_tokenizer(workdir: str, tok: tokenizers.Tokenizer) -> None:
    """Writes <workdir>/tokenizer (process 0; once: a resume checked it is the same)."""
    path = os.path.join(workdir, TOKENIZER_DIR)
    if jax.process_index() != 0 or os.path.isdir(path):
        return
    tmp = f"{path}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tok.save(tmp)
    os.replace(tmp, path)


def load_tokenizer(workdir: str) -> tokenizers.Tokenizer:
    """The run's tokenizer: <workdir>/tokenizer, or bytes for a run saved without one."""
    path = os.path.join(workdir, TOKENIZER_DIR)
    if not os.path.isdir(path):
        return tokenizers.ByteTokenizer()
    try:
        return tokenizers.load(path)
    except ValueError as e:
        raise CheckpointError(f"the tokenizer of {workdir!r}: {e}") from None


def check_tokenizer(workdir: str, tok: tokenizers.Tokenizer) -> None:
    """The data's tokenizer `tok` must be the one the workdir's checkpoints were made with."""
    if not os.path.exists(os.path.join(workdir, CONFIG_FILE)):
        return  # nothing trained here yet
    saved = load_tokenizer(workdir)
    if saved.name != tok.name or saved.vocab_size != tok.vocab_size:
        raise CheckpointError(
            f"{workdir!r} was trained with tokenizer {saved.name} ({saved.vocab_size} ids) "
            f"but the data's is {tok.name} ({tok.vocab_size} ids)"
        )
