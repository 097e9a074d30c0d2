//! Importing columns from any object that speaks the Arrow PyCapsule stream interface
//! (`__arrow_c_stream__`: Polars, PyArrow, ...), without numpy or pyarrow.

use arrow_array::cast::AsArray;
use arrow_array::ffi_stream::{FFI_ArrowArrayStream, RecordBatchStreamReader};
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

/// Concatenates a non-null primitive column (UInt64, UInt32, Float64, ...) of all batches.
pub fn primitive_column<T: ArrowPrimitiveType>(
    batches: &[RecordBatch],
    name: &str,
) -> PyResult<Vec<T::Native>> {
    let mut out = Vec::new();
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
        out.extend_from_slice(typed.values());
    }
    Ok(out)
}
