"""Damages the files of a cache and checks that every reader refuses them cleanly.

Run as a script by ``test_file_fuzz.py`` (a fixed budget) and by ``bench/fuzz.py`` (a
longer run), in a process of its own, so that an abort is seen as one::

    python tests/file_fuzz.py --cases 200 --seed 0 --dir /tmp/fuzz [--endpoint URL]

Each case copies a template cache (uncompressed with an appended part and a saved metadata
version, or zstd-compressed), damages one of its files, then opens it and reads it every
way a user does. A case passes when each read either works or raises a ``dataset_rt``
error (``CacheCorruptError`` for damage), and nothing outside the cache's directory was
written. Damage: truncation, flipped bits, a huge or negative 64-bit value, a zeroed range,
trailing garbage, a file replaced by a symbolic link leaving the cache, and in the manifest,
JSON edits: a file name made into a path trick (``..``, an absolute path, a NUL, a slash),
a huge or negative count, a dropped key or list element.

With ``--endpoint URL`` (an S3 server that takes any credentials, such as moto's), the
damaged cache's files are uploaded as they are to a bucket there and the cache is opened
where it lives, so that the damaged manifest is the one that names what gets downloaded.

Prints one JSON line per case before running it (so that an abort names its case) and one
after, then ``done N``.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

import dataset_rt as drt
from dataset_rt.errors import DatasetRTError

VARIANTS = ("plain", "zstd")
HUGE = (2**63 - 1, 2**62, 2**40 + 7, 2**32 + 1, -1, -(2**62))


def record(i: int) -> dict[str, Any]:
    return {"x": np.arange(i % 9, dtype=np.int64), "label": i % 3}


def build_templates(root: Path) -> None:
    """The caches every case starts from, under ``root``."""
    plain = drt.cache(
        (record(i) for i in range(40)),
        "plain",
        root=root,
        metadata=lambda r: {"label": r["label"]},
        shard_size=1024,
        progress=False,
    )
    drt.append("plain", (record(i) for i in range(40, 60)), root=root, progress=False)
    plain = drt.open("plain", root=root)
    plain.save_metadata(plain.metadata.with_columns(weight=pl.col("label").drt.balance()))
    drt.cache(
        (record(i) for i in range(50)),
        "zstd",
        root=root,
        compression="zstd",
        shard_size=1024,
        progress=False,
    )


def files_of(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def tricks(outside: Path) -> list[str]:
    """File names that try to leave the cache's directory, or are not names at all."""
    return [
        "../escaped.bin",
        "../../escaped.bin",
        "shards/../../escaped.bin",
        str(outside / "escaped.bin"),
        "shards/a\x00b.bin",
        "shards//00000.bin",
        "shards/",
        ".",
        "",
        "manifest.json",
        "metadata/../../../escaped.bin",
    ]


