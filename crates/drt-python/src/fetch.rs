//! Fetchers written in Python: `register_fetcher(dir, fetch)` makes readers of `dir` call
//! `fetch(file)` before they first map a shard (see `drt_core::fetch`), and
//! `epoch_shards(...)` says which shards a loader's batches read, in order.

use std::path::PathBuf;
use std::sync::Arc;

use drt_core::fetch::{FetchError, Fetcher};
use pyo3::prelude::*;

use crate::errors::run;
use crate::loader::{Epoch, PySchedule};

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

/// The shards that the batches of `schedule` of `epoch` read, in the order they are first
/// needed, each once: `(cache, file, batch)`, `file` relative to its cache's directory,
/// `batch` the first batch that reads it.
#[pyfunction]
pub fn epoch_shards(
    py: Python<'_>,
    epoch: &Epoch,
    schedule: &PySchedule,
) -> PyResult<Vec<(u32, String, u64)>> {
    let schedule = schedule.inner;
    run(py, || epoch.open(schedule)?.shards_in_order())
}
