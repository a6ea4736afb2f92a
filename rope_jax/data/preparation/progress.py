"""The progress line on stderr: documents/s, tokens/s, ETA."""

from __future__ import annotations

import sys
import time


class Progress:
    """Throttled progress lines on stderr and the totals of the tokenizing pass."""

    def __init__(self, total_documents: int, total_bytes: int, *, in_process: bool, enabled: bool):
        self.total_documents, self.total_bytes, self.enabled = total_documents, total_bytes, enabled
        self.in_process = in_process  # tokenizing CPU is then part of this process's CPU
        self.documents = self.tokens = self.bytes = 0
        self.cpu = 0.0
        self.start = self.last = time.monotonic()
        self.start_cpu = time.process_time()

    def add(self, documents: int, tokens: int, nbytes: int, cpu: float) -> None:
        self.documents += documents
        self.tokens += tokens
        self.bytes += nbytes
        self.cpu += cpu
        now = time.monotonic()
        if self.enabled and now - self.last >= 2.0:
            self.last = now
            print(self.line(), file=sys.stderr, flush=True)

    def line(self) -> str:
        wall = max(time.monotonic() - self.start, 1e-9)
        left = max(self.total_bytes - self.bytes, 0) / max(self.bytes / wall, 1e-9)
        eta = time.strftime("%H:%M:%S", time.gmtime(left)) if self.bytes else "?"
        return (
            f"prepare: {self.documents:,}/{self.total_documents:,} docs  "
            f"{self.documents / wall:,.0f} docs/s  {self.tokens / wall / 1e6:.3f}M tokens/s  "
            f"{self.bytes / wall / 1e6:.2f} MB/s  ETA {eta}"
        )

    def summary(self) -> dict:
        """Totals; `main_cpu_s` is this process's reading, writing and hashing."""
        wall = time.monotonic() - self.start
        main_cpu = time.process_time() - self.start_cpu - (self.cpu if self.in_process else 0)
        return {
            "main_cpu_s": round(main_cpu, 3),
            "documents": self.documents,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "wall_s": round(wall, 3),
            "tokenize_cpu_s": round(self.cpu, 3),
            "tokens_per_s": round(self.tokens / max(wall, 1e-9)),
            "tokens_per_cpu_s": round(self.tokens / max(self.cpu, 1e-9)),
        }
