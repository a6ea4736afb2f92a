"""Evaluating a run's checkpoint: held-out metrics at any context length, or generation.

`evaluate_checkpoint` restores a checkpoint into the abstract target of the config
saved in the workdir and writes <workdir>/eval_<step>[_<tag>].json; `generate_text`
decodes a continuation of a prompt with a key/value cache.

Before anything is restored or compiled: the workdir must be writable, every split to
score must hold tokens (`check_splits`), and an existing eval JSON of the same step and
tag must have been made with the same settings (seq_lens, split, splits, num_batches),
or else `overwrite` must be given: results made with other settings are never
replaced silently. The result file is locked from that check to its write
(`result_lock`), so a second evaluation of the same file at the same time is refused
at once instead of overwriting the first's result; it is written whole, and only once
every length and split is scored. A long evaluation reports its progress
(`Progress`, eval.py's --progress_s). On a live run (train.py running in
the workdir) the newest complete checkpoint is pinned until it is read: the trainer's
rotation deletes it only afterwards (`checkpoint.Manager.pin`). Where the result went,
and which step it came from, is one line on stderr (stdout holds the JSON).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re

import jax
import numpy as np
from absl import logging
from flax import nnx

from rope_jax import data, defaults, provenance, rotary
from rope_jax import pairs as pairs_lib
from rope_jax import scaling as scaling_lib
from rope_jax.data import sources
from rope_jax.harness import (
    checkpoint,
    checks,
    console,
    distributed,
    evals,
    hostmem,
    runfiles,
    setup,
)
from rope_jax.harness import workdir as workdir_lib
from rope_jax.harness.progress import Progress, progress_line  # noqa: F401 (eval.py's)
from rope_jax.nn import generate
from rope_jax.nn import model as model_lib

_RESULT_KEYS = ("step", "split", "train_seq_len", "settings", "code")


def pin_step(ckpt: checkpoint.Manager, step: int | None, live: bool) -> int:
    """`step`, or the newest step (on a `live` run the newest whose save has finished),
    pinned in the reader `ckpt`: a running trainer's rotation leaves it until it closes."""
    if step is None:
        step = ckpt.pin_newest(complete=live)
        if step is None:
            raise checkpoint.CheckpointError(f"no checkpoints in {ckpt.directory}")
        return step
    ckpt.check_step(step)
    ckpt.pin(step)
    return step


def restore(workdir: str, run, step: int | None, fallback: bool):
    """(step, state) of a checkpoint restored into the run's abstract target and verified.

    With `fallback` (and no `step`), damaged newer steps are skipped with a warning. On a
    live run (train.py running in `workdir`) the newest complete step is read, pinned
    against the trainer's rotation while it is read.
    """
    ckpt = checkpoint.Manager(workdir, read_only=True)
    try:
        return _restore(ckpt, run, step, fallback, workdir_lib.running_holder(workdir) is not None)
    finally:
        ckpt.close()


def _restore(ckpt: checkpoint.Manager, run, step: int | None, fallback: bool, live: bool):
    """`restore` through the reader `ckpt` (its pins hold the step until it closes)."""
    if step is None and fallback:
        if not ckpt.steps():
            raise checkpoint.CheckpointError(f"no checkpoints in {ckpt.directory}")
        step, state, _, skipped = ckpt.restore_latest_good(run.abstract)
        for bad, why in skipped:
            console.warn(f"skipped checkpoint step {bad}: {why}")
        return step, state
    step = pin_step(ckpt, step, live)
    try:
        state, _ = ckpt.restore(step, run.abstract)
    except checkpoint.CheckpointError as e:
        hint = "" if fallback else "; --fallback uses the newest intact step"
        raise checkpoint.CheckpointError(f"{e}{hint}") from e
    return step, state


