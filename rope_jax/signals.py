"""How the entry points meet SIGTERM and Ctrl-C (SIGINT).

  signals.hold_signals()               # a script's first line, before JAX imports
  def main(argv):
      signals.release_signals()        # first thing in main: one that came stops it now
      ...                              # from here Ctrl-C and SIGTERM raise KeyboardInterrupt
      except KeyboardInterrupt as e:   # a command that resumes: one line, exit 130 (143)
          sys.exit(signals.interrupted(e, "the same command resumes"))
      with signals.Interrupts() as stop:   # train.py: the first signal saves, then stops
          ...  stop.signal, stop.name ...; stop.check() between steps
      with signals.StopAtOnce() as stop:   # eval.py: nothing to save: the first one stops
          for batch in batches: stop.check(); ...

Both are context managers that install their handlers (main thread only) and restore
the previous ones. Python runs a handler in the main thread between two bytecodes; when
those are inside a `__del__` or a garbage-collector callback (JAX runs one at every
collection), the exception the handler raises is printed ("Exception ignored in ...")
and dropped, and the program goes on as if no signal had come. So both remember what
they raised, keep the dropped copy quiet (`sys.unraisablehook`) and raise it again at
the caller's next `check()`; any other exception that escapes them once they raised
(the signal's, wrapped by the code it landed in) becomes theirs again. Outside them (an
entry point's start, or a command with nothing to save) a dropped signal is delivered
again until it lands.

While the entry point imports, Ctrl-C and SIGTERM are held, not acted on (`python -m
rope_jax.<module>` holds them from the package's first line, `hold_for_module`, as its
parent packages import JAX before the module's own first line): a KeyboardInterrupt in
the middle of an extension's initialisation can leave it half-initialised, and importing
it again then aborts the process (SIGABRT, "absl::log_internal::SetTimeZone() has already
been called") or the interrupt is dropped in JAX's callback and the command runs on; a
SIGTERM there (a scheduler's) ended the process with no line at all.

Standard library only, outside `rope_jax.harness` (whose package imports JAX), so that
an entry point can import it before anything slow.
"""

from __future__ import annotations

import _thread
import os
import signal
import sys
import threading

NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C"}
_early: list[int] = []  # signals of an entry point's start, not yet acted on
_holding: list[bool] = []  # [True] once `hold_signals` ran: this process is an entry point


def hold_signals() -> None:
    """For an entry point's first lines, before its slow imports (JAX's take seconds):
    a Ctrl-C or SIGTERM is recorded and nothing else until `release_signals`; from then
    on any KeyboardInterrupt that nothing catches ends the process with one line,
    `error: interrupted by Ctrl-C` (or SIGTERM), and exit status 130 (143), instead of a
    traceback."""
    for sig in NAMES:
        signal.signal(sig, _hold)
    _holding[:] = [True]
    sys.excepthook = _one_line_interrupt(sys.excepthook)
    sys.unraisablehook = _deliver_dropped_again(sys.unraisablehook)


def hold_for_module() -> None:
    """`hold_signals` when this process is `python -m rope_jax.<module>` and Python is
    still importing the module's parent packages (the package's `__init__` calls this;
    `sys.argv[0]` is "-m" until the module itself runs). Every such module's `main`
    begins with `release_signals` (tests/faults_test.py checks), so none stays held."""
    argv = getattr(sys, "orig_argv", [])
    module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
    if sys.argv[:1] == ["-m"] and module.split(".")[0] == "rope_jax":
        hold_signals()


def release_signals() -> None:
    """Ends `hold_signals`: a signal held meanwhile raises `Interrupted` now, and a later
    Ctrl-C or SIGTERM raises it at once, as Python's own handler raises KeyboardInterrupt
    for Ctrl-C (and is recorded: where Python drops it, it is delivered again;
    `Interrupts` and `StopAtOnce` act on one recorded before they are entered). Nothing
    where nothing was held (`main` called from a program or a test)."""
    if not _holding:
        return
    for sig in NAMES:
        signal.signal(sig, _record)
    if _early:
        sig, _early[:] = _early[0], []  # acted on here
        raise Interrupted(sig)


def interrupted(error: KeyboardInterrupt, hint: str = "") -> int:
    """For an entry point that caught the interrupt and ends: prints one line on stderr,
    `error: interrupted by Ctrl-C; <hint>` (or SIGTERM, from an `Interrupted`), and
    returns the exit status, 128 + the signal's number."""
    if not isinstance(error, Interrupted):
        error = Interrupted(signal.SIGINT)  # a plain KeyboardInterrupt: Ctrl-C's
    sys.stdout.flush()
    sys.stderr.write(f"error: interrupted by {error.name}{'; ' * bool(hint)}{hint}\n")  # one write
    sys.stderr.flush()
    return error.exit_code


