"""The ``dataset-rt`` command line: ``ls``, ``info``, ``verify``, ``bench``, ``demo``.

Exit codes: 0 success, 1 a dataset_rt error (missing or unreadable cache, bad name), 2 bad
usage, 3 ``verify`` found damage.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import polars as pl

from dataset_rt.caches import describe_compression, open
from dataset_rt.errors import ArgumentError, DatasetRTError
from dataset_rt.progress import format_bytes
from dataset_rt.registry import list_caches
from dataset_rt.roots import root_url
from dataset_rt.serialize import describe_serializer

__all__ = ["main"]


def _ls(args: argparse.Namespace) -> None:
    table = list_caches(args.root, storage_options=dict(args.storage_option))
    if table.is_empty():
        print("no caches")
        return
    rows = [("NAME", "SAMPLES", "SIZE", "SHARDS", "SERIALIZER", "CREATED (UTC)", "CACHE_ID")]
    for r in table.iter_rows(named=True):
        rows.append(
            (
                r["name"],
                f"{r['samples']:,}",
                format_bytes(r["bytes"]),
                str(r["shards"]),
                r["serializer"],
                f"{r['created']:%Y-%m-%d %H:%M}",
                r["cache_id"],
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    numeric = {1, 2, 3}
    for row in rows:
        cells = [
            cell.rjust(w) if i in numeric else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())


def _info(args: argparse.Namespace) -> None:
    c = open(args.name, root=args.root, storage_options=dict(args.storage_option))
    print(f"name        {c.name}")
    if c.url is not None:
        print(f"url         {c.url}")
    print(f"path        {c.path}")
    print(f"cache_id    {c.cache_id}")
    print(f"samples     {len(c):,}")
    parts = f", {c.num_parts} parts" if c.num_parts > 1 else ""
    print(f"size        {format_bytes(c.nbytes)} in {c.num_shards} shard(s){parts}")
    print(f"serializer  {c.serializer} ({describe_serializer(c.serializer)})")
    print(f"compression {describe_compression(c)}")
    print(f"created     {c.created_at:%Y-%m-%d %H:%M:%S} UTC")
    versions = c.metadata_versions()["version"].to_list()
    print(f"metadata    version {c.metadata_version} (saved: {', '.join(map(str, versions))})")
    frame = c.metadata
    summary = pl.DataFrame(
        {
            "column": frame.columns,
            "dtype": [str(t) for t in frame.dtypes],
            "nulls": [s.null_count() for s in frame.iter_columns()],
            "unique": [s.n_unique() for s in frame.iter_columns()],
        }
    )
    with pl.Config(tbl_rows=-1, tbl_hide_dataframe_shape=True):
        print(summary)


EXIT_DAMAGED = 3


def _verify(args: argparse.Namespace) -> int:
    from dataset_rt.verify import verify

    if root_url(args.root) is not None:  # fetches every shard into the local copy, then reads it
        cache = open(args.name, root=args.root, storage_options=dict(args.storage_option))
        report = cache.verify(progress=not args.quiet)
    else:
        report = verify(args.name, root=args.root, progress=not args.quiet)
    print(report)
    return 0 if report.ok else EXIT_DAMAGED


def _workers(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of counts: {text!r}"
        ) from None
    if any(c < 0 for c in counts):
        raise argparse.ArgumentTypeError(f"worker counts must be >= 0: {text!r}")
    return counts


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _bench(args: argparse.Namespace) -> None:
    from dataset_rt.bench import bench, describe

    result = bench(
        args.name,
        root=args.root,
        samples=args.samples,
        batch_size=args.batch_size,
        workers=args.workers,
    )
    print(describe(result))


def _demo(args: argparse.Namespace) -> None:
    from dataset_rt.demo import run

    run(args.root, overwrite=args.overwrite)


def _storage_option(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _push(args: argparse.Namespace) -> None:
    from dataset_rt.remote import push

    url = push(
        args.name,
        args.url,
        root=args.root,
        storage_options=dict(args.storage_option),
        progress=not args.quiet,
    )
    print(f"pushed {args.name} to {url}")


def _pull(args: argparse.Namespace) -> None:
    from dataset_rt.remote import pull

    cache = pull(
        args.url,
        args.name,
        root=args.root,
        storage_options=dict(args.storage_option),
        overwrite=args.overwrite,
        progress=not args.quiet,
    )
    print(f"pulled {args.name} ({len(cache):,} samples) into {cache.path}")


def _add_storage_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-o",
        "--storage-option",
        type=_storage_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the object store, with the keys Polars takes (repeatable)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dataset-rt",
        description="Inspect and manage dataset_rt caches.",
        epilog="The root defaults to $DATASET_RT_HOME (a directory or a URL), else "
        "~/.cache/dataset_rt. Exit codes: "
        "0 success, 1 error, 2 bad usage, 3 verify found damage.",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", help="directory holding the caches")
    remote = argparse.ArgumentParser(add_help=False)
    remote.add_argument(
        "--root",
        help="directory holding the caches, or an object-storage URL (s3://bucket/prefix, ...)",
    )
    _add_storage_option(remote)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("ls", parents=[remote], help="list the caches under the root")
    p.set_defaults(func=_ls, parser=p)
    p = sub.add_parser("info", parents=[remote], help="describe one cache")
    p.add_argument("name", help="the cache's name")
    p.set_defaults(func=_info, parser=p)
    p = sub.add_parser(
        "verify",
        parents=[remote],
        help="read every byte of a cache and report damage (exit code 3 if any)",
    )
    p.add_argument("name", help="the cache's name")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=_verify, parser=p)
    p = sub.add_parser(
        "bench",
        parents=[common],
        help="measure raw reads, decoding and the loader on a cache; name the bottleneck",
    )
    p.add_argument("name", help="the cache's name")
    p.add_argument("--samples", type=_positive, default=20_000, help="draws per pass (20000)")
    p.add_argument("--batch-size", type=_positive, default=64, help="samples per batch (64)")
    p.add_argument(
        "--workers",
        type=_workers,
        default=None,
        help="worker counts to try (default 0,2 with PyTorch installed, else 0; counts above 0 "
        "need PyTorch)",
    )
    p.set_defaults(func=_bench, parser=p)
    transfer = argparse.ArgumentParser(add_help=False)
    _add_storage_option(transfer)
    transfer.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    p = sub.add_parser(
        "push",
        parents=[common, transfer],
        help="upload a cache to object storage (URL/NAME/), its manifest last",
    )
    p.add_argument("name", help="the cache's name")
    p.add_argument("url", help="the remote root, e.g. s3://bucket/prefix")
    p.set_defaults(func=_push, parser=p)
    p = sub.add_parser(
        "pull",
        parents=[common, transfer],
        help="download a cache from object storage, checked before it is published",
    )
    p.add_argument("url", help="the remote root, e.g. s3://bucket/prefix")
    p.add_argument("name", help="the cache's name")
    p.add_argument("--overwrite", action="store_true", help="replace another local build")
    p.set_defaults(func=_pull, parser=p)
    p = sub.add_parser(
        "demo", parents=[common], help="cache scikit-learn's digits and read them back"
    )
    p.add_argument("--overwrite", action="store_true", help="rebuild the demo cache")
    p.set_defaults(func=_demo, parser=p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except ArgumentError as exc:
        # A value argparse could not check by itself: a usage error like argparse's own,
        # with the subcommand's usage line.
        getattr(args, "parser", parser).error(str(exc))
    except DatasetRTError as exc:
        print(f"dataset-rt: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader of our output went away (`dataset-rt info x | head`): not an error.
        # Point stdout at /dev/null so that flushing it at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
