"""What every stage of `benchmarks/gpu_suite.py` shares: its context (the result it
extends, the time it has), the log line, the facts of the machine and the code.

A stage reads and extends `ctx.result` (its OUT/<stage>.json), calls `ctx.save()` after
every finished item, skips items already there, and starts an item only when
`ctx.fits(seconds)` says its estimate ends before the stage's deadline. `done` is set
when every item ran.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable


@dataclasses.dataclass
class Context:
    """One stage's call: OUT, smoke mode, its deadline, the travelling corpus, its result
    (OUT/<stage>.json as far as it got) with `save`, `load` of another stage's result,
    and the rung's arguments."""

    out: str
    smoke: bool
    deadline: float
    data: str
    result: dict
    save: Callable[[], None]
    load: Callable[[str], dict]
    rung_tokens: int = 0  # 0: RUNG_TOKENS (SMOKE_RUNG_TOKENS in smoke mode)
    rung_seed: int = 0  # init and data order of the rows run (0: the rung's own)
    rung_rows: tuple = ()  # the rows to run; () for every row
    rung_variant: str = ""  # "" the rung's own setup; else `rung_variant`'s label

    def left(self) -> float:
        return self.deadline - time.time()

    def fits(self, seconds: float) -> bool:
        """Whether an item estimated at `seconds` ends before the deadline; if not, the
        stage records that it stopped for time."""
        if self.left() >= seconds:
            return True
        self.result["stopped_for_time"] = True
        return False


def log(*parts) -> None:
    print(*parts, flush=True)


def jax_facts() -> dict:
    """The backend and devices, and the code (the commit of a tree that travelled without
    .git comes from its stamp: `python -m rope_jax.provenance --stamp` before the call)."""
    import jax

    from rope_jax import provenance

    kind = jax.devices()[0].device_kind
    return {"backend": jax.default_backend(), "device": kind, "devices": jax.device_count(),
            "code": provenance.describe(provenance.code_version())}  # fmt: skip


def oom(e: Exception) -> bool:
    """Whether `e` is the device running out of memory (a result, not a fault)."""
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text
