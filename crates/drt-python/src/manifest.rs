//! `Manifest`: a read-only view of a cache's manifest, built once from the engine's struct.
//!
//! Python reads the manifest only through this class, so renaming a field of
//! [`drt_core::format::Manifest`] fails to compile here instead of failing at run time.

use std::collections::BTreeMap;

use drt_core::format::Manifest;
use pyo3::prelude::*;

/// What a cache's manifest records (see `docs/design.md`).
#[pyclass(name = "Manifest", module = "dataset_rt._native", frozen, get_all)]
pub struct PyManifest {
    /// The format version (older manifests read as the current one).
    format_version: u64,
    /// The cache's name.
    name: String,
    /// Unique per build.
    cache_id: String,
    /// Number of records.
    num_samples: u64,
    /// Sum of the records' lengths.
    nbytes: u64,
    /// Alignment of every record within its shard.
    alignment: u64,
    /// The serializer, by the name `drt.cache(serializer=...)` takes.
    serializer: String,
    /// Compression of the records: `none`, `zstd` or `lz4`.
    compression: String,
    /// The zstd level records were compressed at; `None` for other codecs.
    compression_level: Option<i32>,
    /// Bytes of the payload shards on disk (compressed, headers and padding included).
    shard_bytes: u64,
    /// Every file the manifest names (relative paths), the manifest itself excepted, with
    /// its recorded xxh3-64 (hex) where there is one.
    files: Vec<(String, Option<String>)>,
    /// The payload shards, the parts' included: (relative path, size, xxh3-64 hex).
    shards: Vec<(String, u64, String)>,
    /// The indexes, the build's then each part's: (relative path, size, xxh3-64 hex).
    indexes: Vec<(String, u64, String)>,
    /// UTC creation time, RFC 3339.
    created_at: String,
    /// Number of payload shards, the parts' included.
    num_shards: usize,
    /// Number of parts: the build's records, then one per append.
    num_parts: usize,
    /// The live metadata version.
    metadata_version: u32,
    /// Every saved metadata version, oldest first.
    metadata_versions: Vec<u32>,
    /// xxh3-64 (hex) of each metadata version's file, where recorded.
    metadata_checksums: BTreeMap<u32, String>,
    /// xxh3-64 (hex) of each metadata version's loader plan, where it has one.
    plan_checksums: BTreeMap<u32, String>,
}

impl From<&Manifest> for PyManifest {
    fn from(m: &Manifest) -> Self {
        Self {
            format_version: m.format_version,
            name: m.name.clone(),
            cache_id: m.cache_id.clone(),
            num_samples: m.num_samples,
            nbytes: m.nbytes,
            alignment: m.alignment,
            serializer: m.serializer.clone(),
            compression: m.compression.clone(),
            compression_level: m.compression_level,
            shard_bytes: m
                .segments()
                .iter()
                .flat_map(|s| s.shards)
                .map(|f| f.size)
                .sum(),
            files: m.files(),
            shards: m
                .segments()
                .iter()
                .flat_map(|s| s.shards)
                .map(|f| (f.file.clone(), f.size, f.checksum.clone()))
                .collect(),
            indexes: m
                .segments()
                .iter()
                .map(|s| (s.index.file.clone(), s.index.size, s.index.checksum.clone()))
                .collect(),
            created_at: m.created_at.clone(),
            num_shards: m.segments().iter().map(|s| s.shards.len()).sum(),
            num_parts: 1 + m.parts.len(),
            metadata_version: m.metadata_version,
            metadata_versions: m.metadata_versions.clone(),
            metadata_checksums: m.metadata_checksums.clone(),
            plan_checksums: m.plan_checksums.clone(),
        }
    }
}

#[pymethods]
impl PyManifest {
    fn __repr__(&self) -> String {
        format!(
            "Manifest(name={:?}, cache_id={:?}, num_samples={}, format_version={})",
            self.name, self.cache_id, self.num_samples, self.format_version
        )
    }
}

/// Reads and checks the manifest of the cache in directory `path`.
#[pyfunction]
pub fn read_manifest(py: Python<'_>, path: std::path::PathBuf) -> PyResult<PyManifest> {
    Manifest::read(&path)
        .map(|m| PyManifest::from(&m))
        .map_err(|e| crate::errors::to_py(py, e))
}

/// Parses and checks a manifest's bytes (a remote cache's, as downloaded); `origin` names
/// where they came from in errors.
#[pyfunction]
pub fn parse_manifest(py: Python<'_>, raw: &[u8], origin: String) -> PyResult<PyManifest> {
    Manifest::parse(raw, std::path::Path::new(&origin))
        .map(|m| PyManifest::from(&m))
        .map_err(|e| crate::errors::to_py(py, e))
}
