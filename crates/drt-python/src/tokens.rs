//! Token streams: one epoch's documents joined and cut into rows of a NumPy batch.

use drt_core::schedule::Schedule;
use drt_core::tokens::{Cursor, TokenStream};
use pyo3::buffer::{Element, PyBuffer};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::errors::run;
use crate::loader::Epoch;

/// A cursor as Python holds it: `(draw, offset, token)`.
type CursorArgs = (u64, u64, u64);

fn cursor((draw, offset, token): CursorArgs) -> Cursor {
    Cursor {
        draw,
        offset,
        token,
    }
}

fn args(c: Cursor) -> CursorArgs {
    (c.draw, c.offset, c.token)
}

#[pyclass(name = "TokenStream", module = "dataset_rt._native", frozen)]
pub struct PyTokenStream {
    inner: TokenStream,
}

/// A writable C-contiguous buffer of `T`, as its address and length.
fn writable<T: Element>(buffer: &PyBuffer<T>, name: &str) -> PyResult<(usize, usize)> {
    if buffer.readonly() || !buffer.is_c_contiguous() {
        return Err(PyValueError::new_err(format!(
            "{name} must be a writable C-contiguous array"
        )));
    }
    Ok((buffer.buf_ptr() as usize, buffer.item_count()))
}

#[pymethods]
impl PyTokenStream {
    /// The token stream of `epoch` (whose plan holds each row's token count), its program
    /// placing the epoch's `total` draws: its documents, each followed by `separator`.
    #[new]
    #[pyo3(signature = (epoch, *, total, separator))]
    fn new(py: Python<'_>, epoch: &Epoch, total: u64, separator: Option<i64>) -> PyResult<Self> {
        let inner = run(py, || {
            let schedule = Schedule::new(total, 0, (0, 1), (1, false))?;
            let source = epoch.open(schedule)?;
            TokenStream::new(source, separator)
        })?;
        Ok(Self { inner })
    }

    /// The cursor `n` tokens after `at`.
    fn advance(&self, py: Python<'_>, at: CursorArgs, n: u64) -> CursorArgs {
        let mut c = cursor(at);
        py.detach(|| self.inner.advance(&mut c, n));
        args(c)
    }

    /// The documents behind `rows` rows of `width` tokens, row `i` starting `i * stride`
    /// tokens after `start`: `(row, column, draw, plan_row, offset, count)` per document
    /// per row.
    fn pieces(
        &self,
        py: Python<'_>,
        start: CursorArgs,
        rows: usize,
        stride: u64,
        width: u64,
    ) -> Vec<(u32, u64, u64, u64, u64, u64)> {
        py.detach(|| {
            self.inner
                .pieces(cursor(start), rows, stride, width)
                .into_iter()
                .map(|p| (p.row, p.column, p.draw, p.plan_row, p.offset, p.count))
                .collect()
        })
    }

    /// Fills `ids` (int64, `rows` rows) with rows of the stream, row `i` starting `i *
    /// stride` tokens after `start`, and `docs` (int32, same shape) with each token's
    /// document number within its row.
    #[pyo3(signature = (start, rows, stride, ids, docs=None))]
    fn fill(
        &self,
        py: Python<'_>,
        start: CursorArgs,
        rows: usize,
        stride: u64,
        ids: PyBuffer<i64>,
        docs: Option<PyBuffer<i32>>,
    ) -> PyResult<()> {
        let (ids_at, n) = writable(&ids, "ids")?;
        let docs_at = match &docs {
            Some(d) => {
                let (at, m) = writable(d, "docs")?;
                if m != n {
                    return Err(PyValueError::new_err(
                        "docs must have as many elements as ids",
                    ));
                }
                Some(at)
            }
            None => None,
        };
        run(py, || {
            // SAFETY: both buffers are writable, C-contiguous and of `n` elements, and the
            // PyBuffer handles keep them alive (and their exporters locked) until the
            // function returns; nothing else writes them meanwhile.
            let ids = unsafe { std::slice::from_raw_parts_mut(ids_at as *mut i64, n) };
            let docs = docs_at.map(|at| {
                // SAFETY: as for `ids`.
                unsafe { std::slice::from_raw_parts_mut(at as *mut i32, n) }
            });
            self.inner.fill(cursor(start), rows, stride, ids, docs)
        })?;
        drop(docs);
        drop(ids);
        Ok(())
    }
}
