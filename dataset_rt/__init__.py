"""dataset_rt: a dataset cache for PyTorch training with a Rust core and a Polars metadata table.

Cache serialized Python records once, then analyse, filter and re-weight their metadata as a
Polars DataFrame without touching the payloads.

>>> import dataset_rt as drt
>>> cache = drt.cache(({"x": i, "label": i % 2} for i in range(4)), "doc-init-example",
...                   metadata=lambda r: {"label": r["label"]}, progress=False)
>>> cache.get(3)
{'x': 3, 'label': 1}
"""

from __future__ import annotations

from dataset_rt import errors, namespace
from dataset_rt._native import __version__
from dataset_rt._version_check import check_polars_version
from dataset_rt.build import cache
from dataset_rt.cache import Cache, default_root, list_caches, open
from dataset_rt.loader import Loader
from dataset_rt.verify import Problem, VerifyReport, verify

__all__ = [
    "Cache",
    "Loader",
    "Problem",
    "VerifyReport",
    "__version__",
    "cache",
    "default_root",
    "errors",
    "list_caches",
    "namespace",
    "open",
    "verify",
]

check_polars_version()
