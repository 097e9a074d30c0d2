"""Faults from outside: files that shrink under a running loader, a full disk, dead workers.

Each runs for real in a child process, so that a crash (SIGBUS, a hang) fails the test with
its exit status instead of taking the test run down.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import python_child

import dataset_rt as drt

TRUNCATE_WHILE_LOADING = """
import os
import numpy as np
import dataset_rt as drt
from dataset_rt.errors import CacheCorruptError

cache = drt.cache(({{"x": np.full(1000, i, dtype=np.int32)}} for i in range(2000)), "big",
                  shard_size=256 * 1024, progress=False)
loader = cache.metadata.drt.loader(batch_size=50, shuffle=False, prefetch=2, collate=list)
batches = iter(loader)
first = next(batches)
assert [int(r["x"][0]) for r in first] == list(range(50))
for shard in (cache.path / "shards").iterdir():
    os.truncate(shard, {keep})
try:
    for _ in batches:
        pass
except CacheCorruptError as exc:
    print("loader:", exc)
else:
    raise SystemExit("the loader read past the truncated end without an error")
try:
    cache.get(1999)
except CacheCorruptError as exc:
    print("get:", exc)
else:
    raise SystemExit("get read past the truncated end without an error")
"""


@pytest.mark.parametrize("keep", [0, 4096])
def test_a_shard_truncated_under_a_running_loader_is_an_error_not_sigbus(keep: int) -> None:
    child = python_child(TRUNCATE_WHILE_LOADING.format(keep=keep))
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, f"exit {child.returncode}\n{out}\n{err}"
    assert "loader:" in out and "shrank while it was mapped" in out
    assert "get:" in out


TRUNCATE_UNDER_GET_MANY = """
import os
import dataset_rt as drt
from dataset_rt.errors import CacheCorruptError

cache = drt.cache((bytes([i % 256]) * 4000 for i in range(2000)), "raw",
                  shard_size=256 * 1024, progress=False)
assert cache.get_many([1999, 7], decode=bytes) == [cache.get_bytes(1999), cache.get_bytes(7)]
assert cache.get(1999) == bytes([1999 % 256]) * 4000
for shard in (cache.path / "shards").iterdir():
    os.truncate(shard, {keep})
try:
    cache.get_many([1999, 1998], decode=bytes)
except CacheCorruptError as exc:
    print("get_many:", exc)
else:
    raise SystemExit("get_many read past the truncated end without an error")
try:
    cache.get_bytes(1)
except CacheCorruptError as exc:
    print("get_bytes:", exc)
else:
    raise SystemExit("a reader that saw its shard shrink went on serving")
"""


@pytest.mark.parametrize("keep", [0, 4096])
def test_a_shard_truncated_under_get_many_of_bytes_is_an_error_not_sigbus(keep: int) -> None:
    child = python_child(TRUNCATE_UNDER_GET_MANY.format(keep=keep))
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, f"exit {child.returncode}\n{out}\n{err}"
    assert "get_many:" in out and "shrank while it was mapped" in out
    assert "get_bytes:" in out


FULL_DISK_BUILD = """
import os, resource, signal
import numpy as np
import dataset_rt as drt
from dataset_rt.errors import CacheIOError

# Files may not grow past 1 MiB: every write beyond fails with EFBIG, as on a full disk.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
try:
    drt.cache((np.zeros(10_000) for _ in range(400)), "full", progress=False)
except CacheIOError as exc:
    print("errno", exc.errno, exc.filename)
else:
    raise SystemExit("a build larger than the disk succeeded")
"""


def test_a_full_disk_during_a_build_leaves_nothing_and_a_retry_works() -> None:
    child = python_child(FULL_DISK_BUILD)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, f"{out}\n{err}"
    assert f"errno {27}" in out  # EFBIG, with the file that could not grow
    root = drt.default_root()
    left = [p.name for p in root.iterdir()]
    assert left == [], left  # no cache, no build directory, no lock file
    assert len(drt.cache((np.zeros(10) for _ in range(4)), "full", progress=False)) == 4


FULL_DISK_SAVE = """
import resource, signal
import numpy as np
import polars as pl
import dataset_rt as drt
from dataset_rt.errors import CacheIOError

