//! A root directory of caches: name → directory, the build lock, build directories and the
//! atomic publication of a finished build.
//!
//! ```text
//! <root>/<name>/                    a published cache
//! <root>/.<name>.lock               flock'ed by the one process building <name>; removed
//!                                   by its holder on release, so none outlives its build
//! <root>/.<name>.build-<pid>-<id>   a build in progress (or left behind by a crash)
//! ```
//!
//! Only the holder of a name's lock creates, publishes or removes that name's build
//! directories, so any build directory found while holding the lock was left by a process
//! that died, and is removed.

use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::error::{Error, IoContext, Result};
use crate::format::{new_cache_id, sync_dir, validate_name, Manifest, MANIFEST_FILE};

/// Whether `path` still names the open `file` (false once it was removed or replaced).
fn is_same_file(file: &File, path: &Path) -> Result<bool> {
    use std::os::unix::fs::MetadataExt;
    let held = file.metadata().at(path)?;
    match std::fs::symlink_metadata(path) {
        Ok(now) => Ok(now.dev() == held.dev() && now.ino() == held.ino()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e).at(path),
    }
}

/// A directory that holds caches by name.
#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
}

/// Exclusive right to build (or rebuild) one cache name; released on drop or process exit.
///
/// The lock is an `flock` on the file `<root>/.<name>.lock`. Its holder removes the file when
/// it releases the lock, so lock files do not pile up in the root. A process that was waiting
/// on the removed file then finds that the path no longer names the file it locked, and tries
/// again on whatever file is there now: the holder is always the one process whose locked
/// file is the one at the path.
#[derive(Debug)]
pub struct BuildLock {
    file: Option<File>,
    path: PathBuf,
    name: String,
    /// The process that took the lock: a child forked while it was held must not remove
    /// the file its parent still holds.
    pid: u32,
}

impl Drop for BuildLock {
    fn drop(&mut self) {
        if let Some(file) = self.file.take() {
            // Removed while still locked, so nobody can take a lock on this file after us
            // and believe it is the current one. A failure leaves a stale, harmless file.
            if self.pid == std::process::id() && is_same_file(&file, &self.path).unwrap_or(false) {
                let _ = std::fs::remove_file(&self.path);
            }
            drop(file);
        }
    }
}

impl BuildLock {
    /// The cache name this lock guards.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Store {
    /// A store at `root` (which need not exist yet).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The directory of cache `name`, after checking the name.
    /// A symbolic link in the cache's place is refused: it could lead anywhere, outside the
    /// root included, and a rebuild would replace the link rather than what it points to.
    pub fn cache_dir(&self, name: &str) -> Result<PathBuf> {
        validate_name(name)?;
        let dir = self.root.join(name);
        if std::fs::symlink_metadata(&dir).is_ok_and(|m| m.file_type().is_symlink()) {
            return Err(Error::corrupt(
                &dir,
                "is a symbolic link; a cache must be a directory inside its root",
            ));
        }
        Ok(dir)
    }

    /// Whether a published cache directory exists for `name` (valid or not).
    pub fn exists(&self, name: &str) -> Result<bool> {
        Ok(self.cache_dir(name)?.join(MANIFEST_FILE).exists())
    }

