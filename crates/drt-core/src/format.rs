//! The on-disk format: directory layout, the manifest, shard headers and checksums.
//!
//! ```text
//! <name>/manifest.json            written last and atomically; names every other file
//! <name>/shards/NNNNN.bin         SHARD_MAGIC header, then records back to back, aligned
//! <name>/index.arrow              per sample: 16-byte locator (offset, length, shard), checksum
//! <name>/metadata/vNNNNN.parquet  metadata versions; the manifest names the live one
//! <name>/parts/NNNNN/             records appended later: shards/ and index.arrow of their own
//! ```

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::compress::Codec;
use crate::error::{Error, IoContext, Result};

/// The format version this build writes, and the newest it reads.
///
/// Version 2 records serializers by the names `drt.cache(serializer=...)` takes. Version 1
/// recorded the default one (protocol 5 with out-of-band buffers) as `pickle-oob` and plain
/// in-band pickle as `pickle`; such manifests are read into the version 2 names, and written
/// back as version 2 when they are next committed. Version 3 adds `parts`: records appended
/// after the build, each part with shards and an index of its own. Version 4 adds compressed
/// records (`compression` other than `none`). Version 5 stores each index as 16-byte
/// locators and a checksum column (see [`crate::index`]); what this build writes is version
/// 5, and a cache written before keeps its version until a part with such an index is
/// appended to it, so that the releases that read it keep reading it.
pub const FORMAT_VERSION: u64 = 5;
/// The first format version whose indexes are locators.
pub const LOCATORS_VERSION: u64 = 5;
/// The name of the manifest file inside a cache directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The name of the index file inside a cache directory.
pub const INDEX_FILE: &str = "index.arrow";
/// The directory that holds the payload shards.
pub const SHARDS_DIR: &str = "shards";
/// The directory that holds the metadata versions.
pub const METADATA_DIR: &str = "metadata";
/// The directory that holds the parts appended after the build, one directory each.
pub const PARTS_DIR: &str = "parts";
/// The first bytes of a record whose large buffers are stored out of band (the default
/// `pickle` serializer's layout: header, aligned buffers, then the pickle stream).
pub const OOB_MAGIC: &[u8; 8] = b"DRTOOB01";
/// Out-of-band buffers start at multiples of this within a record, records at multiples of
/// it within a shard (for the `pickle` serializer) and within a batch's buffer, so that an
/// array viewed in place is as aligned as when it was written.
pub const RECORD_ALIGN: usize = 64;
// Arrays decoded from a compressed record are as aligned as those viewed in a shard.
const _: () = assert!(crate::compress::DECODED_ALIGN == RECORD_ALIGN);
/// Buffers of at least this many bytes are stored out of band, and records holding them are
/// left in their mapped shard by loaders rather than copied into the batch.
pub const MIN_OUT_OF_BAND: usize = 64 * 1024;

/// Bytes each write of a shard, the index or a plan hands the kernel at once. Linux (6.x,
/// ext4 and others) keeps a file written in large writes in large page-cache folios, and
/// maps a whole folio on one page fault: files written 2 MiB at a time fault once per
/// 2 MiB when read at random (400 faults for 20,000 random reads of 800 MiB), 1 MiB at a
/// time twice as often, 64 KiB at a time 25 times as often. A draw from a large cache
/// touches a random page of each, so this sets how often it faults.
pub const WRITE_BUFFER: usize = 4 << 20;
/// The first bytes of every shard file.
pub const SHARD_MAGIC: &[u8; 8] = b"DRTSHRD1";
/// Size of a shard's header; the first record starts at or after this offset.
pub const SHARD_HEADER_LEN: u64 = 64;
/// The longest cache name accepted.
pub const MAX_NAME_LEN: usize = 200;

/// A file of a cache as the manifest records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Path relative to the cache directory.
    pub file: String,
    /// Size in bytes.
    pub size: u64,
    /// xxh3-64 of the whole file, as 16 lowercase hex digits.
    pub checksum: String,
}