def result_lock(workdir: str, path: str) -> workdir_lib.Lock:
    """The lock of one eval JSON, held from its check to its write: a second evaluation
    of the same file is refused at once, not left to overwrite the first's result."""

    def busy(_, holder):
        return (
            f"{path} is being made by another evaluation ({workdir_lib.describe_holder(holder)}"
            "): wait for it to finish, or pass --tag=NAME to write eval_<step>_NAME.json beside it"
        )

    name = f".{os.path.basename(path)}.lock"
    return workdir_lib.Lock(workdir, name=name, busy=busy, enabled=jax.process_index() == 0)


def _hold(stack: contextlib.ExitStack, lock: workdir_lib.Lock) -> None:
    """Takes `lock` (process 0) into `stack`; every process fails alike if it is held."""
    error = None
    try:
        stack.enter_context(lock)
    except workdir_lib.WorkdirError as e:
        error = e
    if distributed.any_process(error is not None):
        raise error or workdir_lib.WorkdirError(f"{lock.path}: held by another evaluation")


def check_splits(config, splits) -> None:
    """Every split in `splits` has a first evaluation batch with scored tokens.

    Reads one batch per split (the token streams are cached for the real evaluation),
    so a missing, empty or too-small split fails before anything compiles.
    """
    for split in dict.fromkeys(splits):
        batches = data.make_eval_iterator(
            config.data,
            split=split,
            batch_size=config.eval.batch_size,
            num_batches=1,  # the whole global batch: every process decides alike
        )
        first = next(iter(batches), None)
        if first is None or not np.asarray(first["weights"]).any():
            raise sources.DataSourceError(
                f"split {split!r} of {sources.describe(config.data)} has too few tokens to "
                "evaluate (it needs at least 2)"
            )


def eval_path(workdir: str, step: int, tag: str = "") -> str:
    """<workdir>/eval_<step>.json, or eval_<step>_<tag>.json."""
    if tag and not re.fullmatch(r"[A-Za-z0-9_.-]+", tag):
        raise ValueError(f"--tag={tag!r} may hold only letters, digits, '_', '.' and '-'")
    return os.path.join(workdir, f"eval_{step}{'_' + tag if tag else ''}.json")


def saved_settings(result: dict) -> dict:
    """The settings an eval JSON was made with (rebuilt from its keys for files written
    before settings were stored; their num_batches is unknown, None)."""
    if "settings" in result:
        return result["settings"]
    lengths = [int(k) for k in result if k.isdigit()]
    splits = [k for k in result if not k.isdigit() and k not in _RESULT_KEYS]
    return {"seq_lens": lengths, "split": result.get("split"), "splits": splits,
            "num_batches": None}  # fmt: skip


def with_rope_scaling(config, scaling=None, max_position_embeddings=None):
    """A copy of `config` under another context-scaling rule: `model.rope.scaling` (the
    rule alone) replaced; which pairs turn (`model.rope.pairs`) is the model's and stays.

    Parameters do not depend on the rule, so a checkpoint restores under any of them: this
    is how context extension is measured (train at T, evaluate at 4T under YaRN, ...).
    """
    if scaling is None and max_position_embeddings is None:
        return config
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError(
            f"--rope_scaling={scaling!r} must be a JSON object of rope_parameters keys"
        )
    if scaling is not None:
        try:
            scaling_lib.check_scaling(scaling, dim=None)
        except ValueError as e:
            raise ValueError(f"--rope_scaling: {e}") from None
    config = defaults.fill(config)  # a full, mutable copy
    own_length = config.model.rope.max_position_embeddings or config.data.seq_len
    with config.model.rope.ignore_type():
        if scaling is not None:
            rule = defaults.fill_model({"rope": {"scaling": scaling}}).rope.scaling
            config.model.rope.scaling = rule
        if max_position_embeddings is not None:
            config.model.rope.max_position_embeddings = max_position_embeddings
    config = checks.resolve(config)
    if max_position_embeddings is not None:
        _check_length_read(config, own_length, max_position_embeddings)
    return config


