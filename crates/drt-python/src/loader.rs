//! The loader's native side: writing its plan, its schedule, and batches read ahead.

use std::borrow::Cow;
use std::ffi::{c_int, c_void};
use std::path::PathBuf;
use std::sync::Arc;

use arrow_array::types::{Float64Type, UInt32Type};
use arrow_array::RecordBatch;
use drt_core::format::OOB_MAGIC;
use drt_core::mapping::Span;
use drt_core::plan::Plan;
use drt_core::prefetch::{Batch, Prefetcher, Source, SourceOptions};
use drt_core::program::Program;
use drt_core::schedule::Schedule;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyMemoryView};

use crate::arrow::{index_column, primitive_column, read_arrow};
use crate::errors::{run, to_py};
use crate::program::PyProgram;

/// Writes a metadata version's loader plan with `write(sample_ids, weights, lengths)`, the
/// GIL released, from a frame of `sample_id` (Int64 or UInt64), `weight` (Float64) and, for
/// token documents, `length` (UInt32), read in place from its Arrow buffers.
pub fn write_version_plan<F>(py: Python<'_>, frame: &Bound<'_, PyAny>, write: F) -> PyResult<()>
where
    F: FnOnce(&[u64], &[f64], Option<&[u32]>) -> drt_core::Result<()> + Send,
{
    let batches = read_arrow(frame)?;
    let sample_ids = index_column(&batches, "sample_id")?;
    let weights = primitive_column::<Float64Type>(&batches, "weight")?;
    let lengths = optional_lengths(&batches)?;
    run(py, || write(&sample_ids, &weights, lengths.as_deref()))
}

/// The frame's `length` column (UInt32), if it has one.
fn optional_lengths(batches: &[RecordBatch]) -> PyResult<Option<Cow<'_, [u32]>>> {
    let has = batches
        .first()
        .is_some_and(|b| b.schema().column_with_name("length").is_some());
    has.then(|| primitive_column::<UInt32Type>(batches, "length"))
        .transpose()
}

/// Writes a loader plan from a frame with `sample_id` (Int64 or UInt64, non-negative),
/// `cache` (UInt32, when there are several caches), `weight` (Float64, when `weighted`) and,
/// for token documents, `length` (UInt32, each at least 1); returns its digest in hex. The
/// columns are read in place, not copied.
#[pyfunction]
pub fn write_plan(
    py: Python<'_>,
    path: PathBuf,
    frame: &Bound<'_, PyAny>,
    num_caches: u32,
    weighted: bool,
) -> PyResult<String> {
    let batches = read_arrow(frame)?;
    let sample_ids = index_column(&batches, "sample_id")?;
    let codes = if num_caches > 1 {
        Some(primitive_column::<UInt32Type>(&batches, "cache")?)
    } else {
        None
    };
    let weights = if weighted {
        Some(primitive_column::<Float64Type>(&batches, "weight")?)
    } else {
        None
    };
    let lengths = optional_lengths(&batches)?;
    let digest = run(py, || {
        Plan::write(
            &path,
            &sample_ids,
            codes.as_deref().map(|c| (c, num_caches)),
            weights.as_deref(),
            lengths.as_deref(),
        )
    })?;
    Ok(format!("{digest:016x}"))
}

/// The rows of the plan at `path`, its caches, whether it draws by weight and its tokens
/// (None unless it holds token documents' lengths), after checking that it is a plan
/// whose size matches its header (its checksum is `verify`'s to check).
#[pyfunction]
pub fn plan_rows(py: Python<'_>, path: PathBuf) -> PyResult<PlanFacts> {
    run(py, || Ok(plan_facts(&Plan::open(&path)?)))
}

/// A plan's rows, caches, whether it draws by weight, and its tokens (if any).
type PlanFacts = (u64, u32, bool, Option<u64>);

/// What [`plan_rows`] and [`PyOpened`]'s `plan` say of `plan`.
fn plan_facts(plan: &Plan) -> PlanFacts {
    (plan.rows(), plan.caches(), plan.weighted(), plan.tokens())
}

