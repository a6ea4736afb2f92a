"""Progress lines of long evaluations and continuations, on stderr (stdout holds
eval.py's JSON or text)."""

from __future__ import annotations

import time

from rope_jax.harness import console


class Progress:
    """Progress lines of a long evaluation or continuation, on stderr (stdout holds
    eval.py's JSON or text):

      eval step 1250, validation @1024: batch 12/40 in 0:00:09  ETA 0:00:21
      generate step 1250: token 4,097/30,000 in 0:00:10  ETA 0:01:03

    one every `every_s` seconds (0: after every item), timed from the end of the first
    item (the one that compiles), so that a short job prints none and the time left is
    the steady rate's. `check` runs before every item (`signals.StopAtOnce.check`: a
    signal Python dropped is raised there)."""

    def __init__(self, every_s: float, check=lambda: None, clock=time.monotonic):
        self.every_s, self.check, self.clock = every_s, check, clock

    def watch(self, items, what: str, total: int | None = None, *, unit: str = "batch",
              per: int = 1, start: int = 0):  # fmt: skip
        """`items`, passed through; the lines name `what` ("eval ..." or "generate ...")
        and count `unit`s: `start + per` for each item done, up to `total` (the ETA's)."""
        begin, first, last = self.clock(), None, None
        for done, item in enumerate(items, start=1):
            self.check()
            yield item  # the caller uses it before asking for the next
            now = self.clock()
            if first is None:
                first = last = now
            elif now - last >= self.every_s:
                last = now
                count = start + done * per if total is None else min(start + done * per, total)
                eta = None if not total else (total - count) * (now - first) / (count - per - start)
                console.note(progress_line(what, count, total, now - begin, eta, unit))


def progress_line(what: str, done: int, total: int | None, seconds: float,
                  eta: float | None, unit: str = "batch") -> str:  # fmt: skip
    """`<what>: <unit> <done>/<total> in <H:MM:SS>  ETA <H:MM:SS>` (no total: no ETA)."""
    line = f"{what}: {unit} {done:,}{f'/{total:,}' if total else ''} in {console.hms(seconds)}"
    return line if eta is None or done == total else f"{line}  ETA {console.hms(eta)}"
