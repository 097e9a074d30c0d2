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

from dataset_rt._version_check import check_polars_version

# Before the modules that use Polars: outside the supported range they could fail to import
# with an error that does not say why.
check_polars_version()

from dataset_rt import errors, namespace  # noqa: E402
from dataset_rt._native import __version__  # noqa: E402
from dataset_rt.appends import append  # noqa: E402
from dataset_rt.build import cache  # noqa: E402
from dataset_rt.caches import Cache, open  # noqa: E402
from dataset_rt.loader import Loader  # noqa: E402
from dataset_rt.program import Phase  # noqa: E402
from dataset_rt.registry import list_caches  # noqa: E402
from dataset_rt.roots import default_root  # noqa: E402
from dataset_rt.streams import TokenLoader  # noqa: E402
from dataset_rt.verify import Problem, VerifyReport, verify  # noqa: E402

__all__ = [
    "Cache",
    "Loader",
    "Phase",
    "Problem",
    "TokenLoader",
    "VerifyReport",
    "__version__",
    "append",
    "cache",
    "default_root",
    "errors",
    "list_caches",
    "namespace",
    "open",
    "verify",
]
