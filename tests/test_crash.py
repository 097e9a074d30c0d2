"""Crash safety and concurrent builders, with real processes and real SIGKILLs."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import polars as pl
import pytest
from helpers import python_child

import dataset_rt as drt
from dataset_rt.errors import CacheNotFoundError

# A child that builds "victim" from 400 records of 2 KiB (shards of 64 KiB, so ~13 shards)
# and kills itself with SIGKILL at the point named by $KILL_AT.
BUILD_AND_DIE = """
import os, signal, sys
import dataset_rt as drt

kill_at = os.environ["KILL_AT"]
if kill_at == "after-metadata":
    # The engine's kill point between the table written and flushed (see faults.rs).
    os.environ["DATASET_RT_TEST_KILL_AT"] = "build-metadata-written"

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def source():
    for i in range(400):
        if kill_at == f"record-{i}":
            die()
        yield bytes([i % 256]) * 2048

drt.cache(source, "victim", metadata=lambda r: {"first": r[0]}, shard_size=64 << 10,
          overwrite=os.environ.get("OVERWRITE") == "1", progress=False)
print("finished")
"""

KILL_POINTS = [
    "record-0",  # before the first record reaches a shard
    "record-1",
    "record-150",  # mid-shard
    "record-32",  # right at a shard boundary (32 records of 2 KiB per 64 KiB shard)
    "record-399",  # the last record
    "after-metadata",  # everything written but the index and the manifest
]


def _run_and_kill(env: dict[str, str]) -> None:
    child = python_child(BUILD_AND_DIE, env)
    out, err = child.communicate(timeout=120)
    assert child.returncode == -signal.SIGKILL, (child.returncode, out, err)
    assert "finished" not in out


@pytest.mark.parametrize("kill_at", KILL_POINTS)
def test_killed_build_leaves_nothing_openable_and_the_next_call_rebuilds(kill_at: str) -> None:
    _run_and_kill({"KILL_AT": kill_at})
    with pytest.raises(CacheNotFoundError):
        drt.open("victim")
    assert "victim" not in drt.list_caches()["name"].to_list()
    rebuilt = drt.cache((bytes([i % 256]) * 2048 for i in range(400)), "victim", progress=False)
    assert len(rebuilt) == 400
    assert rebuilt.get(399) == bytes([399 % 256]) * 2048
    hidden = [p.name for p in rebuilt.root.iterdir() if p.name.startswith(".victim.build")]
    assert hidden == [], "the next build must remove what the crash left"


@pytest.mark.parametrize("kill_at", ["record-150", "after-metadata"])
def test_killed_rebuild_keeps_the_old_cache(kill_at: str) -> None:
    old = drt.cache([b"old"] * 10, "victim", progress=False)
    _run_and_kill({"KILL_AT": kill_at, "OVERWRITE": "1"})
    kept = drt.open("victim")
    assert kept.cache_id == old.cache_id
    assert [kept.get(i) for i in range(10)] == [b"old"] * 10
    assert kept.metadata.height == 10


def test_kill_at_random_moments_never_leaves_a_half_cache() -> None:
    # A longer build (about a second) killed from outside at spread-out moments.
    code = """
    import time
    import dataset_rt as drt

    def source():
        for i in range(40000):
            if i % 1000 == 0:
                time.sleep(0.02)  # stretch the build to about a second
            yield bytes(1024)

    drt.cache(source, "timed", shard_size=1 << 20, progress=False)
    print("finished")
    """
    outcomes = set()
    for delay in (0.1, 0.4, 0.7, 0.9, 1.1, 1.3, 1.5, 1.8, 3.0):
        child = python_child(code)
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)
        try:
            c = drt.open("timed")
        except CacheNotFoundError:
            outcomes.add("absent")
        else:
            # A cache that opens is complete: every record is readable and intact.
            assert len(c) == 40000
            assert c.get(39999, verify=True) == bytes(1024)
            assert c.metadata.height == 40000
            outcomes.add("complete")
            shutil.rmtree(c.path)  # start the next round from nothing
    assert "absent" in outcomes, outcomes


CONCURRENT_BUILDER = """
import json, os, sys, time
import dataset_rt as drt

marker = os.environ["MARKER"]
sync = os.environ["SYNC"]
open(os.path.join(sync, f"ready-{os.getpid()}"), "w").close()
while not os.path.exists(os.path.join(sync, "go")):  # start all callers at once
    time.sleep(0.005)

def source():
    with open(marker, "a") as f:
        f.write(f"{os.getpid()}\\n")
    for i in range(300):
        time.sleep(0.002)  # a build slow enough for the others to arrive meanwhile
        yield {"i": i}

c = drt.cache(source, "shared", metadata=lambda r: {"i": r["i"]},
              overwrite=os.environ.get("OVERWRITE") == "1", progress=False)
