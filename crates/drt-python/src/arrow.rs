//! Importing columns from any object that speaks the Arrow PyCapsule stream interface
//! (`__arrow_c_stream__`: Polars, PyArrow, ...), without numpy or pyarrow.

use std::borrow::Cow;

use arrow_array::cast::AsArray;
use arrow_array::ffi_stream::{FFI_ArrowArrayStream, RecordBatchStreamReader};
use arrow_array::types::{Int64Type, UInt64Type};
use arrow_array::{Array, ArrowPrimitiveType, RecordBatch};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyCapsule;

/// Reads every record batch of `obj.__arrow_c_stream__()`.
pub fn read_arrow(obj: &Bound<'_, PyAny>) -> PyResult<Vec<RecordBatch>> {
    let capsule = obj.call_method0("__arrow_c_stream__")?;
    let capsule = capsule.cast::<PyCapsule>()?;
    let ptr = capsule.pointer_checked(Some(c"arrow_array_stream"))?;
    // SAFETY: a capsule named "arrow_array_stream" holds an FFI_ArrowArrayStream by the
    // PyCapsule interface's contract; `from_raw` moves the stream out and leaves a released
    // one behind, which the capsule's destructor then skips.
    let stream = unsafe { FFI_ArrowArrayStream::from_raw(ptr.as_ptr().cast()) };
    let reader = RecordBatchStreamReader::try_new(stream)
        .map_err(|e| PyValueError::new_err(format!("reading an Arrow stream: {e}")))?;
    reader
        .map(|batch| {
            batch.map_err(|e| PyValueError::new_err(format!("reading an Arrow stream: {e}")))
        })
        .collect()
}

fn column<'a>(batch: &'a RecordBatch, name: &str) -> PyResult<&'a dyn Array> {
    batch
        .column_by_name(name)
        .map(|c| c.as_ref())
        .ok_or_else(|| PyValueError::new_err(format!("the stream lacks column {name:?}")))
}

/// A non-null primitive column (UInt64, UInt32, Float64, ...) of all batches: borrowed from
/// the Arrow buffer when there is one batch (no copy), concatenated otherwise.
pub fn primitive_column<'a, T: ArrowPrimitiveType>(
    batches: &'a [RecordBatch],
    name: &str,
) -> PyResult<Cow<'a, [T::Native]>> {
    let mut parts = Vec::with_capacity(batches.len());
    for batch in batches {
        let array = column(batch, name)?;
        if array.null_count() > 0 {
            return Err(PyValueError::new_err(format!(
                "column {name:?} holds nulls"
            )));
        }
        let typed = array.as_primitive_opt::<T>().ok_or_else(|| {
            PyValueError::new_err(format!("column {name:?} must be {}", T::DATA_TYPE))
        })?;
        parts.push(&typed.values()[..]);
    }
    Ok(match parts.as_slice() {
        [one] => Cow::Borrowed(one),
        _ => Cow::Owned(parts.concat()),
    })
}

/// A non-null, non-negative integer column (Int64 or UInt64) as `u64`s, borrowed where
/// [`primitive_column`] would be.
pub fn index_column<'a>(batches: &'a [RecordBatch], name: &str) -> PyResult<Cow<'a, [u64]>> {
    let signed = batches
        .first()
        .and_then(|b| b.column_by_name(name))
        .is_some_and(|c| c.data_type() == &Int64Type::DATA_TYPE);
    if !signed {
        return primitive_column::<UInt64Type>(batches, name);
    }
    let values = primitive_column::<Int64Type>(batches, name)?;
    if let Some(bad) = values.iter().find(|&&v| v < 0) {
        return Err(PyValueError::new_err(format!(
            "column {name:?} holds the negative value {bad}"
        )));
    }
    Ok(match values {
        Cow::Borrowed(v) => {
            // SAFETY: i64 and u64 have the same size and alignment, and every value is
            // non-negative, so each reads as the same number.
            let unsigned = unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), v.len()) };
            Cow::Borrowed(unsigned)
        }
        Cow::Owned(v) => Cow::Owned(v.into_iter().map(|x| x as u64).collect()),
    })
}
