"""What train.py and eval.py share: flag parsing with one-line errors, and quiet logs.

  app.run(main, flags_parser=cli.parse_flags)

`--help` (`-h`, `-?`, `--helpshort`) prints the entry point's usage and its flags,
`--helpfull` every module's flags, on stdout with exit status 0 (absl exits 1) and
file paths relative to the repository (or to site-packages).

A bad command line (an unknown `--config.x` field, a config file that is not there,
a value of the wrong type, an unknown flag) is one line on stderr, `error: ...`, with
a suggestion where one is close ("did you mean model.rope.sites?"), and exit status
2, before anything is built. `--config.<field>=None` is accepted for a field that is
None already (a typed placeholder), so a whole config can be written out as flags.
Unless `--verbosity`/`-v` is given, absl, Orbax and TFDS logs are off
(`console.quiet_logs`).
"""

from __future__ import annotations

import contextlib
import difflib
import glob
import io
import os
import re
import sys

import jax
import ml_collections
from absl import app, flags
from ml_collections.config_flags import config_flags

from rope_jax.harness import console

FLAGS = flags.FLAGS
USAGE_ERROR = 2  # exit status of a bad command line
HELP = {"help", "h", "?", "helpshort", "helpfull"}  # --help etc.: the usage, exit 0
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fail(message: str, code: int = 1):
    """Prints `error: <message>` (one line) on stderr and exits with `code`.

    In a multi-process run the process ends at once (`abort`): Python's teardown would
    wait in JAX's distributed shutdown for processes that may be waiting for this one in
    a collective (up to its 300 s timeout, the allocation idle); ended, it lets the
    launcher stop the rest (`srun --kill-on-bad-exit`, or the others' heartbeat timeout).
    """
    if _several_processes():
        abort(message, code)
    _say_error(message)
    sys.exit(code)


def _several_processes() -> bool:
    """Whether this is one of several started processes (never starts a backend)."""
    return jax.distributed.is_initialized() and jax.process_count() > 1


def _say_error(message) -> None:
    console.line(sys.stderr, f"error: {' '.join(str(message).split())}")


def out_of_memory(error: Exception) -> str | None:
    """XLA's RESOURCE_EXHAUSTED (a device, or the host under XLA:CPU, could not allocate)
    as one line; None for any other error."""
    text = str(error).strip()
    if "RESOURCE_EXHAUSTED" not in text:
        return None
    return f"out of memory: {text.splitlines()[0]}"


def abort(message: str, code: int):
    """`fail` without the interpreter's teardown, for a run stopped mid-computation (a
    second Ctrl-C): XLA's threads may still be running the step it left, and tearing
    Python down under them can crash (SIGSEGV) or hang. Output is flushed first; what
    the run holds (the workdir lock) is released before this is called."""
    _say_error(message)
    sys.stdout.flush()
    os._exit(code)


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with every failure as one line and exit status 2; --help
    prints the usage and exits 0 (`print_help`)."""
    asked = [a.lstrip("-") for a in argv[1:] if a.startswith("-") and a.lstrip("-") in HELP]
    if asked:
        print_help(full="helpfull" in asked)
    try:
        _check_config_file(argv)
        rest = FLAGS(_drop_none_overrides(argv))
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001  (config_flags raises many types)
        fail(flag_error(argv, e), USAGE_ERROR)
    if FLAGS["verbosity"].using_default_value:
        FLAGS.verbosity = -1  # WARNING; also stops app.run raising it to INFO
        console.quiet_logs()
    return rest


def print_help(full: bool = False):
    """The usage (the main module's docstring) and its flags (`full`: every module's) on
    stdout, file paths made relative to the repository or site-packages; exits 0."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        app.usage(shorthelp=not full, writeto_stdout=True)
    print(readable_paths(text.getvalue()).rstrip("\n"))
    if not full:
        print("\nTry --helpfull to get a list of all flags.")
    sys.exit(0)


def readable_paths(text: str) -> str:
    """`text` without this machine's directories: paths under the repository relative
    to it, those under a site-packages from there."""
    text = text.replace(ROOT + os.sep, "")
    return re.sub(r"(?<![\w.])/\S*?/site-packages/", "", text)


def _drop_none_overrides(argv: list[str]) -> list[str]:
    """argv without `--config.<field>=None` where the field is None already (a typed
    placeholder): absl cannot parse None for it, and the override changes nothing (a
    whole config written out as flags has them)."""
    nones = [a for a in argv if re.match(r"^--?config\.[^=]+=None$", a)]
    if not nones:
        return argv
    config = _load_config(argv)
    if config is None:
        return argv
    keep = []
    for arg in argv:
        field = arg.split("=", 1)[0].split(".", 1)[1] if arg in nones else None
        if field is None or _value(config, field, missing=0) is not None:
            keep.append(arg)
    return keep


