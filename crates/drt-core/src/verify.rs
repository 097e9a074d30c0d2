//! Full verification of a cache: every file's size and checksum against the manifest, every
//! record's bounds and checksum against the index.
//!
//! Opening a cache checks only sizes, so that it reads no payload byte; [`verify`] reads
//! everything once and reports each problem with the file it is in and, for records, the
//! sample ids affected. Files are read with plain reads, never mapped, so a file truncated
//! while it is being verified is reported rather than raising SIGBUS.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use crate::error::{Error, Result};
use crate::format::{
    checksum_hex, FileEntry, Manifest, Segment, MANIFEST_FILE, SHARD_HEADER_LEN, SHARD_MAGIC,
};
use crate::index::Index;
use crate::metadata::{check_digest, check_plan_digest};
use crate::store::{BuildLock, Store};

/// One thing found wrong with a cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The damaged file, relative to the cache directory.
    pub file: String,
    /// What is wrong with it.
    pub message: String,
    /// The samples whose records are affected (empty when the problem is not per record).
    pub sample_ids: Vec<u64>,
}

/// What [`verify`] checked and found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Files whose size and checksum were compared with the manifest.
    pub files_checked: u64,
    /// Records whose bounds and checksum were compared with the index.
    pub samples_checked: u64,
    /// Bytes read.
    pub bytes_read: u64,
    /// Everything found wrong; empty for an intact cache.
    pub problems: Vec<Problem>,
}

impl Report {
    fn problem(&mut self, file: &str, message: impl Into<String>) {
        self.problems.push(Problem {
            file: file.to_string(),
            message: message.into(),
            sample_ids: Vec::new(),
        });
    }
}

/// A file read whole, or the reason it could not be used.
fn read_entry(
    dir: &Path,
    file: &str,
    expected_size: Option<u64>,
) -> std::result::Result<Vec<u8>, String> {
    let path = dir.join(file);
    match std::fs::symlink_metadata(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err("file is missing".into()),
        Err(e) => return Err(e.to_string()),
        Ok(meta) if meta.file_type().is_symlink() => {
            return Err("is a symbolic link; cache files must be regular files".into())
        }
        Ok(meta) if !meta.is_file() => return Err("is not a regular file".into()),
        Ok(meta) => {
            if let Some(size) = expected_size {
                if meta.len() != size {
                    return Err(format!(
                        "file is {} bytes but the manifest records {size} (truncated or overwritten?)",
                        meta.len()
                    ));
                }
            }
        }
    }
    let mut bytes = Vec::new();
    std::fs::File::open(&path)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(|e| e.to_string())?;
    if let Some(size) = expected_size {
        if bytes.len() as u64 != size {
            return Err(format!(
                "file changed size while it was read ({} bytes, the manifest records {size})",
                bytes.len()
            ));
        }
    }
    Ok(bytes)
}

/// Reads `entry` and compares it with its size and checksum, reporting any mismatch.
/// Returns its bytes whenever the size is right (the checksum may still have failed: damaged
/// files are read on, so that the report can name the samples affected) and whether the
/// checksum matched.
fn check_entry(dir: &Path, entry: &FileEntry, report: &mut Report) -> Option<(Vec<u8>, bool)> {
    report.files_checked += 1;
    let bytes = match read_entry(dir, &entry.file, Some(entry.size)) {
        Err(msg) => {
            report.problem(&entry.file, msg);
            return None;
        }
        Ok(bytes) => bytes,
    };
    report.bytes_read += bytes.len() as u64;
    let digest = checksum_hex(xxhash_rust::xxh3::xxh3_64(&bytes));
    let intact = digest == entry.checksum;
    if !intact {
        report.problem(
            &entry.file,
            format!(
                "checksum {digest} does not match the manifest's {}",
                entry.checksum
            ),
        );
    }
    Some((bytes, intact))
}

/// Publishes a whole cache copied into `dir` (a directory from
/// [`Store::begin_build`]) as cache `lock`'s name, after checking every file and record of
/// it against its manifest: a copy that is incomplete, damaged or of another cache is
/// refused (and stays where it is for the caller to discard).
pub fn publish_copy(store: &Store, lock: &BuildLock, dir: &Path) -> Result<()> {
    let report = verify(dir, |_| Ok(()))?;
    if let Some(problem) = report.problems.first() {
        return Err(Error::corrupt(
            dir.join(&problem.file),
            format!(
                "the copy of cache {:?} is damaged ({} problem(s)): {}",
                lock.name(),
                report.problems.len(),
                problem.message
            ),
        ));
    }
    let manifest = Manifest::read(dir)?;
    if manifest.name != lock.name() {
        return Err(Error::InvalidArgument(format!(
            "the copy holds cache {:?}, not {:?}",
            manifest.name,
            lock.name()
        )));
    }
    store.publish(lock, dir)
}