/// Records appended to a cache after its build: shards and an index of their own, in
/// `parts/NNNNN/`. A part's samples follow those before it, in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Part {
    /// The part's shards in id order (the ids its index refers to), paths relative to the
    /// cache directory.
    pub shards: Vec<FileEntry>,
    /// The part's index: its samples, numbered from 0.
    pub index: FileEntry,
    /// Number of records in the part.
    pub num_samples: u64,
    /// Sum of the part's record lengths.
    pub nbytes: u64,
}

impl Part {
    /// The part as JSON, to hand from the process that wrote it to the one that lists it.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// A part from [`to_json`](Self::to_json)'s text.
    pub fn from_json(text: &str) -> Result<Part> {
        serde_json::from_str(text)
            .map_err(|e| Error::InvalidArgument(format!("not a part description: {e}")))
    }

    /// The part with its files' paths, relative to the part's directory, made relative to
    /// the cache directory instead (`relative` being the part's directory there).
    pub fn relocated(mut self, relative: &str) -> Part {
        for entry in self
            .shards
            .iter_mut()
            .chain(std::iter::once(&mut self.index))
        {
            entry.file = format!("{relative}/{}", entry.file);
        }
        self
    }

    /// The part with its files' paths moved from directory `from` to directory `to` (both
    /// relative to the cache directory): what [`relocated`](Self::relocated) did, redone.
    pub fn moved(mut self, from: &str, to: &str) -> Result<Part> {
        for entry in self
            .shards
            .iter_mut()
            .chain(std::iter::once(&mut self.index))
        {
            let Some(inner) = entry
                .file
                .strip_prefix(from)
                .and_then(|f| f.strip_prefix('/'))
            else {
                return Err(Error::InvalidArgument(format!(
                    "part file {:?} is not in directory {from:?}",
                    entry.file
                )));
            };
            entry.file = format!("{to}/{inner}");
        }
        Ok(self)
    }
}

/// One run of a cache's samples with its own shards and index: the build's, or a part's.
#[derive(Debug, Clone, Copy)]
pub struct Segment<'a> {
    /// The sample id of its first record.
    pub first: u64,
    /// Number of records.
    pub num_samples: u64,
    /// Its shards, in the order its index refers to them.
    pub shards: &'a [FileEntry],
    /// Its index.
    pub index: &'a FileEntry,
}

/// The manifest: the one file that makes a directory a cache.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Format version the cache was written with.
    pub format_version: u64,
    /// The cache's name (its directory name).
    pub name: String,
    /// Unique per build.
    pub cache_id: String,
    /// Number of records, the parts' included.
    pub num_samples: u64,
    /// Sum of the records' lengths (padding excluded), the parts' included.
    pub nbytes: u64,
    /// Alignment of every record's first byte within its shard.
    pub alignment: u64,
    /// How the records were serialized: `pickle` (protocol 5, large buffers out of band),
    /// `pickle-inband`, `dill`, or `custom:<qualified name>`.
    pub serializer: String,
    /// How each record is compressed: `none`, `zstd` or `lz4` (see [`crate::compress`]).
    pub compression: String,
    /// The zstd level records were compressed at (for appends to use it too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compression_level: Option<i32>,
    /// UTC creation time, ISO 8601.
    pub created_at: String,
    /// The build's payload shards in id order.
    pub shards: Vec<FileEntry>,
    /// The build's sample index.
    pub index: FileEntry,
    /// Records appended after the build, in order; their samples follow the build's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parts: Vec<Part>,
    /// The live metadata version (`metadata/vNNNNN.parquet`).
    pub metadata_version: u32,
    /// Every metadata version saved so far, oldest first; the live one among them.
    pub metadata_versions: Vec<u32>,
    /// xxh3-64 of each metadata version's file, by version. Caches written before checksums
    /// were recorded have none; their tables are checked only by parsing them.
    #[serde(default)]
    pub metadata_checksums: BTreeMap<u32, String>,
    /// xxh3-64 of each metadata version's loader plan (`metadata/vNNNNN.plan`: its sample
    /// ids and the alias table of its weights), by version: what a shuffled loader over that
    /// version maps instead of building. Versions without one (older caches, empty tables)
    /// have none, and their loaders build their own.
    #[serde(default)]
    pub plan_checksums: BTreeMap<u32, String>,
}

