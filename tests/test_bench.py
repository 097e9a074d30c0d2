"""The benchmarks run (at tiny sizes) so that they never rot; their figures are not checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["build.py", "--records", "300", "--rounds", "1", "--compression"],
            ["serialize only", "drt.cache", "dataset: num_proc=2", "compression, tokens", "lz4"],
        ),
        pytest.param(
            ["build.py", "--records", "300", "--rounds", "1", "--datasets-only", "--ray"],
            ["read + serialize", "num_proc=2", "ray, 2 CPUs"],
            marks=pytest.mark.slow,
        ),
        (["metadata.py", "--rows", "20000", "--rounds", "1"], ["native Polars", ".drt.balance"]),
        (
            ["loader.py", "--records", "2000", "--draws", "2000", "--rounds", "1", "--smoke"],
            ["P1 ", "P2 ", "P7 ", "P3 ", "open + scan() + loader", "P5 ", "sampler for"],
        ),
        (["serialize.py", "--smoke"], ["bare copy", "zero-copy (default)", "pickle in band"]),
        (["access.py", "--smoke"], ["mmap, one by one", "get, one by one", "get_many, 256"]),
        (
            ["startup.py", "--smoke"],
            ["baseline (mmap offsets)", "the rest of import dataset_rt", "scan()    import"],
        ),
        (
            ["remote.py", "--smoke"],
            [
                "open + metadata ready, s3://",
                "0 of them shards",
                "second epoch",
                "fetched on demand",
                "GIL-holding transform, s3://",
            ],
        ),
        (["fuzz.py", "--smoke"], ["damaged local caches", "in a local S3 server", "findings: 0"]),
        (
            ["program.py", "--smoke"],
            ["phase 2:", "3-phase schedule", "per-sample losses", "seen(all_ranks=True)"],
        ),
        (
            ["tokens.py", "--smoke"],
            ["memmap windows (baseline)", "packed loader", "Python packing"],
        ),
        (
            ["tokens_scale.py", "--smoke"],
            ["20,000 documents", "baseline (memmap)", "cache.scan()", "cache.metadata"],
        ),
    ],
    ids=[
        "build",
        "build-ray",
        "metadata",
        "loader",
        "serialize",
        "access",
        "startup",
        "remote",
        "fuzz",
        "program",
        "tokens",
        "tokens-scale",
    ],
)
def test_benchmark_runs_and_prints_its_table(args: list[str], expected: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, str(BENCH / args[0]), *args[1:]],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    for line in expected:
        assert line in result.stdout, result.stdout
