//! `MetadataSave` and the metadata table check: each method one call into
//! [`drt_core::metadata`].

use std::path::PathBuf;

use drt_core::metadata::MetadataSave;
use pyo3::prelude::*;

use crate::errors::run;
use crate::loader::write_version_plan;
use crate::lock::PyBuildLock;

/// The file of metadata version `version` in cache directory `cache_dir`, after checking it
/// is a regular file matching the checksum `expected` (None: none was recorded).
#[pyfunction]
#[pyo3(signature = (cache_dir, version, expected=None))]
pub fn checked_metadata_table(
    py: Python<'_>,
    cache_dir: PathBuf,
    version: u32,
    expected: Option<String>,
) -> PyResult<PathBuf> {
    run(py, || {
        drt_core::metadata::checked_table(&cache_dir, version, expected.as_deref())
    })
}

/// The file of metadata version `version` in cache directory `cache_dir` if it is there as
/// a regular file; its contents are not read (`checked_metadata_table` checks them).
#[pyfunction]
pub fn metadata_table_file(py: Python<'_>, cache_dir: PathBuf, version: u32) -> PyResult<PathBuf> {
    run(py, || drt_core::metadata::table_file(&cache_dir, version))
}

/// A new metadata version being saved under its cache's build lock: write the table to
/// `path`, then `commit()` (or `discard()`).
#[pyclass(name = "MetadataSave", module = "dataset_rt._native")]
pub struct PyMetadataSave {
    save: MetadataSave,
    lock: Py<PyBuildLock>,
}

impl PyMetadataSave {
    /// Wraps a save begun under `lock`, which `commit` records under.
    pub fn new(save: MetadataSave, lock: Py<PyBuildLock>) -> Self {
        Self { save, lock }
    }
}

#[pymethods]
impl PyMetadataSave {
    /// Where to write the new table.
    #[getter]
    fn metadata_path(&self) -> PathBuf {
        self.save.path().to_path_buf()
    }

    /// Writes the new version's loader plan before `commit` (see `CacheBuilder.write_plan`).
    fn write_plan(&mut self, py: Python<'_>, frame: &Bound<'_, PyAny>) -> PyResult<()> {
        write_version_plan(py, frame, |ids, weights, lengths| {
            self.save.plan().write(ids, weights, lengths)
        })
    }

    /// The version the table becomes.
    #[getter]
    fn version(&self) -> u32 {
        self.save.version()
    }

    /// Makes the written table the live version; returns its number.
    fn commit(&mut self, py: Python<'_>) -> PyResult<u32> {
        let lock = self.lock.clone_ref(py);
        run(py, || lock.get().with(|held| self.save.commit(held)))
    }

    /// Removes the table written so far; the live version is untouched.
    fn discard(&mut self, py: Python<'_>) -> PyResult<()> {
        run(py, || self.save.discard())
    }
}
