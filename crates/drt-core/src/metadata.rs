//! A published cache's metadata versions: checking one before it is read, and saving a new
//! one as a single transaction.
//!
//! The engine does not parse the tables (Parquet, written and read by Polars on the Python
//! side); it owns everything around them: where each version lives, the checksum rule, and
//! the order of steps that makes a save atomic. A [`MetadataSave`] hands its caller the one
//! path to write the table to, then publishes it with `commit` or removes it with `discard`
//! (or on drop).

use std::path::{Path, PathBuf};

use crate::error::{Error, IoContext, Result};
use crate::faults::crash_point;
use crate::format::{checksum_hex, file_checksum, sync_dir, sync_file, Manifest, METADATA_DIR};
use crate::plan::Plan;
use crate::store::{BuildLock, Store};

/// The version a freshly built cache's table has.
pub const FIRST_VERSION: u32 = 1;

/// Compares a table's xxh3-64 digest with the one its manifest recorded for `version`
/// (caches written before checksums recorded none: nothing to compare). `Err` says what
/// differs; this is the one rule that both reading and [`crate::verify`] apply.
pub fn check_digest(expected: Option<&str>, digest: u64) -> std::result::Result<(), String> {
    let found = checksum_hex(digest);
    match expected {
        Some(expected) if expected != found => Err(format!(
            "metadata table fails its checksum (manifest {expected}, file {found}); it was \
             modified outside dataset_rt"
        )),
        _ => Ok(()),
    }
}

/// Checks a loader plan's xxh3-64 `digest` against the checksum `expected` its manifest
/// records; `Err` says what differs and what to do.
pub fn check_plan_digest(expected: Option<&str>, digest: u64) -> std::result::Result<(), String> {
    let found = checksum_hex(digest);
    match expected {
        Some(expected) if expected != found => Err(format!(
            "loader plan fails its checksum (manifest {expected}, file {found}); delete the \
             file, and loaders over this version build their own"
        )),
        _ => Ok(()),
    }
}

/// The file of metadata version `version` in cache directory `dir`, checked before anyone
/// parses it: a regular file, matching the checksum `expected` (a flipped bit in a weight
/// would otherwise parse as a wrong weight). Hashing runs at memory speed, a small cost
/// next to the parse.
pub fn checked_table(dir: &Path, version: u32, expected: Option<&str>) -> Result<PathBuf> {
    let path = table_file(dir, version)?;
    let (_, digest) = file_checksum(&path)?;
    check_digest(expected, digest).map_err(|msg| Error::corrupt(&path, msg))?;
    Ok(path)
}

/// The file of metadata version `version` in cache directory `dir` if it is there as a
/// regular file: what can be said of it without reading it (see [`checked_table`]).
pub fn table_file(dir: &Path, version: u32) -> Result<PathBuf> {
    let path = dir.join(Manifest::metadata_file(version));
    match std::fs::symlink_metadata(&path) {
        Ok(meta) if meta.file_type().is_symlink() => Err(Error::corrupt(
            &path,
            "is a symbolic link; cache files must be regular",
        )),
        Ok(_) => Ok(path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Err(Error::corrupt(&path, "the metadata table is missing"))
        }
        Err(e) => Err(e).at(&path),
    }
}

/// Saving a new metadata version of a published cache, under its build lock.
///
/// `begin` checks the cache is still the build the caller edited and picks the next
/// version; the caller writes the table to [`path`](Self::path); `commit` flushes it, moves
/// it into place and records it (with its checksum) in the manifest, which readers see
/// change in one atomic step. A crash at any point leaves the live version as it was.
pub struct MetadataSave {
    store: Store,
    name: String,
    cache_id: String,
    version: u32,
    tmp: PathBuf,
    plan: VersionPlan,
    open: bool,
}

/// The loader plan of a metadata version being written (see [`crate::plan`]): what a
/// shuffled loader over the version's table would write for itself, which loaders over the
/// version then map. Each session that writes a version (a build, an append, a save) holds
/// one; its commit records the digest the plan was hashed with as it was written.
#[derive(Debug)]
pub struct VersionPlan {
    path: PathBuf,
    digest: Option<u64>,
}

