"""Fixtures shared by the test modules (the root conftest isolates DATASET_RT_HOME).

Object storage is moto's standalone S3 server on 127.0.0.1, a real HTTP server in its own
process (never an in-process mock of the client), with a fault-injecting proxy in front of
it where a test needs one.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import FaultyProxy, record

import dataset_rt as drt


@pytest.fixture
def small() -> drt.Cache:
    """A 200-record cache over many small shards, with a label column."""
    return drt.cache(
        [record(i) for i in range(200)],
        "small",
        metadata=lambda r: {"label": r["label"]},
        shard_size=4096,
        progress=False,
    )


@contextlib.contextmanager
def _moto(env: dict[str, str] | None = None) -> Iterator[str]:
    """A moto S3 server on an ephemeral port of 127.0.0.1; its endpoint URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
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


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """A moto S3 server that takes any credentials; its endpoint URL."""
    with _moto() as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def strict_server() -> Iterator[str]:
    """A moto S3 server that checks credentials (it knows none): every request is refused."""
    with _moto({**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"}) as endpoint:
        yield endpoint


@pytest.fixture
def s3(server: str) -> Any:
    """A boto3 client of the server: the test's own view of the bucket's objects."""
    import boto3

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
def proxy(server: str) -> Iterator[FaultyProxy]:
    faulty = FaultyProxy(server)
    try:
        yield faulty
    finally:
        faulty.close()
