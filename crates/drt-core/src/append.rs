//! Appending records to a published cache: a new part, committed with a new metadata version.
//!
//! An [`AppendSession`] writes the records into a hidden directory under `parts/`, while the
//! caller writes the new metadata table (the old rows and the new ones) where the session's
//! metadata save says. `commit` moves the part into place as `parts/NNNNN/` and writes the
//! manifest listing it and the new live version in one atomic step; until then readers see
//! the cache as it was, and a crash at any point leaves it so (the next append clears what
//! the dead one left). Existing files are never touched.

use std::path::{Path, PathBuf};

use crate::error::{Error, IoContext, Result};
use crate::faults::crash_point;
use crate::format::{new_cache_id, sync_dir, Manifest, PARTS_DIR};
use crate::metadata::{current, MetadataSave};
use crate::store::{BuildLock, Store};
use crate::write_behind::WriteBehind;
use crate::writer::{CacheWriter, WriteOptions};

/// One append to a cache, from its first record to its commit.
pub struct AppendSession {
    store: Store,
    name: String,
    cache_id: String,
    dir: PathBuf,
    tmp: PathBuf,
    first: u64,
    writer: Option<WriteBehind>,
    save: MetadataSave,
}

impl AppendSession {
    /// Starts appending to cache `lock.name()`, which must still be the build `cache_id`
    /// (else [`Error::Rebuilt`]); its shards are at most `shard_size` bytes and aligned as
    /// the cache's are.
    pub fn begin(store: &Store, lock: &BuildLock, cache_id: &str, shard_size: u64) -> Result<Self> {
        let save = MetadataSave::begin(store, lock, cache_id)?;
        let name = lock.name();
        let manifest = current(store, name, cache_id)?;
        let dir = store.cache_dir(name)?;
        let parts = dir.join(PARTS_DIR);
        std::fs::create_dir_all(&parts).at(&parts)?;
        clear_leftovers(&parts, manifest.parts.len())?;
        let tmp = parts.join(format!(".tmp-{}-{}", std::process::id(), new_cache_id()?));
        std::fs::create_dir(&tmp).at(&tmp)?;
        let opts = WriteOptions {
            shard_size,
            alignment: manifest.alignment,
        };
        let writer = match CacheWriter::create_part(&tmp, opts).and_then(WriteBehind::spawn) {
            Ok(writer) => writer,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&tmp);
                return Err(e);
            }
        };
        Ok(Self {
            store: store.clone(),
            name: name.to_string(),
            cache_id: cache_id.to_string(),
            dir,
            tmp,
            first: manifest.num_samples,
            writer: Some(writer),
            save,
        })
    }

    /// The sample id of the first appended record: the cache's sample count before.
    pub fn first(&self) -> u64 {
        self.first
    }

    /// Records appended so far.
    pub fn num_samples(&self) -> u64 {
        self.writer.as_ref().map_or(0, WriteBehind::num_samples)
    }

    /// Bytes appended so far.
    pub fn nbytes(&self) -> u64 {
        self.writer.as_ref().map_or(0, WriteBehind::nbytes)
    }

    /// Where the caller writes the new metadata table (every row, old and new) before
    /// [`commit`](Self::commit).
    pub fn metadata_path(&self) -> &Path {
        self.save.path()
    }

    /// Where the caller may write the new version's loader plan.
    pub fn plan_path(&self) -> &Path {
        self.save.plan_path()
    }

    /// Appends one serialized record; returns its sample id in the cache.
    pub fn append(&mut self, record: &[u8]) -> Result<u64> {
        let writer = self.writer.as_mut().ok_or_else(ended)?;
        Ok(self.first + writer.append(record)?)
    }

    /// Writes the part's index, moves the part into place and makes the new metadata table
    /// the live version, listing the part, in one manifest write; returns the version. On
    /// any failure the cache stays as it was.
    pub fn commit(&mut self, lock: &BuildLock) -> Result<u32> {
        let writer = self.writer.take().ok_or_else(ended)?;
        let mut placed: Option<PathBuf> = None;
        let committed = (|| {
            let part = writer.finish_part()?;
            crash_point("append-part-written");
            let (first, tmp, dir) = (self.first, &self.tmp, &self.dir);
            self.save.commit_with(lock, |manifest| {
                if manifest.num_samples != first {
                    return Err(Error::Internal(format!(
                        "the cache holds {} samples, not the {first} this append started from",
                        manifest.num_samples
                    )));
                }
                let relative = Manifest::part_dir(manifest.parts.len() + 1);
                let target = dir.join(&relative);
                std::fs::rename(tmp, &target).at(&target)?;
                placed = Some(target);
                sync_dir(&dir.join(PARTS_DIR))?;
                crash_point("append-part-moved");
                manifest.add_part(part.relocated(&relative));
                Ok(())
            })
        })();
        if committed.is_err() {
            let _ = std::fs::remove_dir_all(&self.tmp);
            // The part's directory goes too, unless the manifest lists it after all.
            if let Some(target) = placed {
                let listed = current(&self.store, &self.name, &self.cache_id).is_ok_and(|m| {
                    m.parts
                        .iter()
                        .any(|p| target.ends_with(part_dir_of(&p.index.file)))
                });
                if !listed {
                    let _ = std::fs::remove_dir_all(&target);
                }
            }
        }
        committed
    }

    /// Removes what was written; the cache is untouched.
    pub fn discard(&mut self) -> Result<()> {
        self.writer = None;
        self.save.discard()?;
        match std::fs::remove_dir_all(&self.tmp) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e).at(&self.tmp),
            _ => Ok(()),
        }
    }
}

impl Drop for AppendSession {
    fn drop(&mut self) {
        if self.writer.is_some() {
            let _ = std::fs::remove_dir_all(&self.tmp);
        }
    }
}

/// The part directory (`parts/NNNNN`) a part's file lives in.
fn part_dir_of(file: &str) -> &str {
    file.rsplit_once('/').map_or(file, |(dir, _)| dir)
}

/// Removes what dead appends left under `parts` (only the lock holder writes there):
/// hidden directories being written, and part directories that no manifest lists (moved
/// into place by an append that died before its manifest was written).
fn clear_leftovers(parts: &Path, listed: usize) -> Result<()> {
    for entry in std::fs::read_dir(parts).at(parts)? {
        let entry = entry.at(parts)?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let unlisted = name.parse::<usize>().is_ok_and(|n| n > listed);
        if name.starts_with(".tmp-") || unlisted {
            let path = entry.path();
            std::fs::remove_dir_all(&path).at(&path)?;
        }
    }
    Ok(())
}

/// The error of a call on a session that has ended: the bindings never make one.
fn ended() -> Error {
    Error::Internal("the append was already committed or discarded".into())
}