cache = drt.open("meta")
rng = np.random.default_rng(0)
bigger = cache.metadata.with_columns(noise=pl.Series(rng.random(cache.metadata.height)))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
try:
    cache.save_metadata(bigger)
except CacheIOError as exc:
    print("errno", exc.errno)
else:
    raise SystemExit("a save larger than the disk succeeded")
"""


def test_a_full_disk_during_a_metadata_save_keeps_the_live_version() -> None:
    cache = drt.cache(range(200_000), "meta", progress=False)
    manifest = (cache.path / "manifest.json").read_text()
    listing = sorted(os.listdir(cache.path / "metadata"))
    limit = (cache.path / "metadata" / "v00001.parquet").stat().st_size + 4096
    child = python_child(FULL_DISK_SAVE.format(limit=limit))
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, f"{out}\n{err}"
    assert "errno 27" in out
    assert (cache.path / "manifest.json").read_text() == manifest
    assert sorted(os.listdir(cache.path / "metadata")) == listing  # no temporary file left
    assert drt.open("meta").metadata_version == 1
    assert drt.open("meta").verify(progress=False).ok


TRUNCATE_UNDER_VIEWS = """
import os
import numpy as np
import dataset_rt as drt
from dataset_rt.errors import CacheCorruptError

# 80 KB arrays: out of band, so the loader's arrays view the mapped shards.
cache = drt.cache(({"x": np.full(20_000, i, dtype=np.float32)} for i in range(64)), "views",
                  shard_size=1 << 20, progress=False)
loader = cache.metadata.drt.loader(batch_size=8, shuffle=False, prefetch=2, collate=list)
batches = iter(loader)
first = next(batches)
assert [float(r["x"][-1]) for r in first] == list(range(8))
for shard in (cache.path / "shards").iterdir():
    os.truncate(shard, 0)
print("held:", sum(float(r["x"].sum()) for r in first))
try:
    for _ in batches:
        pass
except CacheCorruptError as exc:
    print("loader:", exc)
else:
    raise SystemExit("the loader read past the truncated end without an error")
"""


def test_arrays_viewing_a_truncated_shard_read_zeros_and_the_loader_stops() -> None:
    child = python_child(TRUNCATE_UNDER_VIEWS)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, f"exit {child.returncode}\n{out}\n{err}"
    assert "held: 0.0" in out  # the views' pages read as zeros instead of raising SIGBUS
    assert "loader:" in out and "shrank while it was mapped" in out


KILL_A_WORKER = """
import faulthandler, json, multiprocessing, os, signal, sys, threading
# A hang shows where every thread waits, well before the test's own timeout.
faulthandler.dump_traceback_later(120, exit=True, file=sys.stderr)
import numpy as np
import dataset_rt as drt

cache = drt.open("workers")
loader = cache.metadata.drt.loader(batch_size=8, seed=0, num_workers=2, prefetch=1)
threads_before = len(os.listdir("/proc/self/task"))
batches = iter(loader)
next(batches)
workers = multiprocessing.active_children()
assert workers, "no worker processes found"
print(json.dumps({"workers": [w.pid for w in workers]}), flush=True)
import gc, multiprocessing.synchronize, time
time.sleep(PAUSE)  # with a pause, the worker has queued its next batch
# PyTorch's workers take the loader's shared "done" event lock for every index they get; a
# worker killed inside that moment takes the lock with it and hangs every DataLoader on
# the event (a PyTorch hazard, not the one tested here). So the worker is stopped first
# and killed only at a moment it does not hold that lock.
(done,) = [o for o in gc.get_objects() if isinstance(o, multiprocessing.synchronize.Event)]
while True:
    os.kill(workers[0].pid, signal.SIGSTOP)
    if done._cond._lock.acquire(False):
        done._cond._lock.release()
        break
    os.kill(workers[0].pid, signal.SIGCONT)
    time.sleep(0.001)
os.kill(workers[0].pid, signal.SIGKILL)
try:
    for _ in batches:
        pass
except RuntimeError as exc:
    message = str(exc)
else:
    raise SystemExit("the loader finished although a worker was killed")