impl Manifest {
    /// Reads and checks the manifest of the cache in `dir`.
    pub fn read(dir: &Path) -> Result<Manifest> {
        let path = dir.join(MANIFEST_FILE);
        crate::ensure_intact!(
            !std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink()),
            &path,
            "is a symbolic link; cache files must be regular files"
        );
        let text = std::fs::read(&path).at(&path)?;
        Self::parse(&text, &path)
    }

    /// Parses and checks the manifest `text`, read from `path` (named in errors; a remote
    /// cache's manifest arrives as bytes).
    pub fn parse(text: &[u8], path: &Path) -> Result<Manifest> {
        let path = path.to_path_buf();
        let value: serde_json::Value = serde_json::from_slice(text)
            .map_err(|e| Error::corrupt(&path, format!("not valid JSON: {e}")))?;
        // The version is checked before the rest, so that a newer format gets the right error
        // even when its other fields changed.
        let found = value
            .get("format_version")
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| Error::corrupt(&path, "no integer format_version"))?;
        if found > FORMAT_VERSION {
            return Err(Error::UnsupportedVersion {
                path,
                found,
                supported: FORMAT_VERSION,
            });
        }
        let mut manifest: Manifest = serde_json::from_value(value)
            .map_err(|e| Error::corrupt(&path, format!("malformed manifest: {e}")))?;
        manifest.check(&path)?;
        manifest.upgrade();
        Ok(manifest)
    }

    /// Writes the manifest into `dir` atomically (temporary file, fsync, rename), as the
    /// oldest format version that holds it: 3 (4 when compressed), or 5 once an index is
    /// stored as locators.
    pub fn write(&self, dir: &Path) -> Result<()> {
        let codec = if self.compression == "none" { 3 } else { 4 };
        let written = Manifest {
            format_version: self.format_version.max(codec),
            ..self.clone()
        };
        let text = serde_json::to_vec_pretty(&written)
            .map_err(|e| Error::Internal(format!("cannot encode manifest: {e}")))?;
        write_atomic(&dir.join(MANIFEST_FILE), &text)
    }

    /// Brings a manifest of an older format version to this one, in memory. Its
    /// `format_version` stays the one read: it says how its indexes are stored.
    fn upgrade(&mut self) {
        if self.format_version < 2 {
            let renamed = match self.serializer.as_str() {
                "pickle-oob" => "pickle",
                "pickle" => "pickle-inband",
                other => other,
            };
            self.serializer = renamed.to_string();
        }
    }

    /// Every file the manifest names, relative to the cache directory, the manifest itself
    /// excepted, with its recorded checksum where there is one: shards and indexes (the
    /// build's, then each part's), metadata versions and loader plans. What a copy of the
    /// cache must hold.
    pub fn files(&self) -> Vec<(String, Option<String>)> {
        let mut files: Vec<(String, Option<String>)> = self
            .segments()
            .iter()
            .flat_map(|s| s.shards.iter().chain(std::iter::once(s.index)))
            .map(|entry| (entry.file.clone(), Some(entry.checksum.clone())))
            .collect();
        files.extend(self.metadata_versions.iter().map(|v| {
            let checksum = self.metadata_checksums.get(v).cloned();
            (Self::metadata_file(*v), checksum)
        }));
        files.extend(
            self.plan_checksums
                .iter()
                .map(|(&v, checksum)| (Self::plan_file(v), Some(checksum.clone()))),
        );
        files
    }

    /// How the records are compressed.
    pub fn codec(&self) -> Result<Codec> {
        Codec::parse(&self.compression, self.compression_level)
    }

    /// The build's records and each part's, in sample order.
    pub fn segments(&self) -> Vec<Segment<'_>> {
        let appended: u64 = self.parts.iter().map(|p| p.num_samples).sum();
        let mut first = self.num_samples.saturating_sub(appended);
        let mut segments = vec![Segment {
            first: 0,
            num_samples: first,
            shards: &self.shards,
            index: &self.index,
        }];
        for part in &self.parts {
            segments.push(Segment {
                first,
                num_samples: part.num_samples,
                shards: &part.shards,
                index: &part.index,
            });
            first += part.num_samples;
        }
        segments
    }

    /// Lists `part` after the cache's records, which it joins: its samples get the next
    /// sample ids.
    pub fn add_part(&mut self, part: Part) {
        // Parts are written by this build, so their indexes are locators.
        self.format_version = self.format_version.max(LOCATORS_VERSION);
        self.num_samples += part.num_samples;
        self.nbytes += part.nbytes;
        self.parts.push(part);
    }

    /// The relative path of the directory of part `number` (1 for the first appended).
    pub fn part_dir(number: usize) -> String {
        format!("{PARTS_DIR}/{number:05}")
    }

    /// The relative path of metadata version `version`.
    pub fn metadata_file(version: u32) -> String {
        format!("{METADATA_DIR}/v{version:05}.parquet")
    }

    /// The relative path of the loader plan of metadata version `version`.
    pub fn plan_file(version: u32) -> String {
        format!("{METADATA_DIR}/v{version:05}.plan")
    }

    fn check(&self, path: &Path) -> Result<()> {
        // The id names directories (a remote cache's local copy): letters, digits, - and _.
        crate::ensure_intact!(
            (1..=64).contains(&self.cache_id.len())
                && self
                    .cache_id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
            path,
            "cache_id {:?} is not a build id",
            self.cache_id
        );
        crate::ensure_intact!(
            self.alignment.is_power_of_two() && self.alignment <= 4096,
            path,
            "alignment {} is not a power of two up to 4096",
            self.alignment
        );
        if let Err(e) = self.codec() {
            return Err(Error::corrupt(path, e.to_string()));
        }
        let appended = self
            .parts
            .iter()
            .map(|p| p.num_samples)
            .try_fold(0u64, u64::checked_add);
        crate::ensure_intact!(
            appended.is_some_and(|n| n <= self.num_samples),
            path,
            "its parts hold more samples than the cache's {}",
            self.num_samples
        );
        for segment in self.segments() {
            for entry in segment.shards.iter().chain(std::iter::once(segment.index)) {
                crate::ensure_intact!(
                    is_plain_relative(&entry.file),
                    path,
                    "file entry {:?} leaves the cache directory",
                    entry.file
                );
            }
            crate::ensure_intact!(
                segment.shards.len() <= u32::MAX as usize,
                path,
                "too many shards"
            );
        }
        crate::ensure_intact!(
            self.metadata_versions.contains(&self.metadata_version),
            path,
            "live metadata version {} is not among the saved versions {:?}",
            self.metadata_version,
            self.metadata_versions
        );
        Ok(())
    }
}

