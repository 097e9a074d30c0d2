"""Processes killed in the middle of a push, a pull or a parallel build, with real SIGKILLs
and moto's S3 server: what they leave opens as before or as after, never as a mix, and the
next call completes and cleans up."""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import python_child

import dataset_rt as drt
from dataset_rt.errors import CacheNotFoundError
from dataset_rt.remote import pull, push

# A child that pushes or pulls cache "moving" and kills itself with SIGKILL as transfer
# number $KILL_AT (1-based, counted over the whole call) starts: exactly where a machine
# that loses power mid-transfer stops.
TRANSFER_AND_DIE = """
import json, os, signal, threading
from dataset_rt import objects
from dataset_rt.remote import pull, push

kill_at, calls, lock = int(os.environ["KILL_AT"]), [0], threading.Lock()
verb = os.environ["VERB"]
original = getattr(objects.RemoteDir, "upload" if verb == "push" else "download")

def dying(self, *args):
    with lock:
        calls[0] += 1
        if calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    return original(self, *args)

setattr(objects.RemoteDir, "upload" if verb == "push" else "download", dying)
options = json.loads(os.environ["OPTIONS"])
if verb == "push":
    push("moving", os.environ["URL"], root=os.environ["ROOT"], storage_options=options,
         overwrite=True, progress=False)
else:
    pull(os.environ["URL"], "moving", root=os.environ["ROOT"], storage_options=options,
         overwrite=True, progress=False)
print("finished")
"""


def _build(root: Path, seed: int) -> drt.Cache:
    rng = np.random.default_rng(seed)
    return drt.cache(
        ({"x": rng.standard_normal(64)} for _ in range(120)),
        "moving",
        root=root,
        shard_size=4096,
        overwrite=True,
        progress=False,
    )


def _transfers(cache: drt.Cache) -> int:
    """Files a push or pull of ``cache`` moves: every file of its manifest, then the manifest."""
    return sum(1 for p in cache.path.rglob("*") if p.is_file())


def _kill_during(verb: str, kill_at: int, url: str, root: Path, options: dict[str, str]) -> None:
    env = {"VERB": verb, "KILL_AT": str(kill_at), "URL": url, "ROOT": str(root)}
    child = python_child(TRANSFER_AND_DIE, {**env, "OPTIONS": json.dumps(options)})
    out, err = child.communicate(timeout=120)
    assert child.returncode == -signal.SIGKILL, (child.returncode, out, err[-2000:])


def _remote_state(url: str, options: dict[str, str], local: Path) -> str | None:
    """The cache_id of the remote cache if it opens (checked completely), None if absent."""
    try:
        cache = drt.open("moving", root=url, storage_options=options, local_dir=local)
    except CacheNotFoundError:
        return None
    cache.verify(progress=False).raise_if_damaged()
    return cache.cache_id


@pytest.mark.parametrize("where", ["first", "middle", "manifest"])
def test_a_killed_push_leaves_the_remote_as_before_or_as_after(
    tmp_path: Path, bucket: str, options: dict[str, str], where: str
) -> None:
    old = _build(tmp_path / "old", seed=0)
    new = _build(tmp_path / "new", seed=1)
    url = f"s3://{bucket}/caches"
    push("moving", url, root=tmp_path / "old", storage_options=options, progress=False)
    total = _transfers(new)
    kill_at = {"first": 1, "middle": total // 2, "manifest": total}[where]
    _kill_during("push", kill_at, url, tmp_path / "new", options)
    # An overwriting push deletes the old manifest before its first upload, so that readers
    # of the old build never fetch the new build's shards: the cache is then absent until
    # the new manifest is up. It never opens as a mix of the two builds.
    state = _remote_state(url, options, tmp_path / "local-1")
    assert state in (None, old.cache_id), state
    push("moving", url, root=tmp_path / "new", storage_options=options, progress=False)
    assert _remote_state(url, options, tmp_path / "local-2") == new.cache_id


def test_a_killed_first_push_leaves_nothing_that_opens(
    tmp_path: Path, bucket: str, options: dict[str, str]
) -> None:
    cache = _build(tmp_path / "src", seed=0)
    url = f"s3://{bucket}/caches"
    _kill_during("push", _transfers(cache), url, tmp_path / "src", options)  # at the manifest
    assert _remote_state(url, options, tmp_path / "local-1") is None
    push("moving", url, root=tmp_path / "src", storage_options=options, progress=False)
    assert _remote_state(url, options, tmp_path / "local-2") == cache.cache_id


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_killed_pull_publishes_nothing_and_the_next_one_cleans_up(
    tmp_path: Path, bucket: str, options: dict[str, str], where: str
) -> None:
    old = _build(tmp_path / "dest", seed=0)  # the local build a pull with overwrite replaces
    new = _build(tmp_path / "src", seed=1)
    url = f"s3://{bucket}/caches"
    push("moving", url, root=tmp_path / "src", storage_options=options, progress=False)
    total = _transfers(new) - 1  # the manifest comes with the first request, not a download
    kill_at = {"first": 1, "middle": total // 2, "last": total}[where]
    dest = tmp_path / "dest"
    _kill_during("pull", kill_at, url, dest, options)
    kept = drt.open("moving", root=dest)
    assert kept.cache_id == old.cache_id, "the local build is untouched until a copy is whole"
    kept.verify(progress=False).raise_if_damaged()
    pulled = pull(url, "moving", root=dest, storage_options=options, overwrite=True)
    assert pulled.cache_id == new.cache_id
    pulled.verify(progress=False).raise_if_damaged()
    assert sorted(p.name for p in dest.iterdir() if not p.name.startswith(".moving.lock")) == [
        "moving"
    ], "the next pull removed the killed one's partial copy"


def test_a_killed_parallel_build_never_leaves_a_half_cache(tmp_path: Path) -> None:
    code = f"""
    import time
    import dataset_rt as drt

    class Slow:
        def __len__(self):
            return 6000

        def __getitem__(self, i):
            if i % 500 == 0:
                time.sleep(0.05)  # stretch the build over a second or so
            return bytes([i % 256]) * 512

    drt.cache(Slow(), "parallel", root={str(tmp_path)!r}, num_proc=2, shard_size=1 << 16,
              progress=False)
    print("finished")
    """
    outcomes: set[str] = set()
    for delay in (0.3, 0.8, 1.2, 1.6, 2.2, 4.0):
        child = python_child(code)
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)
        try:
            cache = drt.open("parallel", root=tmp_path)
        except CacheNotFoundError:
            outcomes.add("absent")
        else:
            assert len(cache) == 6000
            cache.verify(progress=False).raise_if_damaged()
            assert cache.get(5999, verify=True) == bytes([5999 % 256]) * 512
            outcomes.add("complete")
            shutil.rmtree(cache.path)
    assert "absent" in outcomes, outcomes
    # The next build of the name clears what the killed ones left (their workers included).
    time.sleep(0.5)
    rebuilt = drt.cache([b"a", b"b"], "parallel", root=tmp_path, num_proc=2, progress=False)
    assert rebuilt.get_many([0, 1]) == [b"a", b"b"]
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith(".parallel.build")]
    assert not left, left
