"""push and pull: caches copied to and from an S3 API server on 127.0.0.1 (moto's standalone
server, a real HTTP server in its own process; never an in-process mock of the client)."""

from __future__ import annotations

import http.client
import json
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import boto3
import numpy as np
import pytest
from helpers import record, same_record

import dataset_rt as drt
from dataset_rt.errors import (
    ArgumentError,
    CacheCorruptError,
    CacheIOError,
    CacheNotFoundError,
)
from dataset_rt.remote import pull, push


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """A moto S3 server on an ephemeral port of 127.0.0.1; its endpoint URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("the moto server did not start") from None
                time.sleep(0.1)
        yield endpoint
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture
def s3(server: str) -> Any:
    """A boto3 client of the server: the test's own view of the bucket's objects."""
    return boto3.client(
        "s3",
        endpoint_url=server,
        aws_access_key_id="test",
        aws_secret_access_key="test",
        region_name="us-east-1",
    )


@pytest.fixture
def bucket(s3: Any, request: pytest.FixtureRequest) -> str:
    test = request.node.originalname.removeprefix("test_").replace("_", "-")[:40].strip("-")
    name = f"{test}-{secrets.token_hex(4)}"
    s3.create_bucket(Bucket=name)
    return name


@pytest.fixture
def options(server: str) -> dict[str, str]:
    """Storage options with the keys Polars takes."""
    return {
        "aws_endpoint_url": server,
        "aws_access_key_id": "test",
        "aws_secret_access_key": "test",
        "aws_region": "us-east-1",
        "aws_allow_http": "true",
    }


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


class FaultyProxy:
    """An HTTP proxy on 127.0.0.1 in front of the S3 server that fails chosen requests:
    ``fail`` answers 503, ``drop`` closes the connection without an answer, ``slow`` waits
    ``delay`` seconds before forwarding. ``every`` picks every n-th request; n = 1 is all."""

    def __init__(self, upstream: str) -> None:
        self.upstream = urlparse(upstream).netloc
        self.fault, self.every, self.delay = "none", 0, 0.0
        self.requests = self.injected = self.active = self.most_active = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class names it
                pass

            def forward(self) -> None:
                # A request counts as in flight until its answer starts: the client may send
                # its next one as soon as it has read this one's.
                with proxy.lock:
                    proxy.active += 1
                    proxy.most_active = max(proxy.most_active, proxy.active)
                self.counted = True
                try:
                    self.relay()
                finally:
                    self.answered()

            def answered(self) -> None:
                if self.counted:
                    self.counted = False
                    with proxy.lock:
                        proxy.active -= 1

            def relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                fault = proxy.take()
                if fault == "drop":
                    self.answered()
                    self.close_connection = True
                    return
                if fault == "fail":
                    self.answered()
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if fault == "slow":
                    time.sleep(proxy.delay)
                upstream = http.client.HTTPConnection(proxy.upstream, timeout=60)
                upstream.request(self.command, self.path, body=body, headers=dict(self.headers))
                response = upstream.getresponse()
                data = response.read()
                upstream.close()
                self.answered()
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                if self.command == "HEAD":
                    self.send_header("Content-Length", response.getheader("Content-Length", "0"))
                else:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def inject(self, fault: str, every: int, delay: float = 0.0) -> None:
        with self.lock:
            self.fault, self.every, self.delay = fault, every, delay
            self.requests = self.injected = self.most_active = 0

    def take(self) -> str:
        with self.lock:
            self.requests += 1
            if self.fault == "none" or self.requests % self.every:
                return "none"
            self.injected += 1
            return self.fault

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def proxy(server: str) -> Iterator[FaultyProxy]:
    faulty = FaultyProxy(server)
    try:
        yield faulty
    finally:
        faulty.close()


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
