//! Appending records to a published cache: a new part, committed with a new metadata version.
//!
//! An [`AppendSession`] writes the records into a hidden staging directory under `parts/`
//! (its own part as `00000/`, and parts that other processes write with a
//! [`PartWriter`](crate::build::PartWriter) as `00001/` and on), while the caller writes the
//! new metadata table (the old rows and the new ones) where the session's metadata save
//! says. `commit` moves each part into place as `parts/NNNNN/` and writes the manifest
//! listing them and the new live version in one atomic step; until then readers see the
//! cache as it was, and a crash at any point leaves it so (the next append clears what the
//! dead one left). Existing files are never touched.

use std::path::{Path, PathBuf};

use crate::error::{Error, IoContext, Result};
use crate::faults::crash_point;
use crate::format::{new_cache_id, sync_dir, Manifest, Part, PARTS_DIR};
use crate::metadata::{current, MetadataSave, VersionPlan};
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
        let own = tmp.join(Self::staged_part(0));
        std::fs::create_dir_all(&own).at(&own)?;
        let opts = WriteOptions {
            shard_size,
            alignment: manifest.alignment,
            compression: manifest.codec()?,
        };
        let writer = match CacheWriter::create_part(&own, opts).and_then(WriteBehind::spawn) {
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

    /// The staging directory: parts written by other processes go into
    /// [`staged_part(j)`](Self::staged_part) under it, for `j` from 1.
    pub fn staging_dir(&self) -> &Path {
        &self.tmp
    }

    /// The directory, relative to the staging directory, of staged part `j`: 0 is the
    /// session's own, whose records come first.
    pub fn staged_part(j: usize) -> String {
        format!("{j:05}")
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

    /// The new version's loader plan, to write before [`commit`](Self::commit).
    pub fn plan(&mut self) -> &mut VersionPlan {
        self.save.plan()
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
        self.commit_with_parts(lock, Vec::new())
    }

    /// [`commit`](Self::commit), listing after the session's own part the `staged` parts
    /// that other processes wrote into the staging directory (their paths relative to it,
    /// as a [`PartWriter`](crate::build::PartWriter) there returns them), in order.
    pub fn commit_with_parts(&mut self, lock: &BuildLock, staged: Vec<Part>) -> Result<u32> {
        let writer = self.writer.take().ok_or_else(ended)?;
        let mut placed: Vec<PathBuf> = Vec::new();
        let committed = (|| {
            let own = writer.finish_part()?.relocated(&Self::staged_part(0));
            let mut parts = vec![own];
            parts.extend(staged);
            crash_point("append-part-written");
            let (first, tmp, dir) = (self.first, &self.tmp, &self.dir);
            self.save.commit_with(lock, |manifest| {
                if manifest.num_samples != first {
                    return Err(Error::Internal(format!(
                        "the cache holds {} samples, not the {first} this append started from",
                        manifest.num_samples
                    )));
                }
                for part in parts {
                    let staged = part_dir_of(&part.index.file).to_string();
                    let relative = Manifest::part_dir(manifest.parts.len() + 1);
                    let target = dir.join(&relative);
                    std::fs::rename(tmp.join(&staged), &target).at(&target)?;
                    placed.push(target);
                    manifest.add_part(part.moved(&staged, &relative)?);
                }
                sync_dir(&dir.join(PARTS_DIR))?;
                crash_point("append-part-moved");
                Ok(())
            })
        })();
        // Empty once committed: every part moved out of it.
        let _ = std::fs::remove_dir_all(&self.tmp);
        if committed.is_err() {
            // The parts' directories go too, unless the manifest lists them after all.
            let listed = current(&self.store, &self.name, &self.cache_id)
                .map(|m| m.parts)
                .unwrap_or_default();
            for target in placed {
                if !listed
                    .iter()
                    .any(|p| target.ends_with(part_dir_of(&p.index.file)))
                {
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