def _check_length_read(config, own_length: int, new: int) -> None:
    """A new `max_position_embeddings` that changes no rotation at any length (a rule that
    reads none: default, linear, llama3 given its original length) is a
    ValueError naming the flag, not a flag silently ignored."""
    if new == own_length:  # said again, for clarity
        return
    num_axes, head_dim = data.kind(config.data).num_axes, config.model.head_dim
    spec = model_lib.rotation(config.model, num_axes, train_seq_len=config.data.seq_len)
    own = dataclasses.replace(spec, max_position_embeddings=own_length)
    lengths = {own_length, new, own_length + 1, new + 1, 8 * max(own_length, new)}
    for n in sorted(lengths) if spec.scaling is not None else ():  # plain RoPE reads none
        tables = [
            rotary.pair_table(head_dim, s, num_axes=num_axes, seq_len=n)[0] for s in (spec, own)
        ]
        factors = [rotary.attention_factor(head_dim, s, seq_len=n) for s in (spec, own)]
        if not np.array_equal(*tables) or factors[0] != factors[1]:
            return
    raise ValueError(
        f"--max_position_embeddings={new} changes no rotation under rope_type="
        f"{spec.rope_type!r}, which reads no length here (the run's is {own_length}): give "
        "--rope_scaling with a rule that reads it (dynamic, yarn, longrope)"
    )


def with_pairs(config, pairs=None):
    """A copy of `config` turning other pairs (`model.rope.pairs` replaced, the context
    rule and the ladder kept): frequency surgery without training, e.g. a QK-trained
    model evaluated with only its fastest pairs turning (MHA2MLA's partial RoPE) or with
    its own per-head choice (rule "heads"). `pairs`: a `pairs.PairSpec` or a mapping of
    its fields; None returns `config` as it is. Errors name `model.rope.pairs`."""
    if pairs is None:
        return config
    try:
        spec = pairs_lib.PairSpec.of(pairs)
    except ValueError as e:
        raise ValueError(f"model.rope.{e}") from None
    config = defaults.fill(config)  # a full, mutable copy
    with config.model.rope.ignore_type():
        config.model.rope.pairs = defaults.fill_model({"rope": {"pairs": spec.config()}}).rope.pairs
    config = checks.resolve(config)
    model_lib.layer_rotations(
        config.model, data.kind(config.data).num_axes, train_seq_len=config.data.seq_len
    )  # fits the heads and layers
    return config


def with_data(config, name: str | None = None, data_dir: str | None = None):
    """A copy of `config` reading another dataset (`data.name`, `data.data_dir`), e.g. one
    part of the training corpus prepared with the same tokenizer; the tokenizer is
    checked against the run's before anything is restored."""
    if not name and not data_dir:
        return config
    config = defaults.fill(config)  # a full, mutable copy
    if name:
        config.data.name = name
    if data_dir:
        config.data.data_dir = data_dir
    return checks.resolve(config)


def with_answer_tokens(config, answer_tokens: int | None = None):
    """A copy of `config` whose example tasks answer within `answer_tokens` tokens
    (`eval.answer_tokens`; 0 = each task's own budget); `config` itself for None."""
    if answer_tokens is None:
        return config
    if isinstance(answer_tokens, bool) or not isinstance(answer_tokens, int) or answer_tokens < 0:
        raise ValueError(f"--answer_tokens={answer_tokens!r} must be a number of tokens >= 0 "
                         "(0 = each task's own budget)")  # fmt: skip
    config = defaults.fill(config)  # a full, mutable copy
    config.eval.answer_tokens = answer_tokens
    return checks.resolve(config)


def parse_seq_lens(values) -> list[int]:
    """`--seq_lens` as positive integers (strings from the command line, or ints); one
    line naming the flag otherwise."""
    try:
        lengths = [int(str(v).strip()) for v in values]
    except ValueError:
        lengths = []
    if len(lengths) != len(values) or any(t <= 0 for t in lengths):
        text = ",".join(str(v) for v in values)
        raise ValueError(f"--seq_lens={text} must be positive integers, e.g. --seq_lens=256,1024")
    return lengths