/// A relative path with no `..`, no root and no empty components.
fn is_plain_relative(file: &str) -> bool {
    !file.is_empty()
        && !file.starts_with('/')
        && file
            .split('/')
            .all(|part| !part.is_empty() && part != "." && part != "..")
}

/// The relative path of shard `id`.
pub fn shard_file(id: u32) -> String {
    format!("{SHARDS_DIR}/{id:05}.bin")
}

/// Checks that `name` can serve as a cache's directory name under a root.
pub fn validate_name(name: &str) -> Result<()> {
    let invalid = |why: String| {
        Err(Error::InvalidName {
            name: name.to_string(),
            why,
        })
    };
    if name.is_empty() {
        return invalid("it is empty".into());
    }
    if name.len() > MAX_NAME_LEN {
        return invalid(format!("it is longer than {MAX_NAME_LEN} bytes"));
    }
    if name.contains(['/', '\\']) {
        return invalid("it contains a path separator; use '-' or '_' instead".into());
    }
    if name.starts_with('.') {
        return invalid("it starts with '.', which is reserved for temporary files".into());
    }
    let allowed = |c: char| c.is_ascii_alphanumeric() || "._+=@-".contains(c);
    if let Some(c) = name.chars().find(|c| !allowed(*c)) {
        return invalid(format!(
            "character {c:?} is not allowed; use letters, digits and . _ + = @ -"
        ));
    }
    Ok(())
}

