"""Caches opened straight from object storage: metadata at once, payload shards on demand.

Everything goes through moto's S3 server on 127.0.0.1 (see conftest.py); a proxy in front
of it counts the requests, so that "nothing but the metadata was fetched" and "each shard
once" are checked where the bytes travel, not inferred from the local directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from helpers import FaultyProxy, python_child, record, same_record

import dataset_rt as drt
from dataset_rt import _native
from dataset_rt.errors import (
    ArgumentError,
    CacheCorruptError,
    CacheIOError,
    CacheNotFoundError,
    StaleCacheError,
)
from dataset_rt.remote import pull, push

N = 300


def _records(n: int = N, offset: int = 0) -> list[dict[str, Any]]:
    return [record(i + offset) for i in range(n)]


@pytest.fixture
def through(options: dict[str, str], proxy: FaultyProxy) -> dict[str, str]:
    """Storage options that reach the server through the counting proxy."""
    return {**options, "aws_endpoint_url": proxy.endpoint}


@pytest.fixture
def url(bucket: str, options: dict[str, str]) -> str:
    """A remote root holding cache "rc", built with ``drt.cache(root=url)``: many shards."""
    root = f"s3://{bucket}/team"
    built = drt.cache(
        _records(),
        "rc",
        root=root,
        metadata=lambda r: {"label": r["label"]},
        shard_size=4 << 10,
        storage_options=options,
        progress=False,
    )
    assert built.url == f"{root}/rc" and built.num_shards > 20
    return root


def _local_shards(cache: drt.Cache) -> list[Path]:
    return sorted(p for p in cache.path.rglob("*.bin") if p.parent.name == "shards")


def _bytes_on_disk(cache: drt.Cache) -> int:
    """Bytes of the shards in the local copy now (eviction may remove some meanwhile)."""
    total = 0
    for path in _local_shards(cache):
        try:
            total += path.stat().st_size
        except FileNotFoundError:
            continue
    return total


def _reference(tmp_path: Path) -> drt.Cache:
    """The same records cached on local disk."""
    return drt.cache(
        _records(),
        "reference",
        root=tmp_path / "ref",
        metadata=lambda r: {"label": r["label"]},
        progress=False,
    )


def test_opening_reads_the_metadata_files_alone_and_analysis_fetches_no_payload(
    url: str, through: dict[str, str], proxy: FaultyProxy, tmp_path: Path
) -> None:
    proxy.inject("none", 1)
    cache = drt.open("rc", root=url, storage_options=through, local_dir=tmp_path / "local")
    assert cache.url == f"{url}/rc" and len(cache) == N
    frame = cache.metadata
    assert frame.height == N and set(frame["label"].to_list()) == set(range(5))
    scanned = cache.scan().filter(pl.col("label") < 2).collect()
    assert scanned.height == frame.filter(pl.col("label") < 2).height
    summary = frame.drt.summary(by="label")
    assert summary["samples"].sum() == N
    balanced = frame.with_columns(weight=pl.col("label").drt.balance())
    assert balanced["weight"].sum() > 0
    drt.list_caches(url, storage_options=through)
    fetched = {path.split("/rc/", 1)[1] for path in proxy.gets("/rc/")}
    assert fetched == {"manifest.json", "metadata/v00001.parquet"}, "the metadata files alone"
    assert _local_shards(cache) == []
    # A loader needs the saved plan (when it is made) and the index (when it reads).
    loader = cache.scan().drt.loader(batch_size=8, seed=0, collate=list)
    assert "/rc/metadata/v00001.plan" in "".join(proxy.gets("/rc/"))
    assert sum(len(batch) for batch in loader) == N
    fetched = {path.split("/rc/", 1)[1] for path in proxy.gets("/rc/")}
    assert {"index.arrow", "metadata/v00001.plan"} <= fetched


def test_records_and_loaders_fetch_each_needed_shard_once_and_match_a_local_cache(
    url: str, through: dict[str, str], proxy: FaultyProxy, tmp_path: Path
) -> None:
    reference = _reference(tmp_path)
    proxy.inject("none", 1)
    cache = drt.open("rc", root=url, storage_options=through, local_dir=tmp_path / "local")
    assert same_record(cache.get(7), reference.get(7))
    assert len(proxy.gets("/shards/")) == 1, "get() fetched the one shard it reads"
    assert all(
        same_record(a, b)
        for a, b in zip(
            cache.get_many(range(40, 60)), reference.get_many(range(40, 60)), strict=True
        )
    )

    # Two epochs of a weighted loader: draws identical to the local cache's, and every
    # shard fetched once (the second epoch reads the local copy).
    frame = cache.metadata.with_columns(weight=pl.col("label") + 1.0)
    local_frame = reference.metadata.with_columns(weight=pl.col("label") + 1.0)
    remote_loader = frame.drt.loader(batch_size=32, seed=3, collate=list)
    local_loader = local_frame.drt.loader(batch_size=32, seed=3, collate=list)
    for _ in range(2):
        for a, b in zip(remote_loader, local_loader, strict=True):
            assert all(same_record(x, y) for x, y in zip(a, b, strict=True))
    shards = proxy.gets("/shards/")
    assert len(shards) == len(set(shards)), "no shard was fetched twice"
    assert len(shards) == len(_local_shards(cache)) <= cache.num_shards


def test_worker_processes_share_one_local_copy(
    url: str, through: dict[str, str], proxy: FaultyProxy, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    reference = _reference(tmp_path)
    proxy.inject("none", 1)
    cache = drt.open("rc", root=url, storage_options=through, local_dir=tmp_path / "local")
    loader = cache.scan().drt.loader(batch_size=16, seed=5, num_workers=2, collate=list)
    local = reference.scan().drt.loader(batch_size=16, seed=5, collate=list)
    got = [r["caption"] for batch in loader for r in batch]
    assert got == [r["caption"] for batch in local for r in batch]
    shards = proxy.gets("/shards/")
    assert len(shards) == len(set(shards)) == len(_local_shards(cache))


def test_a_local_limit_evicts_the_least_recently_used_shards(
    url: str, options: dict[str, str], tmp_path: Path
) -> None:
    reference = _reference(tmp_path)
    limit = 40 << 10  # about ten of the cache's 4 KiB shards
    cache = drt.open(
        "rc", root=url, storage_options=options, local_dir=tmp_path / "local", local_limit=limit
    )
    loader = cache.metadata.drt.loader(batch_size=8, seed=1, collate=list)
    expected = reference.metadata.drt.loader(batch_size=8, seed=1, collate=list)
    for a, b in zip(loader, expected, strict=True):
        assert all(same_record(x, y) for x, y in zip(a, b, strict=True))
        on_disk = _bytes_on_disk(cache)
        assert on_disk <= limit + (4 << 10) * 10, on_disk  # the limit, plus what is in flight
    assert _bytes_on_disk(cache) <= limit
    # Evicted shards come back when read again.
    assert all(same_record(cache.get(i), reference.get(i)) for i in range(0, N, 7))
    with pytest.raises(ArgumentError, match="more than local_limit=40,960"):
        cache.verify(progress=False)
    with pytest.raises(ArgumentError, match="local_limit"):
        drt.open("rc", root=url, storage_options=options, local_limit=-1)


def test_a_damaged_remote_shard_is_never_published(
    url: str, bucket: str, s3: Any, options: dict[str, str], tmp_path: Path
) -> None:
    key = "team/rc/shards/00003.bin"
    body = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[-1] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    cache = drt.open("rc", root=url, storage_options=options, local_dir=tmp_path / "local")
    refused: list[tuple[int, str]] = []
    for i in cache.metadata["sample_id"].to_list():
        try:
            cache.get(i)
        except CacheCorruptError as exc:
            refused.append((i, str(exc)))
            break
    (damaged, message), *_ = refused
    assert "shards/00003.bin does not match its manifest" in message
    assert not (cache.path / "shards" / "00003.bin").exists()
    assert not list((cache.root / ".partial").iterdir()), "the partial download was removed"
    with pytest.raises(CacheCorruptError, match="00003.bin"):
        cache.get(damaged)  # asked again, fetched again, refused again


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda m: {**m, "cache_id": "../../outside"}, "is not a build id"),
        (lambda m: {**m, "format_version": 99}, "format version 99"),
        (lambda m: {k: v for k, v in m.items() if k != "shards"}, "malformed manifest"),
    ],
    ids=["cache-id-with-a-path", "newer-format", "missing-field"],
)
def test_a_remote_manifest_is_checked_by_the_engine_before_anything_uses_it(
    url: str,
    bucket: str,
    s3: Any,
    options: dict[str, str],
    tmp_path: Path,
    edit: Any,
    expected: str,
) -> None:
    # The cache_id names the local copy's directory: a manifest that would lead it
    # elsewhere is refused, as one of a newer format or a malformed one is, naming the URL.
    key = "team/rc/manifest.json"
    manifest = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    s3.put_object(Bucket=bucket, Key=key, Body=json.dumps(edit(manifest)).encode())
    with pytest.raises(CacheCorruptError, match=expected) as caught:
        drt.open("rc", root=url, storage_options=options, local_dir=tmp_path / "local")
    assert "team/rc/manifest.json" in str(caught.value)
    assert not (tmp_path / "outside").exists()
    assert "rc" not in drt.list_caches(url, storage_options=options)["name"].to_list()


def test_a_download_left_by_a_killed_process_is_never_trusted(
    url: str, options: dict[str, str], tmp_path: Path
) -> None:
    local = tmp_path / "local"
    code = f"""