print(json.dumps({"cache_id": c.cache_id, "n": len(c), "last": c.get(299)["i"]}))
"""


@pytest.mark.parametrize("overwrite", [False, True])
def test_concurrent_callers_build_once_and_all_open_it(tmp_path: Path, overwrite: bool) -> None:
    import json

    marker = tmp_path / "builders.txt"
    sync = tmp_path / "sync"
    sync.mkdir()
    env = {"MARKER": str(marker), "SYNC": str(sync), "OVERWRITE": "1" if overwrite else "0"}
    children = [python_child(CONCURRENT_BUILDER, env) for _ in range(8)]
    deadline = time.monotonic() + 120
    while len(list(sync.glob("ready-*"))) < len(children):
        assert time.monotonic() < deadline, "children did not start"
        assert all(c.poll() is None for c in children), "a child exited early"
        time.sleep(0.01)
    (sync / "go").touch()
    results = []
    for child in children:
        out, err = child.communicate(timeout=180)
        assert child.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    builders = marker.read_text().split()
    assert len(builders) == 1, f"{len(builders)} processes built the cache"
    assert len({r["cache_id"] for r in results}) == 1
    assert all(r["n"] == 300 and r["last"] == 299 for r in results)


# A child that saves a new metadata version of "saved" and kills itself at $KILL_AT.
SAVE_AND_DIE = """
import os
import polars as pl
import dataset_rt as drt

# The engine's kill points (faults.rs): the new table written to its temporary file but not
# flushed, or in place with the manifest not yet updated.
os.environ["DATASET_RT_TEST_KILL_AT"] = {
    "before-fsync": "metadata-written", "after-rename": "metadata-renamed"
}[os.environ["KILL_AT"]]
c = drt.open("saved")
c.save_metadata(c.metadata.with_columns(weight=pl.col("sample_id").cast(pl.Float64) + 1))
print("finished")
"""


@pytest.mark.parametrize("kill_at", ["before-fsync", "after-rename"])
def test_a_killed_metadata_save_keeps_the_live_version(kill_at: str) -> None:
    import polars as pl

    c = drt.cache(range(500), "saved", progress=False)
    before = c.metadata
    child = python_child(SAVE_AND_DIE, {"KILL_AT": kill_at})
    out, err = child.communicate(timeout=120)
    assert child.returncode == -signal.SIGKILL, (out, err)
    reopened = drt.open("saved")
    assert reopened.metadata_version == 1
    assert reopened.metadata.equals(before)
    assert reopened.verify(progress=False).ok
    # The next save succeeds, and leaves no temporary file of the dead one behind.
    assert reopened.save_metadata(before.filter(pl.col("sample_id") < 5)) == 2
    assert drt.open("saved").metadata.height == 5
    leftovers = [p.name for p in (c.path / "metadata").iterdir() if ".tmp-" in p.name]
    assert leftovers == []


# A child that builds a loader over an edited frame (its plan goes to a scratch directory),
# prints that directory and kills itself before any finalizer can remove it.
LOADER_AND_DIE = """
import os, signal
import polars as pl
import dataset_rt as drt

cache = drt.cache([bytes([i]) * 64 for i in range(40)], "small", progress=False)
loader = cache.metadata.filter(pl.col("sample_id") < 30).drt.loader(batch_size=4, seed=0)
next(iter(loader))
mine = [n for n in os.listdir(os.environ["BASE"]) if f"-{os.getpid()}-" in n]
print(",".join(mine), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_loaders_scratch_directory_goes_with_the_next_loader(tmp_path: Path) -> None:
    from dataset_rt import scratch

    # Where this host keeps scratch directories (/dev/shm where it is writable).
    probe = scratch.scratch_dir("dataset_rt-probe-")
    base = str(Path(probe).parent)
    shutil.rmtree(probe)
    child = python_child(LOADER_AND_DIE, {"BASE": base})
    out, err = child.communicate(timeout=120)
    assert child.returncode == -signal.SIGKILL, (child.returncode, out, err)
    leaked = [Path(base, name) for name in out.strip().split(",") if name]
    assert len(leaked) == 1 and (leaked[0] / "plan.bin").is_file(), (out, err)
    assert f"-{child.pid}-" in leaked[0].name
    # A directory of another PID namespace with the same (dead) PID is not this host's to judge.
    foreign = Path(base, f"dataset_rt-loader-0foreign-{child.pid}-x")
    foreign.mkdir()
    try:
        # A live loader of this process keeps its directory through the sweep.
        cache = drt.open("small")
        frame = cache.metadata.filter(pl.col("sample_id") < 20)
        first = frame.drt.loader(batch_size=4, seed=1)
        own = [p for p in Path(base).iterdir() if f"-{os.getpid()}-" in p.name]
        second = frame.drt.loader(batch_size=4, seed=2)
        assert not leaked[0].exists(), "the next loader removes a dead process's scratch"
        assert own and all(p.is_dir() for p in own)
        assert foreign.is_dir()
        assert sum(len(batch) for batch in first) == 20
        assert sum(len(batch) for batch in second) == 20
    finally:
        shutil.rmtree(foreign, ignore_errors=True)