/// The size and xxh3-64 of the file at `path`, read with plain reads (never mapped, so a file
/// truncated meanwhile is an error, not a signal).
pub fn file_checksum(path: &Path) -> Result<(u64, u64)> {
    let mut file = std::fs::File::open(path).at(path)?;
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e).at(path),
        };
        hasher.update(&buf[..n]);
        size += n as u64;
    }
    Ok((size, hasher.digest()))
}

/// Formats an xxh3-64 digest the way the manifest stores it.
pub fn checksum_hex(digest: u64) -> String {
    format!("{digest:016x}")
}

/// A fresh cache id: 12 lowercase hex digits from the OS's random source.
pub fn new_cache_id() -> Result<String> {
    let mut bytes = [0u8; 6];
    getrandom::fill(&mut bytes).map_err(|e| Error::Io {
        path: "<random source>".into(),
        source: std::io::Error::other(e.to_string()),
    })?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// The current UTC time as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc_now_iso() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    iso_from_unix(secs)
}

fn iso_from_unix(secs: i64) -> String {
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Civil-from-days (Howard Hinnant's algorithm), valid for the proleptic Gregorian calendar.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Writes `bytes` to `path` through a temporary sibling, fsyncs it and renames it into place,
/// so that readers see the old file or the new one, never a torn one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let result = (|| {
        let mut file = std::fs::File::create(&tmp).at(&tmp)?;
        file.write_all(bytes).at(&tmp)?;
        file.sync_all().at(&tmp)?;
        std::fs::rename(&tmp, path).at(path)?;
        if let Some(parent) = path.parent() {
            sync_dir(parent)?;
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Flushes a directory's entries to disk, so that a rename inside it survives a power loss.
pub fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir).at(dir)?.sync_all().at(dir)
}

/// Flushes a file's contents to disk.
pub fn sync_file(path: &Path) -> Result<()> {
    std::fs::File::open(path).at(path)?.sync_all().at(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_would_escape_or_hide_are_refused() {
        for bad in ["", ".", "..", "../x", "a/b", "a\\b", ".hidden", "a b", "é"] {
            assert!(validate_name(bad).is_err(), "{bad:?} was accepted");
        }
        for good in ["digits-v1", "mnist_train.2026", "a+b=c@d", "X"] {
            validate_name(good).unwrap();
        }
        assert!(validate_name(&"a".repeat(MAX_NAME_LEN + 1)).is_err());
    }

    #[test]
    fn iso_dates_match_known_instants() {
        assert_eq!(iso_from_unix(0), "1970-01-01T00:00:00Z");
        assert_eq!(iso_from_unix(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(iso_from_unix(1_796_282_444), "2026-12-03T07:20:44Z");
    }

    #[test]
    fn cache_ids_are_fresh_hex() {
        let a = new_cache_id().unwrap();
        let b = new_cache_id().unwrap();
        assert_eq!(a.len(), 12);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }

    #[test]
    fn plain_relative_paths_only() {
        assert!(is_plain_relative("shards/00000.bin"));
        for bad in ["", "/etc/passwd", "../x", "a//b", "a/./b", "shards/../../x"] {
            assert!(!is_plain_relative(bad), "{bad:?}");
        }
    }
}
