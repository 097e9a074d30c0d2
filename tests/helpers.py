"""Shared by the tests: small records and a way to run Python in a child process."""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NamedTuple
from urllib.parse import urlparse

import numpy as np

if TYPE_CHECKING:
    import torch

REPO = Path(__file__).resolve().parent.parent


def record(i: int) -> dict[str, Any]:
    """A small record like a real one: an image-ish array, a label, a caption."""
    rng = np.random.default_rng(i)
    return {
        "image": rng.integers(0, 255, size=(3, 8, 8), dtype=np.uint8),
        "label": i % 5,
        "caption": f"sample {i}",
    }


def same_record(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        a.keys() == b.keys()
        and np.array_equal(a["image"], b["image"])
        and a["label"] == b["label"]
        and a["caption"] == b["caption"]
    )


def python_child(
    code: str,
    env: dict[str, str] | None = None,
    stdout: IO[str] | int = subprocess.PIPE,
    stderr: IO[str] | int = subprocess.PIPE,
) -> subprocess.Popen[str]:
    """Starts ``python -c code`` with the tests' helpers importable (output to pipes)."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), full_env.get("PYTHONPATH", "")])
    full_env.update(env or {})
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        stdout=stdout,
        stderr=stderr,
        text=True,
    )


def slow_identity(x: Any) -> Any:
    """A transform that takes a known time (1 ms), for the loaders' stage counters."""
    import time

    time.sleep(0.001)
    return x


class Squares:
    """A map-style dataset (no ``__iter__``) that can die or fail at a chosen index; parallel
    builds send it to their worker processes, which import it from here."""

    def __init__(self, n: int, die_at: int = -1, fail_at: int = -1) -> None:
        self.n, self.die_at, self.fail_at = n, die_at, fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index == self.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if index == self.fail_at:
            raise ValueError(f"unreadable file for {index}")
        return {"i": index, "sq": np.full(4, index * index), "tag": f"t{index % 3}"}


class FaultyProxy:
    """An HTTP proxy on 127.0.0.1 in front of the S3 server that fails chosen requests:
    ``fail`` answers 503, ``drop`` closes the connection without an answer, ``slow`` waits
    ``delay`` seconds before forwarding. ``every`` picks every n-th request; n = 1 is all."""

    def __init__(self, upstream: str) -> None:
        self.upstream = urlparse(upstream).netloc
        self.fault, self.every, self.delay = "none", 0, 0.0
        self.requests = self.injected = self.active = self.most_active = 0
        self.seen: list[tuple[str, str]] = []  # (method, path) of every request
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
                fault = proxy.take(self.command, self.path)
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
            self.seen = []

    def take(self, method: str, path: str) -> str:
        with self.lock:
            self.seen.append((method, path))
            self.requests += 1
            if self.fault == "none" or self.requests % self.every:
                return "none"
            self.injected += 1
            return self.fault

    def gets(self, part: str) -> list[str]:
        """The paths of the GET requests so far whose path contains ``part``."""
        with self.lock:
            return [path for method, path in self.seen if method == "GET" and part in path]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Pair(NamedTuple):
    """A named tuple of tensors, as a collate may return."""

    x: torch.Tensor
    label: torch.Tensor


class Holder:
    """An object of the user's own that holds a batch's tensors."""

    def __init__(self, batch: dict[str, torch.Tensor]) -> None:
        self.batch = batch


def transposed(records: list[dict[str, Any]]) -> Any:
    """A collate that returns views, copies and containers of the default collate's batch."""
    import torch

    from dataset_rt.collate import default_collate

    batch = default_collate(records)
    return [
        Pair(batch["x"].t(), batch["label"]),
        {"tail": batch["x"][1:, :3], "doubled": batch["x"] * 2, "name": "b"},
        (batch["label"].to(torch.float64), np.asarray(batch["label"])),
    ]


def held(records: list[dict[str, Any]]) -> Any:
    """A collate that returns the default collate's batch inside an object of its own."""
    from dataset_rt.collate import default_collate

    return Holder(default_collate(records))


def as_arrays(records: list[dict[str, Any]]) -> Any:
    """A collate that returns the default collate's array as a NumPy array over its memory."""
    from dataset_rt.collate import default_collate

    batch = default_collate(records)
    return {"x": batch["x"].numpy(), "label": batch["label"]}
