"""What a run prints: progress on stdout, warnings on stderr, library logs kept quiet.

  console.say("step 5/20  loss 5.95 ...")     # progress and results: stdout, flushed
  console.warn("checkpoint step 20 ...")      # "warning: ..." on stderr
  console.note("wrote WD/eval_20.json")       # beside data on stdout: stderr
  console.quiet_logs()                        # absl/Orbax/TFDS INFO logs off
  console.native_stdout_to_stderr()           # native code's prints (gloo's): stderr
  with console.into_log("WD/eval.log"): ...   # a tool's in-process evaluation: its log

Only process 0 of a multi-process run prints. The entry points call `quiet_logs`
unless the user asked for logs with `--verbosity` (`-v`); errors are theirs to print
(`error: ...`, one line, on stderr).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

import jax

# Libraries whose records are dropped in quiet mode: the harness reports their
# failures itself, as one line (an Orbax save failure logs a dozen ERROR lines).
_QUIET_SOURCES = (f"{os.sep}orbax{os.sep}", f"{os.sep}tensorflow_datasets{os.sep}",
                  f"{os.sep}grain{os.sep}")  # fmt: skip
_native_stdout_moved = False


def say(message: str) -> None:
    """One progress line on stdout (process 0 only)."""
    if jax.process_index() == 0:
        line(sys.stdout, message)


def warn(message: str) -> None:
    """One `warning: ...` line on stderr (process 0 only)."""
    if jax.process_index() == 0:
        line(sys.stderr, f"warning: {message}")


def note(message: str) -> None:
    """One line on stderr (process 0 only), for a command whose stdout is data (eval.py
    prints its JSON there): where the result went, which step it came from."""
    if jax.process_index() == 0:
        line(sys.stderr, message)


def line(stream, text: str) -> None:
    """`text` and its newline in one write, then flushed: `print` writes them apart, and
    a signal whose handler prints the next line (`cli.abort`) can land in between."""
    stream.write(text + "\n")
    stream.flush()


def hms(seconds: float) -> str:
    """`H:MM:SS` of a duration (progress lines' elapsed time and ETA)."""
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def native_stdout_to_stderr() -> None:
    """From now on what native code writes on file descriptor 1 goes to stderr, while
    Python's prints (`sys.stdout`, `say`) keep the real stdout. Gloo, the CPU backend's
    cross-process collectives, prints "[Gloo] Rank i is connected to ..." there from
    every process, which would land in the middle of a command's data (eval.py's JSON).
    Once per process; a `sys.stdout` without a file descriptor (a test's) is left alone."""
    global _native_stdout_moved
    if _native_stdout_moved:
        return
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return
    sys.stdout.flush()
    kept = os.dup(fd)
    os.dup2(sys.stderr.fileno(), fd)
    encoding, errors = sys.stdout.encoding, sys.stdout.errors
    sys.stdout = open(kept, "w", buffering=1, encoding=encoding, errors=errors)  # noqa: SIM115
    _native_stdout_moved = True


class _DropLibraryRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(source in record.pathname for source in _QUIET_SOURCES)


def orbax_leftover(unraisable) -> bool:
    """An unraisable exception that is the checkpoint library's leftovers: a callback
    landing after its event loop closed, or one of Orbax's read coroutines closed
    unfinished after a restore failed (it raises from its GeneratorExit). The failure
    itself is reported as one line; these would add pages of "Exception ignored"."""
    error, code = unraisable.exc_value, getattr(unraisable.object, "cr_code", None)
    if isinstance(error, RuntimeError) and "Event loop is closed" in str(error):
        return True
    return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


def _drop_closed_loop_noise(previous):
    """An unraisable-exception hook that drops `orbax_leftover`s and passes the rest."""

    def hook(unraisable):
        if not orbax_leftover(unraisable):
            previous(unraisable)

    hook.drops_closed_loops = True
    return hook


@contextlib.contextmanager
def into_log(path: str):
    """Inside, what is printed (stdout and stderr: results, notes, warnings) is appended
    to `path`, and library logs are quiet (`quiet_logs`): for a tool that evaluates in
    its own process between its progress lines, as eval.py's output goes to its log."""
    quiet_logs()
    with open(path, "a") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        yield f


def quiet_logs() -> None:
    """absl logging at WARNING, Orbax/TFDS/Grain records and TFDS progress bars off,
    Orbax's leftover unraisable exceptions (`orbax_leftover`) off."""
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.WARNING)
    absl_logger = logging.getLogger("absl")
    if not any(isinstance(f, _DropLibraryRecords) for f in absl_logger.filters):
        absl_logger.addFilter(_DropLibraryRecords())
    for name in ("jax", "orbax", "tensorflow_datasets", "grain"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    if not getattr(sys.unraisablehook, "drops_closed_loops", False):
        sys.unraisablehook = _drop_closed_loop_noise(sys.unraisablehook)
    try:
        import tensorflow_datasets as tfds

        tfds.disable_progress_bar()
    except ImportError:  # pragma: no cover - tfds is a dependency
        pass
