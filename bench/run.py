"""dataset_rt against the peers users would pick instead: one table per workload.

    python bench/run.py                  # workloads small and large, every installed system
    python bench/run.py --scale          # adds the scale workload: 1M, 10M, 100M rows
    python bench/run.py --smoke          # tiny sizes, one round: checks that it runs
    python bench/run.py --systems dataset_rt,mmap --workloads small --rounds 5

The peers come with ``pip install -e ".[bench]"``, except the original DatasetRT
(``dataset-rt-0.4.8``), which shares our import name and runs in a virtual environment of its
own: ``bench/peer-env.sh`` creates it, ``$DATASET_RT_PEER_PYTHON`` names another. Systems that
are not installed are skipped (and named). Workloads, each the same records for every system
(bench/peers.py):

    small  200,000 records: a uint8 (3, 32, 32) image, a skewed int label, a short caption
    large  5,000 records with a 256 KiB uint8 image
    tiny   10,000,000 records with an 8-byte image (--workloads tiny: long, every peer
           builds them)
    scale  (--scale, bench/scale.py) dataset_rt and the baseline only, at 1M, 10M and 100M
           rows of 8-byte records: start-up, open + first batch, a pass, 2 workers, memory
           per row, a new loader after filter + re-weight

For each system, in fresh processes so that one system's memory never counts for another:

    build        writing the records in the system's format (one run); bytes on disk
    start-up     a fresh process: import + open + the first batch of 256 weighted draws;
                 warm page cache, and cold (posix_fadvise DONTNEED on every file first)
    1 process    weighted random reads (balanced classes, with replacement), decoded to
                 dictionaries with a NumPy image, batches of 256, in one process; each
                 batch's images are stacked into one array (what training does next, and
                 what makes every system read the bytes: a view alone reads nothing)
    2 workers    the same draws through a PyTorch DataLoader with 2 worker processes and the
                 default collate (dataset_rt: its own loader), from the first batch on
    memory       peak RSS, PSS and anonymous memory of the parent reading in one process;
                 PSS of each worker and of all processes together with 2 workers
    filter       keep two classes, re-weight them equally, get a new iterator: time to its
                 first batch, with the dataset already open

Every other figure is the median of --rounds runs after an untimed warm-up, with its spread
(max - min); memory figures are the peaks over those runs. Each comes with its ratio to the
baseline ``mmap`` (a flat file of pickles read through ``mmap`` with NumPy offsets) measured
in the same run. Read passes stop after --cap seconds.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # start-up probes count from here: every import below included

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import scale  # noqa: E402
from measuring import MemorySampler, median_spread, runs  # noqa: E402
from peers import BASELINE, BATCH, SYSTEMS, System, Workload, foreign_env  # noqa: E402

WORKLOADS = {
    "small": {"records": 200_000, "shape": (3, 32, 32), "draws": 50_000},
    "large": {"records": 5_000, "shape": (4, 256, 256), "draws": 5_000},
    "tiny": {"records": 10_000_000, "shape": (1, 1, 8), "draws": 50_000},
}
SMOKE = {
    "small": {"records": 2_000, "shape": (3, 32, 32), "draws": 1_000},
    "large": {"records": 40, "shape": (4, 64, 64), "draws": 1_000},
    "tiny": {"records": 20_000, "shape": (1, 1, 8), "draws": 1_000},
}


# -- measuring, in child processes ---------------------------------------------------------
def _batch_len(batch: Any) -> int:
    if isinstance(batch, dict):
        return len(batch["label"])
    return len(batch)


def measure(system: System, wl: Workload, path: Path, rounds: int, cap: float) -> dict[str, Any]:
    handle = system.open(path)
    draws = wl.weighted_draws(wl.draws)
    memory = MemorySampler()
    memory.start()
    result: dict[str, Any] = {}

    stacked = np.empty((BATCH, *wl.shape), dtype=np.uint8)

    def one_process() -> float:
        n, start = 0, time.perf_counter()
        batches = system.read(handle, draws)
        for batch in batches:
            # Unsafe casting: Hugging Face's NumPy format returns uint8 columns as int64.
            np.stack([r["image"] for r in batch], out=stacked[: len(batch)], casting="unsafe")
            n += len(batch)
            if time.perf_counter() - start > cap:
                break
        rate = n / (time.perf_counter() - start)
        memory.sample()  # with the pass's reader still alive: mappings drop with it
        del batches, batch
        return rate

    memory.take()
    result["read"] = runs(one_process, rounds)
    result["memory_read"] = memory.take()

    def two_workers() -> float:
        batches = iter(system.loader(path, draws, 2))
        next(batches)  # worker start-up is not throughput
        memory.sample()  # the workers are alive now; short passes fall between samples
        n, start = 0, time.perf_counter()
        for batch in batches:
            n += _batch_len(batch)
            if time.perf_counter() - start > cap:
                break
        rate = n / (time.perf_counter() - start)
        del batches
        return rate

    result["workers"] = runs(two_workers, rounds)
    result["memory_workers"] = memory.take()
    memory.stop()

    def refilter() -> float:
        start = time.perf_counter()
        system.refilter(handle, wl.draws)
        return time.perf_counter() - start

    result["filter"] = runs(refilter, rounds)
    return result


def startup(system: System, path: Path) -> dict[str, Any]:
    draws = np.load(path.parent / f"{system.name}.draws.npy")
    handle = system.open(path)
    next(iter(system.read(handle, draws)))
    return {"seconds": time.perf_counter() - _T0}


def disk_bytes(path: Path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def build(system: System, wl: Workload, path: Path) -> dict[str, Any]:
    start = time.perf_counter()
    system.build(wl, path)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "bytes": disk_bytes(path)}


def drop_page_cache(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def probe_main(args: argparse.Namespace) -> None:
    system = SYSTEMS[args.system]()
    path = Path(args.dir)
    spec = (SMOKE if args.smoke else WORKLOADS)[args.workload]
    if args.probe == "startup":
        out = startup(system, path)
    else:
        wl = Workload(args.workload, spec["records"], spec["shape"], spec["draws"])
        if args.probe == "build":
            out = build(system, wl, path)
        else:
            out = measure(system, wl, path, args.rounds, args.cap)
    print("\n" + json.dumps({"probe": out}))


# -- orchestrating --------------------------------------------------------------------------
def child(args: argparse.Namespace, kind: str, system: str, workload: str, path: Path) -> Any:
    # Each system's own interpreter: the original DatasetRT lives in a virtual environment of
    # its own (its import name is ours), and gets no PYTHONPATH that could point at ours.
    python = SYSTEMS[system].python()
    cmd = [
        python,
        __file__,
        "--probe",
        kind,
        "--system",
        system,
        "--workload",
        workload,
        "--dir",
        str(path),
        "--rounds",
        str(args.rounds),
        "--cap",
        str(args.cap),
    ]
    if args.smoke:
        cmd.append("--smoke")
    env = None if python == sys.executable else foreign_env()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith('{"probe"'):
            return json.loads(line)["probe"]
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
    raise RuntimeError(f"{kind} of {system} on {workload} failed (exit {done.returncode}):\n{tail}")


def run_workload(args: argparse.Namespace, name: str, systems: list[str]) -> dict[str, Any]:
    spec = (SMOKE if args.smoke else WORKLOADS)[name]
    wl = Workload(name, spec["records"], spec["shape"], spec["draws"])
    root = Path(args.root) / name
    root.mkdir(parents=True, exist_ok=True)
    print(
        f"\n== {name}: {wl.records:,} records of {wl.record_bytes():,} bytes pickled, "
        f"{wl.draws:,} weighted draws per pass ==",
        flush=True,
    )
    results: dict[str, Any] = {}
    first = wl.weighted_draws(BATCH)
    for system in systems:
        path = root / system
        shutil.rmtree(path, ignore_errors=True)
        np.save(root / f"{system}.draws.npy", first)
        try:
            results[system] = {"build": child(args, "build", system, name, path)}
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            results[system] = {"error": f"build: {exc}"}
        print(f"  built {system}", flush=True)
    for system in systems:
        if "error" in results[system]:
            continue
        path = root / system
        try:
            results[system].update(child(args, "measure", system, name, path))
            warm = [
                child(args, "startup", system, name, path)["seconds"]
                for _ in range(args.rounds + 1)
            ]
            results[system]["startup"] = median_spread(warm[1:])
            cold = []
            for _ in range(args.rounds):
                drop_page_cache(path)
                cold.append(child(args, "startup", system, name, path)["seconds"])
            results[system]["startup_cold"] = median_spread(cold)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            results[system]["error"] = str(exc)
        print(f"  measured {system}", flush=True)
        shutil.rmtree(path, ignore_errors=True)
    table(wl, results)
    for system, r in results.items():
        if "error" in r:
            print(f"\n{system} failed:\n{r['error']}")
    return {"records": wl.records, "record_bytes": wl.record_bytes(), "systems": results}


def _fmt(value: dict[str, float], digits: int, base: float | None = None) -> str:
    text = f"{value['median']:,.{digits}f} ±{value['spread']:,.{digits}f}"
    if base:
        text += f" ({value['median'] / base:.2f}x)"
    return text


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f}"


def _ratio(value: float, base: float | None) -> str:
    return f" ({value / base:.2f}x)" if base else ""


def table(wl: Workload, results: dict[str, Any]) -> None:
    base = results.get(BASELINE, {})
    ok = "error" not in base and "read" in base

    def ref(key: str) -> float | None:
        return base[key]["median"] if ok else None

    def ref_of(fn: Callable[[dict[str, Any]], float]) -> float | None:
        return fn(base) if ok else None

    def build_s(r: dict[str, Any]) -> float:
        return float(r["build"]["seconds"])

    def disk(r: dict[str, Any]) -> float:
        return float(r["build"]["bytes"])

    def total(r: dict[str, Any]) -> float:
        return float(r["memory_workers"]["total_pss"])

    mb = wl.record_bytes() / 1e6
    print(
        "\n| system | build s | disk MB | start-up s, warm | cold | 1 process, samples/s | MB/s "
        "| 2 workers, samples/s | 1 process: RSS / PSS / anon MiB | 2 workers: PSS of each "
        "| all processes | filter + re-weight s | how it filters |"
    )
    print(
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
    )
    for name, r in results.items():
        if "error" in r:
            first_line = r["error"].splitlines()[0]
            print(f"| {name} | failed: {first_line} |" + " |" * 11)
            continue
        parent = r["memory_read"]["parent"]
        workers = r["memory_workers"]["workers"]
        system = SYSTEMS[name]
        cells = [
            name,
            f"{build_s(r):.1f}" + _ratio(build_s(r), ref_of(build_s)),
            f"{disk(r) / 1e6:,.0f}" + _ratio(disk(r), ref_of(disk)),
            _fmt(r["startup"], 2, ref("startup")),
            _fmt(r["startup_cold"], 2, ref("startup_cold")),
            _fmt(r["read"], 0, ref("read")),
            f"{r['read']['median'] * mb:,.0f}",
            _fmt(r["workers"], 0, ref("workers")),
            " / ".join(_mib(m) for m in parent),
            ", ".join(_mib(w[1]) for w in workers) or "-",
            _mib(int(total(r))) + _ratio(total(r), ref_of(total)),
            _fmt(r["filter"], 3, ref("filter")),
            system.filter_how,
        ]
        print("| " + " | ".join(cells) + " |")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workloads", default="small,large")
    parser.add_argument("--scale", action="store_true", help="add the scale workload")
    scale.add_arguments(parser)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cap", type=float, default=2.0, help="seconds per read pass")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round")
    parser.add_argument("--root", help="where to build (default: a new temporary directory)")
    parser.add_argument("--json", help="also write every figure to this file")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per child process")
    parser.add_argument("--probe", choices=["build", "measure", "startup"], help=argparse.SUPPRESS)
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        probe_main(args)
        return
    if args.smoke:
        args.rounds, args.cap = 1, 0.5
    workloads = args.workloads.split(",")
    unknown = [w for w in workloads if w not in WORKLOADS]
    wanted = args.systems.split(",")
    unknown += [s for s in wanted if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown workload or system: {', '.join(unknown)}")
    systems = [s for s in wanted if SYSTEMS[s].installed()]
    missing = [s for s in wanted if s not in systems]
    if BASELINE not in systems:
        systems.insert(0, BASELINE)
    owned = args.root is None
    args.root = args.root or tempfile.mkdtemp(prefix="drt-bench-")
    python = platform.python_version()
    print(f"machine: {os.cpu_count()} cores, {platform.platform()}, Python {python}")
    print(
        f"systems: {', '.join(systems)}"
        + (f"; not installed: {', '.join(missing)}" if missing else "")
    )
    for s in systems:
        if SYSTEMS[s].python() != sys.executable:
            print(f"{s} runs in {SYSTEMS[s].python()}")
    print(
        f"median of {args.rounds} rounds after a warm-up, ± spread (max - min); (ratio to "
        f"{BASELINE}); read passes capped at {args.cap} s; warm page cache unless 'cold'"
    )
    report = {"systems": systems, "missing": missing, "rounds": args.rounds, "workloads": {}}
    try:
        for name in workloads:
            report["workloads"][name] = run_workload(args, name, systems)
        if args.scale:
            report["workloads"]["scale"] = scale.run(args)
    finally:
        if owned:
            shutil.rmtree(args.root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
