"""Shared by the tests: small records and a way to run Python in a child process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import IO, Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent


def record(i: int) -> dict[str, Any]:
    """A small record like a real one: an image-ish array, a label, a caption."""
    rng = np.random.default_rng(i)
    return {
        "image": rng.integers(0, 255, size=(3, 8, 8), dtype=np.uint8),
        "label": i % 5,
        "caption": f"sample {i}",
    }


def same_record(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        a.keys() == b.keys()
        and np.array_equal(a["image"], b["image"])
        and a["label"] == b["label"]
        and a["caption"] == b["caption"]
    )


def python_child(
    code: str,
    env: dict[str, str] | None = None,
    stdout: IO[str] | int = subprocess.PIPE,
    stderr: IO[str] | int = subprocess.PIPE,
) -> subprocess.Popen[str]:
    """Starts ``python -c code`` with the tests' helpers importable (output to pipes)."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), full_env.get("PYTHONPATH", "")])
    full_env.update(env or {})
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        stdout=stdout,
        stderr=stderr,
        text=True,
    )


def slow_identity(x: Any) -> Any:
    """A transform that takes a known time (1 ms), for the loaders' stage counters."""
    import time

    time.sleep(0.001)
    return x


class Squares:
    """A map-style dataset (no ``__iter__``) that can die or fail at a chosen index; parallel
    builds send it to their worker processes, which import it from here."""

    def __init__(self, n: int, die_at: int = -1, fail_at: int = -1) -> None:
        self.n, self.die_at, self.fail_at = n, die_at, fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index == self.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if index == self.fail_at:
            raise ValueError(f"unreadable file for {index}")
        return {"i": index, "sq": np.full(4, index * index), "tag": f"t{index % 3}"}
