//! Fetchers written in Python: `register_fetcher(dir, fetch)` makes readers of `dir` call
//! `fetch(file)` before they first map a shard (see `drt_core::fetch`), and
//! `epoch_shards(...)` says which shards a loader's batches read, in order.

use std::path::PathBuf;
use std::sync::Arc;

use drt_core::fetch::{FetchError, Fetcher};
use pyo3::prelude::*;

use crate::errors::run;
use crate::loader::{Epoch, PySchedule};
use crate::program::PyProgram;

/// A Python callable `fetch(file)`, called with the GIL from whichever thread reads the shard.
struct PyFetcher {
    fetch: Py<PyAny>,
}

impl Fetcher for PyFetcher {
    fn fetch(&self, file: &str) -> Result<(), FetchError> {
        Python::attach(|py| self.fetch.call1(py, (file,)))
            .map(drop)
            .map_err(|e| Box::new(e) as FetchError)
    }
}

/// Readers opened on `path` from now on call `fetch(file)` before first reading each shard,
/// instead of checking and mapping every shard at open. What `fetch` raises reaches the
/// reader's caller as it was raised.
#[pyfunction]
pub fn register_fetcher(path: PathBuf, fetch: Py<PyAny>) {
    drt_core::fetch::register(&path, Arc::new(PyFetcher { fetch }));
}

/// Readers opened on `path` from now on read it as a local cache. Whether one was registered.
#[pyfunction]
pub fn unregister_fetcher(path: PathBuf) -> bool {
    drt_core::fetch::unregister(&path)
}

/// The shards that the batches of `schedule` read, in the order they are first needed, each
/// once: `(cache, file, batch)`, `file` relative to `cache_dirs[cache]`, `batch` the first
/// batch that reads it.
#[pyfunction]
#[pyo3(signature = (plan_path, cache_dirs, cache_ids, schedule, *, seed, epoch, program=None))]
#[allow(clippy::too_many_arguments)]
pub fn epoch_shards(
    py: Python<'_>,
    plan_path: PathBuf,
    cache_dirs: Vec<PathBuf>,
    cache_ids: Vec<String>,
    schedule: &PySchedule,
    seed: u64,
    epoch: u64,
    program: Option<&PyProgram>,
) -> PyResult<Vec<(u32, String, u64)>> {
    let source = Epoch::new(
        plan_path,
        cache_dirs,
        cache_ids,
        program,
        (seed, epoch, false, false),
    );
    run(py, || source.open(schedule.inner)?.shards_in_order())
}
