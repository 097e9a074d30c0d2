//! A build in progress: records appended in a private directory, then published atomically
//! under the cache's name, or discarded.
//!
//! A [`BuildSession`] owns the whole transaction, so that every way out of it is handled in
//! one place: `finish` publishes (and discards the directory if publishing fails), `discard`
//! removes it, and dropping an unfinished session removes it too.

use std::path::{Path, PathBuf};

use crate::error::{Error, IoContext, Result};
use crate::faults::crash_point;
use crate::format::{new_cache_id, sync_file, Manifest, Part};
use crate::metadata::{VersionPlan, FIRST_VERSION};
use crate::store::{BuildLock, Store};
use crate::write_behind::WriteBehind;
use crate::writer::{CacheWriter, ManifestInfo, WriteOptions};

/// One build of a cache, from its first record to its publication.
pub struct BuildSession {
    store: Store,
    name: String,
    dir: PathBuf,
    cache_id: String,
    writer: Option<WriteBehind>,
    plan: VersionPlan,
}

impl BuildSession {
    /// Starts a build of cache `lock.name()` in a fresh build directory of `store`, removing
    /// those left behind by dead builds of the same name.
    pub fn begin(store: &Store, lock: &BuildLock, opts: WriteOptions) -> Result<Self> {
        let dir = store.begin_build(lock)?;
        let started = new_cache_id().and_then(|cache_id| {
            let writer = CacheWriter::create(&dir, opts).and_then(WriteBehind::spawn)?;
            Ok((cache_id, writer))
        });
        match started {
            Ok((cache_id, writer)) => Ok(Self {
                plan: VersionPlan::new(dir.join(Manifest::plan_file(FIRST_VERSION))),
                store: store.clone(),
                name: lock.name().to_string(),
                dir,
                cache_id,
                writer: Some(writer),
            }),
            Err(e) => {
                let _ = store.discard(&dir);
                Err(e)
            }
        }
    }

    /// The build directory, where the metadata table is written before [`finish`](Self::finish).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The id the cache will have.
    pub fn cache_id(&self) -> &str {
        &self.cache_id
    }

    /// Records appended so far.
    pub fn num_samples(&self) -> u64 {
        self.writer.as_ref().map_or(0, WriteBehind::num_samples)
    }

    /// Bytes appended so far.
    pub fn nbytes(&self) -> u64 {
        self.writer.as_ref().map_or(0, WriteBehind::nbytes)
    }

    /// Where the caller writes the cache's metadata table (its first version) before
    /// [`finish`](Self::finish).
    pub fn metadata_path(&self) -> PathBuf {
        self.dir.join(Manifest::metadata_file(FIRST_VERSION))
    }

    /// The first version's loader plan, to write before [`finish`](Self::finish).
    pub fn plan(&mut self) -> &mut VersionPlan {
        &mut self.plan
    }

    /// Appends one serialized record; returns its sample id.
    pub fn append(&mut self, record: &[u8]) -> Result<u64> {
        self.writer.as_mut().ok_or_else(ended)?.append(record)
    }

    /// Writes the index and the manifest and publishes the cache under its name. On any
    /// failure the build directory is removed and the cache of that name, if any, stays.
    pub fn finish(&mut self, lock: &BuildLock, serializer: String) -> Result<()> {
        self.finish_with_parts(lock, serializer, Vec::new())
    }

    /// [`finish`](Self::finish) for a build whose later records other processes wrote as
    /// `parts` in the build directory (see [`PartWriter`]; paths relative to the build
    /// directory): their samples follow this session's own, in order.
    pub fn finish_with_parts(
        &mut self,
        lock: &BuildLock,
        serializer: String,
        parts: Vec<Part>,
    ) -> Result<()> {
        let writer = self.writer.take().ok_or_else(ended)?;
        let info = ManifestInfo {
            name: self.name.clone(),
            cache_id: self.cache_id.clone(),
            serializer,
            metadata_version: FIRST_VERSION,
            parts,
            plan_digest: self.plan.digest(),
        };
        let table = self.metadata_path();
        let published = (|| {
            if table.is_file() {
                crash_point("build-metadata-written");
                sync_file(&table)?;
            }
            if self.plan.digest().is_some() {
                sync_file(self.plan.path())?;
            }
            writer.finish(info)?;
            self.store.publish(lock, &self.dir)
        })();
        if published.is_err() {
            let _ = self.store.discard(&self.dir);
        }
        published
    }

    /// Removes the build directory; the cache of this name, if any, is untouched.
    pub fn discard(&mut self) -> Result<()> {
        self.writer = None;
        self.store.discard(&self.dir)
    }
}

