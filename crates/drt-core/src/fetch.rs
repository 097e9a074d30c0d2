//! Files fetched on first use: caches whose indexes and payloads live elsewhere (object
//! storage).
//!
//! The engine's third piece of process-wide state, beside [`crate::mapping`]'s table of
//! mappings and [`crate::sigbus`]'s guarded ranges: a table of [`Fetcher`]s by cache
//! directory. A reader opened on a directory that has one maps its indexes and shards
//! lazily: it checks none at open, and the first use of each asks the fetcher to make the
//! file present (download, check and publish it, or wait for whoever is doing so), then maps
//! it like a local one. Directories without a fetcher are read as before: every index and
//! shard is checked and mapped at open.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// What a fetcher's failure carries: the caller's own error, handed back unchanged.
pub type FetchError = Box<dyn std::error::Error + Send + Sync>;

/// Makes a cache's index and shard files present on first use.
pub trait Fetcher: Send + Sync {
    /// Called before `file` (an index or a shard, relative to the cache directory) is first
    /// mapped by a reader; returns once the file is there, complete and checked against the
    /// manifest. Called for present files too, so that the fetcher sees which are in use.
    fn fetch(&self, file: &str) -> std::result::Result<(), FetchError>;
}

static FETCHERS: Mutex<Option<HashMap<PathBuf, Arc<dyn Fetcher>>>> = Mutex::new(None);

fn table() -> std::sync::MutexGuard<'static, Option<HashMap<PathBuf, Arc<dyn Fetcher>>>> {
    FETCHERS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Readers opened on `dir` from now on fetch their shards through `fetcher`.
pub fn register(dir: &Path, fetcher: Arc<dyn Fetcher>) {
    table()
        .get_or_insert_with(HashMap::new)
        .insert(dir.to_path_buf(), fetcher);
}

/// Readers opened on `dir` from now on read it as a local cache; open ones keep their fetcher.
pub fn unregister(dir: &Path) -> bool {
    table()
        .as_mut()
        .is_some_and(|fetchers| fetchers.remove(dir).is_some())
}

/// The fetcher registered for `dir`, if any.
pub fn fetcher_for(dir: &Path) -> Option<Arc<dyn Fetcher>> {
    table()
        .as_ref()
        .and_then(|fetchers| fetchers.get(dir).cloned())
}
