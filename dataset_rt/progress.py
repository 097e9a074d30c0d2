"""A dependency-free progress line for long builds: records, bytes and rate."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
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
    """Reports a build's progress on one status line, by time rather than by record count.

    On a terminal or in a notebook the line is drawn at the first record and then redrawn in
    place every ``interval`` seconds, however slow each record is. Elsewhere (logs, CI) a
    line is printed every ``log_interval`` seconds, so a long build shows it is alive
    without flooding the log, and a fast one prints only its final summary.

    ``nbytes`` returns the bytes written so far; it is only called when a line is drawn.
    """

    def __init__(
        self,
        name: str,
        *,
        nbytes: Callable[[], int],
        enabled: bool = True,
        total: int | None = None,
        stream: TextIO | None = None,
        interval: float = 0.2,
        log_interval: float = 30.0,
    ) -> None:
        self._name = name
        self._enabled = enabled
        self._total = total
        self._nbytes = nbytes
        self._stream = stream if stream is not None else sys.stderr
        self._live = enabled and _interactive(self._stream)
        self._interval = interval if self._live else log_interval
        self._start = time.perf_counter()
        # A live line shows the first record at once; a log's first line waits an interval.
        self._next_draw = self._start if self._live else self._start + self._interval
        self.records = 0
        self.nbytes = 0

    def settle(self, records: int) -> None:
        """Sets the final totals; call it before the build's writer is finished and gone."""
        self.records = records
        self.nbytes = self._nbytes()

    def update(self, records: int) -> None:
        """Sets the records so far; draws a line if the last one is old enough."""
        self.records = records
        if self._enabled:
            now = time.perf_counter()
            if now >= self._next_draw:
                self._next_draw = now + self._interval
                self.nbytes = self._nbytes()
                self._draw(now, end="" if self._live else "\n")

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
        self._stream.write(("\r" if self._live else "") + self._line(now) + end)
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
