//! `BuildLock`: a cache name's build lock, held by a Python `with` block.

use std::sync::Mutex;

use drt_core::store::BuildLock;
use pyo3::prelude::*;

/// The build lock of one cache name, released by `release()` or on leaving a `with` block.
#[pyclass(name = "BuildLock", module = "dataset_rt._native", frozen)]
pub struct PyBuildLock {
    inner: Mutex<Option<BuildLock>>,
    waited: bool,
}

impl PyBuildLock {
    /// Wraps a lock taken by [`Store::lock`](drt_core::store::Store::lock); `waited` says
    /// whether taking it had to wait for another process.
    pub fn new(lock: BuildLock, waited: bool) -> Self {
        Self {
            inner: Mutex::new(Some(lock)),
            waited,
        }
    }

    /// Runs `f` with the lock, or fails once the lock was released.
    pub fn with<T>(
        &self,
        f: impl FnOnce(&BuildLock) -> drt_core::Result<T>,
    ) -> drt_core::Result<T> {
        let guard = self
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match guard.as_ref() {
            Some(held) => f(held),
            None => Err(drt_core::Error::Internal(
                "the build lock was already released".into(),
            )),
        }
    }
}

#[pymethods]
impl PyBuildLock {
    /// Whether taking the lock had to wait for another process.
    #[getter]
    fn waited(&self) -> bool {
        self.waited
    }

    fn release(&self) {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        _exc_type: &Bound<'_, PyAny>,
        _exc: &Bound<'_, PyAny>,
        _tb: &Bound<'_, PyAny>,
    ) {
        self.release();
    }
}
