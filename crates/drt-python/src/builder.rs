//! `CacheBuilder`: appends serialized records to a build directory and publishes it.

use std::path::PathBuf;

use drt_core::store::Store;
use drt_core::write_behind::WriteBehind;
use drt_core::writer::ManifestInfo;
use pyo3::prelude::*;

use crate::errors::run;
use crate::lock::PyBuildLock;

/// Records at least this long are copied into the write-behind batch with the GIL released.
const DETACH_THRESHOLD: usize = 64 << 10;

#[pyclass(name = "CacheBuilder", module = "dataset_rt._native")]
pub struct PyCacheBuilder {
    store: Store,
    lock: Py<PyBuildLock>,
    name: String,
    dir: PathBuf,
    cache_id: String,
    writer: Option<WriteBehind>,
}

impl PyCacheBuilder {
    pub fn new(
        store: Store,
        lock: Py<PyBuildLock>,
        name: String,
        dir: PathBuf,
        writer: WriteBehind,
        py: Python<'_>,
    ) -> PyResult<Self> {
        let cache_id = run(py, drt_core::format::new_cache_id)?;
        Ok(Self {
            store,
            lock,
            name,
            dir,
            cache_id,
            writer: Some(writer),
        })
    }

    fn writer(&mut self) -> drt_core::Result<&mut WriteBehind> {
        self.writer.as_mut().ok_or_else(|| {
            drt_core::Error::Internal("the build was already finished or aborted".into())
        })
    }
}

#[pymethods]
impl PyCacheBuilder {
    /// The build directory, where the metadata table is written before `finish`.
    #[getter]
    fn path(&self) -> PathBuf {
        self.dir.clone()
    }

    #[getter]
    fn cache_id(&self) -> String {
        self.cache_id.clone()
    }

    #[getter]
    fn num_samples(&self) -> u64 {
        self.writer.as_ref().map_or(0, WriteBehind::num_samples)
    }

    #[getter]
    fn nbytes(&self) -> u64 {
        self.writer.as_ref().map_or(0, WriteBehind::nbytes)
    }

    /// Where metadata version `version` goes inside the build directory.
    fn metadata_path(&self, version: u32) -> PathBuf {
        self.dir
            .join(drt_core::format::Manifest::metadata_file(version))
    }

    /// Appends one serialized record; returns its sample id.
    fn append(&mut self, py: Python<'_>, record: &[u8]) -> PyResult<u64> {
        if record.len() >= DETACH_THRESHOLD {
            run(py, || self.writer()?.append(record))
        } else {
            self.writer()
                .and_then(|w| w.append(record))
                .map_err(|e| crate::errors::to_py(py, e))
        }
    }

    /// Writes the index and manifest and publishes the cache under its name.
    fn finish(
        &mut self,
        py: Python<'_>,
        serializer: String,
        metadata_version: u32,
    ) -> PyResult<()> {
        let lock = self.lock.clone_ref(py);
        run(py, || {
            let writer = self.writer.take().ok_or_else(|| {
                drt_core::Error::Internal("the build was already finished".into())
            })?;
            let info = ManifestInfo {
                name: self.name.clone(),
                cache_id: self.cache_id.clone(),
                serializer,
                metadata_version,
            };
            let published = lock.get().with(|held| {
                writer
                    .finish(info)
                    .and_then(|_| self.store.publish(held, &self.dir))
            });
            if published.is_err() {
                let _ = self.store.discard(&self.dir);
            }
            published
        })
    }

    /// Removes the build directory; the cache of this name, if any, is untouched.
    fn abort(&mut self, py: Python<'_>) -> PyResult<()> {
        self.writer = None;
        run(py, || self.store.discard(&self.dir))
    }
}

impl Drop for PyCacheBuilder {
    fn drop(&mut self) {
        if self.writer.is_some() {
            let _ = self.store.discard(&self.dir);
        }
    }
}