import os, signal
import dataset_rt as drt
from dataset_rt import _native
from dataset_rt import objects
cache = drt.open("rc", root={url!r}, storage_options={options!r}, local_dir={str(local)!r})
real = objects.RemoteDir.download
def die_midway(self, path, target, stop=None):
    real(self, path, target, stop)
    with open(target, "r+b") as f:
        f.truncate(100)
    os.kill(os.getpid(), signal.SIGKILL)
objects.RemoteDir.download = die_midway
cache.get(0)
"""
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert child.returncode == -9, child.stderr
    (partial,) = local.glob("*/.partial/*")
    assert partial.stat().st_size == 100
    assert not list(local.glob("*/rc/shards/*.bin"))
    cache = drt.open("rc", root=url, storage_options=options, local_dir=local)
    assert not partial.exists(), "opening removes what dead processes left"
    assert same_record(cache.get(0), _reference(tmp_path).get(0))


def test_a_rebuilt_remote_cache_is_detected_and_never_mixed(
    url: str, options: dict[str, str], tmp_path: Path
) -> None:
    local = tmp_path / "local"
    old = drt.open("rc", root=url, storage_options=options, local_dir=local)
    first = old.get(0)
    rebuilt = drt.cache(
        _records(offset=1000),
        "rc",
        root=url,
        shard_size=4 << 10,
        storage_options=options,
        overwrite=True,
        progress=False,
        metadata=lambda r: {"label": r["label"]},
    )
    assert rebuilt.cache_id != old.cache_id and rebuilt.path != old.path
    assert same_record(old.get(0), first), "a fetched shard stays readable"
    with pytest.raises(StaleCacheError, match=r"'rc' at s3://.*/team/rc was rebuilt"):
        old.get(N - 1)  # its shard was never fetched: the remote one is another build's
    new = drt.open("rc", root=url, storage_options=options, local_dir=local)
    assert new.cache_id == rebuilt.cache_id
    assert same_record(new.get(0), record(1000)) and same_record(new.get(N - 1), record(999 + N))
    reused = drt.cache([1], "rc", root=url, storage_options=options, progress=False)
    assert reused.cache_id == rebuilt.cache_id, "an existing remote cache is reused"


def test_a_remote_default_root_serves_open_list_and_the_command_line(
    url: str, options: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DATASET_RT_HOME", url)
    monkeypatch.setenv("DATASET_RT_LOCAL_DIR", str(tmp_path / "local"))
    assert drt.list_caches(storage_options=options)["name"].to_list() == ["rc"]
    cache = drt.open("rc", storage_options=options)
    assert cache.path.is_relative_to(tmp_path / "local") and len(cache) == N
    with pytest.raises(ArgumentError, match="in object storage"):
        drt.append("rc", [record(0)])
    with pytest.raises(ArgumentError, match="pull it"):
        cache.save_metadata(cache.metadata)

    env = {**os.environ, "DATASET_RT_HOME": url, "DATASET_RT_LOCAL_DIR": str(tmp_path / "cli")}
    flags = [arg for key, value in options.items() for arg in ("-o", f"{key}={value}")]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "dataset_rt.cli", *args, *flags],
            capture_output=True,
            text=True,
            env=env,
        )

    listed = cli("ls")
    assert listed.returncode == 0 and "rc" in listed.stdout and "300" in listed.stdout
    info = cli("info", "rc")
    assert info.returncode == 0, info.stderr
    assert f"url         {url}/rc" in info.stdout and "label" in info.stdout
    verified = cli("verify", "rc", "-q")
    assert verified.returncode == 0, verified.stderr
    assert "intact" in verified.stdout
    missing = cli("info", "nothing")
    assert missing.returncode == 1 and f"no cache 'nothing' under {url}" in missing.stderr


def test_missing_buckets_and_refused_credentials_say_which(
    url: str, options: dict[str, str], strict_server: str, tmp_path: Path
) -> None:
    refused = {**options, "aws_endpoint_url": strict_server, "aws_access_key_id": "nobody"}
    with pytest.raises(
        CacheIOError, match=r"refused \(InvalidAccessKeyId\): check the credentials"
    ):
        drt.open("rc", root="s3://any-bucket/x", storage_options=refused, local_dir=tmp_path)
    with pytest.raises(CacheIOError, match="InvalidAccessKeyId"):
        drt.list_caches("s3://any-bucket/x", storage_options=refused)
    with pytest.raises(CacheIOError, match="bucket 'no-such-bucket' does not exist"):
        drt.open("rc", root="s3://no-such-bucket/x", storage_options=options)
    with pytest.raises(CacheNotFoundError, match=f"no cache 'other' under {url}"):
        drt.open("other", root=url, storage_options=options, local_dir=tmp_path)


def test_ranks_on_one_machine_fetch_each_shard_once_between_them(
    url: str, through: dict[str, str], proxy: FaultyProxy, tmp_path: Path
) -> None:
    local = tmp_path / "node"
    code = f"""
