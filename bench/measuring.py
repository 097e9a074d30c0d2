"""What the benchmarks measure with: medians, paired rounds, memory of a process tree."""

from __future__ import annotations

import os
import statistics
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def median_spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "spread": max(values) - min(values)}


def runs(fn: Callable[[], float], rounds: int) -> dict[str, float]:
    fn()  # warm-up, excluded: page cache, allocator, worker code paths
    return median_spread([fn() for _ in range(rounds)])


@dataclass(frozen=True)
class Paired:
    """One candidate's rates over the rounds of :func:`paired`."""

    label: str
    median: float
    spread: float
    ratio: float
    """The median over rounds of this rate over the baseline's rate in the same round."""


def paired(candidates: list[tuple[str, Callable[[], float]]], rounds: int) -> list[Paired]:
    """Rates of each candidate (the first is the baseline), measured in alternation.

    After one warm-up call of each, every round calls each candidate once, in order. A ratio
    is taken within a round and then the median over rounds, so that a machine whose speed
    drifts during the run (a noisy VM) moves both sides of each ratio alike.
    """
    for _, fn in candidates:
        fn()  # warm-up, excluded: page cache, allocator, worker code paths
    values: list[list[float]] = [[] for _ in candidates]
    for _ in range(rounds):
        for got, (_, fn) in zip(values, candidates, strict=True):
            got.append(fn())
    base = values[0]
    return [
        Paired(
            label,
            statistics.median(got),
            max(got) - min(got),
            statistics.median(x / b for x, b in zip(got, base, strict=True)),
        )
        for (label, _), got in zip(candidates, values, strict=True)
    ]


def _smaps(pid: int) -> tuple[int, int, int]:
    """RSS, PSS and anonymous (private heap) memory of a process in bytes.

    Pages of mapped data files count in RSS and PSS (shared page cache, split by PSS between
    the processes that map them); anonymous memory is what the process holds on its own.
    """
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0]) * 1024
    return fields["Rss"], fields["Pss"], fields["Anonymous"]


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            kids.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    return kids


class MemorySampler(threading.Thread):
    """Peak RSS and PSS of this process, of each worker and of all processes together.

    Multiprocessing's helpers (its resource tracker, the fork server that workers are
    forked from) count in the total only; every other descendant is a worker. Each pass
    starts new workers, so the two largest are the peak of the two running at a time.

    The thread samples the descendants every 0.2 s; this process is sampled only when
    :meth:`sample` is called, after a pass and outside its timing. Reading a process's
    ``smaps_rollup`` walks the page tables of all its mappings (40-80 ms for a reader of a
    100M-row cache, as long as a whole pass), which would otherwise take a core from the
    pass being measured, and more from the system whose reader maps more pages.
    """

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peaks: dict[int, tuple[int, int, int]] = {}
        self.total = 0
        self._parent_pss = 0
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.wait(0.2):
            self.sample(parent=False)

    def sample(self, parent: bool = True) -> None:
        """Samples the descendants, and this process unless ``parent`` is false (its last
        sampled PSS then counts in the total)."""
        kids = _children()
        me = os.getpid()
        found, frontier = [], [me]
        while frontier:
            below = kids.get(frontier.pop(), [])
            found += below
            frontier += below
        total = 0 if parent else self._parent_pss
        for pid in [me, *found] if parent else found:
            try:
                rss, pss, anon = _smaps(pid)
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except (OSError, KeyError):
                continue
            if pid == me:
                self._parent_pss = pss
            total += pss
            helper = b"resource_tracker" in cmdline or (
                b"forkserver" in cmdline and pid in kids.get(me, [])
            )
            if not helper:
                old = self.peaks.get(pid, (0, 0, 0))
                self.peaks[pid] = (max(old[0], rss), max(old[1], pss), max(old[2], anon))
        self.total = max(self.total, total)

    def take(self) -> dict[str, Any]:
        """The peaks since the last call."""
        self.sample()
        peaks, self.peaks = self.peaks, {}
        total, self.total = self.total, 0
        parent = peaks.pop(os.getpid(), (0, 0, 0))
        workers = sorted(peaks.values(), key=lambda p: p[1], reverse=True)[:2]
        return {"parent": parent, "workers": workers, "total_pss": total}

    def stop(self) -> None:
        self._stop.set()
