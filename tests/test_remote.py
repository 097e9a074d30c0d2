"""push and pull: caches copied to and from an S3 API server on 127.0.0.1 (moto's standalone
server, a real HTTP server in its own process; never an in-process mock of the client)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import FaultyProxy, record, same_record

import dataset_rt as drt
from dataset_rt.errors import (
    ArgumentError,
    CacheCorruptError,
    CacheIOError,
    CacheNotFoundError,
)
from dataset_rt.remote import pull, push


@pytest.fixture
def grown(tmp_path: Path) -> drt.Cache:
    """A cache with every kind of file: parts, two metadata versions, a saved plan."""
    root = tmp_path / "local"
    drt.cache(
        [record(i) for i in range(40)],
        "shared",
        root=root,
        metadata=lambda r: {"label": r["label"]},
        shard_size=16 << 10,
        progress=False,
    )
    return drt.append(
        "shared",
        [record(i) for i in range(40, 60)],
        root=root,
        metadata=lambda r: {"label": r["label"]},
        progress=False,
    )


def _keys(s3: Any, bucket: str) -> list[str]:
    listed = s3.list_objects_v2(Bucket=bucket).get("Contents", [])
    return sorted(o["Key"] for o in listed)


def test_a_pushed_cache_pulls_back_identical(
    grown: drt.Cache, s3: Any, bucket: str, options: dict[str, str], tmp_path: Path
) -> None:
    url = push("shared", f"s3://{bucket}/team", root=grown.root, storage_options=options)
    assert url == f"s3://{bucket}/team/shared"
    local = sorted(str(p.relative_to(grown.path)) for p in grown.path.rglob("*") if p.is_file())
    assert _keys(s3, bucket) == [f"team/shared/{f}" for f in local if f != "metadata/.lock"]

    elsewhere = tmp_path / "elsewhere"
    copy = pull(f"s3://{bucket}/team", "shared", root=elsewhere, storage_options=options)
    assert copy.cache_id == grown.cache_id and copy.num_parts == 2 and len(copy) == 60
    assert all(same_record(copy.get(i), grown.get(i)) for i in range(60))
    assert copy.metadata.equals(grown.metadata)
    assert drt.verify("shared", root=elsewhere, progress=False).ok
    # Pulling the same build again downloads nothing and keeps the cache.
    again = pull(f"s3://{bucket}/team", "shared", root=elsewhere, storage_options=options)
    assert again.path == copy.path and again.cache_id == copy.cache_id
    assert not [p for p in elsewhere.iterdir() if p.name.startswith(".shared.build")]


def test_a_local_file_that_fails_its_checksum_is_never_pushed_and_the_manifest_stays_away(
    grown: drt.Cache, s3: Any, bucket: str, options: dict[str, str]
) -> None:
    shard = grown.path / "parts" / "00001" / "shards" / "00000.bin"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CacheCorruptError, match=r"parts/00001/shards/00000.bin does not match"):
        push("shared", f"s3://{bucket}", root=grown.root, storage_options=options)
    assert "shared/manifest.json" not in _keys(s3, bucket)
    with pytest.raises(CacheNotFoundError, match=f"no cache 'shared' under s3://{bucket}"):
        pull(f"s3://{bucket}", "shared", root=grown.root / "x", storage_options=options)


def test_a_damaged_or_missing_remote_object_is_never_published(
    grown: drt.Cache, s3: Any, bucket: str, options: dict[str, str], tmp_path: Path
) -> None:
    push("shared", f"s3://{bucket}", root=grown.root, storage_options=options)
    key = "shared/shards/00000.bin"
    body = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[100] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    target = tmp_path / "pulled"
    with pytest.raises(CacheCorruptError, match=r"shards/00000.bin"):
        pull(f"s3://{bucket}", "shared", root=target, storage_options=options)
    with pytest.raises(CacheNotFoundError):
        drt.open("shared", root=target)
    assert not [p.name for p in target.iterdir() if ".build-" in p.name]

    s3.delete_object(Bucket=bucket, Key="shared/index.arrow")
    with pytest.raises(CacheNotFoundError, match=rf"no object at s3://{bucket}/shared/index.arrow"):
        pull(f"s3://{bucket}", "shared", root=target, storage_options=options)
    with pytest.raises(CacheNotFoundError):
        drt.open("shared", root=target)


def test_errors_name_the_bucket_and_other_builds_are_not_mixed(
    grown: drt.Cache, bucket: str, options: dict[str, str], tmp_path: Path
) -> None:
    with pytest.raises(CacheIOError, match="bucket 'no-such-bucket' does not exist"):
        push("shared", "s3://no-such-bucket/x", root=grown.root, storage_options=options)
    with pytest.raises(ArgumentError, match="not an object-storage URL"):
        push("shared", "/tmp/somewhere", root=grown.root)
    push("shared", f"s3://{bucket}", root=grown.root, storage_options=options)
    other = drt.cache([1, 2, 3], "shared", root=tmp_path / "other", progress=False)
    with pytest.raises(ArgumentError, match="holds another build of 'shared'"):
        push("shared", f"s3://{bucket}", root=other.root, storage_options=options)
    with pytest.raises(ArgumentError, match="pass overwrite=True"):
        pull(f"s3://{bucket}", "shared", root=other.root, storage_options=options)
    replaced = pull(
        f"s3://{bucket}", "shared", root=other.root, storage_options=options, overwrite=True
    )
    assert replaced.cache_id == grown.cache_id and len(replaced) == 60


def test_the_command_line_pushes_and_pulls(
    grown: drt.Cache, bucket: str, options: dict[str, str], tmp_path: Path
) -> None:
    flags = [arg for key, value in options.items() for arg in ("-o", f"{key}={value}")]
    url = f"s3://{bucket}/cli"
    run = [sys.executable, "-m", "dataset_rt.cli"]
    pushed = subprocess.run(
        [*run, "push", "shared", url, "--root", str(grown.root), "-q", *flags],
        capture_output=True,
        text=True,
        check=False,
    )
    assert pushed.returncode == 0, pushed.stderr
    assert f"pushed shared to {url}/shared" in pushed.stdout
    target = tmp_path / "cli-pulled"
    pulled = subprocess.run(
        [*run, "pull", url, "shared", "--root", str(target), "-q", *flags],
        capture_output=True,
        text=True,
        check=False,
    )
    assert pulled.returncode == 0, pulled.stderr
    assert "pulled shared (60 samples)" in pulled.stdout
    copy = drt.open("shared", root=target)
    assert np.array_equal(copy.get(59)["image"], grown.get(59)["image"])
    missing = subprocess.run(
        [*run, "pull", url, "nothing", "--root", str(target), "-q", *flags],
        capture_output=True,
        text=True,
        check=False,
    )
    assert missing.returncode == 1 and "no cache 'nothing' under" in missing.stderr
    assert json.loads((copy.path / "manifest.json").read_text())["cache_id"] == grown.cache_id


@pytest.mark.parametrize(("fault", "every"), [("fail", 3), ("drop", 4)])
def test_server_errors_and_dropped_connections_are_retried(
    grown: drt.Cache,
    bucket: str,
    options: dict[str, str],
    proxy: FaultyProxy,
    tmp_path: Path,
    fault: str,
    every: int,
) -> None:
    through = {**options, "aws_endpoint_url": proxy.endpoint}
    proxy.inject(fault, every)
    push("shared", f"s3://{bucket}", root=grown.root, storage_options=through, progress=False)
    pushed = proxy.injected
    copy = pull(f"s3://{bucket}", "shared", root=tmp_path / "p", storage_options=through)
    assert pushed > 0 and proxy.injected > pushed, "faults were injected both ways"
    assert copy.cache_id == grown.cache_id
    assert all(copy.get_bytes(i) == grown.get_bytes(i) for i in range(60))


def test_a_slow_response_times_out_and_is_read_again(
    grown: drt.Cache, bucket: str, options: dict[str, str], proxy: FaultyProxy, tmp_path: Path
) -> None:
    push("shared", f"s3://{bucket}", root=grown.root, storage_options=options, progress=False)
    through = {**options, "aws_endpoint_url": proxy.endpoint, "timeout": "1s"}
    proxy.inject("slow", 3, delay=3.0)
    copy = pull(f"s3://{bucket}", "shared", root=tmp_path / "p", storage_options=through)
    assert proxy.injected > 0 and copy.cache_id == grown.cache_id


def test_a_server_that_keeps_failing_is_an_error_naming_the_object(
    grown: drt.Cache, bucket: str, options: dict[str, str], proxy: FaultyProxy, tmp_path: Path
) -> None:
    push("shared", f"s3://{bucket}", root=grown.root, storage_options=options, progress=False)
    through = {**options, "aws_endpoint_url": proxy.endpoint}
    proxy.inject("fail", 1)
    start = time.monotonic()
    with pytest.raises(CacheIOError, match=rf"object storage failed on s3://{bucket}/shared/"):
        pull(f"s3://{bucket}", "shared", root=tmp_path / "p", storage_options=through)
    assert time.monotonic() - start < 45, "retries stop after a bounded time"
    assert proxy.requests > 1, "the request was retried before giving up"
    proxy.inject("none", 1)
    with pytest.raises(CacheNotFoundError):
        drt.open("shared", root=tmp_path / "p")


def test_files_move_in_parallel_with_a_bounded_number_in_flight(
    bucket: str, options: dict[str, str], proxy: FaultyProxy, tmp_path: Path
) -> None:
    many = drt.cache(
        [bytes([i % 256]) * 900 for i in range(120)],
        "many-shards",
        root=tmp_path / "local",
        serializer=bytes,
        decode=bytes,
        shard_size=1024,
        progress=False,
    )
    assert many.num_shards == 120
    through = {**options, "aws_endpoint_url": proxy.endpoint}
    proxy.inject("slow", 1, delay=0.05)
    push("many-shards", f"s3://{bucket}", root=many.root, storage_options=through, progress=False)
    assert 1 < proxy.most_active <= 8, proxy.most_active
    proxy.inject("slow", 1, delay=0.05)
    copy = pull(f"s3://{bucket}", "many-shards", root=tmp_path / "p", storage_options=through)
    assert 1 < proxy.most_active <= 8, proxy.most_active
    assert [copy.get_bytes(i) for i in range(120)] == [many.get_bytes(i) for i in range(120)]


def test_a_file_url_is_a_remote_root_too(grown: drt.Cache, tmp_path: Path) -> None:
    url = (tmp_path / "shared-disk").as_uri()
    assert push("shared", url, root=grown.root, progress=False) == f"{url}/shared"
    assert (tmp_path / "shared-disk" / "shared" / "manifest.json").is_file()
    copy = pull(url, "shared", root=tmp_path / "p", progress=False)
    assert copy.cache_id == grown.cache_id and copy.get_bytes(59) == grown.get_bytes(59)
