//! The weight rule of [`drt_core::weights`] for Python: a frame's weights and a mixture's
//! shares are checked there, not again in Python.

use arrow_array::cast::AsArray;
use arrow_array::types::{Float64Type, Int64Type, UInt64Type};
use arrow_array::{Array, RecordBatch};
use drt_core::weights::{checked_shares, fold};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::arrow::read_arrow;
use crate::errors::to_py;

/// Row `row` of the batches' column `name` as text, for an error message.
fn value_at(batches: &[RecordBatch], name: &str, row: usize) -> String {
    let mut at = row;
    for batch in batches {
        if at >= batch.num_rows() {
            at -= batch.num_rows();
            continue;
        }
        let Some(column) = batch.column_by_name(name) else {
            break;
        };
        if column.is_null(at) {
            return "None".to_string();
        }
        if let Some(a) = column.as_primitive_opt::<Int64Type>() {
            return a.value(at).to_string();
        }
        if let Some(a) = column.as_primitive_opt::<UInt64Type>() {
            return a.value(at).to_string();
        }
        break;
    }
    format!("row {row}")
}

/// Checks the Float64 column `weight` of `frame` (any object with `__arrow_c_stream__`)
/// and raises `WeightError` naming the first bad row by its `sample_id` (Int64 or UInt64).
/// `allow_empty` accepts a frame without rows (the table of an empty cache).
#[pyfunction]
#[pyo3(signature = (frame, allow_empty=false))]
pub fn check_weights(py: Python<'_>, frame: &Bound<'_, PyAny>, allow_empty: bool) -> PyResult<()> {
    let batches = read_arrow(frame)?;
    let mut columns = Vec::with_capacity(batches.len());
    for batch in &batches {
        let column = batch
            .column_by_name("weight")
            .and_then(|c| c.as_primitive_opt::<Float64Type>())
            .ok_or_else(|| PyValueError::new_err("the frame needs a Float64 column 'weight'"))?;
        columns.push(column);
    }
    if allow_empty && columns.iter().all(|c| c.is_empty()) {
        return Ok(());
    }
    // Without nulls, a plain pass over the values: 0.28 s for 100M weights, against 0.52 s
    // through Arrow's iterator of options.
    let result = if columns.iter().all(|c| c.null_count() == 0) {
        let values = columns
            .iter()
            .flat_map(|c| c.values().iter().map(|&w| Some(w)));
        py.detach(|| fold(values, |_| ()))
    } else {
        py.detach(|| fold(columns.iter().flat_map(|c| c.iter()), |_| ()))
    };
    result.map(|_| ()).map_err(|fault| {
        let err = fault.error("weight", |row| {
            format!("sample_id {}", value_at(&batches, "sample_id", row))
        });
        to_py(py, err)
    })
}

/// Checks the shares of a mixture's named groups (`WeightError` names the group).
#[pyfunction]
pub fn check_shares(py: Python<'_>, names: Vec<String>, shares: Vec<f64>) -> PyResult<()> {
    checked_shares(&names, &shares)
        .map(|_| ())
        .map_err(|e| to_py(py, e))
}
