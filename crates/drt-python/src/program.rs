//! Sampling programs: weight tables in files, the segments that use them, and the draws
//! they make, handed to Polars as Arrow columns.

use std::path::PathBuf;
use std::sync::Arc;

use arrow_array::ffi_stream::FFI_ArrowArrayStream;
use arrow_array::types::Float64Type;
use arrow_array::{
    ArrayRef, Int64Array, RecordBatch, RecordBatchIterator, UInt32Array, UInt64Array,
};
use drt_core::plan::{MappedTable, Plan};
use drt_core::program::{draw_positions, Program, Segment};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyCapsule;

use crate::arrow::{primitive_column, read_arrow};
use crate::errors::run;

/// A segment as Python passes it: `(start, from, blend)`, `blend` None or `(to, end)`.
type SegmentArgs = (u64, u32, Option<(u32, u64)>);

#[pyclass(name = "Program", module = "dataset_rt._native", frozen)]
pub struct PyProgram {
    pub(crate) inner: Arc<Program>,
    tables: Vec<PathBuf>,
    segments: Vec<SegmentArgs>,
}

#[pymethods]
impl PyProgram {
    /// Maps the weight files (or weighted plans) `tables` and checks the segments against
    /// them; segment `(start, from, blend)` draws global draws from `start` on from table
    /// `from`, or, with `blend = (to, end)`, blends linearly into table `to` by draw `end`.
    #[new]
    fn new(py: Python<'_>, tables: Vec<PathBuf>, segments: Vec<SegmentArgs>) -> PyResult<Self> {
        let inner = run(py, || {
            let mapped = tables
                .iter()
                .map(|t| MappedTable::open(t))
                .collect::<drt_core::Result<Vec<_>>>()?;
            let cut = segments
                .iter()
                .map(|&(start, from, to)| Segment { start, from, to })
                .collect();
            Program::new(mapped, cut)
        })?;
        Ok(Self {
            inner: Arc::new(inner),
            tables,
            segments,
        })
    }

    /// Pickles as its constructor arguments, so that it travels to worker processes.
    fn __getnewargs__(&self) -> (Vec<PathBuf>, Vec<SegmentArgs>) {
        (self.tables.clone(), self.segments.clone())
    }

    #[getter]
    fn rows(&self) -> u64 {
        self.inner.rows()
    }
}

/// Writes the alias table of the Float64 column `column` of `frame` (no nulls) to `path`,
/// by rename, synced to disk first if `sync`; returns the file's xxh3-64 in hex.
#[pyfunction]
pub fn write_table(
    py: Python<'_>,
    path: PathBuf,
    frame: &Bound<'_, PyAny>,
    column: &str,
    sync: bool,
) -> PyResult<String> {
    let batches = read_arrow(frame)?;
    let weights = primitive_column::<Float64Type>(&batches, column)?;
    let digest = run(py, || {
        drt_core::program::write_table(&path, &weights, column, sync)
    })?;
    Ok(drt_core::format::checksum_hex(digest))
}

/// Columns made in native code, handed to Polars (or any Arrow consumer) through the
/// Arrow PyCapsule stream interface: `pl.DataFrame(columns)`.
#[pyclass(name = "Columns", module = "dataset_rt._native", frozen)]
pub struct PyColumns {
    batch: RecordBatch,
}

#[pymethods]
impl PyColumns {
    #[pyo3(signature = (requested_schema=None))]
    fn __arrow_c_stream__<'py>(
        &self,
        py: Python<'py>,
        requested_schema: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyCapsule>> {
        let _ = requested_schema; // the columns come in their own types
        let batch = self.batch.clone();
        let reader = RecordBatchIterator::new([Ok(batch.clone())], batch.schema());
        let stream = FFI_ArrowArrayStream::new(Box::new(reader));
        PyCapsule::new_with_value(py, stream, c"arrow_array_stream")
    }
}

/// What positions `start, start + step, ...` below `stop` of epoch `epoch` draw, for a
/// loader with plan `plan_path`, `program` (None: the plan's own table), `seed` and
/// `total` draws per epoch: columns `position`, `row`, `cache`, `sample_id`, `segment`.
#[pyfunction]
#[pyo3(signature = (plan_path, program, *, seed, epoch, total, start, stop, step))]
#[allow(clippy::too_many_arguments)]
pub fn draws_at(
    py: Python<'_>,
    plan_path: PathBuf,
    program: Option<&PyProgram>,
    seed: u64,
    epoch: u64,
    total: u64,
    start: u64,
    stop: u64,
    step: u64,
) -> PyResult<PyColumns> {
    if step == 0 {
        return Err(PyValueError::new_err("step must be at least 1"));
    }
    let program = program.map(|p| p.inner.clone());
    let drawn = run(py, || {
        let plan = Plan::open(&plan_path)?;
        let count = usize::try_from(stop.saturating_sub(start).div_ceil(step))
            .map_err(|_| drt_core::Error::InvalidArgument("too many positions".into()))?;
        draw_positions(
            &plan,
            program.as_deref(),
            seed,
            epoch,
            total,
            (start, step, count),
        )
    })?;
    columns(vec![
        (
            "position",
            Arc::new(Int64Array::from(signed(drawn.positions))),
        ),
        ("row", Arc::new(UInt64Array::from(drawn.rows))),
        ("cache", Arc::new(UInt32Array::from(drawn.caches))),
        (
            "sample_id",
            Arc::new(Int64Array::from(signed(drawn.sample_ids))),
        ),
        ("segment", Arc::new(UInt32Array::from(drawn.segments))),
    ])
}

/// The rows of the plan at `plan_path` in order: columns `cache` and `sample_id`.
#[pyfunction]
pub fn plan_samples(py: Python<'_>, plan_path: PathBuf) -> PyResult<PyColumns> {
    let (caches, sample_ids) = run(py, || {
        let plan = Plan::open(&plan_path)?;
        Ok((0..plan.rows())
            .map(|row| plan.sample(row))
            .unzip::<_, _, Vec<_>, Vec<_>>())
    })?;
    columns(vec![
        ("cache", Arc::new(UInt32Array::from(caches))),
        ("sample_id", Arc::new(UInt64Array::from(sample_ids))),
    ])
}

/// Positions and sample ids as Polars' frames hold them (Int64); both are below 2^63.
fn signed(values: Vec<u64>) -> Vec<i64> {
    values.into_iter().map(|v| v as i64).collect()
}

fn columns(columns: Vec<(&str, ArrayRef)>) -> PyResult<PyColumns> {
    let batch = RecordBatch::try_from_iter(columns)
        .map_err(|e| PyValueError::new_err(format!("building columns: {e}")))?;
    Ok(PyColumns { batch })
}