import dataset_rt as drt
from dataset_rt import _native
cache = drt.open("rc", root={url!r}, storage_options={through!r}, local_dir={str(local)!r})
loader = cache.scan().drt.loader(batch_size=8, seed=2, rank=RANK, world_size=2, collate=list)
print(sum(len(batch) for batch in loader))
"""
    proxy.inject("none", 1)
    ranks = [python_child(code.replace("RANK", str(rank))) for rank in range(2)]
    outputs = [rank.communicate(timeout=300) for rank in ranks]
    for rank, (out, err) in zip(ranks, outputs, strict=True):
        assert rank.returncode == 0, err
        assert int(out) == N // 2
    shards = proxy.gets("/shards/")
    assert shards and len(shards) == len(set(shards)), "one download per shard, both ranks"


def test_faults_while_fetching_on_demand_are_retried(
    url: str, through: dict[str, str], proxy: FaultyProxy, tmp_path: Path
) -> None:
    cache = drt.open("rc", root=url, storage_options=through, local_dir=tmp_path / "local")
    reference = _reference(tmp_path)
    proxy.inject("drop", 2)  # every other request: each shard's first try, or its retry
    assert all(same_record(cache.get(i), reference.get(i)) for i in range(0, N, 10))
    shards = proxy.gets("/shards/")
    assert proxy.injected > 0 and len(shards) > len(set(shards)), "dropped fetches were retried"
    proxy.inject("drop", 3)
    got = cache.scan().drt.loader(batch_size=32, seed=4, collate=list)
    expected = reference.scan().drt.loader(batch_size=32, seed=4, collate=list)
    for a, b in zip(got, expected, strict=True):
        assert all(same_record(x, y) for x, y in zip(a, b, strict=True))


def test_a_loader_left_early_stops_its_fetching_without_waiting_for_it(
    url: str, through: dict[str, str], proxy: FaultyProxy, tmp_path: Path
) -> None:
    code = f"""
