//! `CacheBuilder` and `AppendSession`: a build or an append in progress, each method one
//! call into its core session.

use std::path::PathBuf;

use drt_core::append::AppendSession;
use drt_core::build::{BuildSession, PartWriter};
use drt_core::format::Part;
use drt_core::writer::WriteOptions;
use pyo3::prelude::*;

use crate::errors::{run, to_py};
use crate::loader::write_version_plan;
use crate::lock::PyBuildLock;

/// Records at least this long are copied into the write-behind batch with the GIL released.
const DETACH_THRESHOLD: usize = 64 << 10;

/// `append(record)`, with the GIL released for long records (copying them takes a while,
/// short ones are not worth the switch).
fn append_record(
    py: Python<'_>,
    record: &[u8],
    append: impl FnOnce(&[u8]) -> drt_core::Result<u64> + Send,
) -> PyResult<u64> {
    if record.len() >= DETACH_THRESHOLD {
        run(py, || append(record))
    } else {
        append(record).map_err(|e| to_py(py, e))
    }
}

/// Parts other processes wrote, from their `PartWriter.finish` texts.
fn parse_parts(texts: &[String]) -> drt_core::Result<Vec<Part>> {
    texts.iter().map(|text| Part::from_json(text)).collect()
}

#[pyclass(name = "CacheBuilder", module = "dataset_rt._native")]
pub struct PyCacheBuilder {
    session: BuildSession,
    lock: Py<PyBuildLock>,
}

impl PyCacheBuilder {
    /// Wraps a session begun under `lock`, which `finish` publishes under.
    pub fn new(session: BuildSession, lock: Py<PyBuildLock>) -> Self {
        Self { session, lock }
    }
}

#[pymethods]
impl PyCacheBuilder {
    /// The build directory, where the metadata table is written before `finish`.
    #[getter]
    fn path(&self) -> PathBuf {
        self.session.dir().to_path_buf()
    }

    #[getter]
    fn cache_id(&self) -> String {
        self.session.cache_id().to_string()
    }

    #[getter]
    fn num_samples(&self) -> u64 {
        self.session.num_samples()
    }

    #[getter]
    fn nbytes(&self) -> u64 {
        self.session.nbytes()
    }

    /// Where the cache's metadata table is written before `finish`.
    #[getter]
    fn metadata_path(&self) -> PathBuf {
        self.session.metadata_path()
    }

    /// Writes the first version's loader plan before `finish`, from a frame of `sample_id`,
    /// `weight` and (token caches) `length`.
    fn write_plan(&mut self, py: Python<'_>, frame: &Bound<'_, PyAny>) -> PyResult<()> {
        write_version_plan(py, frame, |ids, weights, lengths| {
            self.session.plan().write(ids, weights, lengths)
        })
    }

    /// Appends one serialized record; returns its sample id.
    fn append(&mut self, py: Python<'_>, record: &[u8]) -> PyResult<u64> {
        append_record(py, record, |r| self.session.append(r))
    }

    /// Writes the index and manifest and publishes the cache under its name, listing the
    /// `parts` other processes wrote into the build directory (`PartWriter.finish` texts).
    #[pyo3(signature = (serializer, parts=Vec::new()))]
    fn finish(&mut self, py: Python<'_>, serializer: String, parts: Vec<String>) -> PyResult<()> {
        let lock = self.lock.clone_ref(py);
        run(py, || {
            let parts = parse_parts(&parts)?;
            lock.get()
                .with(|held| self.session.finish_with_parts(held, serializer, parts))
        })
    }

    /// Removes the build directory; the cache of this name, if any, is untouched.
    fn abort(&mut self, py: Python<'_>) -> PyResult<()> {
        run(py, || self.session.discard())
    }
}

/// An append in progress: records go into a new part of a published cache, each method one
/// call into a core `AppendSession`.
#[pyclass(name = "AppendSession", module = "dataset_rt._native")]
pub struct PyAppendSession {
    session: AppendSession,
    lock: Py<PyBuildLock>,
}

impl PyAppendSession {
    /// Wraps a session begun under `lock`, which `commit` records under.
    pub fn new(session: AppendSession, lock: Py<PyBuildLock>) -> Self {
        Self { session, lock }
    }
}

