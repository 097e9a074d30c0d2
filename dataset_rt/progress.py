"""A dependency-free progress line for long builds: records, bytes and rate."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["BuildProgress", "format_bytes"]


def format_bytes(n: float) -> str:
    """``1536`` → ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - loop always returns


def _interactive(stream: TextIO) -> bool:
    if "ipykernel" in sys.modules:
        return True
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class BuildProgress:
    """Redraws one status line at most every ``interval`` seconds while a cache is built.

    On a terminal or in a notebook the line updates in place; elsewhere (logs, CI) only the
    final summary is printed, so log files are not flooded.
    """

    def __init__(
        self,
        name: str,
        *,
        enabled: bool = True,
        total: int | None = None,
        stream: TextIO | None = None,
        interval: float = 0.2,
    ) -> None:
        self._name = name
        self._enabled = enabled
        self._total = total
        self._stream = stream if stream is not None else sys.stderr
        self._live = enabled and _interactive(self._stream)
        self._interval = interval
        self._start = time.perf_counter()
        self._next_draw = self._start + interval
        self.records = 0
        self.nbytes = 0

    def update(self, records: int, nbytes: int) -> None:
        """Sets the totals so far; redraws if the last draw is old enough."""
        self.records = records
        self.nbytes = nbytes
        if self._live:
            now = time.perf_counter()
            if now >= self._next_draw:
                self._next_draw = now + self._interval
                self._draw(now, end="")

    def _line(self, now: float) -> str:
        elapsed = max(now - self._start, 1e-9)
        done = f"{self.records:,}"
        if self._total:
            done += f"/{self._total:,} ({100 * self.records / self._total:.0f}%)"
        return (
            f"caching {self._name!r}: {done} records, {format_bytes(self.nbytes)}, "
            f"{self.records / elapsed:,.0f} rec/s, {format_bytes(self.nbytes / elapsed)}/s"
        )

    def _draw(self, now: float, end: str) -> None:
        self._stream.write("\r" + self._line(now) + end)
        self._stream.flush()

    def close(self, *, ok: bool) -> None:
        """Prints the final line (only for a completed build)."""
        if not self._enabled:
            return
        if ok:
            self._draw(time.perf_counter(), end="\n")
        elif self._live:
            self._stream.write("\n")
            self._stream.flush()