/// Maps the plan at `path` and holds the mapping: the live version's plan, kept by the
/// `Cache` whose `scan()` loaders map it, so that each new loader over it finds the pages
/// earlier ones touched still mapped (see `drt_core::mapping`).
#[pyfunction]
pub fn hold_plan(py: Python<'_>, path: PathBuf) -> PyResult<PyOpened> {
    let plan = run(py, || Plan::open(&path))?;
    Ok(PyOpened {
        plan: Arc::new(plan),
        _caches: Arc::default(),
    })
}

/// What a loader's reading of one epoch opens: its plan, its caches (`cache_dirs[i]`
/// holding build `cache_ids[i]`), the draws' seed and epoch, whether records are checked
/// (`verify`) and large buffers read in place (`views`) and, when its weights change with
/// progress, its sampling program. Every native reader of an epoch (batches, the shards it
/// reads, token streams) is opened from one.
#[pyclass(name = "Epoch", module = "dataset_rt._native", frozen)]
pub struct Epoch {
    plan: PathBuf,
    dirs: Vec<PathBuf>,
    ids: Vec<String>,
    options: SourceOptions,
    program: Option<Arc<Program>>,
}

#[pymethods]
impl Epoch {
    #[new]
    #[pyo3(signature = (plan_path, cache_dirs, cache_ids, *, seed, epoch, verify=false, views=false, program=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        plan_path: PathBuf,
        cache_dirs: Vec<PathBuf>,
        cache_ids: Vec<String>,
        seed: u64,
        epoch: u64,
        verify: bool,
        views: bool,
        program: Option<&PyProgram>,
    ) -> Self {
        Self {
            plan: plan_path,
            dirs: cache_dirs,
            ids: cache_ids,
            options: SourceOptions {
                seed,
                epoch,
                verify,
                views,
            },
            program: program.map(|p| p.inner.clone()),
        }
    }
}

impl Epoch {
    /// The epoch's source, its draws placed by `schedule`.
    pub fn open(&self, schedule: Schedule) -> drt_core::Result<Source> {
        let source = Source::open(&self.plan, &self.dirs, &self.ids, schedule, self.options)?;
        match &self.program {
            Some(program) => source.with_program(program.clone()),
            None => Ok(source),
        }
    }
}

#[pyclass(name = "Schedule", module = "dataset_rt._native", frozen)]
pub struct PySchedule {
    pub(crate) inner: Schedule,
}

#[pymethods]
impl PySchedule {
    #[new]
    fn new(
        py: Python<'_>,
        total: u64,
        cursor: u64,
        rank: u64,
        world_size: u64,
        batch_size: u64,
        drop_last: bool,
    ) -> PyResult<Self> {
        Schedule::new(total, cursor, (rank, world_size), (batch_size, drop_last))
            .map(|inner| Self { inner })
            .map_err(|e| to_py(py, e))
    }

    /// The same layout from position `cursor` of the epoch on.
    fn at(&self, cursor: u64) -> Self {
        Self {
            inner: self.inner.at(cursor),
        }
    }

    /// Pickles as its constructor arguments, so that it travels to worker processes.
    fn __getnewargs__(&self) -> (u64, u64, u64, u64, u64, bool) {
        let s = &self.inner;
        (
            s.total,
            s.cursor,
            s.rank,
            s.world_size,
            s.batch_size,
            s.drop_last,
        )
    }

    #[getter]
    fn total(&self) -> u64 {
        self.inner.total
    }

    #[getter]
    fn cursor(&self) -> u64 {
        self.inner.cursor
    }

    #[getter]
    fn rank(&self) -> u64 {
        self.inner.rank
    }

    #[getter]
    fn world_size(&self) -> u64 {
        self.inner.world_size
    }

    #[getter]
    fn batch_size(&self) -> u64 {
        self.inner.batch_size
    }

    #[getter]
    fn num_batches(&self) -> u64 {
        self.inner.num_batches()
    }