/// Verifies cache `name` of `store` completely (see [`verify`]). A cache that does not exist
/// is an error; a damaged manifest is for the report to describe.
pub fn verify_named(
    store: &Store,
    name: &str,
    progress: impl FnMut(u64) -> Result<()>,
) -> Result<Report> {
    match store.manifest(name) {
        Ok(_) | Err(Error::Corrupt { .. } | Error::UnsupportedVersion { .. }) => {}
        Err(other) => return Err(other),
    }
    verify(&store.cache_dir(name)?, progress)
}

/// Verifies the cache in `dir` completely. `progress` is told the bytes read after each file
/// and may stop the work by returning an error (Ctrl-C).
///
/// Damage is reported in the returned [`Report`]; an `Err` means the verification itself
/// could not run (no cache there, or `progress` stopped it).
pub fn verify(dir: &Path, mut progress: impl FnMut(u64) -> Result<()>) -> Result<Report> {
    let mut report = Report::default();
    if !dir.join(MANIFEST_FILE).exists() {
        return Err(Error::corrupt(
            dir,
            "no manifest.json: not a dataset_rt cache",
        ));
    }
    report.files_checked += 1;
    let manifest = match Manifest::read(dir) {
        Ok(m) => m,
        Err(e) => {
            report.problem(MANIFEST_FILE, e.to_string());
            return Ok(report);
        }
    };

    // Each segment (the build's records, then each appended part's): its index checked as a
    // file, then parsed; its records are checked against the shards even when its checksum
    // fails, so that the report can name the samples affected.
    for segment in manifest.segments() {
        let index_ok = matches!(
            check_entry(dir, segment.index, &mut report),
            Some((_, true))
        );
        progress(report.bytes_read)?;
        let index_path = dir.join(&segment.index.file);
        let index = if index_ok || index_path.is_file() {
            match Index::open(&index_path, segment.num_samples) {
                Ok(index) => Some(index),
                Err(e) => {
                    if index_ok {
                        report.problem(&segment.index.file, e.to_string());
                    }
                    None
                }
            }
        } else {
            None
        };

        // Shards whose whole-file checksum fails are still used for the per-record checks
        // when their size is right, so that the report names the damaged samples.
        let mut shards: Vec<Option<Vec<u8>>> = Vec::with_capacity(segment.shards.len());
        for entry in segment.shards {
            let bytes = check_entry(dir, entry, &mut report).map(|(bytes, _)| bytes);
            if let Some(bytes) = &bytes {
                if bytes.len() < SHARD_HEADER_LEN as usize || bytes[..8] != SHARD_MAGIC[..] {
                    report.problem(&entry.file, "not a dataset_rt shard (bad header)");
                }
            }
            shards.push(bytes);
            progress(report.bytes_read)?;
        }

        if let Some(index) = &index {
            check_records(&segment, index, &shards, &mut report);
        }
    }

    // Metadata versions (present, and matching their recorded checksum where there is one)
    // and loader plans (present and intact: a loader maps them instead of building its own).
    type Check = fn(Option<&str>, u64) -> std::result::Result<(), String>;
    let tables = manifest.metadata_versions.iter().map(|v| {
        let expected = manifest.metadata_checksums.get(v).map(String::as_str);
        (Manifest::metadata_file(*v), expected, check_digest as Check)
    });
    let plans = manifest.plan_checksums.iter().map(|(v, expected)| {
        (
            Manifest::plan_file(*v),
            Some(expected.as_str()),
            check_plan_digest as Check,
        )
    });
    for (file, expected, check) in tables.chain(plans) {
        report.files_checked += 1;
        match read_entry(dir, &file, None) {
            Err(msg) => report.problem(&file, msg),
            Ok(bytes) => {
                report.bytes_read += bytes.len() as u64;
                if let Err(msg) = check(expected, xxhash_rust::xxh3::xxh3_64(&bytes)) {
                    report.problem(&file, msg);
                }
            }
        }
        progress(report.bytes_read)?;
    }
    Ok(report)
}