    /// Takes the build lock of `name`, waiting for another holder to release it. `poll` is
    /// called between attempts and may abort the wait by returning an error (Ctrl-C).
    /// Returns the lock and whether it had to wait.
    pub fn lock(
        &self,
        name: &str,
        mut poll: impl FnMut() -> Result<()>,
    ) -> Result<(BuildLock, bool)> {
        validate_name(name)?;
        std::fs::create_dir_all(&self.root).at(&self.root)?;
        let path = self.root.join(format!(".{name}.lock"));
        let mut waited = false;
        loop {
            // A symbolic link in the lock's place is refused (ELOOP) rather than followed: the
            // check below compares the file at the path itself with the one locked.
            let file = File::options()
                .create(true)
                .truncate(false)
                .write(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&path)
                .at(&path)?;
            loop {
                match file.try_lock() {
                    Ok(()) => break,
                    Err(std::fs::TryLockError::WouldBlock) => {
                        waited = true;
                        poll()?;
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(std::fs::TryLockError::Error(e)) => return Err(e).at(&path),
                }
            }
            if is_same_file(&file, &path)? {
                let lock = BuildLock {
                    file: Some(file),
                    path,
                    name: name.to_string(),
                    pid: std::process::id(),
                };
                return Ok((lock, waited));
            }
            // The holder we waited for removed the file on release: lock the current one.
            waited = true;
            poll()?;
        }
    }

    /// Removes build directories of `name` left behind by dead processes, then creates a
    /// fresh one.
    pub fn begin_build(&self, lock: &BuildLock) -> Result<PathBuf> {
        self.remove_stale_builds(lock)?;
        let dir = self.root.join(format!(
            ".{}.build-{}-{}",
            lock.name,
            std::process::id(),
            new_cache_id()?
        ));
        std::fs::create_dir(&dir).at(&dir)?;
        Ok(dir)
    }

    fn remove_stale_builds(&self, lock: &BuildLock) -> Result<()> {
        let prefix = format!(".{}.build-", lock.name);
        for entry in std::fs::read_dir(&self.root).at(&self.root)? {
            let entry = entry.at(&self.root)?;
            if entry.file_name().to_string_lossy().starts_with(&prefix) {
                let path = entry.path();
                std::fs::remove_dir_all(&path).at(&path)?;
            }
        }
        Ok(())
    }

    /// Removes an unfinished build directory.
    pub fn discard(&self, build_dir: &Path) -> Result<()> {
        match std::fs::remove_dir_all(build_dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e).at(build_dir),
            _ => Ok(()),
        }
    }

    /// Makes a finished build visible as cache `lock.name`, replacing any cache of that name
    /// in one atomic step: readers see the old cache or the new one, never neither or a mix.
    pub fn publish(&self, lock: &BuildLock, build_dir: &Path) -> Result<()> {
        let target = self.cache_dir(&lock.name)?;
        if target.exists() {
            exchange(build_dir, &target)?;
            sync_dir(&self.root)?;
            // `build_dir` now holds the replaced cache. A crash before it is gone leaves a
            // stale build directory, which the next build of this name removes.
            self.discard(build_dir)?;
        } else {
            std::fs::rename(build_dir, &target).at(&target)?;
            sync_dir(&self.root)?;
        }
        Ok(())
    }

    /// The names of the published caches under the root, sorted. A missing root has none.
    pub fn names(&self) -> Result<Vec<String>> {
        let entries = match std::fs::read_dir(&self.root) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e).at(&self.root),
        };
        let mut names = Vec::new();
        for entry in entries {
            let entry = entry.at(&self.root)?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let is_dir = entry.file_type().is_ok_and(|t| t.is_dir()); // links not followed
            if is_dir && validate_name(&name).is_ok() && entry.path().join(MANIFEST_FILE).is_file()
            {
                names.push(name);
            }
        }
        names.sort();
        Ok(names)
    }

    /// The manifest of cache `name`, or [`Error::CacheNotFound`].
    pub fn manifest(&self, name: &str) -> Result<Manifest> {
        let dir = self.cache_dir(name)?;
        if !dir.join(MANIFEST_FILE).exists() {
            return Err(Error::CacheNotFound {
                name: name.to_string(),
                root: self.root.clone(),
            });
        }
        Manifest::read(&dir)
    }
}

/// Swaps two directory entries atomically.
#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes()).map_err(|_| {
            Error::InvalidArgument(format!("path {} contains a NUL byte", p.display()))
        })
    };
    let (ca, cb) = (c(a)?, c(b)?);
    // SAFETY: both arguments are valid NUL-terminated paths that outlive the call.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    match err.raw_os_error() {
        // Filesystems without RENAME_EXCHANGE: fall back to two renames.
        Some(libc::EINVAL) | Some(libc::ENOSYS) => exchange_by_renames(a, b),
        _ => Err(err).at(b),
    }
}

#[cfg(not(target_os = "linux"))]
fn exchange(a: &Path, b: &Path) -> Result<()> {
    exchange_by_renames(a, b)
}