def parse_rope_scaling(text: str | None) -> dict | None:
    """`--rope_scaling` (a JSON object of rope_parameters keys) as a dict, or None."""
    if text is None:
        return None
    example = """e.g. --rope_scaling='{"rope_type": "yarn", "factor": 4}'"""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"--rope_scaling={text} is not valid JSON ({e.msg} at character {e.pos + 1}); {example}"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(f"--rope_scaling={text} must be a JSON object; {example}")
    return value


def check_existing(path: str, settings: dict, overwrite: bool) -> None:
    """Refuses (one line) to replace `path` if it was made with other settings."""
    if overwrite or not os.path.exists(path):
        return
    try:
        with open(path) as f:
            old = saved_settings(json.load(f))
    except (OSError, ValueError, AttributeError):
        return  # unreadable: nothing worth keeping
    always = ("rope_scaling", "max_position_embeddings")  # None there is a setting too
    diffs = [f"{k}: {old.get(k)!r} -> {v!r}" for k, v in settings.items()
             if (old.get(k) is not None or k in always) and old.get(k) != v]  # fmt: skip
    if diffs:
        raise ValueError(
            f"{path} exists and was made with other settings ({'; '.join(diffs)}): pass "
            "--tag=NAME to write eval_<step>_NAME.json beside it, or --overwrite to replace it"
        )


def eval_settings(config, *, seq_lens, split, splits, num_batches, rope_scaling,
                  max_position_embeddings, tasks, examples, other_data) -> dict:  # fmt: skip
    """What an evaluation is made with (recorded in its file): the arguments, with the
    run's config filling those not given (`tasks`: `eval.tasks`, `examples`:
    `eval.examples`)."""
    lengths = parse_seq_lens(seq_lens) or [checks.trained_length(config), *config.eval.seq_lens]
    settings = {"seq_lens": lengths,
                "split": split or config.data.eval_split,
                "splits": list(config.eval.splits if splits is None else splits),
                "num_batches": config.eval.num_batches if num_batches is None else num_batches,
                "rope_scaling": rope_scaling,
                "max_position_embeddings": max_position_embeddings}  # fmt: skip
    tasks = evals.parse(config.eval.tasks if tasks is None else tasks)
    if tasks != ("loss",):  # absent for the loss alone, as in files made before tasks
        settings["tasks"] = list(tasks)
    # each task's own settings (passkey_examples, examples): absent when it is not run
    settings.update(evals.settings(tasks, config.eval.examples if examples is None else examples))
    if other_data:  # likewise absent for training's own data
        settings["data"] = {"name": config.data.name, "data_dir": config.data.data_dir}
    return settings