impl VersionPlan {
    pub(crate) fn new(path: PathBuf) -> Self {
        Self { path, digest: None }
    }

    /// Writes the plan of one cache's rows `sample_ids`, drawn by `weights`, with token
    /// documents' `lengths`, and flushes it to disk (the commit's own flush then finds
    /// nothing left to write).
    pub fn write(
        &mut self,
        sample_ids: &[u64],
        weights: &[f64],
        lengths: Option<&[u32]>,
    ) -> Result<()> {
        self.digest = None;
        let digest = Plan::write(&self.path, sample_ids, None, Some(weights), lengths)?;
        sync_file(&self.path)?;
        self.digest = Some(digest);
        Ok(())
    }

    /// The digest of the plan as written; None until it is.
    pub(crate) fn digest(&self) -> Option<u64> {
        self.digest
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

impl MetadataSave {
    /// Starts saving a new version of cache `lock.name()`, which must still be the build
    /// `cache_id` (else [`Error::Rebuilt`]). Temporary tables found now were left by a
    /// process that died mid-save (only the lock holder writes them) and are removed.
    pub fn begin(store: &Store, lock: &BuildLock, cache_id: &str) -> Result<Self> {
        let name = lock.name();
        let manifest = current(store, name, cache_id)?;
        let cache_dir = store.cache_dir(name)?;
        let dir = cache_dir.join(METADATA_DIR);
        for entry in std::fs::read_dir(&dir).at(&dir)? {
            let file = entry.at(&dir)?.file_name();
            let file = file.to_string_lossy();
            if file.starts_with(".v")
                && (file.contains(".parquet.tmp-") || file.contains(".plan.tmp-"))
            {
                let stale = dir.join(&*file);
                std::fs::remove_file(&stale).at(&stale)?;
            }
        }
        let version = manifest
            .metadata_versions
            .iter()
            .max()
            .map_or(FIRST_VERSION, |v| v + 1);
        Ok(Self {
            store: store.clone(),
            name: name.to_string(),
            cache_id: cache_id.to_string(),
            version,
            tmp: temporary(&cache_dir, &Manifest::metadata_file(version)),
            plan: VersionPlan::new(temporary(&cache_dir, &Manifest::plan_file(version))),
            open: true,
        })
    }

    /// Where the caller writes the new table.
    pub fn path(&self) -> &Path {
        &self.tmp
    }

    /// The new version's loader plan, to write before the commit.
    pub fn plan(&mut self) -> &mut VersionPlan {
        &mut self.plan
    }

    /// The version the table becomes.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Makes the written table the live version; returns its number. On failure nothing of
    /// it is left and the live version is unchanged.
    pub fn commit(&mut self, lock: &BuildLock) -> Result<u32> {
        self.commit_with(lock, |_| Ok(()))
    }

    /// [`commit`](Self::commit), with `edit` applied to the manifest it writes, in the same
    /// atomic write (an append adds its part there). An error from `edit` aborts the commit.
    pub(crate) fn commit_with(
        &mut self,
        lock: &BuildLock,
        edit: impl FnOnce(&mut Manifest) -> Result<()>,
    ) -> Result<u32> {
        if !self.open {
            return Err(Error::Internal(
                "the metadata save was already committed or discarded".into(),
            ));
        }
        if lock.name() != self.name {
            return Err(Error::Internal(format!(
                "a metadata save of {} was committed under the lock of {}",
                crate::error::quote(&self.name),
                crate::error::quote(lock.name())
            )));
        }
        self.open = false;
        let dir = self.store.cache_dir(&self.name)?;
        let file = dir.join(Manifest::metadata_file(self.version));
        let plan = dir.join(Manifest::plan_file(self.version));
        let committed = (|| {
            if !self.tmp.is_file() {
                return Err(Error::Internal(format!(
                    "the new metadata table {} was not written before the commit",
                    self.tmp.display()
                )));
            }
            crash_point("metadata-written");
            sync_file(&self.tmp)?;
            if self.plan.digest().is_some() {
                sync_file(self.plan.path())?;
                std::fs::rename(self.plan.path(), &plan).at(&plan)?;
            }
            std::fs::rename(&self.tmp, &file).at(&file)?;
            sync_dir(file.parent().unwrap_or(&dir))?;
            crash_point("metadata-renamed");
            let mut manifest = current(&self.store, &self.name, &self.cache_id)?;
            edit(&mut manifest)?;
            let (_, digest) = file_checksum(&file)?;
            manifest.metadata_versions.push(self.version);
            manifest.metadata_version = self.version;
            manifest
                .metadata_checksums
                .insert(self.version, checksum_hex(digest));
            if let Some(digest) = self.plan.digest() {
                manifest
                    .plan_checksums
                    .insert(self.version, checksum_hex(digest));
            }
            manifest.write(&dir)
        })();
        if committed.is_err() {
            for path in [&self.tmp, self.plan.path(), &file, &plan] {
                let _ = std::fs::remove_file(path);
            }
        }
        committed.map(|()| self.version)
    }

    /// Removes the table written so far; the live version is untouched.
    pub fn discard(&mut self) -> Result<()> {
        self.open = false;
        for path in [&self.tmp, self.plan.path()] {
            match std::fs::remove_file(path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e).at(path),
                _ => {}
            }
        }
        Ok(())
    }
}

impl Drop for MetadataSave {
    fn drop(&mut self) {
        if self.open {
            let _ = std::fs::remove_file(&self.tmp);
            let _ = std::fs::remove_file(self.plan.path());
        }
    }
}

/// Puts back the saved loader plan of metadata `version` of cache `lock.name()` (still the
/// build `cache_id`) from `source`, a plan built anew from that version's table: copied in
/// next to it, flushed, and renamed over whatever is there, but only if its checksum is the
/// one the manifest recorded, which proves it is the plan that was saved. Returns whether it
/// was put back (false: the version records no plan, or `source` is another one).
pub fn restore_plan(
    store: &Store,
    lock: &BuildLock,
    cache_id: &str,
    version: u32,
    source: &Path,
) -> Result<bool> {
    let manifest = current(store, lock.name(), cache_id)?;
    let Some(expected) = manifest.plan_checksums.get(&version) else {
        return Ok(false);
    };
    let (_, digest) = file_checksum(source)?;
    if &checksum_hex(digest) != expected {
        return Ok(false);
    }
    let dir = store.cache_dir(lock.name())?;
    let target = dir.join(Manifest::plan_file(version));
    let tmp = temporary(&dir, &Manifest::plan_file(version));
    let restored = (|| {
        std::fs::copy(source, &tmp).at(&tmp)?;
        sync_file(&tmp)?;
        std::fs::rename(&tmp, &target).at(&target)?;
        sync_dir(target.parent().unwrap_or(&dir))
    })();
    if restored.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    restored.map(|()| true)
}

/// Where this process writes `file` (a path relative to cache directory `dir`) before
/// renaming it into place: beside it, hidden, named after it and this process. Only the
/// holder of the cache's lock writes these, so any found while holding it are leftovers.
fn temporary(dir: &Path, file: &str) -> PathBuf {
    let path = dir.join(file);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

/// The manifest of cache `name`, which must still be the build `cache_id`.
pub(crate) fn current(store: &Store, name: &str, cache_id: &str) -> Result<Manifest> {
    let manifest = store.manifest(name)?;
    if manifest.cache_id != cache_id {
        return Err(Error::Rebuilt {
            name: name.to_string(),
            expected: cache_id.to_string(),
            found: manifest.cache_id,
        });
    }
    Ok(manifest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_that_differs_from_its_checksum_or_is_missing_is_corrupt() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(Manifest::metadata_file(3));
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, b"table").unwrap();
        let right = checksum_hex(xxhash_rust::xxh3::xxh3_64(b"table"));
        assert!(checked_table(dir.path(), 3, Some(&right)).is_ok());
        assert!(
            checked_table(dir.path(), 3, None).is_ok(),
            "no checksum recorded"
        );
        let err = checked_table(dir.path(), 3, Some("0000000000000000")).unwrap_err();
        assert!(err.to_string().contains("fails its checksum"), "{err}");
        let err = checked_table(dir.path(), 4, None).unwrap_err();
        assert!(matches!(err, Error::Corrupt { .. }), "{err}");
    }
}