def _say(message: str) -> None:
    """A line on stdout, safe inside a signal handler (no re-entry into a buffered print)."""
    try:
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), (message + "\n").encode())
    except (OSError, ValueError, AttributeError):  # stdout replaced (tests) or closed
        print(message, flush=True)


def _hold(sig, frame) -> None:
    _early.append(sig)


def _record(sig, frame) -> None:
    _early.append(sig)
    raise Interrupted(sig)


def _deliver_dropped_again(previous):
    """Outside `Interrupts` and `StopAtOnce` (whose own hook comes first), a signal that
    `_record` raised where Python drops it is delivered again, from a thread: it lands
    at a later point of the main thread (or is dropped and delivered again)."""

    def hook(unraisable) -> None:
        if not (_early and isinstance(unraisable.exc_value, KeyboardInterrupt)):
            return previous(unraisable)
        sig = _early.pop()  # `_record` appends it again when it lands
        again = threading.Timer(0.05, _thread.interrupt_main, (sig,))  # once this hook returned
        again.daemon = True
        again.start()

    return hook


def _one_line_interrupt(previous):
    def hook(kind, value, traceback) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            return previous(kind, value, traceback)
        os._exit(interrupted(value))  # as `cli.abort`: no teardown under XLA's threads

    return hook


class Interrupted(KeyboardInterrupt):
    """A signal that stops the command now: `name` ("Ctrl-C", "SIGTERM") and `exit_code`
    (128 + the signal's number, as a shell reports a process the signal ended)."""

    def __init__(self, sig: int):
        self.signal = sig
        super().__init__(self.name)

    @property
    def name(self) -> str:
        return NAMES.get(self.signal, "signal")

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signal)


class Aborted(KeyboardInterrupt):
    """A second Ctrl-C while training: abort without saving."""


class _Handlers:
    """Installs `_handle` for SIGTERM and SIGINT, and the hook that keeps a raised
    signal's dropped copy quiet; `check` raises it again."""

    def __init__(self):
        self.signal = None  # the first signal that came
        self.raised: KeyboardInterrupt | None = None  # what a handler raised
        self._previous = {}
        self._previous_hook = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in NAMES:
                self._previous[sig] = signal.signal(sig, self._handle)
            self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
            early, _early[:] = list(_early), []
            try:
                for sig in early:  # a Ctrl-C that came while the command started
                    self._handle(sig, None)
            except BaseException:
                self.__exit__()
                raise
        return self

    def __exit__(self, kind=None, value=None, traceback=None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._previous_hook is not None:
            sys.unraisablehook = self._previous_hook
        if self.raised is not None and kind is not None and not issubclass(kind, KeyboardInterrupt):
            # the handler's exception landed in code that wrapped it (a JAX cache key's
            # __eq__, called from C++, raised "Equality of global cache key led to an
            # exception"): what escapes is the signal's
            raise self.raised from value

    @property
    def name(self) -> str:
        return NAMES.get(self.signal, "signal")

    def check(self) -> None:
        """Raises again what a handler raised, in case Python dropped it where it landed."""
        if self.raised is not None:
            raise self.raised

    def _raise(self, error: KeyboardInterrupt):
        self.raised = error
        raise error

    def _unraisable(self, unraisable) -> None:
        if self.raised is not None and isinstance(unraisable.exc_value, KeyboardInterrupt):
            return  # the handler's exception, dropped where it landed: `check` raises it
        self._previous_hook(unraisable)

    def _handle(self, sig, frame) -> None:
        raise NotImplementedError


class Interrupts(_Handlers):
    """SIGTERM and a first Ctrl-C ask the training loop to save after the current step
    and return (`signal` is set); a second Ctrl-C raises `Aborted` at once.

    In a run of several processes the signal may reach them at different steps (or
    only some): the processes agree at each log step (`distributed.any_process`), so all
    save the same step, the first log step after the signal (`train.log_every_steps`
    must fit in the scheduler's grace time between SIGTERM and SIGKILL)."""

    @property
    def aborted(self) -> bool:
        """A second Ctrl-C came."""
        return self.raised is not None

    def _handle(self, sig, frame) -> None:
        if sig == signal.SIGINT and self.signal is not None:
            self._raise(Aborted())  # the second Ctrl-C: abort now
        if self.signal is None:
            self.signal = sig
            _say(
                f"{self.name}: saving at the end of this step, then exiting"
                + (" (Ctrl-C again to abort without saving)" if sig == signal.SIGINT else "")
            )


class StopAtOnce(_Handlers):
    """SIGTERM or Ctrl-C raises `Interrupted` at once: for a command with nothing to save
    (an evaluation writes its result only when it is complete)."""

    def _handle(self, sig, frame) -> None:
        if self.signal is None:
            self.signal = sig
        self._raise(Interrupted(self.signal))