    #[getter]
    fn per_rank(&self) -> u64 {
        self.inner.per_rank()
    }

    fn cursor_after(&self, batches: u64) -> u64 {
        self.inner.cursor_after(batches)
    }
}

/// A record's bytes in its mapped shard, as a read-only buffer; the mapping lives as long
/// as this object or any view of it.
#[pyclass(name = "MappedRecord", module = "dataset_rt._native", frozen)]
pub struct PyMappedRecord {
    span: Span,
}

#[pymethods]
impl PyMappedRecord {
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let bytes = slf.get().span.bytes();
        // SAFETY: the bytes lie in a read-only mapping that the span keeps alive, and the
        // view keeps `slf` (and so the span) alive. If the file shrinks, the pages read as
        // zeros instead of raising SIGBUS (the shard is registered with drt_core::sigbus),
        // and `Batch.shrank` says so.
        unsafe { fill_read_only(slf.as_any(), bytes, view, flags) }
    }

    unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {}

    fn __len__(&self) -> usize {
        self.span.bytes().len()
    }
}

/// Fills `view` (the buffer Python asks `owner` for) as a read-only view of `bytes`; the
/// view holds a new reference to `owner` (`view.obj`).
///
/// # Safety
///
/// `view` must be the buffer passed to `owner`'s `__getbuffer__`, and `bytes` must stay
/// valid and unchanged for as long as `owner` lives.
unsafe fn fill_read_only(
    owner: &Bound<'_, PyAny>,
    bytes: &[u8],
    view: *mut pyo3::ffi::Py_buffer,
    flags: c_int,
) -> PyResult<()> {
    // SAFETY: the caller's contract; FillInfo only reads `bytes`' address and length.
    let rc = unsafe {
        pyo3::ffi::PyBuffer_FillInfo(
            view,
            owner.as_ptr(),
            bytes.as_ptr() as *mut c_void,
            bytes.len() as pyo3::ffi::Py_ssize_t,
            1,
            flags,
        )
    };
    if rc == -1 {
        return Err(PyErr::fetch(owner.py()));
    }
    Ok(())
}

/// A read-only memoryview of a record left in its mapped shard.
pub fn mapped_view<'py>(py: Python<'py>, span: &Span) -> PyResult<Bound<'py, PyMemoryView>> {
    let record = Bound::new(py, PyMappedRecord { span: span.clone() })?;
    PyMemoryView::from(record.as_any())
}

/// Views of records in a batch's own buffer: slices of one `memoryview` of the whole
/// buffer, made on first use, so each keeps the batch alive.
struct BufferViews<'a, 'py> {
    batch: &'a Bound<'py, PyBatch>,
    whole: Option<Bound<'py, PyMemoryView>>,
}

impl<'a, 'py> BufferViews<'a, 'py> {
    fn new(batch: &'a Bound<'py, PyBatch>) -> Self {
        Self { batch, whole: None }
    }

    /// A read-only `memoryview` of record `i`'s bytes in the buffer.
    fn record(&mut self, i: usize) -> PyResult<Bound<'py, PyAny>> {
        let whole = match &self.whole {
            Some(whole) => whole,
            None => self.whole.insert(PyMemoryView::from(self.batch.as_any())?),
        };
        let inner = &self.batch.get().inner;
        let (start, end) = (inner.starts[i] as isize, inner.ends[i] as isize);
        whole.get_item(pyo3::types::PySlice::new(self.batch.py(), start, end, 1))
    }
}

/// Calls `f` with a read-only `memoryview` of `bytes` that is released as soon as `f`
/// returns: a reference `f` kept to it refuses every access from then on.
///
/// # Safety
///
/// `bytes` must stay valid and unchanged until this function returns.
pub unsafe fn call_on_transient_view<'py>(
    f: &Bound<'py, PyAny>,
    bytes: &[u8],
) -> PyResult<Bound<'py, PyAny>> {
    let py = f.py();
    // SAFETY: the caller keeps `bytes` valid for the call; the view is released before
    // returning, so nothing can read through it afterwards.
    let view = unsafe {
        Bound::from_owned_ptr_or_err(
            py,
            pyo3::ffi::PyMemoryView_FromMemory(
                bytes.as_ptr() as *mut std::ffi::c_char,
                bytes.len() as pyo3::ffi::Py_ssize_t,
                pyo3::ffi::PyBUF_READ,
            ),
        )?
    };
    let result = f.call1((&view,));
    view.call_method0(pyo3::intern!(py, "release"))?;
    result
}

