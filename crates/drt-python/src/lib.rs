//! The `dataset_rt._native` extension module: thin bindings from Python to `drt-core`.
//!
//! Every binding converts its arguments, releases the GIL around one core call through
//! [`errors::run`], and converts the result. The Polars expression plugins of `drt-polars`
//! are linked into this same library, so one file serves both `import` and
//! `register_plugin_function`.

mod arrow;
mod builder;
mod errors;
mod fetch;
mod loader;
mod lock;
mod manifest;
mod metadata;
mod program;
mod reader;
mod store;
mod tokens;
mod weights;

use pyo3::prelude::*;

// Linking the plugin crate is what exports its `_polars_plugin_*` symbols from this library.
use drt_polars as _;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("FORMAT_VERSION", drt_core::format::FORMAT_VERSION)?;
    // The names of a cache's files are the format's: Python spells none of them.
    m.add("MANIFEST_FILE", drt_core::format::MANIFEST_FILE)?;
    m.add("SHARDS_DIR", drt_core::format::SHARDS_DIR)?;
    m.add("PARTS_DIR", drt_core::format::PARTS_DIR)?;
    // The record layout is the format's: Python's serializer writes what the core reads.
    m.add(
        "OOB_MAGIC",
        pyo3::types::PyBytes::new(m.py(), drt_core::format::OOB_MAGIC),
    )?;
    m.add("RECORD_ALIGN", drt_core::format::RECORD_ALIGN)?;
    m.add("MIN_OUT_OF_BAND", drt_core::format::MIN_OUT_OF_BAND)?;
    m.add(
        "TOKEN_MAGIC",
        pyo3::types::PyBytes::new(m.py(), drt_core::tokens::TOKEN_MAGIC),
    )?;
    m.add_class::<tokens::PyTokenStream>()?;
    m.add_class::<store::PyStore>()?;
    m.add_class::<lock::PyBuildLock>()?;
    m.add_class::<builder::PyCacheBuilder>()?;
    m.add_class::<builder::PyAppendSession>()?;
    m.add_class::<builder::PyPartWriter>()?;
    m.add_class::<reader::PyCacheReader>()?;
    m.add_class::<manifest::PyManifest>()?;
    m.add_class::<loader::PySchedule>()?;
    m.add_class::<loader::Epoch>()?;
    m.add_class::<loader::PyBatch>()?;
    m.add_class::<loader::PyMappedRecord>()?;
    m.add_class::<loader::PyPrefetcher>()?;
    m.add_class::<loader::PyOpened>()?;
    m.add_class::<program::PyProgram>()?;
    m.add_class::<program::PyColumns>()?;
    m.add_function(wrap_pyfunction!(program::write_table, m)?)?;
    m.add_function(wrap_pyfunction!(program::draws_at, m)?)?;
    m.add_function(wrap_pyfunction!(program::plan_samples, m)?)?;
    m.add_function(wrap_pyfunction!(store::validate_name, m)?)?;
    m.add_function(wrap_pyfunction!(store::file_checksum, m)?)?;
    m.add_function(wrap_pyfunction!(store::metadata_file, m)?)?;
    m.add_function(wrap_pyfunction!(store::plan_file, m)?)?;
    m.add_function(wrap_pyfunction!(store::part_dir, m)?)?;
    m.add_function(wrap_pyfunction!(loader::plan_rows, m)?)?;
    m.add_function(wrap_pyfunction!(loader::hold_plan, m)?)?;
    m.add_class::<metadata::PyMetadataSave>()?;
    m.add_function(wrap_pyfunction!(metadata::checked_metadata_table, m)?)?;
    m.add_function(wrap_pyfunction!(metadata::metadata_table_file, m)?)?;
    m.add_function(wrap_pyfunction!(loader::write_plan, m)?)?;
    m.add_function(wrap_pyfunction!(weights::check_weights, m)?)?;
    m.add_function(wrap_pyfunction!(weights::check_shares, m)?)?;
    m.add_function(wrap_pyfunction!(builder::relocate_part, m)?)?;
    m.add_function(wrap_pyfunction!(manifest::read_manifest, m)?)?;
    m.add_function(wrap_pyfunction!(manifest::parse_manifest, m)?)?;
    m.add_function(wrap_pyfunction!(fetch::register_fetcher, m)?)?;
    m.add_function(wrap_pyfunction!(fetch::unregister_fetcher, m)?)?;
    m.add_function(wrap_pyfunction!(fetch::epoch_shards, m)?)?;
    Ok(())
}
