//! `Store` and `BuildLock`: a root of caches and the per-name build lock.

use std::path::PathBuf;

use drt_core::append::AppendSession;
use drt_core::build::BuildSession;
use drt_core::metadata::MetadataSave;
use drt_core::store::Store;
use drt_core::writer::WriteOptions;
use pyo3::prelude::*;

use crate::builder::{PyAppendSession, PyCacheBuilder};
use crate::errors::{run, run_interruptible, to_py};
use crate::lock::PyBuildLock;
use crate::manifest::PyManifest;
use crate::metadata::PyMetadataSave;
use crate::reader::PyCacheReader;

/// Checks a cache name; raises `CacheNameError` naming what is wrong with it.
#[pyfunction]
pub fn validate_name(py: Python<'_>, name: &str) -> PyResult<()> {
    drt_core::format::validate_name(name).map_err(|e| to_py(py, e))
}

/// The path of metadata version `version` within a cache's directory: the format owns the
/// naming, so Python never spells it.
#[pyfunction]
pub fn metadata_file(version: u32) -> String {
    drt_core::format::Manifest::metadata_file(version)
}

/// The path of the directory of part `number` (1 for the first) within a cache's directory.
#[pyfunction]
pub fn part_dir(number: usize) -> String {
    drt_core::format::Manifest::part_dir(number)
}

/// The path of the loader plan of metadata version `version` within a cache's directory.
#[pyfunction]
pub fn plan_file(version: u32) -> String {
    drt_core::format::Manifest::plan_file(version)
}

/// The size and xxh3-64 (16 hex digits) of a file, read without mapping it.
#[pyfunction]
pub fn file_checksum(py: Python<'_>, path: PathBuf) -> PyResult<(u64, String)> {
    run(py, || {
        let (size, digest) = drt_core::format::file_checksum(&path)?;
        Ok((size, drt_core::format::checksum_hex(digest)))
    })
}

type VerifyResult = (u64, u64, u64, Vec<(String, String, Vec<u64>)>);

#[pyclass(name = "Store", module = "dataset_rt._native", frozen)]
pub struct PyStore {
    inner: Store,
}

#[pymethods]
impl PyStore {
    #[new]
    fn new(root: PathBuf) -> Self {
        Self {
            inner: Store::new(root),
        }
    }

    #[getter]
    fn root(&self) -> PathBuf {
        self.inner.root().to_path_buf()
    }

    fn names(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        run(py, || self.inner.names())
    }

    fn exists(&self, py: Python<'_>, name: &str) -> PyResult<bool> {
        run(py, || self.inner.exists(name))
    }

    fn manifest(&self, py: Python<'_>, name: &str) -> PyResult<PyManifest> {
        let manifest = run(py, || self.inner.manifest(name))?;
        Ok(PyManifest::from(&manifest))
    }

    /// Verifies cache `name` completely; returns (files checked, samples checked, bytes read,
    /// problems as (file, message, sample ids)). `progress` receives the bytes read so far.
    #[pyo3(signature = (name, progress=None))]
    fn verify(
        &self,
        py: Python<'_>,
        name: &str,
        progress: Option<Py<PyAny>>,
    ) -> PyResult<VerifyResult> {
        // An exception raised by the progress callback stops the check and reaches the
        // caller as itself.
        let mut failed: Option<PyErr> = None;
        let report = run_interruptible(py, |poll| {
            drt_core::verify::verify_named(&self.inner, name, |bytes| {
                poll()?;
                let Some(callback) = &progress else {
                    return Ok(());
                };
                Python::attach(|py| callback.call1(py, (bytes,)).map(|_| ())).map_err(|e| {
                    failed = Some(e);
                    drt_core::Error::Interrupted
                })
            })
        });
        if let Some(err) = failed {
            return Err(err);
        }
        let report = report?;
        let problems = report
            .problems
            .into_iter()
            .map(|p| (p.file, p.message, p.sample_ids))
            .collect();
        Ok((
            report.files_checked,
            report.samples_checked,
            report.bytes_read,
            problems,
        ))
    }

