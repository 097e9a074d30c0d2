//! `CacheReader`: an open cache, read by sample id.

use std::sync::Arc;

use drt_core::prefetch::Batch;
use drt_core::reader::CacheReader;
use pyo3::prelude::*;

use crate::loader::PyBatch;
use pyo3::types::PyBytes;

use crate::errors::to_py;
use crate::manifest::PyManifest;

#[pyclass(name = "CacheReader", module = "dataset_rt._native", frozen)]
pub struct PyCacheReader {
    inner: Arc<CacheReader>,
}

impl From<CacheReader> for PyCacheReader {
    fn from(reader: CacheReader) -> Self {
        Self {
            inner: Arc::new(reader),
        }
    }
}

#[pymethods]
impl PyCacheReader {
    #[getter]
    fn path(&self) -> std::path::PathBuf {
        self.inner.dir().to_path_buf()
    }

    #[getter]
    fn manifest(&self) -> PyManifest {
        PyManifest::from(self.inner.manifest())
    }

    fn __len__(&self) -> usize {
        self.inner.len() as usize
    }

    /// One record copied into a one-record `Batch` whose buffer starts 64-byte aligned, for
    /// decoding arrays as views (`batch.views()[0]`).
    #[pyo3(signature = (sample_id, verify = false))]
    fn get_batch(&self, py: Python<'_>, sample_id: u64, verify: bool) -> PyResult<PyBatch> {
        Batch::of_record(&self.inner, sample_id, verify)
            .map(PyBatch::from)
            .map_err(|e| to_py(py, e))
    }

    /// The bytes of one record; `verify=True` checks them against the stored checksum.
    #[pyo3(signature = (sample_id, verify = false))]
    fn get_bytes<'py>(
        &self,
        py: Python<'py>,
        sample_id: u64,
        verify: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        self.inner
            .copy_record(sample_id, verify)
            .map(|b| PyBytes::new(py, &b))
            .map_err(|e| to_py(py, e))
    }
}
