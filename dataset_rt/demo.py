"""The demo: cache scikit-learn's handwritten digits, look at the metadata, read records back."""

from __future__ import annotations

from typing import Any

import polars as pl

from dataset_rt.build import cache
from dataset_rt.cache import Cache, PathLike

__all__ = ["DEMO_NAME", "digits_cache", "run"]

DEMO_NAME = "sklearn-digits-v1"


def _digit_records() -> Any:
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError(
            "the demo caches scikit-learn's digits dataset: pip install 'dataset-rt[demo]'"
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
    print(digits)
    print()
    counts = (
        digits.metadata.group_by("label")
        .agg(samples=pl.len(), mean_ink=pl.col("ink").mean().round(1))
        .sort("label")
    )
    print("Class counts, from the metadata table alone (no payload was read):")
    print(counts)
    print()
    record = digits.get(0)
    print(f"Record 0 read back: label={record['label']}, image {record['image'].shape}:")
    for row in record["image"]:
        print("  " + "".join(" .:-=+*#%@"[min(int(v) * 10 // 17, 9)] for v in row))
    print()
    # Registered namespaces are invisible to type checkers, hence the ignore.
    weights = digits.metadata.select(
        pl.col("weight").drt.normalize()  # type: ignore[attr-defined]
    ).to_series()
    print(f"Sampling probabilities from the .drt plugin sum to {weights.sum():.6f}.")
    return digits