def json_leaves(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    out = [(path, value)]
    if isinstance(value, dict):
        for k, v in value.items():
            out += json_leaves(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += json_leaves(v, (*path, i))
    return out


def edit_manifest(rng: random.Random, path: Path, outside: Path) -> str:
    manifest = json.loads(path.read_text())
    where, value = rng.choice(json_leaves(manifest)[1:])
    parent = manifest
    for key in where[:-1]:
        parent = parent[key]
    last = where[-1]
    if isinstance(value, str):
        new: Any = rng.choice(tricks(outside))
        parent[last] = new
    elif isinstance(value, bool) or value is None:
        new = rng.choice([0, "x", [], None if value is not None else 1])
        parent[last] = new
    elif isinstance(value, int | float):
        new = rng.choice(HUGE)
        parent[last] = new
    elif isinstance(value, list) and value and rng.random() < 0.5:
        del value[rng.randrange(len(value))]
        new = "an element dropped"
    elif isinstance(value, list):
        value.append(value[0] if value else 1)
        new = "an element repeated"
    else:
        del parent[last]
        new = "dropped"
    path.write_text(json.dumps(manifest))
    return f"json {list(where)} -> {new!r}"


def damage_bytes(rng: random.Random, path: Path, outside: Path) -> str:
    data = bytearray(path.read_bytes())
    kind = rng.choice(["truncate", "flip", "huge", "zero", "append", "symlink"])
    if kind == "truncate" or not data:
        cut = rng.randrange(len(data)) if data else 0
        path.write_bytes(bytes(data[:cut]))
        return f"truncated to {cut} of {len(data)} bytes"
    if kind == "flip":
        spots = [rng.randrange(len(data) * 8) for _ in range(rng.randint(1, 8))]
        for bit in spots:
            data[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(bytes(data))
        return f"bits {spots} flipped"
    if kind == "huge":
        at = rng.randrange(max(1, len(data) - 7))
        value = rng.choice(HUGE)
        data[at : at + 8] = struct.pack("<q", value)[: len(data) - at]
        path.write_bytes(bytes(data[: max(len(data), at + 8)]))
        return f"{value} written at byte {at}"
    if kind == "zero":
        at = rng.randrange(len(data))
        span = rng.randint(1, 64)
        data[at : at + span] = bytes(len(data[at : at + span]))
        path.write_bytes(bytes(data))
        return f"{span} bytes zeroed at {at}"
    if kind == "append":
        path.write_bytes(bytes(data) + rng.randbytes(rng.randint(1, 64)))
        return "garbage appended"
    target = outside / "target.bin"
    path.unlink()
    path.symlink_to(target)
    return f"replaced by a link to {target}"


def reads(cache_of: Callable[[], drt.Cache]) -> dict[str, str]:
    """Every way a user reads a cache; each step's outcome: ok, or the error's class."""
    outcomes: dict[str, str] = {}

    def step(name: str, run: Callable[[], Any]) -> Any:
        try:
            result = run()
        except DatasetRTError as exc:
            outcomes[name] = type(exc).__name__
            return None
        except Exception as exc:  # anything else is a finding: reported, not raised
            outcomes[name] = f"UNEXPECTED {type(exc).__module__}.{type(exc).__name__}: {exc}"
            return None
        outcomes[name] = "ok"
        return result

    cache = step("open", cache_of)
    if cache is None:
        return outcomes
    n = len(cache)
    ids = [0, n - 1, n // 2] if n else []
    step("get_bytes", lambda: [cache.get_bytes(i) for i in ids])
    step("get(verify=True)", lambda: [cache.get(i, verify=True) for i in ids])
    step("get_many(verify=True)", lambda: cache.get_many(ids, verify=True))
    step("metadata", lambda: cache.metadata)
    step("scan", lambda: cache.scan().collect())
    step(
        "loader over scan()",
        lambda: next(iter(cache.scan().drt.loader(batch_size=8, collate=list, verify=True))),
    )
    step(
        "evaluation pass",
        lambda: list(
            cache.metadata.drt.loader(batch_size=16, shuffle=False, decode=bytes, collate=list)
        ),
    )
    step("verify", lambda: cache.verify(progress=False).raise_if_damaged())
    return outcomes


class Bucket:
    """A bucket of an S3 server that takes any credentials, written to with boto3 (so that
    damaged files arrive as they are) and read by dataset_rt."""

    def __init__(self, endpoint: str, name: str) -> None:
        import boto3

        self.name = name
        self.options = {
            "aws_endpoint_url": endpoint,
            "aws_access_key_id": "test",
            "aws_secret_access_key": "test",
            "aws_region": "us-east-1",
            "aws_allow_http": "true",
        }
        self.client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="test",
            aws_secret_access_key="test",
            region_name="us-east-1",
        )
        self.client.create_bucket(Bucket=name)

    def upload(self, prefix: str, cache_dir: Path) -> str:
        """Puts every file of ``cache_dir`` (a link: its target's bytes) under
        ``prefix/<cache name>/``; returns the root URL to open it from."""
        for rel in files_of(cache_dir):
            key = f"{prefix}/{cache_dir.name}/{rel}"
            self.client.put_object(Bucket=self.name, Key=key, Body=(cache_dir / rel).read_bytes())
        return f"s3://{self.name}/{prefix}"


def run_case(
    index: int, rng: random.Random, templates: Path, work: Path, remote: Bucket | None
) -> dict[str, Any]:
    variant = rng.choice(VARIANTS)
    case_dir = work / f"case-{index:05d}"
    root, outside = case_dir / "root", case_dir / "outside"
    outside.mkdir(parents=True)
    (outside / "target.bin").write_bytes(b"not a cache file " * 8)
    shutil.copytree(templates / variant, root / variant, symlinks=True)
    cache_dir = root / variant
    file = rng.choice(files_of(cache_dir))
    if file == "manifest.json" and rng.random() < 0.7:
        what = edit_manifest(rng, cache_dir / file, outside)
    else:
        what = damage_bytes(rng, cache_dir / file, outside)
    case = {"case": index, "variant": variant, "file": file, "damage": what}
    print(json.dumps({"starting": case}), flush=True)
    before = snapshot(outside)
    local = case_dir / "local"
    if remote is not None:
        url = remote.upload(f"case-{index:05d}", cache_dir)
        outcomes = reads(
            lambda: drt.open(variant, root=url, storage_options=remote.options, local_dir=local)
        )
    else:
        outcomes = reads(lambda: drt.open(variant, root=root))
    escaped = [
        str(p.relative_to(case_dir))
        for p in case_dir.rglob("*")
        if not any(p.is_relative_to(d) for d in (root, outside, local))
    ]
    if snapshot(outside) != before:
        escaped.append("outside/ was written")
    return {**case, "outcomes": outcomes, "escaped": escaped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--endpoint", help="an S3 server's URL: open the caches from there")
    args = parser.parse_args()
    templates = args.dir / "templates"
    build_templates(templates)
    remote = None if args.endpoint is None else Bucket(args.endpoint, f"fuzz-{args.seed}")
    for index in range(args.cases):
        rng = random.Random(f"{args.seed}-{index}")
        result = run_case(index, rng, templates, args.dir, remote)
        print(json.dumps(result), flush=True)
        shutil.rmtree(args.dir / f"case-{index:05d}", ignore_errors=True)
    print(f"done {args.cases}", flush=True)


if __name__ == "__main__":
    main()
