"""The ``dataset-rt`` command line: ``ls``, ``info NAME``, ``demo``.

Exit codes: 0 success, 1 a dataset_rt error (missing or damaged cache, bad name), 2 bad usage.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import polars as pl

from dataset_rt.cache import list_caches, open
from dataset_rt.errors import DatasetRTError
from dataset_rt.progress import format_bytes

__all__ = ["main"]


def _ls(args: argparse.Namespace) -> None:
    table = list_caches(args.root)
    if table.is_empty():
        print("no caches")
        return
    with pl.Config(tbl_rows=-1, tbl_hide_dataframe_shape=True):
        print(table)


def _info(args: argparse.Namespace) -> None:
    c = open(args.name, root=args.root)
    print(f"name        {c.name}")
    print(f"path        {c.path}")
    print(f"cache_id    {c.cache_id}")
    print(f"samples     {len(c):,}")
    print(f"size        {format_bytes(c.nbytes)} in {c.num_shards} shard(s)")
    print(f"serializer  {c.serializer}")
    print(f"created     {c.created_at:%Y-%m-%d %H:%M:%S} UTC")
    print(f"metadata    version {c.metadata_version}")
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


def _demo(args: argparse.Namespace) -> None:
    from dataset_rt.demo import run

    run(args.root, overwrite=args.overwrite)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dataset-rt",
        description="Inspect and manage dataset_rt caches.",
        epilog="The root defaults to $DATASET_RT_HOME, else ~/.cache/dataset_rt.",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", help="directory holding the caches")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("ls", parents=[common], help="list the caches under the root")
    p.set_defaults(func=_ls)
    p = sub.add_parser("info", parents=[common], help="describe one cache")
    p.add_argument("name", help="the cache's name")
    p.set_defaults(func=_info)
    p = sub.add_parser(
        "demo", parents=[common], help="cache scikit-learn's digits and read them back"
    )
    p.add_argument("--overwrite", action="store_true", help="rebuild the demo cache")
    p.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        args.func(args)
    except DatasetRTError as exc:
        print(f"dataset-rt: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
