"""The long run of the damaged-file fuzzer (tests/file_fuzz.py; the suite runs 300 local and
60 remote cases): many more cases, local and in a local S3 server, with a count of what each
read did. Any finding (a foreign exception, damage that verify missed, a write outside the
cache) is printed and makes the exit status 1; an abort shows as the fuzzer's own death.

    python bench/fuzz.py                          # 5,000 local and 500 remote cases
    python bench/fuzz.py --cases 20000 --seed 7   # another 20,000
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from remote import start_server

FUZZ = Path(__file__).resolve().parent.parent / "tests" / "file_fuzz.py"


def run(cases: int, seed: int, *extra: str) -> int:
    """Runs the fuzzer; prints its counts and findings; returns the number of findings."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="drt-bench-fuzz-") as work:
        command = [sys.executable, str(FUZZ), "--cases", str(cases), "--seed", str(seed)]
        done = subprocess.run(
            [*command, "--dir", work, *extra],
            capture_output=True,
            text=True,
            cwd=work,  # outside the checkout, whose dataset_rt/ would shadow the installed one
        )
    lines = done.stdout.splitlines()
    if done.returncode != 0:
        print(f"  the fuzzer died ({done.returncode}) in {lines[-1] if lines else '?'}")
        print(done.stderr[-3000:])
        return 1
    results = [json.loads(line) for line in lines if line.startswith('{"case"')]
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    findings = []
    for r in results:
        outcomes = r["outcomes"]
        counts.update(
            (k, v if not v.startswith("UNEXPECTED") else "UNEXPECTED") for k, v in outcomes.items()
        )
        refused = [k for k, v in outcomes.items() if v == "CacheCorruptError" and k != "open"]
        bad = [v for v in outcomes.values() if v.startswith("UNEXPECTED")]
        if bad or r["escaped"] or (refused and outcomes.get("verify") == "ok"):
            findings.append(f"  case {r['case']}: {r['file']}, {r['damage']}: {bad} {r['escaped']}")
    print(f"  {len(results):,} cases in {time.perf_counter() - start:.0f} s")
    for read in dict.fromkeys(k for k, _ in counts):
        shown = ", ".join(f"{v} {n:,}" for (k, v), n in sorted(counts.items()) if k == read)
        print(f"    {read:<22} {shown}")
    print(f"  findings: {len(findings)}")
    print("\n".join(findings[:50]))
    return len(findings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=5000, help="local cases")
    parser.add_argument("--remote-cases", type=int, default=500)
    parser.add_argument("--seed", type=int, default=1, help="the suite runs seed 0")
    parser.add_argument("--smoke", action="store_true", help="a few cases, to check it runs")
    args = parser.parse_args()
    local, remote = (30, 10) if args.smoke else (args.cases, args.remote_cases)
    print("== damaged local caches ==")
    found = run(local, args.seed)
    print("== damaged caches in a local S3 server ==")
    found += run(remote, args.seed, "--endpoint", start_server())
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