/// Swaps `a` and `b` with renames through a third name. Not atomic: a crash between the
/// renames leaves `b` absent until the next build, but never a mixed cache.
fn exchange_by_renames(a: &Path, b: &Path) -> Result<()> {
    let parked = a.with_extension("parked");
    std::fs::rename(b, &parked).at(b)?;
    std::fs::rename(a, b).at(b)?;
    std::fs::rename(&parked, a).at(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `poll` for `Store::lock` that gives up (as Ctrl-C would) at its `n`-th call.
    fn interrupted_at_poll(n: usize) -> impl FnMut() -> Result<()> {
        let mut polls = 0;
        move || {
            polls += 1;
            if polls == n {
                Err(Error::Interrupted)
            } else {
                Ok(())
            }
        }
    }

    #[test]
    fn second_locker_waits_until_release() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(dir.path());
        let (first, waited) = store.lock("x", || Ok(())).unwrap();
        assert!(!waited);
        let err = store.lock("x", interrupted_at_poll(3)).unwrap_err();
        assert!(matches!(err, Error::Interrupted));
        drop(first);
        let (_second, waited) = store.lock("x", || Ok(())).unwrap();
        assert!(!waited);
        // Other names are independent.
        store.lock("y", || panic!("must not wait")).unwrap();
    }

    #[test]
    fn the_lock_file_lives_only_while_held_and_waiters_follow_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(dir.path());
        let path = dir.path().join(".z.lock");
        let (first, _) = store.lock("z", || Ok(())).unwrap();
        assert!(path.exists());
        // A waiter holds the file the first holder removes on release; it must go on to
        // lock the file that is at the path afterwards, not the removed one.
        let (waiting, is_waiting) = std::sync::mpsc::channel();
        let waiter = std::thread::spawn({
            let store = store.clone();
            move || {
                store
                    .lock("z", || {
                        let _ = waiting.send(()); // it holds the first file and waits on it
                        Ok(())
                    })
                    .unwrap()
            }
        });
        is_waiting.recv().unwrap();
        drop(first);
        let (second, waited) = waiter.join().unwrap();
        assert!(waited);
        assert!(path.exists(), "the holder's file is at the path");
        // While the second holds it, nobody else gets it.
        let err = store.lock("z", interrupted_at_poll(2)).unwrap_err();
        assert!(matches!(err, Error::Interrupted));
        drop(second);
        assert!(!path.exists(), "no lock file is left behind");
    }

    #[test]
    fn a_symlink_in_the_lock_files_place_is_an_error_not_a_spin() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(dir.path());
        std::os::unix::fs::symlink(dir.path().join("elsewhere"), dir.path().join(".s.lock"))
            .unwrap();
        let err = store.lock("s", || Ok(())).unwrap_err();
        assert!(err.to_string().contains(".s.lock"), "{err}");
    }

    #[test]
    fn publish_replaces_atomically_and_stale_builds_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(dir.path());
        let (lock, _) = store.lock("c", || Ok(())).unwrap();
        let stale = dir.path().join(".c.build-1-dead");
        std::fs::create_dir(&stale).unwrap();
        let b1 = store.begin_build(&lock).unwrap();
        assert!(!stale.exists());
        std::fs::write(b1.join(MANIFEST_FILE), "one").unwrap();
        store.publish(&lock, &b1).unwrap();
        let b2 = store.begin_build(&lock).unwrap();
        std::fs::write(b2.join(MANIFEST_FILE), "two").unwrap();
        store.publish(&lock, &b2).unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.path().join("c").join(MANIFEST_FILE)).unwrap(),
            "two"
        );
        assert!(!b2.exists());
        assert_eq!(store.names().unwrap(), vec!["c".to_string()]);
    }

    #[test]
    fn names_skip_hidden_and_incomplete_entries() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("no-manifest")).unwrap();
        std::fs::create_dir(dir.path().join(".c.build-1-x")).unwrap();
        std::fs::write(dir.path().join(".c.build-1-x").join(MANIFEST_FILE), "").unwrap();
        let store = Store::new(dir.path());
        assert!(store.names().unwrap().is_empty());
        assert!(Store::new(dir.path().join("absent"))
            .names()
            .unwrap()
            .is_empty());
        assert!(matches!(
            store.manifest("no-manifest"),
            Err(Error::CacheNotFound { .. })
        ));
    }

    #[test]
    fn a_symlink_in_a_caches_place_is_refused() {
        let root = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join(MANIFEST_FILE), "{}").unwrap();
        std::os::unix::fs::symlink(outside.path(), root.path().join("escape")).unwrap();
        let store = Store::new(root.path());
        let err = store.cache_dir("escape").unwrap_err().to_string();
        assert!(err.contains("symbolic link"), "{err}");
        assert!(store.manifest("escape").is_err());
        assert!(store.names().unwrap().is_empty());
    }
}
