"""Sweep planning: a config's `sweep(add)` rows x seeds -> the list of jobs to run.

`plan(args)` checks everything a user can get wrong (rows, --set overrides, every
row's config) before anything runs, and returns one `Job` per (row, seed): the
train.py flags, the step it ends at, the eval lengths or splits. `status(job)` reads
a job's workdir: done, partial or new.
"""

from __future__ import annotations

import ast
import collections
import difflib
import inspect
import json
import os
import re
import shlex

from rope_jax import defaults
from rope_jax.experiments import failures

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # train.py
SETTINGS = ("model.num_layers", "model.embed_dim", "model.num_heads", "model.num_kv_heads",
            "model.head_dim", "model.mlp_dim", "data.name", "data.seq_len",
            "data.global_batch_size", "train.num_steps", "optim.lr")  # fmt: skip
# Settings shown only when they differ from the default (so older results still match).
OPTIONAL_SETTINGS = {"data.tokenizer": "", "data.packing": "stream"}


def run_dir(workdir: str, row: str, seed: int) -> str:
    """Where a sweep whose --workdir is `workdir` trains row `row`, seed `seed`."""
    return os.path.abspath(os.path.join(workdir, row, f"seed_{seed}"))


# One training job: train.py arguments, the step it ends at, eval lengths (T first).
# splits: held-out splits eval.py scores at T (config eval.splits; multimodal data).
Job = collections.namedtuple("Job", "row seed workdir flags final_step seq_lens splits")
# "{seed}" in a string value becomes each run's seed: a row can start from the run of the
# same seed of another sweep (--set train.init_from=runs/base/qk/seed_{seed})
SEED_FIELD = "{seed}"


class SweepError(ValueError):
    """A bad sweep request or a failed run; one readable line."""


def format_command(argv) -> str:
    """The shell command that reproduces this invocation."""
    return shlex.join(["python", "-m", "rope_jax.experiments.sweep", *argv])


def parse_value(text: str, like, kind: type | None = None):
    """Parses `text` as the type of the existing field value `like`, or, for an unset
    optional field (a placeholder, `like` None), as its declared type `kind`."""
    if like is None and kind in (bool, int, float, tuple, str):
        if text.strip().lower() in ("none", ""):
            return None
        like = kind()
    if isinstance(like, bool):
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{text!r} is not true or false")
        return text.lower() in ("true", "1")
    if isinstance(like, int | float):
        return type(like)(text)
    if isinstance(like, tuple):
        try:
            value = ast.literal_eval(text) if text.strip() else ()
        except (ValueError, SyntaxError):
            value = tuple(filter(None, text.strip("()").split(",")))
        return tuple(value) if isinstance(value, list | tuple) else (value,)
    return text


def flag_value(value) -> str:
    """`value` as ml_collections config_flags parses it back (`--config.x=<this>`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(tuple(value)) if isinstance(value, tuple | list) else str(value)


def split_sets(items) -> list[tuple[str, str]]:
    """`--set a.b=1,c.d=(1,2)` items -> [(key, text)]; commas split before `key=`."""
    out = []
    for part in (p for item in items for p in re.split(r",(?=[A-Za-z_][\w.]*=)", item)):
        key, sep, text = part.partition("=")
        if not sep or not key.strip():
            raise SweepError(f"--set {part!r} is not key=value (e.g. train.num_steps=200)")
        out.append((key.strip(), text))
    return out


def field_types(config, prefix="") -> dict:
    """Dotted path -> declared type of every leaf field (placeholders included)."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        out.update(field_types(value, name + ".") if hasattr(value, "items")
                   else {name: config.get_type(key)})  # fmt: skip
    return out


def leaves(config, prefix="") -> dict:
    """Dotted path -> value for every leaf field."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        out.update(leaves(value, name + ".") if hasattr(value, "items") else {name: value})
    return out


def apply(config, overrides: dict, where: str) -> None:
    """Sets dotted fields; unknown fields and wrong types are SweepErrors."""
    fields = leaves(config)
    for dotted, value in overrides.items():
        if dotted not in fields:
            close = difflib.get_close_matches(dotted, fields, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise SweepError(f"{where}: no config field {dotted!r}{hint}")
        try:
            config.update_from_flattened_dict({dotted: value})
        except (TypeError, ValueError) as e:
            raise SweepError(f"{where}: {dotted}={value!r}: {e}") from None


def load_rows(path: str, arg: str):
    """(module, base config, rows) from a config file with get_config(arg) and sweep(add)."""
    try:
        module = defaults.load_module(path)
    except ValueError as e:
        raise SweepError(f"--config: {e}") from None
    if not callable(getattr(module, "sweep", None)):
        raise SweepError(f"{path} defines no sweep(add); add one that calls "
                         "add(name='vo', **{'model.rope.sites': 'vo'}) per row")  # fmt: skip
    try:
        base = defaults.fill(module.get_config(arg) if arg else module.get_config())
    except (TypeError, ValueError) as e:
        raise SweepError(f"--config={path}:{arg}: {e}") from None
    rows = {}

    def add(name, **overrides):
        if not re.fullmatch(r"[\w.+-]+", name or "") or name in rows:
            raise SweepError(f"{path}: sweep() row name {name!r} is repeated or not a plain "
                             "directory name")  # fmt: skip
        rows[name] = overrides

    takes_arg = "arg" in inspect.signature(module.sweep).parameters
    module.sweep(add, arg=arg) if takes_arg else module.sweep(add)  # arg: the size etc.
    if not rows:
        raise SweepError(f"{path}: sweep(add) added no rows")
    return module, base, rows


def pick(text: str, known, flag: str) -> list[str]:
    """The comma-separated names in `text`, in order; a SweepError naming `flag` for a name
    not in `known`, none at all, or one listed twice."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SweepError(f"{flag}: unknown {', '.join(unknown) or '(none given)'}; "
                         f"known: {', '.join(known)}")  # fmt: skip
    if (twice := repeated(names)) is not None:
        raise SweepError(f"{flag} lists {twice} twice")
    return names


