"""Loader workers start the way users write scripts: without a main guard, under torchrun,
from a notebook cell, and never hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import dataset_rt as drt
from dataset_rt import workers
from dataset_rt.errors import ArgumentError, WorkerError

# A training script as users write it: everything at module level, a transform defined in the
# script itself, workers, and (under torchrun) a process group joined at import time.
SCRIPT = """
import json, os, sys
import numpy as np
import torch
import dataset_rt as drt

distributed = "RANK" in os.environ
if distributed:
    import torch.distributed as dist
    dist.init_process_group("gloo")


def to_pair(record):
    return torch.from_numpy(record["x"].astype(np.float32)), record["label"]


cache = drt.cache(
    ({"x": np.full(4, i), "label": i % 3} for i in range(120)),
    "script-cache",
    metadata=lambda r: {"label": r["label"]},
    progress=False,
)
loader = cache.metadata.drt.loader(batch_size=10, seed=1, num_workers=2, transform=to_pair)
ids = [int(v) for _ in range(2) for x, _ in loader for v in x[:, 0]]
print(json.dumps({"rank": int(os.environ.get("RANK", 0)), "ids": ids}), flush=True)
if distributed:
    dist.barrier()
    dist.destroy_process_group()
"""

GUARDED = (
    "def main():\n"
    + textwrap.indent(SCRIPT, "    ")
    + '\n\nif __name__ == "__main__":\n    main()\n'
)


def _expected(world: int) -> list[list[int]]:
    """Each rank's sample ids over two epochs, read in this process without workers."""
    cache = drt.cache(
        ({"x": np.full(4, i), "label": i % 3} for i in range(120)),
        "script-cache",
        metadata=lambda r: {"label": r["label"]},
        progress=False,
    )
    out = []
    for rank in range(world):
        loader = cache.metadata.drt.loader(
            batch_size=10, seed=1, rank=rank, world_size=world, collate=list
        )
        out.append([int(r["x"][0]) for _ in range(2) for b in loader for r in b])
    return out


def _run(command: list[str], tmp_path: Path, timeout: float = 240) -> list[dict[str, Any]]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    try:
        done = subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{command} hung: no exit after {timeout} s; stderr: {exc.stderr!r}")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return sorted(lines, key=lambda r: r["rank"])


@pytest.mark.parametrize("guarded", [False, True], ids=["no-main-guard", "main-guard"])
@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_training_scripts_with_workers(launcher: str, guarded: bool, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(GUARDED if guarded else SCRIPT)
    if launcher == "python":
        command, world = [sys.executable, str(script)], 1
    else:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(script),
        ]
        world = 2
    results = _run(command, tmp_path)
    assert [r["rank"] for r in results] == list(range(world))
    assert [r["ids"] for r in results] == _expected(world)


class _NeverLoads:
    """A transform whose unpickling in a worker never returns: a worker that cannot start."""

    def __call__(self, record: Any) -> Any:
        return record

    def __reduce__(self) -> tuple[Any, ...]:
        return (time.sleep, (3600,))


def test_a_worker_that_cannot_start_is_an_error_in_bounded_time(
    small: drt.Cache, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DATASET_RT_WORKER_START_TIMEOUT", "5")
    loader = small.metadata.drt.loader(batch_size=10, num_workers=2, transform=_NeverLoads())
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"2 of 2 loader worker processes did not start"):
        next(iter(loader))
    assert time.monotonic() - start < 60
    assert workers.start_timeout() == 5.0
    for bad in ("soon", "0", "-1", "inf"):
        monkeypatch.setenv("DATASET_RT_WORKER_START_TIMEOUT", bad)
        with pytest.raises(ArgumentError, match="DATASET_RT_WORKER_START_TIMEOUT"):
            next(iter(loader))


NOTEBOOK_CELLS = [
    """
import numpy as np
import polars as pl
import torch
import dataset_rt as drt

cache = drt.cache(
    ({"image": np.full((2, 2), i, dtype=np.uint8), "label": i % 4} for i in range(256)),
    "notebook-cache",
    metadata=lambda r: {"label": r["label"]},
    progress=False,
)
""",
    """
SCALE = 0.5

def to_tensors(record):
    return torch.from_numpy(record["image"].astype(np.float32) * SCALE), record["label"]
""",
    """
loader = cache.metadata.drt.loader(batch_size=64, num_workers=2, transform=to_tensors, seed=0)
batches = list(loader)
total = sum(int(labels.numel()) for images, labels in batches)
largest = max(float(images.max()) for images, labels in batches)
print("samples", total, "scaled", 100 < largest <= 127.5)
""",
    """
cache.metadata.drt.plot("label")
""",
]


def test_a_notebook_cell_function_reaches_the_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(textwrap.dedent(c)) for c in NOTEBOOK_CELLS]
    # The kernel inherits DATASET_RT_HOME, and draws with its own inline backend as in Jupyter.
    monkeypatch.delenv("MPLBACKEND", raising=False)
    client = nbclient.NotebookClient(
        notebook,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    outputs = notebook.cells[2].outputs
    text = "".join(o.get("text", "") for o in outputs)
    assert "samples 256 scaled True" in text, outputs
    # The chart renders once: one output, the figure as an image (its text/plain is only the
    # fallback of the same output), with no "<Axes: ...>" result above a second drawing.
    (plot,) = notebook.cells[3].outputs
    assert "image/png" in plot["data"], plot
    assert "<Axes" not in plot["data"].get("text/plain", "")


def test_records_of_a_main_module_class_get_an_error_that_says_what_to_do(
    tmp_path: Path,
) -> None:
    script = tmp_path / "build.py"
    script.write_text(
        "import dataclasses\n"
        "import dataset_rt as drt\n\n"
        "@dataclasses.dataclass\n"
        "class Point:\n"
        "    x: int\n\n"
        "drt.cache([Point(i) for i in range(10)], 'points', progress=False)\n"
    )
    subprocess.run([sys.executable, str(script)], check=True, timeout=120)
    loader = drt.open("points").metadata.drt.loader(batch_size=5, collate=list)
    with pytest.raises(drt.errors.SerializationError, match=r'__main__.*serializer="dill"'):
        next(iter(loader))