#[pyclass(name = "Batch", module = "dataset_rt._native", frozen)]
pub struct PyBatch {
    inner: Batch,
}

impl From<Batch> for PyBatch {
    fn from(inner: Batch) -> Self {
        Self { inner }
    }
}

#[pymethods]
impl PyBatch {
    /// Exposes the records' bytes as one read-only buffer (`memoryview(batch)`).
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let data = &slf.get().inner.data;
        // SAFETY: the bytes belong to this frozen object, which never changes them and which
        // the view keeps alive.
        unsafe { fill_read_only(slf.as_any(), data, view, flags) }
    }

    unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {}

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    #[getter]
    fn number(&self) -> u64 {
        self.inner.number
    }

    /// Whether a shard that records of this batch were left in shrank under a view of it:
    /// their pages past the new end read as zeros, so nothing decoded from them holds.
    #[getter]
    fn shrank(&self) -> bool {
        self.inner.outside.iter().flatten().any(Span::shrank)
    }

    /// The records' total length in bytes (the buffer also holds alignment padding).
    #[getter]
    fn nbytes(&self) -> u64 {
        self.inner.payload_len()
    }

    /// The records as a list of `bytes`, one Python object each.
    fn records<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let batch = &self.inner;
        PyList::new(
            py,
            (0..batch.len()).map(|i| PyBytes::new(py, batch.record(i))),
        )
    }

    /// The records as read-only `memoryview`s, without copying: of the batch's buffer
    /// (keeping the batch alive), or of the mapped shard for records left there (keeping the
    /// mapping alive). Each starts at a 64-byte aligned address.
    pub fn views<'py>(slf: Bound<'py, Self>) -> PyResult<Bound<'py, PyList>> {
        let py = slf.py();
        let batch = &slf.get().inner;
        let mut buffer = BufferViews::new(&slf);
        let views = (0..batch.len()).map(|i| match batch.outside(i) {
            Some(span) => Ok(mapped_view(py, span)?.into_any()),
            None => buffer.record(i),
        });
        PyList::new(py, views.collect::<PyResult<Vec<_>>>()?)
    }

    /// Decodes every record in one native loop: records that start with `OOB_MAGIC` (those
    /// with out-of-band buffers) go to `oob` as `memoryview`s of the batch buffer, or of their
    /// mapped shard if they were left there, which their arrays may keep; every other record
    /// goes to `plain` (`pickle.loads`) as a memoryview that is released once `plain`
    /// returns, so nothing it built can refer to the buffer.
    ///
    /// The first exception a decoder raises is raised as is; the caller names the record.
    fn decode<'py>(
        slf: Bound<'py, Self>,
        plain: &Bound<'py, PyAny>,
        oob: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let py = slf.py();
        let batch = &slf.get().inner;
        let mut buffer = BufferViews::new(&slf);
        let mut out = Vec::with_capacity(batch.len());
        for i in 0..batch.len() {
            let decoded = match batch.outside(i) {
                Some(span) => oob.call1((mapped_view(py, span)?,))?,
                None if batch.record(i).starts_with(OOB_MAGIC) => {
                    oob.call1((buffer.record(i)?,))?
                }
                // SAFETY: the record lies in the buffer of this frozen batch, which `slf`
                // keeps alive and unchanged for the whole call.
                None => unsafe { call_on_transient_view(plain, batch.record(i))? },
            };
            out.push(decoded);
        }
        PyList::new(py, out)
    }

    /// Where each record starts in the buffer.
    #[getter]
    fn starts(&self) -> Vec<u64> {
        self.inner.starts.clone()
    }

    /// Where each record ends in the buffer.
    #[getter]
    fn ends(&self) -> Vec<u64> {
        self.inner.ends.clone()
    }

    #[getter]
    fn sample_ids(&self) -> Vec<u64> {
        self.inner.sample_ids.clone()
    }

    #[getter]
    fn caches(&self) -> Vec<u32> {
        self.inner.caches.clone()
    }
}