    fn open(&self, py: Python<'_>, name: &str) -> PyResult<PyCacheReader> {
        run(py, || {
            // Reading the manifest first turns a missing cache into CacheNotFound.
            self.inner.manifest(name)?;
            drt_core::reader::CacheReader::open(&self.inner.cache_dir(name)?)
        })
        .map(PyCacheReader::from)
    }

    fn lock(&self, py: Python<'_>, name: &str) -> PyResult<PyBuildLock> {
        let (lock, waited) = run_interruptible(py, |poll| self.inner.lock(name, poll))?;
        Ok(PyBuildLock::new(lock, waited))
    }

    /// Starts saving a new metadata version of cache `lock`'s name, which must still be the
    /// build `cache_id` (else `StaleCacheError`).
    fn save_metadata(
        &self,
        py: Python<'_>,
        lock: Py<PyBuildLock>,
        cache_id: &str,
    ) -> PyResult<PyMetadataSave> {
        let save = run(py, || {
            lock.get()
                .with(|held| MetadataSave::begin(&self.inner, held, cache_id))
        })?;
        Ok(PyMetadataSave::new(save, lock))
    }

    /// Puts back the saved loader plan of metadata `version` from `source` if `source` has
    /// the checksum the manifest recorded for it; returns whether it did.
    fn restore_plan(
        &self,
        py: Python<'_>,
        lock: Py<PyBuildLock>,
        cache_id: &str,
        version: u32,
        source: PathBuf,
    ) -> PyResult<bool> {
        run(py, || {
            lock.get().with(|held| {
                drt_core::metadata::restore_plan(&self.inner, held, cache_id, version, &source)
            })
        })
    }

    #[pyo3(signature = (lock, shard_size, alignment, compression = "none", compression_level = None))]
    fn begin_build(
        &self,
        py: Python<'_>,
        lock: Py<PyBuildLock>,
        shard_size: u64,
        alignment: u64,
        compression: &str,
        compression_level: Option<i32>,
    ) -> PyResult<PyCacheBuilder> {
        let session = run(py, || {
            let opts = WriteOptions::parse(shard_size, alignment, compression, compression_level)?;
            lock.get()
                .with(|held| BuildSession::begin(&self.inner, held, opts))
        })?;
        Ok(PyCacheBuilder::new(session, lock))
    }

    /// Starts a copy of cache `lock`'s name made elsewhere (a download): a hidden directory
    /// under the root that `publish_copy` makes the cache once every file is in it.
    fn begin_copy(&self, py: Python<'_>, lock: Py<PyBuildLock>) -> PyResult<PathBuf> {
        run(py, || lock.get().with(|held| self.inner.begin_build(held)))
    }

    /// Checks the copy in directory `path` completely against its manifest and publishes it under
    /// `lock`'s name in one atomic step; a damaged or incomplete copy is refused.
    fn publish_copy(&self, py: Python<'_>, lock: Py<PyBuildLock>, path: PathBuf) -> PyResult<()> {
        run(py, || {
            lock.get()
                .with(|held| drt_core::verify::publish_copy(&self.inner, held, &path))
        })
    }

    /// Removes a copy that was not published.
    fn discard_copy(&self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        run(py, || self.inner.discard(&path))
    }

    /// Starts appending records to cache `lock`'s name, which must still be the build
    /// `cache_id` (else `StaleCacheError`), as a new part of shards of at most `shard_size`.
    fn begin_append(
        &self,
        py: Python<'_>,
        lock: Py<PyBuildLock>,
        cache_id: &str,
        shard_size: u64,
    ) -> PyResult<PyAppendSession> {
        let session = run(py, || {
            lock.get()
                .with(|held| AppendSession::begin(&self.inner, held, cache_id, shard_size))
        })?;
        Ok(PyAppendSession::new(session, lock))
    }
}