def evaluate_checkpoint(
    workdir: str,
    *,
    step: int | None = None,
    seq_lens=(),
    split: str | None = None,
    splits=None,
    num_batches: int | None = None,
    fallback: bool = False,
    tag: str = "",
    overwrite: bool = False,
    rope_scaling: dict | None = None,
    max_position_embeddings: int | None = None,
    tasks=None,
    examples: int | None = None,
    data_name: str | None = None,
    data_dir: str | None = None,
    progress: Progress | None = None,
) -> dict:
    """Restores a checkpoint into an abstract target and evaluates it; writes JSON.

    `rope_scaling` (a dict of rope_parameters keys) evaluates under another context-
    scaling rule than training used; `max_position_embeddings` likewise. `data_name`
    (and `data_dir`) evaluate on another dataset than training's (`with_data`).
    `tasks` (default `eval.tasks`; `harness.evals`) are scored at every length with
    `examples` (default `eval.examples`) examples each where they have examples; their
    metrics share each length's entry; `splits` are scored by the loss at the training
    length. `progress` prints progress lines and checks for a signal per batch.

    The file (`eval_path`) also records the settings and the code (`provenance`); the
    returned dict is the same without them. Another model or data needs a `tag`.
    """
    check_tagged(tag, rope_scaling=rope_scaling, max_position_embeddings=max_position_embeddings,
                 data=data_name)  # fmt: skip
    config = with_rope_scaling(runfiles.load_config(workdir), rope_scaling, max_position_embeddings)
    config = with_data(config, data_name, data_dir)
    settings = eval_settings(config, seq_lens=seq_lens, split=split, splits=splits,
                             num_batches=num_batches, rope_scaling=rope_scaling,
                             max_position_embeddings=max_position_embeddings,
                             tasks=tasks, examples=examples,
                             other_data=bool(data_name or data_dir))  # fmt: skip
    seq_lens, split, splits, num_batches, tasks = _asked(settings)
    examples = config.eval.examples if examples is None else examples
    eval_path(workdir, 0, tag), workdir_lib.check_writable(workdir)  # a bad tag fails now
    # what was asked for must exist and fit before anything else is said of it (a split
    # that is not there, behind "the file exists with other settings", took two tries)
    distributed.process_0_first(data.ensure_built, config.data)  # no concurrent builds
    runfiles.check_tokenizer(workdir, data.kind(config.data).tokenizer())
    evals.check(config, tasks, split=split, lengths=seq_lens, examples=examples)
    run = setup.build(config)
    hostmem.check_eval(run, config, [*seq_lens, config.data.seq_len] if splits else seq_lens)
    check_splits(config, [split, *splits])
    live = workdir_lib.running_holder(workdir)  # train.py is running there now
    with contextlib.ExitStack() as stack:
        ckpt = checkpoint.Manager(workdir, read_only=True)
        stack.callback(ckpt.close)  # the pins go with it
        if step is not None or not fallback:  # the step is known: refuse at once
            step = pin_step(ckpt, step, live is not None)
            _hold(stack, result_lock(workdir, eval_path(workdir, step, tag)))
            check_existing(eval_path(workdir, step, tag), settings, overwrite)
        known = step
        step, state = _restore(ckpt, run, step, fallback, live is not None)
        ckpt.close()  # the state is in memory: rotation may take the step now
        path = eval_path(workdir, step, tag)
        if known is None:  # the step --fallback found
            _hold(stack, result_lock(workdir, path))
            check_existing(path, settings, overwrite)
        ctx = evals.Context(run, state["params"], config, split=split, num_batches=num_batches,
                            examples=examples, progress=progress, step=step)  # fmt: skip
        result = _score(ctx, tasks, seq_lens, splits)
        if progress is not None:
            progress.check()  # a signal dropped in the last batch: nothing is written
        if jax.process_index() == 0:
            code = provenance.describe(provenance.code_version())
            workdir_lib.write_atomic(
                path, json.dumps({**result, "settings": settings, "code": code}, indent=2)
            )
    console.say(json.dumps(result, indent=2))  # process 0 only
    console.note(f"evaluated step {step} of {ckpt.directory}{_live_note(live)}; wrote {path}")
    return result


def _asked(settings: dict) -> tuple:
    """(seq_lens, split, splits, num_batches, tasks) of an evaluation's settings."""
    tasks = evals.parse(settings.get("tasks", ("loss",)))
    return (*(settings[k] for k in ("seq_lens", "split", "splits", "num_batches")), tasks)


def _score(ctx: evals.Context, tasks, seq_lens, splits) -> dict:
    """The result of `evaluate_checkpoint`: every task at every length on `ctx.split`,
    then the loss of every split in `splits` at the training length."""
    config = ctx.config
    result = {"step": int(ctx.step), "split": ctx.split,
              "train_seq_len": checks.trained_length(config)}  # fmt: skip
    for seq_len in seq_lens:
        result[str(seq_len)] = evals.score(ctx, tasks, seq_len)
        logging.info("step %d, seq_len %d: %s", ctx.step, seq_len, result[str(seq_len)])
    for name in splits:
        result[name] = evals.score(dataclasses.replace(ctx, split=name), ("loss",), None)
        logging.info("step %d, split %s: %s", ctx.step, name, result[name])
    return result


