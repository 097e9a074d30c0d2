"""Files from elsewhere are untrusted: every file a reader opens, damaged every way
``file_fuzz.py`` knows, gives ``CacheCorruptError`` (or another dataset_rt error) and never
an abort, a foreign exception or a write outside the cache's directory.

The cases are drawn from fixed seeds, so every run checks the same ones; ``bench/fuzz.py``
runs many more.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

FUZZ = Path(__file__).with_name("file_fuzz.py")


def fuzz(tmp_path: Path, cases: int, *extra: str) -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, str(FUZZ), "--cases", str(cases), "--dir", str(tmp_path), *extra],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = done.stdout.splitlines()
    assert done.returncode == 0, (
        f"the fuzzer died with code {done.returncode} in {lines[-1] if lines else None}:\n"
        f"{done.stderr[-3000:]}"
    )
    assert lines[-1] == f"done {cases}", done.stderr[-3000:]
    results = [json.loads(line) for line in lines if line.startswith('{"case"')]
    assert len(results) == cases
    return results


def check(results: list[dict[str, Any]]) -> None:
    findings = []
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    for r in results:
        outcomes = r["outcomes"]
        counts.update(outcomes.items())
        where = f"case {r['case']}: {r['variant']} {r['file']}, {r['damage']}"
        for read, outcome in outcomes.items():
            if outcome.startswith("UNEXPECTED"):
                findings.append(f"{where}: {read} raised {outcome}")
        if r["escaped"]:
            findings.append(f"{where}: wrote outside the cache: {r['escaped']}")
        refused = [k for k, v in outcomes.items() if v == "CacheCorruptError" and k != "open"]
        if refused and outcomes.get("verify") == "ok":
            findings.append(f"{where}: {refused} found damage that verify did not report")
    assert not findings, "\n".join(findings)
    # The damage bites at every depth: refused at open, by a read, and harmless.
    assert counts[("open", "CacheCorruptError")] > 0
    assert counts[("open", "ok")] > 0
    assert counts[("verify", "CacheCorruptError")] > 0
    assert any(v == "CacheCorruptError" for (k, v) in counts if k not in ("open", "verify"))


def test_damaged_local_caches_are_refused_cleanly(tmp_path: Path) -> None:
    results = fuzz(tmp_path, 300)
    check(results)
    damaged = {r["file"].split("/")[0] for r in results}
    assert {"manifest.json", "index.arrow", "shards", "metadata", "parts"} <= damaged
    assert {r["variant"] for r in results} == {"plain", "zstd"}
    assert any(r["damage"].startswith("json") for r in results)
    assert any("link" in r["damage"] for r in results)


def test_damaged_remote_caches_are_refused_cleanly(tmp_path: Path, server: str) -> None:
    check(fuzz(tmp_path, 60, "--endpoint", server))