#[pyclass(name = "Prefetcher", module = "dataset_rt._native", frozen)]
pub struct PyPrefetcher {
    /// Taken out when dropped, so that its thread is joined with the GIL released.
    prefetcher: Option<Prefetcher>,
    opened: PyOpened,
    pid: u32,
}

/// The plan and caches an epoch's reader opened. A loader keeps its last epoch's, so that
/// the next epoch, which opens them again, shares their mappings and the pages the earlier
/// one touched (see `drt_core::mapping`) instead of faulting them in anew.
#[pyclass(
    name = "Opened",
    module = "dataset_rt._native",
    frozen,
    skip_from_py_object
)]
#[derive(Clone)]
pub struct PyOpened {
    plan: Arc<Plan>,
    _caches: Arc<Vec<drt_core::reader::CacheReader>>,
}

impl PyOpened {
    /// What `source` opened.
    fn of(source: &Source) -> Self {
        Self {
            plan: source.plan.clone(),
            _caches: source.caches.clone(),
        }
    }
}

#[pymethods]
impl PyOpened {
    /// The plan's rows, its caches, whether it draws by weight and its tokens (None unless
    /// it holds token documents' lengths), as [`plan_rows`] gives them.
    #[getter]
    fn plan(&self) -> PlanFacts {
        plan_facts(&self.plan)
    }
}

impl Drop for PyPrefetcher {
    fn drop(&mut self) {
        if let Some(prefetcher) = self.prefetcher.take() {
            // Dropping joins the reading thread, which may be waiting for the GIL in a
            // remote cache's fetcher: release it meanwhile.
            Python::attach(|py| py.detach(move || drop(prefetcher)));
        }
    }
}

#[pymethods]
impl PyPrefetcher {
    /// Starts reading batches `first, first + step, ...` of `schedule` of `epoch` on a native
    /// thread.
    #[new]
    fn new(
        py: Python<'_>,
        epoch: &Epoch,
        schedule: &PySchedule,
        first: u64,
        step: u64,
        depth: usize,
    ) -> PyResult<Self> {
        let schedule = schedule.inner;
        let (prefetcher, opened) = run(py, || {
            let source = epoch.open(schedule)?;
            let opened = PyOpened::of(&source);
            let numbers = (first..schedule.num_batches()).step_by(step.max(1) as usize);
            Ok((Prefetcher::start(source, numbers, depth)?, opened))
        })?;
        Ok(Self {
            prefetcher: Some(prefetcher),
            opened,
            pid: std::process::id(),
        })
    }

    /// What this epoch's reader opened, to keep after the epoch ends.
    #[getter]
    fn opened(&self) -> PyOpened {
        self.opened.clone()
    }

    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Batches already read and waiting in the queue (0: the next call waits for a read).
    #[getter]
    fn ready(&self) -> usize {
        self.prefetcher.as_ref().map_or(0, Prefetcher::ready)
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<PyBatch>> {
        if std::process::id() != self.pid {
            // Threads do not survive fork: the prefetch thread lives in the parent only.
            return Err(PyRuntimeError::new_err(
                "a dataset_rt prefetcher cannot be used in a forked child; iterate the \
                 loader inside the child instead",
            ));
        }
        let Some(prefetcher) = &self.prefetcher else {
            return Ok(None);
        };
        match py.detach(|| prefetcher.next()) {
            None => Ok(None),
            Some(Ok(inner)) => Ok(Some(PyBatch { inner })),
            Some(Err(e)) => Err(to_py(py, e)),
        }
    }
}
