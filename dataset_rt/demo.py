"""The demo: cache scikit-learn's handwritten digits, look at the metadata, read records back."""

from __future__ import annotations

from typing import Any

import polars as pl

from dataset_rt.build import cache
from dataset_rt.caches import Cache
from dataset_rt.roots import PathLike
from dataset_rt.serialize import describe_serializer

__all__ = ["DEMO_NAME", "digits_cache", "run"]

DEMO_NAME = "sklearn-digits-v1"


def _digit_records() -> Any:
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError(
            "the demo caches scikit-learn's digits dataset: pip install scikit-learn"
        ) from exc
    import numpy as np

    digits = load_digits()
    for image, label in zip(digits.images, digits.target, strict=True):
        # Pixel intensities are 0..16; uint8 keeps each record small.
        yield {"image": image.astype(np.uint8), "label": int(label)}


def digits_cache(
    root: PathLike | None = None, *, overwrite: bool = False, progress: bool = True
) -> Cache:
    """The demo cache: 1,797 8x8 handwritten digits with their label as metadata.

    Built on first use from the copy of the dataset that ships inside scikit-learn, reused
    afterwards.
    """
    return cache(
        _digit_records,
        DEMO_NAME,
        root=root,
        metadata=lambda r: {"label": r["label"], "ink": int(r["image"].sum())},
        overwrite=overwrite,
        progress=progress,
    )


def run(root: PathLike | None = None, *, overwrite: bool = False) -> Cache:
    """Builds (or reuses) the demo cache and prints what a user would look at first."""
    digits = digits_cache(root, overwrite=overwrite)
    print(
        f"scikit-learn's {len(digits):,} handwritten digits, cached as one record each "
        "(an 8x8 image and its label):"
    )
    print(f"  {digits}")
    print(f"  serializer {digits.serializer!r}: {describe_serializer(digits.serializer)}")
    print()
    print(
        "The metadata table: one row per record, with the columns the metadata function "
        "returned\n(label, and ink = the sum of the image's pixel intensities) and a "
        "sampling weight:"
    )
    print(digits.metadata.head(3))
    print()
    counts = (
        digits.metadata.group_by("label")
        .agg(samples=pl.len(), mean_ink=pl.col("ink").mean().round(1))
        .sort("label")
    )
    print("Records and mean ink per label, from the metadata table alone (no record was read):")
    with pl.Config(tbl_rows=10):
        print(counts)
    print()
    record = digits.get(0)
    label, shape = record["label"], record["image"].shape
    print(f"Record 0 read back with digits.get(0): label={label}, image {shape}:")
    for row in record["image"]:
        print("  " + "".join(" .:-=+*#%@"[min(int(v) * 10 // 17, 9)] for v in row))
    print()
    # Registered namespaces are invisible to type checkers, hence the ignore.
    weights = digits.metadata.select(
        pl.col("weight").drt.normalize()  # type: ignore[attr-defined]
    ).to_series()
    print(
        "pl.col('weight').drt.normalize(), one of dataset_rt's Polars expressions (run in "
        f"Rust),\nturns the weights into sampling probabilities: they sum to {weights.sum():.6f}."
    )
    print(f"\nRun it again and the cache is reused; it lives in {digits.path}.")
    return digits
