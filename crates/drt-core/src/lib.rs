//! The engine of dataset_rt: the on-disk format of a cache, the shard writer, the mapped
//! index and shard reader, and the weight arithmetic behind the Polars expressions.
//!
//! Nothing here knows about Python or Polars: `drt-python` binds this crate to Python and
//! `drt-polars` exposes its column functions as Polars expression plugins.
//!
//! A cache is written by a [`writer::CacheWriter`] into a build directory handed out by a
//! [`store::Store`], published atomically under its name, and read by a
//! [`reader::CacheReader`]. Records appended later go into a part of their own
//! ([`append::AppendSession`]), listed by the manifest after the build's.

pub mod append;
pub mod build;
pub mod compress;
pub mod error;
pub mod faults;
pub mod fetch;
pub mod format;
pub mod index;
pub mod mapping;
pub mod metadata;
pub mod plan;
pub mod prefetch;
pub mod program;
pub mod reader;
pub mod sampler;
pub mod schedule;
pub mod sigbus;
pub mod split;
pub mod store;
pub mod tokens;
pub mod verify;
pub mod weights;
pub mod write_behind;
pub mod writer;

pub use error::{Error, Result};