import gc, time
import dataset_rt as drt
from dataset_rt import _native
cache = drt.open("rc", root={url!r}, storage_options={through!r}, local_dir={str(tmp_path)!r})
for _ in range(3):
    for batch in cache.scan().drt.loader(batch_size=16, seed=1, prefetch=8, collate=list):
        break  # the reading thread and the prefetching are mid-download
    gc.collect()
print("left")
"""
    proxy.inject("slow", 1, delay=0.3)
    child = python_child(code)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert out.strip() == "left"


def test_the_environment_gives_the_credentials_options_leave_out(
    url: str, options: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in ("aws_endpoint_url", "aws_access_key_id", "aws_secret_access_key", "aws_region"):
        monkeypatch.setenv(key.upper(), options[key])
    # Plain HTTP is a setting of the test server, not a credential.
    cache = drt.open(
        "rc", root=url, storage_options={"aws_allow_http": "true"}, local_dir=tmp_path / "local"
    )
    assert len(cache) == N and cache.get(3)["caption"] == "sample 3"


def test_a_plot_of_a_remote_cache_fetches_no_payload(
    url: str, options: dict[str, str], tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    cache = drt.open("rc", root=url, storage_options=options, local_dir=tmp_path / "local")
    figure = cache.metadata.drt.plot(by="label")
    assert len(figure.axes) >= 1 and figure.axes[0].has_data()
    assert _local_shards(cache) == []


def test_a_loader_fetches_ahead_in_parallel_within_a_bound(
    url: str, through: dict[str, str], proxy: FaultyProxy, tmp_path: Path
) -> None:
    cache = drt.open("rc", root=url, storage_options=through, local_dir=tmp_path / "local")
    proxy.inject("slow", 1, delay=0.05)
    batches = sum(1 for _ in cache.scan().drt.loader(batch_size=64, seed=6, collate=list))
    assert batches == -(-N // 64)
    # 8 downloads ahead of the batches, and the reader's own for a shard none has started.
    assert 1 < proxy.most_active <= 9, proxy.most_active
    assert len(proxy.gets("/shards/")) == len(_local_shards(cache))


def test_an_open_killed_midway_and_an_append_pushed_later_are_both_handled(
    url: str, options: dict[str, str], tmp_path: Path
) -> None:
    local = tmp_path / "local"
    code = f"""