def _live_note(live: dict | None) -> str:
    if live is None:
        return ""
    return (
        f" (train.py is running there, {workdir_lib.describe_holder(live)}: its newest "
        "complete checkpoint, pinned against rotation while it was read)"
    )


def check_tagged(tag: str, **changes) -> None:
    """A ValueError naming the first of `changes` (flag name -> value, None or "" when not
    given) that evaluates another model or dataset than the run's without a `tag`."""
    given = [name for name, value in changes.items() if value not in (None, "")]
    if given and not tag:
        flag = f"--{given[0]}"
        raise ValueError(
            f"{flag} evaluates {'another dataset' if given[0] == 'data' else 'another model'} "
            f"than the run's: add --tag=NAME (the result goes to eval_<step>_NAME.json; "
            "eval_<step>.json stays the run's own, the one its sweep's table reads)"
        )


def without_corpus(config):
    """A copy of `config` that reads no corpus (generation needs only the model, whose
    vocabulary the saved tokenizer vouches for): data as the byte default."""
    if data.kind(config.data).name == "multimodal":
        return config
    config = defaults.fill(config)
    byte_default = defaults.data()
    for key in ("name", "files", "tokenizer", "packing"):
        config.data[key] = byte_default[key]
    return checks.resolve(config)


def generate_text(
    workdir: str,
    *,
    prompt: str,
    max_new_tokens: int = 200,
    step: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    fallback: bool = False,
    progress: Progress | None = None,
    rope_scaling: dict | None = None,
    max_position_embeddings: int | None = None,
) -> str:
    """Restores a checkpoint and returns `prompt` + its continuation, cut at the first EOS;
    text is encoded and decoded with the run's own tokenizer (<workdir>/tokenizer).
    `rope_scaling` / `max_position_embeddings` decode under another context-scaling rule
    (as `evaluate_checkpoint`: a continuation past the training length under YaRN, ...).
    `progress` prints progress lines of a long continuation and checks for a signal
    between its decoding calls and before the text is printed (`signals.StopAtOnce.check`:
    a signal Python dropped while it generated stops it there)."""
    config = with_rope_scaling(runfiles.load_config(workdir), rope_scaling, max_position_embeddings)
    tok = runfiles.load_tokenizer(workdir)
    if tok.vocab_size != config.model.vocab_size:
        raise checkpoint.CheckpointError(
            f"the tokenizer of {workdir!r} has {tok.vocab_size} ids, the model "
            f"{config.model.vocab_size}"
        )
    run = setup.build(without_corpus(config), vocab_from_data=False)
    ids = tok.encode(prompt) if prompt else [tok.eos_id]  # EOS ends a document
    if isinstance(max_new_tokens, int) and max_new_tokens > 0:  # else generate's own line
        hostmem.check_generate(run, config, len(ids), max_new_tokens)
    step, state = restore(workdir, run, step, fallback)
    net = nnx.merge(run.graphdef, state["params"])
    watch = progress and functools.partial(
        progress.watch, what=f"generate step {step}", total=max_new_tokens, unit="token",
        per=generate.CHUNK, start=1,
    )  # fmt: skip
    new = generate.generate(
        net, np.asarray(ids, np.int32)[None], max_new_tokens=max_new_tokens,
        temperature=temperature, seed=seed, watch=watch,
    )[0]  # fmt: skip
    new = list(map(int, new))
    if tok.eos_id in new:
        new = new[: new.index(tok.eos_id)]
    text = prompt + tok.decode(new)
    logging.info("step %d: %d new tokens", step, len(new))
    if progress is not None:
        progress.check()
    console.say(text)  # process 0 only: every process decoded the same tokens
    return text
