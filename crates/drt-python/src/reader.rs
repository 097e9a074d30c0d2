//! `CacheReader`: an open cache, read by sample id.

use std::sync::Arc;

use drt_core::prefetch::{Batch, ViewRule};
use drt_core::reader::CacheReader;
use pyo3::prelude::*;

use drt_core::format::OOB_MAGIC;

use crate::loader::{call_on_transient_view, mapped_view, PyBatch};
use pyo3::types::PyBytes;

use crate::errors::{run, to_py};
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

    /// Records `sample_ids`, in order, as one `Batch` whose records start 64-byte aligned:
    /// copied into its buffer, or with `views`, records with large out-of-band buffers left
    /// in their mapped shard.
    #[pyo3(signature = (sample_ids, verify = false, views = false))]
    fn get_batch(
        &self,
        py: Python<'_>,
        sample_ids: Vec<u64>,
        verify: bool,
        views: bool,
    ) -> PyResult<PyBatch> {
        let rule = views.then(ViewRule::out_of_band);
        let read = || Batch::of_records(&self.inner, &sample_ids, verify, rule.as_ref());
        // One small record reads faster than the GIL changes hands.
        let batch = if sample_ids.len() > 1 {
            run(py, read)?
        } else {
            read().map_err(|e| to_py(py, e))?
        };
        Ok(PyBatch::from(batch))
    }

    /// Record `sample_id` decoded where it lies in its mapped shard, without a copy where
    /// possible: by `oob` from a view of the shard (records with large out-of-band buffers
    /// at an aligned address), by `plain` (`pickle.loads`) from a view released once it
    /// returns (plain pickles), else by `oob` from an aligned copy. Exceptions of the
    /// decoders are raised as they are; the caller names the record.
    #[pyo3(signature = (sample_id, verify, plain, oob))]
    fn get<'py>(
        &self,
        py: Python<'py>,
        sample_id: u64,
        verify: bool,
        plain: &Bound<'py, PyAny>,
        oob: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let span = self
            .inner
            .guarded_span(sample_id, verify)
            .map_err(|e| to_py(py, e))?;
        let shrank = || to_py(py, self.inner.shrank());
        if span.shrank() {
            return Err(shrank());
        }
        let decoded = if ViewRule::out_of_band().applies(&span) {
            oob.call1((mapped_view(py, &span)?,))
        } else if span.viewable() && !span.bytes().starts_with(OOB_MAGIC) {
            // SAFETY: the span keeps its mapping alive for the call; a registered mapping
            // reads as zeros, never faults, if the file shrinks meanwhile (checked below).
            unsafe { call_on_transient_view(plain, span.bytes()) }
        } else {
            // An aligned copy for its arrays to view; its bytes were verified above.
            let batch = Batch::of_records(&self.inner, &[sample_id], false, None)
                .map_err(|e| to_py(py, e))?;
            let batch = Bound::new(py, PyBatch::from(batch))?;
            oob.call1((PyBatch::views(batch)?.get_item(0)?,))
        };
        // What was decoded from zeros (or failed on them) is the shrinking's doing.
        if span.shrank() {
            return Err(shrank());
        }
        decoded
    }

    /// The bytes of one record; `verify=True` checks them against the stored checksum.
    #[pyo3(signature = (sample_id, verify = false))]
    fn get_bytes<'py>(
        &self,
        py: Python<'py>,
        sample_id: u64,
        verify: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        // Copied from the guarded span straight into the `bytes`: a shard truncated
        // meanwhile reads as zeros there, and the guard reports it.
        self.inner
            .guarded_record(sample_id, verify, |b| PyBytes::new(py, b))
            .map_err(|e| to_py(py, e))
    }

    /// The bytes of each record of `sample_ids`, in order (ids may repeat), as `get_bytes`
    /// gives them: one call for a batch of a decoder that takes `bytes`.
    #[pyo3(signature = (sample_ids, verify = false))]
    fn get_many_bytes<'py>(
        &self,
        py: Python<'py>,
        sample_ids: Vec<u64>,
        verify: bool,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        sample_ids
            .into_iter()
            .map(|id| self.get_bytes(py, id, verify))
            .collect()
    }
}