import os, signal
import dataset_rt as drt
from dataset_rt import _native
from dataset_rt import fetch
real = fetch._download_checked
def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
fetch._download_checked = die
drt.open("rc", root={url!r}, storage_options={options!r}, local_dir={str(local)!r})
"""
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert child.returncode == -9, child.stderr
    assert list(local.glob("*/.partial/*-manifest")), "the killed open left its staging"
    cache = drt.open("rc", root=url, storage_options=options, local_dir=local)
    assert len(cache) == N and not list(local.glob("*/.partial/*"))
    assert cache.get(0)["caption"] == "sample 0"

    # The same build grows (an append, pushed again): reopening serves the new records.
    pulled = pull(url, "rc", root=tmp_path / "work", storage_options=options, progress=False)
    drt.append("rc", _records(10, offset=N), root=pulled.root, progress=False)
    push("rc", url, root=pulled.root, storage_options=options, progress=False)
    grown = drt.open("rc", root=url, storage_options=options, local_dir=local)
    assert grown.cache_id == cache.cache_id and len(grown) == N + 10
    assert same_record(grown.get(N + 3), record(N + 3))


def test_local_dir_is_for_remote_roots_and_eviction_spares_local_caches_under_it(
    url: str, options: dict[str, str], tmp_path: Path
) -> None:
    with pytest.raises(ArgumentError, match="local_dir and local_limit apply to caches in object"):
        drt.open("anything", root=tmp_path, local_dir=tmp_path / "x")
    local = tmp_path / "shared"
    mine = drt.cache(_records(50), "mine", root=local, shard_size=4 << 10, progress=False)
    before = _local_shards(mine)
    cache = drt.open("rc", root=url, storage_options=options, local_dir=local, local_limit=1)
    assert cache.get(5)["caption"] == "sample 5"
    assert _local_shards(mine) == before, "a local cache under local_dir is not a copy"
    assert drt.verify("mine", root=local, progress=False).ok


def test_an_overwriting_build_leaves_only_its_own_objects(
    url: str, bucket: str, s3: Any, options: dict[str, str]
) -> None:
    smaller = drt.cache(
        _records(20),
        "rc",
        root=url,
        shard_size=4 << 10,
        storage_options=options,
        overwrite=True,
        progress=False,
    )
    listed = s3.list_objects_v2(Bucket=bucket, Prefix="team/rc/")["Contents"]
    keys = {o["Key"].removeprefix("team/rc/") for o in listed}
    files = {file for file, _ in _native.read_manifest(smaller.path).files}
    assert keys == files | {"manifest.json"}
    assert len(drt.open("rc", root=url, storage_options=options)) == 20


def test_a_packed_loader_reads_a_token_cache_in_object_storage(
    bucket: str, options: dict[str, str], tmp_path: Path
) -> None:
    import numpy as np

    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 30_000, size=int(rng.integers(5, 300))) for _ in range(400)]
    drt.cache(
        docs,
        "rtok",
        root=f"s3://{bucket}/tokens",
        serializer="tokens",
        shard_size=8 << 10,
        storage_options=options,
        progress=False,
    )
    local = drt.cache(docs, "rtok-local", serializer="tokens", progress=False)
    remote = drt.open(
        "rtok", root=f"s3://{bucket}/tokens", storage_options=options, local_dir=tmp_path / "local"
    )
    a = list(remote.metadata.drt.loader(4, seq_len=64, seed=1, separator=0))
    b = list(local.metadata.drt.loader(4, seq_len=64, seed=1, separator=0))
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        assert (x["input_ids"] == y["input_ids"]).all()
