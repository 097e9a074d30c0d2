"""Shared by the tests: small records and a way to run Python in a child process."""

from __future__ import annotations

import os
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
