//! The one error type of the engine.
//!
//! I/O variants carry the path they failed on; corruption variants carry the file and what
//! was wrong with it, so that the Python layer can name the offending input.

use std::path::{Path, PathBuf};

/// Everything that can go wrong in the engine.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An operating-system error on a file or directory.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory the operation failed on.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// No cache exists at the given place.
    #[error("no cache {} under {}", quote(name), root.display())]
    CacheNotFound {
        /// The cache's name.
        name: String,
        /// The root directory that was searched.
        root: PathBuf,
    },
    /// The cache under a name is another build than the one a frame or loader refers to.
    #[error(
        "cache {} was rebuilt (cache_id {expected} is now {found}); the frame refers to a \
         build that no longer exists",
        quote(name)
    )]
    Rebuilt {
        /// The cache's name.
        name: String,
        /// The cache_id the caller expected.
        expected: String,
        /// The cache_id found on disk.
        found: String,
    },
    /// A file of a cache does not hold what the manifest or the format promise.
    #[error("{}: {msg}", path.display())]
    Corrupt {
        /// The damaged file.
        path: PathBuf,
        /// What was found to be wrong.
        msg: String,
    },
    /// The cache was written by a newer dataset_rt than this one.
    #[error(
        "{}: written with format version {found}, but this dataset_rt reads versions up to \
         {supported}; upgrade dataset-rt to open it",
        path.display()
    )]
    UnsupportedVersion {
        /// The manifest that declared the version.
        path: PathBuf,
        /// The version found.
        found: u64,
        /// The newest version this build understands.
        supported: u64,
    },
    /// A cache name that cannot be used as a directory under the root.
    #[error("invalid cache name {}: {why}", quote(name))]
    InvalidName {
        /// The rejected name.
        name: String,
        /// Why it was rejected.
        why: String,
    },
    /// A sample id outside `0..len`.
    #[error(
        "sample_id {sample_id} is out of range for cache {} with {len} samples",
        quote(name)
    )]
    SampleOutOfRange {
        /// The requested id.
        sample_id: u64,
        /// The number of samples in the cache.
        len: u64,
        /// The cache's name.
        name: String,
    },
    /// An argument outside its allowed range.
    #[error("{0}")]
    InvalidArgument(String),
    /// Sampling weights or shares that break the rule of [`crate::weights`].
    #[error("{0}")]
    Weight(String),
    /// The operation was interrupted (for example by Ctrl-C while waiting on a lock).
    #[error("interrupted")]
    Interrupted,
    /// The operating system refused a resource that is not a file (a thread, memory).
    #[error("{what}: {source}")]
    System {
        /// What was being obtained.
        what: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A broken invariant of dataset_rt itself: a bug, never the caller's doing.
    #[error(
        "internal error: {0}. This is a bug in dataset_rt; please report it, with this \
         message, at https://github.com/dataset-rt/dataset-rt/issues"
    )]
    Internal(String),
    /// A shard's [`crate::fetch::Fetcher`] failed to make it present.
    #[error("{}: {source}", path.display())]
    Fetch {
        /// The shard that was to be fetched.
        path: PathBuf,
        /// The fetcher's own error, handed back to its caller unchanged.
        source: crate::fetch::FetchError,
    },
}

/// Quotes a user-given string the way Python's `repr` does: `'name'`, with escapes.
pub fn quote(s: &str) -> String {
    format!("'{}'", s.escape_debug())
}

/// The engine's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A corruption error for `path`.
    pub fn corrupt(path: impl AsRef<Path>, msg: impl Into<String>) -> Self {
        Error::Corrupt {
            path: path.as_ref().to_path_buf(),
            msg: msg.into(),
        }
    }
}

/// Attaches a path to `std::io::Error`s.
pub trait IoContext<T> {
    /// Turns an I/O error into [`Error::Io`] naming `path`.
    fn at(self, path: &Path) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn at(self, path: &Path) -> Result<T> {
        self.map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })
    }
}

/// Returns early with [`Error::Corrupt`] unless the condition holds.
#[macro_export]
macro_rules! ensure_intact {
    ($cond:expr, $path:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err($crate::error::Error::corrupt($path, format!($($fmt)+)));
        }
    };
}

/// Returns early with [`Error::InvalidArgument`].
#[macro_export]
macro_rules! bail_arg {
    ($($fmt:tt)+) => {
        return Err($crate::error::Error::InvalidArgument(format!($($fmt)+)))
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_errors_say_they_are_bugs_and_where_to_report_them() {
        let text = Error::Internal("row 3 is in group 9 of 2".into()).to_string();
        assert!(
            text.starts_with("internal error: row 3 is in group 9 of 2."),
            "{text}"
        );
        assert!(text.contains("please report it"), "{text}");
        assert!(
            text.contains("github.com/dataset-rt/dataset-rt/issues"),
            "{text}"
        );
    }

    #[test]
    fn system_errors_say_what_was_refused() {
        let source = std::io::Error::from_raw_os_error(libc::EAGAIN);
        let err = Error::System {
            what: "cannot start the prefetch thread".into(),
            source,
        };
        assert!(
            err.to_string()
                .starts_with("cannot start the prefetch thread: "),
            "{err}"
        );
    }
}
