//! The one place where engine errors become Python exceptions, and the helper every binding
//! uses to run engine code with the GIL released.

use drt_core::Error;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

/// Maps an engine error to the matching class of `dataset_rt.errors`.
pub fn to_py(py: Python<'_>, err: Error) -> PyErr {
    if let Error::Fetch { source, .. } = &err {
        // A Python fetcher's own exception, raised again as it was.
        if let Some(raised) = source.downcast_ref::<PyErr>() {
            return raised.clone_ref(py);
        }
    }
    let class = match &err {
        Error::Io { .. } => "CacheIOError",
        Error::CacheNotFound { .. } => "CacheNotFoundError",
        Error::Rebuilt { .. } => "StaleCacheError",
        Error::Corrupt { .. } => "CacheCorruptError",
        Error::UnsupportedVersion { .. } => "CacheVersionError",
        Error::InvalidName { .. } => "CacheNameError",
        Error::SampleOutOfRange { .. } => "SampleIndexError",
        Error::InvalidArgument(_) => "ArgumentError",
        Error::Weight(_) => "WeightError",
        Error::Interrupted => "DatasetRTError",
        Error::System { .. } => "CacheIOError",
        Error::Internal(_) => "InternalError",
        Error::Fetch { .. } => "CacheIOError",
    };
    let message = err.to_string();
    let build = || -> PyResult<PyErr> {
        let cls = py.import("dataset_rt.errors")?.getattr(class)?;
        let value = match &err {
            // OSError's (errno, strerror, filename) form keeps `errno` usable, e.g. ENOSPC.
            Error::Io { path, source } => cls.call1((
                source.raw_os_error().unwrap_or(0),
                source.to_string(),
                path.to_string_lossy().into_owned(),
            ))?,
            Error::System { source, .. } => {
                cls.call1((source.raw_os_error().unwrap_or(0), message.as_str()))?
            }
            _ => cls.call1((message.as_str(),))?,
        };
        Ok(PyErr::from_value(value))
    };
    build().unwrap_or_else(|_| PyRuntimeError::new_err(message))
}

/// Runs `f` with the GIL released and maps its error.
pub fn run<T: Send>(py: Python<'_>, f: impl Send + FnOnce() -> drt_core::Result<T>) -> PyResult<T> {
    py.detach(f).map_err(|e| to_py(py, e))
}

/// Runs `f` with the GIL released, giving it a `poll` callback that checks for Ctrl-C; an
/// interrupt raises the KeyboardInterrupt that Python signalled.
pub fn run_interruptible<T: Send>(
    py: Python<'_>,
    f: impl Send + FnOnce(&mut dyn FnMut() -> drt_core::Result<()>) -> drt_core::Result<T>,
) -> PyResult<T> {
    let mut pending: Option<PyErr> = None;
    let result = py.detach(|| {
        let mut poll = || {
            Python::attach(|py| py.check_signals()).map_err(|e| {
                pending = Some(e);
                Error::Interrupted
            })
        };
        f(&mut poll)
    });
    match (result, pending) {
        (Ok(v), _) => Ok(v),
        (Err(_), Some(signal)) => Err(signal),
        (Err(e), None) => Err(to_py(py, e)),
    }
}
