"""The peer benchmark (bench/run.py) runs end to end at tiny sizes, so that it never rots.

It compares every system that is installed: dataset_rt and the two baselines always, the
peers where the ``bench`` extra is installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _run(script: str, tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], Any]:
    """Runs ``bench/<script>`` with its data and its JSON report under ``tmp_path``."""
    report_path = tmp_path / "report.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / script),
            *args,
            "--root",
            str(tmp_path / "data"),
            "--json",
            str(report_path),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads(report_path.read_text())


def test_smoke_run_measures_every_installed_system(tmp_path: Path) -> None:
    done, report = _run("run.py", tmp_path, "--smoke")
    systems = report["systems"]
    assert {"dataset_rt", "mmap", "list"} <= set(systems)
    for workload in ("small", "large"):
        results = report["workloads"][workload]["systems"]
        assert set(results) == set(systems)
        for name, r in results.items():
            assert "error" not in r, f"{name} on {workload}: {r.get('error')}"
            assert r["build"]["bytes"] > 0 and r["build"]["seconds"] > 0
            for figure in ("read", "workers", "filter", "startup", "startup_cold"):
                assert r[figure]["median"] > 0, (name, workload, figure)
            assert r["memory_read"]["parent"][1] > 0
            assert len(r["memory_workers"]["workers"]) == 2, (name, workload)
            # Every system appears in the printed table, with a ratio to the baseline.
            assert f"| {name} | " in done.stdout
    assert "(1.00x)" in done.stdout
    # Built data is removed as soon as a system is measured.
    assert not any(p.is_file() for p in (tmp_path / "data").rglob("*") if p.suffix != ".npy")


def test_scale_workload_measures_both_systems_at_each_size(tmp_path: Path) -> None:
    done, report = _run("scale.py", tmp_path, "--sizes", "3000,6000", "--rounds", "1")
    assert set(report) == {"3000", "6000"}
    for size, results in report.items():
        assert set(results) == {"dataset_rt", "mmap"}, size
        for name, r in results.items():
            assert r["build"]["bytes"] > 0
            for figure in ("read", "workers", "filter", "startup_total", "startup_open"):
                assert r[figure]["median"] > 0, (size, name, figure)
            assert r["startup_import"]["median"] < r["startup_total"]["median"]
            assert len(r["memory_workers"]["workers"]) == 2, (size, name)
        assert f"{int(size):,} rows" in done.stdout
    assert "| dataset_rt | " in done.stdout and "| mmap | " in done.stdout
    assert not any(p.is_file() for p in (tmp_path / "data").rglob("*") if p.suffix != ".npy")