/// Checks every record of a segment's `index` against its shards' bytes; problems are
/// grouped by file and kind, each with the (cache-wide) sample ids it affects.
fn check_records(
    segment: &Segment<'_>,
    index: &Index,
    shards: &[Option<Vec<u8>>],
    report: &mut Report,
) {
    let mut grouped: BTreeMap<(String, &'static str), Vec<u64>> = BTreeMap::new();
    let mut add = |file: &str, what: &'static str, id: u64| {
        grouped
            .entry((file.to_string(), what))
            .or_default()
            .push(id);
    };
    let index_file = segment.index.file.as_str();
    for row in 0..index.len() {
        report.samples_checked += 1;
        let id = segment.first + row;
        if index
            .stored_sample_id(row)
            .is_some_and(|stored| stored != row)
        {
            add(
                index_file,
                "rows whose stored sample_id is not their position",
                id,
            );
        }
        let loc = index.location(row);
        let Some(entry) = segment.shards.get(loc.shard as usize) else {
            add(
                index_file,
                "samples that point to a shard the manifest does not list",
                id,
            );
            continue;
        };
        let Some(bytes) = &shards[loc.shard as usize] else {
            add(&entry.file, "samples in an unreadable shard", id);
            continue;
        };
        let end = loc.offset.checked_add(loc.length);
        if loc.offset < SHARD_HEADER_LEN || end.is_none_or(|e| e > bytes.len() as u64) {
            add(&entry.file, "samples whose bytes lie outside the shard", id);
            continue;
        }
        let record = &bytes[loc.offset as usize..(loc.offset + loc.length) as usize];
        if xxhash_rust::xxh3::xxh3_64(record) != index.checksum(row) {
            add(&entry.file, "samples whose bytes fail their checksum", id);
        }
    }
    for ((file, what), ids) in grouped {
        report.problems.push(Problem {
            message: format!("{} {what}", ids.len()),
            file,
            sample_ids: ids,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::writer::WriteOptions;

    fn build(dir: &Path, n: usize) -> Manifest {
        let records: Vec<Vec<u8>> = (0..n).map(|i| vec![i as u8; 100 + i % 50]).collect();
        let opts = WriteOptions {
            shard_size: 4096,
            alignment: 64,
            ..WriteOptions::default()
        };
        crate::reader::tests::build(dir, &records, opts)
    }

    fn no_progress(_: u64) -> Result<()> {
        Ok(())
    }

    #[test]
    fn an_intact_cache_has_no_problems() {
        let dir = tempfile::tempdir().unwrap();
        let m = build(dir.path(), 200);
        let report = verify(dir.path(), no_progress).unwrap();
        assert_eq!(report.problems, vec![]);
        assert_eq!(report.samples_checked, 200);
        assert_eq!(report.files_checked, 3 + m.shards.len() as u64);
    }

    #[test]
    fn flipped_bytes_name_the_shard_and_the_samples() {
        let dir = tempfile::tempdir().unwrap();
        let m = build(dir.path(), 200);
        let shard = dir.path().join(&m.shards[1].file);
        let mut bytes = std::fs::read(&shard).unwrap();
        bytes[SHARD_HEADER_LEN as usize + 3] ^= 0xff;
        std::fs::write(&shard, bytes).unwrap();
        let report = verify(dir.path(), no_progress).unwrap();
        assert_eq!(report.problems.len(), 2, "{:?}", report.problems);
        assert!(report.problems[0].message.contains("checksum"));
        let records = &report.problems[1];
        assert_eq!(records.file, m.shards[1].file);
        assert_eq!(records.sample_ids.len(), 1);
        let first_of_shard_1 = (0..200u64)
            .find(|&i| {
                let index = Index::open(&dir.path().join("index.arrow"), 200).unwrap();
                index.location(i).shard == 1
            })
            .unwrap();
        assert_eq!(records.sample_ids, vec![first_of_shard_1]);
    }

    #[test]
    fn missing_and_truncated_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let m = build(dir.path(), 200);
        std::fs::remove_file(dir.path().join(&m.shards[0].file)).unwrap();
        let last = dir.path().join(&m.shards.last().unwrap().file);
        let len = std::fs::metadata(&last).unwrap().len();
        std::fs::File::options()
            .write(true)
            .open(&last)
            .unwrap()
            .set_len(len - 10)
            .unwrap();
        std::fs::write(dir.path().join(Manifest::metadata_file(1)), b"mota").unwrap();
        let report = verify(dir.path(), no_progress).unwrap();
        let text = format!("{:?}", report.problems);
        assert!(text.contains("file is missing"), "{text}");
        assert!(text.contains("truncated or overwritten"), "{text}");
        assert!(text.contains("v00001.parquet"), "{text}");
        let unreadable: Vec<_> = report
            .problems
            .iter()
            .filter(|p| p.message.contains("unreadable shard"))
            .collect();
        assert_eq!(unreadable.len(), 2);
    }

    #[test]
    fn a_garbled_manifest_is_one_problem() {
        let dir = tempfile::tempdir().unwrap();
        build(dir.path(), 10);
        std::fs::write(dir.path().join(MANIFEST_FILE), b"{not json").unwrap();
        let report = verify(dir.path(), no_progress).unwrap();
        assert_eq!(report.problems.len(), 1);
        assert_eq!(report.problems[0].file, MANIFEST_FILE);
    }

    #[test]
    fn no_cache_is_an_error_not_a_report() {
        let dir = tempfile::tempdir().unwrap();
        assert!(verify(dir.path(), no_progress).is_err());
    }
}