#[pymethods]
impl PyAppendSession {
    /// The sample id of the first appended record.
    #[getter]
    fn first(&self) -> u64 {
        self.session.first()
    }

    #[getter]
    fn num_samples(&self) -> u64 {
        self.session.num_samples()
    }

    #[getter]
    fn nbytes(&self) -> u64 {
        self.session.nbytes()
    }

    /// Where the new metadata table (old rows and new) is written before `commit`.
    #[getter]
    fn metadata_path(&self) -> PathBuf {
        self.session.metadata_path().to_path_buf()
    }

    /// Writes the new version's loader plan before `commit` (see `CacheBuilder.write_plan`).
    fn write_plan(&mut self, py: Python<'_>, frame: &Bound<'_, PyAny>) -> PyResult<()> {
        write_version_plan(py, frame, |ids, weights, lengths| {
            self.session.plan().write(ids, weights, lengths)
        })
    }

    /// Appends one serialized record; returns its sample id in the cache.
    fn append(&mut self, py: Python<'_>, record: &[u8]) -> PyResult<u64> {
        append_record(py, record, |r| self.session.append(r))
    }

    /// Where other processes write parts of this append: `PartWriter(staging_dir,
    /// staged_part(j), ...)` for `j` from 1.
    #[getter]
    fn staging_dir(&self) -> PathBuf {
        self.session.staging_dir().to_path_buf()
    }

    /// The directory of staged part `j` under `staging_dir`.
    #[staticmethod]
    fn staged_part(j: usize) -> String {
        AppendSession::staged_part(j)
    }

    /// Moves the session's part, then the staged `parts` (`PartWriter.finish` texts) into
    /// place and makes the new table the live version; returns it.
    #[pyo3(signature = (parts=Vec::new()))]
    fn commit(&mut self, py: Python<'_>, parts: Vec<String>) -> PyResult<u32> {
        let lock = self.lock.clone_ref(py);
        run(py, || {
            let parts = parse_parts(&parts)?;
            lock.get()
                .with(|held| self.session.commit_with_parts(held, parts))
        })
    }

    /// Removes what was written; the cache is untouched.
    fn abort(&mut self, py: Python<'_>) -> PyResult<()> {
        run(py, || self.session.discard())
    }
}

/// One part of a parallel build, written by a worker process into the build directory.
#[pyclass(name = "PartWriter", module = "dataset_rt._native")]
pub struct PyPartWriter {
    writer: PartWriter,
}

#[pymethods]
impl PyPartWriter {
    /// Starts writing part directory `relative` of build directory `build_dir`, its records
    /// compressed with `compression` (`none`, `zstd` or `lz4`) at `compression_level`.
    #[new]
    #[pyo3(signature = (build_dir, relative, shard_size, alignment, compression = "none", compression_level = None))]
    fn new(
        py: Python<'_>,
        build_dir: PathBuf,
        relative: String,
        shard_size: u64,
        alignment: u64,
        compression: &str,
        compression_level: Option<i32>,
    ) -> PyResult<Self> {
        let writer = run(py, || {
            let opts = WriteOptions::parse(shard_size, alignment, compression, compression_level)?;
            PartWriter::create(&build_dir, &relative, opts)
        })?;
        Ok(Self { writer })
    }

    #[getter]
    fn num_samples(&self) -> u64 {
        self.writer.num_samples()
    }

    #[getter]
    fn nbytes(&self) -> u64 {
        self.writer.nbytes()
    }

    /// Appends one serialized record; returns its position in the part.
    fn append(&mut self, py: Python<'_>, record: &[u8]) -> PyResult<u64> {
        append_record(py, record, |r| self.writer.append(r))
    }

    /// Writes the part's index; returns the part's description for `CacheBuilder.finish`.
    fn finish(&mut self, py: Python<'_>) -> PyResult<String> {
        run(py, || self.writer.finish().map(|part| part.to_json()))
    }
}

/// A part's description (`PartWriter.finish`'s text) after its directory moved from
/// `old_dir` to `new_dir`, both relative to the directory it was written in.
#[pyfunction]
pub fn relocate_part(py: Python<'_>, part: &str, old_dir: &str, new_dir: &str) -> PyResult<String> {
    Part::from_json(part)
        .and_then(|p| p.moved(old_dir, new_dir))
        .map(|p| p.to_json())
        .map_err(|e| to_py(py, e))
}