del batches
gc.collect()
# The other worker is told to stop and multiprocessing's queue feeder threads end on their
# own once the queues close; on a loaded machine that takes a moment: wait up to 10 s, then
# count what is left.
deadline = time.monotonic() + 10
while time.monotonic() < deadline and (
    multiprocessing.active_children() or len(os.listdir("/proc/self/task")) > threads_before
):
    time.sleep(0.05)
alive = [p.pid for p in multiprocessing.active_children()]
print(json.dumps({"message": message, "alive": alive,
                  "threads": len(os.listdir("/proc/self/task")) - threads_before,
                  "names": [t.name for t in threading.enumerate()]}))
"""


@pytest.mark.parametrize("pause", [0.0, 1.5])
def test_a_killed_worker_is_a_clear_error_without_hang_or_leaks(
    pause: float, tmp_path: Path
) -> None:
    drt.cache(({"x": np.full(4, i)} for i in range(5000)), "workers", progress=False)
    # Output goes to files, and the test waits for the process, not for the end of its
    # pipes: a worker or fork server left behind would hold a pipe open and hide what
    # happened behind a timeout. What is left behind is checked by pid instead.
    out_path, err_path = tmp_path / "out", tmp_path / "err"
    with out_path.open("w") as out_file, err_path.open("w") as err_file:
        child = python_child(
            KILL_A_WORKER.replace("PAUSE", repr(pause)), stdout=out_file, stderr=err_file
        )
        returncode = child.wait(timeout=180)
    out, err = out_path.read_text(), err_path.read_text()
    assert returncode == 0, f"{out}\n{err}"
    lines = [json.loads(line) for line in out.strip().splitlines() if line.startswith("{")]
    workers, result = lines[0]["workers"], lines[-1]
    assert "worker" in result["message"] and "exited unexpectedly" in result["message"]
    assert result["alive"] == []  # the other worker was shut down too
    assert result["threads"] <= 0, result
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in workers):
        time.sleep(0.05)
    left = [pid for pid in workers if Path(f"/proc/{pid}").exists()]
    assert not left, f"worker processes {left} outlived the loader's process"


SAVE_FROM_ANOTHER_PROCESS = """
import polars as pl
import dataset_rt as drt

cache = drt.open("running")
print(cache.save_metadata(cache.metadata.filter(pl.col("sample_id") < 10)))
"""


def test_a_loader_keeps_its_snapshot_while_another_process_saves_metadata() -> None:
    cache = drt.cache(({"x": np.full(8, i)} for i in range(400)), "running", progress=False)
    loader = cache.metadata.drt.loader(batch_size=20, shuffle=False, collate=list, prefetch=1)
    batches = iter(loader)
    seen = [int(r["x"][0]) for r in next(batches)]
    child = python_child(SAVE_FROM_ANOTHER_PROCESS)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert out.strip() == "2"
    seen += [int(r["x"][0]) for batch in batches for r in batch]
    assert seen == list(range(400))  # the running epoch is unaffected
    fresh = drt.open("running").metadata.drt.loader(batch_size=20, shuffle=False, collate=list)
    assert [int(r["x"][0]) for batch in fresh for r in batch] == list(range(10))


ORPHANED = """
import json, multiprocessing, time
import dataset_rt as drt

loader = drt.open("orphans").metadata.drt.loader(batch_size=8, num_workers=2, prefetch=1)
batches = iter(loader)
next(batches)
print(json.dumps([p.pid for p in multiprocessing.active_children()]), flush=True)
time.sleep(120)
"""


def test_workers_end_when_the_loader_process_is_killed(tmp_path: Path) -> None:
    # A fork server's workers have it as their parent, and it lives as long as they do: they
    # must watch the loader's process itself, or a killed training job leaves them behind.
    drt.cache(({"x": np.full(4, i)} for i in range(2000)), "orphans", progress=False)
    child = python_child(ORPHANED)
    assert child.stdout is not None
    workers = json.loads(child.stdout.readline())
    assert len(workers) == 2
    child.kill()
    child.wait(timeout=60)
    for pipe in (child.stdout, child.stderr):
        if pipe is not None:
            pipe.close()  # not read to their end: what the child left behind may hold them
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in workers):
        time.sleep(0.05)
    left = [pid for pid in workers if Path(f"/proc/{pid}").exists()]
    assert not left, f"worker processes {left} outlived their loader's killed process"