/// Writes one part of a build in another process (a parallel build's worker): records go
/// into `<build dir>/<relative>/`, and [`finish`](Self::finish) gives the part for
/// [`BuildSession::finish_with_parts`].
pub struct PartWriter {
    relative: String,
    writer: Option<WriteBehind>,
}

impl PartWriter {
    /// Starts writing part directory `relative` (such as `parts/00001`) of build directory
    /// `build_dir`.
    pub fn create(build_dir: &Path, relative: &str, opts: WriteOptions) -> Result<Self> {
        let dir = build_dir.join(relative);
        std::fs::create_dir_all(&dir).at(&dir)?;
        let writer = CacheWriter::create_part(&dir, opts).and_then(WriteBehind::spawn)?;
        Ok(Self {
            relative: relative.to_string(),
            writer: Some(writer),
        })
    }

    /// Records appended so far.
    pub fn num_samples(&self) -> u64 {
        self.writer.as_ref().map_or(0, WriteBehind::num_samples)
    }

    /// Bytes appended so far.
    pub fn nbytes(&self) -> u64 {
        self.writer.as_ref().map_or(0, WriteBehind::nbytes)
    }

    /// Appends one serialized record; returns its position in the part.
    pub fn append(&mut self, record: &[u8]) -> Result<u64> {
        self.writer.as_mut().ok_or_else(ended)?.append(record)
    }

    /// Writes the part's index; returns the part, paths relative to the build directory.
    pub fn finish(&mut self) -> Result<Part> {
        let writer = self.writer.take().ok_or_else(ended)?;
        Ok(writer.finish_part()?.relocated(&self.relative))
    }
}

/// The error of a call on a session that has ended: the bindings never make one.
fn ended() -> Error {
    Error::Internal("the build was already finished or discarded".into())
}

impl Drop for BuildSession {
    fn drop(&mut self) {
        if self.writer.is_some() {
            let _ = self.store.discard(&self.dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> (tempfile::TempDir, Store) {
        let root = tempfile::tempdir().unwrap();
        let store = Store::new(root.path());
        (root, store)
    }

    fn lock(store: &Store, name: &str) -> BuildLock {
        store.lock(name, || Ok(())).unwrap().0
    }

    #[test]
    fn a_finished_session_publishes_its_records_under_the_name() {
        let (_root, store) = store();
        let held = lock(&store, "built");
        let mut session = BuildSession::begin(&store, &held, WriteOptions::default()).unwrap();
        for record in [b"one".as_slice(), b"two", b"three"] {
            session.append(record).unwrap();
        }
        assert_eq!(session.num_samples(), 3);
        let (id, dir) = (session.cache_id().to_string(), session.dir().to_path_buf());
        let table = session.metadata_path();
        std::fs::create_dir_all(table.parent().unwrap()).unwrap();
        std::fs::write(&table, b"the metadata table").unwrap();
        session.finish(&held, "pickle".into()).unwrap();
        assert!(!dir.exists(), "the build directory became the cache");
        let manifest = store.manifest("built").unwrap();
        assert_eq!((manifest.cache_id, manifest.num_samples), (id, 3));
        assert!(
            session.append(b"late").is_err(),
            "a finished session takes no records"
        );
    }

    #[test]
    fn a_session_that_fails_to_publish_leaves_nothing_behind() {
        let (_root, store) = store();
        let held = lock(&store, "unfinished");
        let mut session = BuildSession::begin(&store, &held, WriteOptions::default()).unwrap();
        session.append(b"record").unwrap();
        let dir = session.dir().to_path_buf();
        // No metadata table was written: the build cannot be published.
        let err = session.finish(&held, "pickle".into()).unwrap_err();
        assert!(err.to_string().contains("metadata table"), "{err}");
        assert!(!dir.exists());
        assert!(!store.exists("unfinished").unwrap());
    }

    #[test]
    fn a_dropped_or_discarded_session_leaves_nothing_behind() {
        let (_root, store) = store();
        let held = lock(&store, "dropped");
        let session = BuildSession::begin(&store, &held, WriteOptions::default()).unwrap();
        let dir = session.dir().to_path_buf();
        assert!(dir.is_dir());
        drop(session);
        assert!(!dir.exists());
        let mut session = BuildSession::begin(&store, &held, WriteOptions::default()).unwrap();
        session.append(b"x").unwrap();
        let dir = session.dir().to_path_buf();
        session.discard().unwrap();
        assert!(!dir.exists());
        assert!(!store.exists("dropped").unwrap());
    }
}