def _load_config(argv: list[str]):
    """The ConfigDict --config names (without its overrides), or None."""
    value = _config_arg(argv)
    if value is None:
        return None
    try:
        config = config_flags.ConfigFileFlagParser("config", lock_config=False).parse(value)
    except Exception:  # noqa: BLE001  (the flag parse reports it)
        return None
    return config if isinstance(config, ml_collections.ConfigDict) else None  # not an error stub


def _value(config, field: str, missing):
    node = config
    for part in field.split("."):
        if not hasattr(node, "items") or part not in node:
            return missing
        node = node[part]
    return node


def flag_error(argv: list[str], error: Exception) -> str:
    """One line for a failed parse: the unknown config field with the nearest real
    one, or the first line of what absl / the config file said."""
    unknown = _unknown_config_field(argv)
    if unknown:
        return unknown
    text = str(error).strip()
    if "Error whilst parsing config file" in text:  # the config's get_config raised
        last = [line.strip() for line in text.splitlines() if line.strip()][-1]
        last = re.sub(r"^(?:\w+\.)*\w*(?:Error|Exception): ", "", last)  # the message only
        return f"--config={_config_arg(argv)}: {last}"
    first = text.splitlines()[0] if text else type(error).__name__
    match = re.search(r"Unknown command line flag '([^']+)'", first)
    if match and "did you mean" not in first.lower():
        name = match.group(1)
        head, _, rest = name.partition(".")
        if rest and difflib.get_close_matches(head, ["config"], n=1):
            first += f"; did you mean --config.{rest}?"
        else:
            first += _did_you_mean(name, [n for n in FLAGS if len(n) > 1])
    return first


def _config_arg(argv: list[str]) -> str | None:
    """The value of --config in argv (`path[:arg]`), or None."""
    for i, arg in enumerate(argv):
        if re.match(r"^--?config=", arg):
            return arg.split("=", 1)[1]
        if re.match(r"^--?config$", arg) and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _check_config_file(argv: list[str]) -> None:
    value = _config_arg(argv)
    if value is None:
        return
    path = value.split(":", 1)[0]
    if path.endswith(".json"):  # config_flags would run it as Python: "name 'null' ..."
        raise ValueError(f"--config={value}: a config file is Python (configs/*.py); a run's "
                         f"saved config is read with --config=configs/saved.py:"
                         f"{os.path.dirname(path) or '.'}")  # fmt: skip
    if os.path.isfile(path):
        return
    directory = os.path.dirname(path) or "."
    candidates = sorted(glob.glob(os.path.join(directory, "*.py")))
    if not candidates and os.path.isdir("configs"):
        candidates = sorted(glob.glob(os.path.join("configs", "*.py")))
    candidates = [c for c in candidates if not os.path.basename(c).startswith("_")]
    hint = _did_you_mean(path, candidates) or (
        f"; config files: {', '.join(candidates)}" if candidates else ""
    )
    raise ValueError(f"config file {path!r} not found (--config={value}){hint}")


def _unknown_config_field(argv: list[str]) -> str | None:
    """`unknown config field ...; did you mean ...?` for the first --config.<field>
    that the config does not have, or None (also when the config cannot be loaded)."""
    config = _load_config(argv)
    if config is None:
        return None
    fields = dotted_fields(config)
    for arg in argv:
        match = re.match(r"^--?(?:no)?config\.([^=]+)", arg)
        if match and match.group(1) not in fields:
            field = match.group(1)
            return f"unknown config field {field!r} (in {arg}){_nearest_field(field, fields)}"
    return None


def _nearest_field(field: str, fields: list[str]) -> str:
    """`; did you mean a.b?` (a sibling if the section exists, else any field), or the
    fields of the section when none is close."""
    parent, _, leaf = field.rpartition(".")
    if parent and parent not in fields:
        return _did_you_mean(field, fields)
    siblings = [f.rpartition(".")[2] for f in fields if f.rpartition(".")[0] == parent]
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {parent + '.' if parent else ''}{close[0]}?"
    return f"; {parent or 'the config'} has: {', '.join(siblings)}"


def dotted_fields(config, prefix: str = "") -> list[str]:
    """Every field of a ConfigDict as a dotted path, sections included."""
    out = []
    for key, value in config.items():
        name = f"{prefix}{key}"
        out.append(name)
        if hasattr(value, "items"):
            out += dotted_fields(value, name + ".")
    return out


def _did_you_mean(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""
