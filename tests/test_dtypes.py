"""Every ``.drt`` expression and frame method, on every Polars dtype, eager and streaming:
each gives a result or an error that names the column, never an abort or a Rust panic.

The sweep runs in a child process (``dtype_sweep.py``), so that an abort fails this test
instead of killing the suite. The suite runs it on the newest and on the lowest supported
Polars.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SWEEP = Path(__file__).with_name("dtype_sweep.py")


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    home = tmp_path_factory.mktemp("sweep-home")
    env = {**os.environ, "DATASET_RT_HOME": str(home), "MPLBACKEND": "Agg"}
    done = subprocess.run(
        [sys.executable, str(SWEEP)], capture_output=True, text=True, env=env, timeout=600
    )
    lines = done.stdout.splitlines()
    last = json.loads(lines[-2]) if len(lines) > 1 else None
    assert done.returncode == 0, (
        f"the sweep died with code {done.returncode} after {last}:\n{done.stderr[-3000:]}"
    )
    assert lines and lines[-1] == "done", done.stderr[-3000:]
    return [json.loads(line) for line in lines[:-1]]


def test_the_sweep_covers_every_dtype_and_case(cases: list[dict[str, Any]]) -> None:
    dtypes = {c["dtype"] for c in cases}
    for dtype in ("Null", "Object", "Categorical", "Enum", "Decimal", "Datetime UTC", "List"):
        assert dtype in dtypes and f"{dtype}, empty" in dtypes
    assert {"Array", "Struct", "String all null", "Float64 all null"} <= dtypes
    import polars as pl

    if hasattr(pl, "Extension"):
        assert "Extension" in dtypes
    names = {c["case"] for c in cases}
    assert {"balance [eager]", "balance [streaming]", "loader (weight)", "summary(by=)"} <= names
    # What must work does: numeric weights weigh, any hashable key balances.
    ok = {(c["case"], c["dtype"]) for c in cases if c["outcome"] == "ok"}
    for dtype in ("Int64", "UInt8", "Float32", "Decimal"):
        assert ("normalize [eager]", dtype) in ok
        assert ("loader (weight)", dtype) in ok
    for dtype in ("String", "Categorical", "Enum", "Datetime UTC", "Struct", "Null", "List"):
        assert ("balance [eager]", dtype) in ok
        assert ("balance [streaming]", dtype) in ok
        assert ("summary(by=)", dtype) in ok
    if hasattr(pl, "Extension"):  # extension columns are read as their storage
        assert ("balance [eager]", "Extension") in ok
        assert ("normalize [streaming]", "Extension") in ok


def test_every_error_is_specific_and_names_the_column(cases: list[dict[str, Any]]) -> None:
    errors = [c for c in cases if c["outcome"] == "error"]
    assert errors, "some dtypes are refused"
    # A frame without rows may be refused as such ("the frame has no rows").
    bad = [
        c
        for c in errors
        if "panic" in c["message"].lower()
        or c["error"].startswith("other:")
        or (c["column"] not in c["message"] and not c["dtype"].endswith(", empty"))
    ]
    assert not bad, "\n".join(
        f"{c['case']} on {c['dtype']}: {c['error']} {c['message']}" for c in bad
    )


def test_refusals_name_the_dtype(cases: list[dict[str, Any]]) -> None:
    refused = {(c["case"], c["dtype"]): c["message"] for c in cases if c["outcome"] == "error"}
    message = refused[("normalize [eager]", "String")]
    assert "'probe'" in message and "str" in message
    message = refused[("split [streaming]", "Float64")]
    assert "'probe'" in message and "f64" in message
    message = refused[("loader (weight)", "Boolean")]
    assert "weight" in message and "bool" in message.lower()