def repeated(names: list[str]) -> str | None:
    """The first name listed more than once, or None."""
    return next((n for n in dict.fromkeys(names) if names.count(n) > 1), None)


def plan(args) -> tuple[list[Job], dict]:
    """Checks everything a user can get wrong, then lists the runs; runs nothing."""
    path, _, arg = args.config.partition(":")
    module, base, rows = load_rows(path, arg)
    if args.rows:
        rows = {r: rows[r] for r in pick(args.rows, rows, "--rows")}
    sets, fields, types = {}, leaves(base), field_types(base)
    for key, text in split_sets(args.set):
        try:  # an unknown key stays text here; apply() below names it
            sets[key] = parse_value(text, fields.get(key), types.get(key))
        except ValueError as e:
            raise SweepError(f"--set {key}={text}: {e}") from None
    if "seed" in sets:
        raise SweepError("--set seed: the sweep sets each run's seed (--seeds=N runs 0..N-1)")
    for key in sets:
        setters = [r for r, o in rows.items() if key in o]
        if setters:
            raise SweepError(f"--set {key}: set per run by {', '.join(setters)} (leave those "
                             "rows out with --rows, or change the config arg instead)")  # fmt: skip
    apply(base, sets, "--set")
    if args.seeds < 1:
        raise SweepError(f"--seeds={args.seeds} must be >= 1")
    try:
        mults = [int(m) for m in args.extrapolate.split(",") if m.strip()]
    except ValueError:
        raise SweepError(f"--extrapolate={args.extrapolate!r} is not integers like 2,4") from None
    from rope_jax.harness import checks  # imports jax: only once the cheap checks passed
    from rope_jax.nn import model

    config_arg, runs = os.path.abspath(path) + (f":{arg}" if arg else ""), []
    kv_bytes = {}
    for row, overrides in rows.items():
        config = defaults.fill(base)
        apply(config, overrides, f"{path}: row {row}")
        try:
            config = checks.resolve(config)
        except ValueError as e:
            raise SweepError(f"row {row}: {e}") from None
        kv_bytes[row] = model.kv_cache_bytes_per_token(config.model)
        t, splits = int(config.data.seq_len), tuple(config.eval.splits)
        lens = [t] if splits else [t, *sorted({t * m for m in mults if m > 1})]
        flags = [f"--config.{k}={flag_value(v)}" for k, v in {**sets, **overrides}.items()]
        for seed in range(args.seeds):
            workdir = run_dir(args.workdir, row, seed)
            head = [f"--config={config_arg}", f"--workdir={workdir}", f"--config.seed={seed}"]
            seeded = [f.replace(SEED_FIELD, str(seed)) for f in flags]
            runs.append(Job(row, seed, workdir, head + seeded, config.train.num_steps, lens,
                            splits))  # fmt: skip
    if len({run.seq_lens[0] for run in runs}) > 1:
        raise SweepError("rows set different data.seq_len; the table compares them at one T")
    runs.sort(key=lambda run: run.seed)  # seed by seed: a sweep cut short has every row once
    fields = leaves(base)
    return runs, {
        "config": args.config, "title": (module.__doc__ or "").strip().split("\n")[0],
        "overrides": {r: {k: flag_value(v) for k, v in o.items()} for r, o in rows.items()},
        "settings": {k: fields[k] for k in SETTINGS if k in fields}
        | {k: fields[k] for k, v in OPTIONAL_SETTINGS.items() if fields[k] != v},
        "article_loss": getattr(module, "ARTICLE_LOSS", None), "seeds": list(range(args.seeds)),
        "eval_split": fields["data.eval_split"], "kv_bytes": kv_bytes,
    }  # fmt: skip


def status(run: Job) -> str:
    """done: eval json of the final step with every length; failed: not done, with a
    failure record (`failures`); partial: started; new."""
    path = os.path.join(run.workdir, f"eval_{run.final_step}.json")
    try:
        with open(path) as f:
            saved = json.load(f)
        if all(key in saved for key in columns(run)):
            return "done"
    except (OSError, ValueError):  # missing, or cut short by a kill
        pass
    if failures.read(run.workdir) is not None:
        return "failed"
    return "partial" if os.path.isdir(run.workdir) else "new"


def columns(run: Job) -> list[str]:
    """Keys of a run's eval json the report reads: context lengths, then splits."""
    return [*map(str, run.seq_lens), *run.splits]
