//! Reading a cache: the manifest, the mapped index and the mapped payload shards.
//!
//! Opening checks every file's size against the manifest and parses the index's footer, but
//! reads no payload byte; each read checks the record's bounds against its mapped shard.
//! A cache whose files are fetched on first use (see [`crate::fetch`]) checks and maps each
//! index and shard when it is first needed instead.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use crate::compress::Codec;
use crate::error::{Error, IoContext, Result};
use crate::fetch::Fetcher;
use crate::format::{checksum_hex, Manifest, SHARD_HEADER_LEN, SHARD_MAGIC};
use crate::index::{Index, Location};
use crate::mapping::{MappedFile, Span};

struct Shard {
    /// Relative to the cache directory, as the manifest names it.
    file: String,
    path: PathBuf,
    size: u64,
    /// Set at open, or for a fetched cache when the shard is first read.
    map: OnceLock<Arc<MappedFile>>,
}

/// The build's records, or a part's: an index of its own over shards of its own.
struct Segment {
    /// The sample id of its first record.
    first: u64,
    num_samples: u64,
    /// Set at open, or for a fetched cache when a record is first looked up.
    index: OnceLock<Index>,
    index_file: String,
    index_size: u64,
    shards: Vec<Shard>,
}

/// An open cache.
pub struct CacheReader {
    dir: PathBuf,
    manifest: Manifest,
    /// How records are stored: read in place, or decoded into memory of their own.
    codec: Codec,
    /// In sample order; the build's first. Opening costs one index mapping per part.
    segments: Vec<Segment>,
    /// Set once a mapped file of this cache was found to have shrunk: some of its pages may
    /// now read as zeros, so no further record is served.
    poisoned: AtomicBool,
    /// Makes shards present on first read; `None` for a local cache, mapped whole at open.
    fetcher: Option<Arc<dyn Fetcher>>,
}

impl std::fmt::Debug for CacheReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheReader")
            .field("dir", &self.dir)
            .field("name", &self.manifest.name)
            .field("num_samples", &self.manifest.num_samples)
            .finish()
    }
}

/// Checks that `file` exists in `dir` with the `size` the manifest records.
fn check_size(dir: &Path, file: &str, size: u64) -> Result<PathBuf> {
    let path = dir.join(file);
    // Not followed: a cache's files are regular files inside it, and a link could point
    // anywhere (outside the root included).
    let meta = std::fs::symlink_metadata(&path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            Error::corrupt(&path, "file is missing")
        } else {
            Error::Io {
                path: path.clone(),
                source: e,
            }
        }
    })?;
    crate::ensure_intact!(
        meta.is_file(),
        &path,
        "is a symbolic link or not a regular file; cache files must be regular files"
    );
    crate::ensure_intact!(
        meta.len() == size,
        &path,
        "file is {} bytes but the manifest records {} (truncated or overwritten?)",
        meta.len(),
        size
    );
    Ok(path)
}

/// Checks shard `file` against the `size` the manifest records and maps it.
fn map_shard(dir: &Path, file: &str, size: u64) -> Result<Arc<MappedFile>> {
    let path = check_size(dir, file, size)?;
    crate::ensure_intact!(
        size >= SHARD_HEADER_LEN,
        &path,
        "shard is shorter than its header"
    );
    let file = std::fs::File::open(&path).at(&path)?;
    let map = MappedFile::open(&file, &path)?;
    crate::ensure_intact!(
        map.len() as u64 == size && map[..8] == SHARD_MAGIC[..],
        &path,
        "not a dataset_rt shard (bad header)"
    );
    Ok(map)
}

/// Checks the index `file` against the `size` the manifest records and maps it.
fn map_index(dir: &Path, file: &str, size: u64, num_samples: u64) -> Result<Index> {
    Index::open(&check_size(dir, file, size)?, num_samples)
}

/// Maps a segment's index and shards, checking each against the manifest's sizes; unless
/// they are fetched on first use (`lazy`).
fn open_segment(dir: &Path, segment: &crate::format::Segment<'_>, lazy: bool) -> Result<Segment> {
    let index = OnceLock::new();
    if !lazy {
        let entry = segment.index;
        let _ = index.set(map_index(
            dir,
            &entry.file,
            entry.size,
            segment.num_samples,
        )?);
    }
    let mut shards = Vec::with_capacity(segment.shards.len());
    for entry in segment.shards {
        let map = OnceLock::new();
        if !lazy {
            let _ = map.set(map_shard(dir, &entry.file, entry.size)?);
        }
        shards.push(Shard {
            file: entry.file.clone(),
            path: dir.join(&entry.file),
            size: entry.size,
            map,
        });
    }
    Ok(Segment {
        first: segment.first,
        num_samples: segment.num_samples,
        index,
        index_file: segment.index.file.clone(),
        index_size: segment.index.size,
        shards,
    })
}

impl CacheReader {
    /// Opens the cache in directory `dir`.
    /// Shards are checked and mapped here, unless a [`Fetcher`] is registered for `dir`:
    /// then each is fetched, checked and mapped when first read.
    pub fn open(dir: &Path) -> Result<Self> {
        let manifest = Manifest::read(dir)?;
        let codec = manifest.codec()?;
        let fetcher = crate::fetch::fetcher_for(dir);
        let segments = manifest
            .segments()
            .into_iter()
            .map(|segment| open_segment(dir, &segment, fetcher.is_some()))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            dir: dir.to_path_buf(),
            manifest,
            codec,
            segments,
            poisoned: AtomicBool::new(false),
            fetcher,
        })
    }

    /// Whether shards are fetched on first read rather than mapped at open.
    pub fn fetches(&self) -> bool {
        self.fetcher.is_some()
    }

    /// `shard`'s mapping: mapped at open, or fetched and mapped on this first read.
    fn mapping<'a>(&self, shard: &'a Shard) -> Result<&'a Arc<MappedFile>> {
        if let Some(map) = shard.map.get() {
            return Ok(map);
        }
        let map = self.fetched(&shard.file, || {
            map_shard(&self.dir, &shard.file, shard.size)
        })?;
        // Two threads may map it at once: both get the process's one mapping of the file.
        Ok(shard.map.get_or_init(|| map))
    }

    /// `segment`'s index: mapped at open, or fetched and mapped on the first lookup.
    fn index<'a>(&self, segment: &'a Segment) -> Result<&'a Index> {
        if let Some(index) = segment.index.get() {
            return Ok(index);
        }
        let file = &segment.index_file;
        let index = self.fetched(file, || {
            map_index(&self.dir, file, segment.index_size, segment.num_samples)
        })?;
        Ok(segment.index.get_or_init(|| index))
    }

    /// `open(file)` once the fetcher has made `file` present. A file evicted by another
    /// process between its fetch and its opening is fetched again.
    fn fetched<T>(&self, file: &str, open: impl Fn() -> Result<T>) -> Result<T> {
        let path = self.dir.join(file);
        let Some(fetcher) = &self.fetcher else {
            return Err(Error::Internal(format!(
                "{} was not mapped at open",
                path.display()
            )));
        };
        let mut attempts = 0;
        loop {
            // The fetcher runs Python: its faults are not a mapped file's.
            crate::sigbus::unguarded(|| fetcher.fetch(file)).map_err(|source| Error::Fetch {
                path: path.clone(),
                source,
            })?;
            match open() {
                Err(_) if attempts < 3 && !path.exists() => attempts += 1,
                opened => return opened,
            }
        }
    }

    /// The shard file (relative to the cache directory) holding record `sample_id`.
    pub fn shard_file(&self, sample_id: u64) -> Result<&str> {
        let (_, shard) = self.shard_of(sample_id)?;
        Ok(&shard.file)
    }

    /// Refuses reads once a mapped file of the cache shrank.
    fn check_usable(&self) -> Result<()> {
        if self.poisoned.load(Ordering::Relaxed) {
            return Err(self.shrank());
        }
        Ok(())
    }

    /// Marks the cache unreadable after a SIGBUS on one of its mapped files.
    pub fn poison(&self) {
        self.poisoned.store(true, Ordering::Relaxed);
    }

    /// The error reads report after a mapped file of the cache shrank.
    pub fn shrank(&self) -> Error {
        Error::corrupt(
            &self.dir,
            "a file of this cache shrank while it was mapped (truncated by another process?); \
             reading from it stopped. Check it with `dataset-rt verify`, rebuild it if damaged, \
             and open it again",
        )
    }

    /// A copy of record `sample_id`'s bytes (decoded, for a compressed cache), checked against
    /// its checksum if `verify`. A shard truncated under the mapping yields an error instead
    /// of SIGBUS.
    pub fn copy_record(&self, sample_id: u64, verify: bool) -> Result<Vec<u8>> {
        self.guarded_record(sample_id, verify, <[u8]>::to_vec)
    }

    /// `copy(bytes)` of record `sample_id`'s bytes (decoded, for a compressed cache),
    /// checked against its checksum if `verify`. `copy` runs while the mapping is guarded: a
    /// shard truncated under it yields an error instead of SIGBUS.
    pub fn guarded_record<T>(
        &self,
        sample_id: u64,
        verify: bool,
        copy: impl FnOnce(&[u8]) -> T,
    ) -> Result<T> {
        let (result, faulted) =
            crate::sigbus::guarded(|| Ok(copy(self.span(sample_id, verify)?.bytes())));
        if faulted {
            self.poison();
            return Err(self.shrank());
        }
        result
    }

    /// The cache's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The manifest read at open.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Number of samples.
    pub fn len(&self) -> u64 {
        self.manifest.num_samples
    }

    /// Whether the cache has no samples.
    pub fn is_empty(&self) -> bool {
        self.manifest.num_samples == 0
    }

    /// The segment holding `sample_id` (which is in range).
    fn segment_of(&self, sample_id: u64) -> &Segment {
        match self.segments.as_slice() {
            [only] => only,
            all => &all[all.partition_point(|s| s.first <= sample_id) - 1],
        }
    }

    /// Asks the processor to load the index entry of `sample_id`, which a read of it will
    /// look up next: a hint, which does nothing for an id out of range or an index not yet
    /// mapped.
    #[inline]
    pub fn prefetch_location(&self, sample_id: u64) {
        if sample_id < self.len() {
            let segment = self.segment_of(sample_id);
            if let Some(index) = segment.index.get() {
                index.prefetch(sample_id - segment.first);
            }
        }
    }

    /// Asks the processor to load the first bytes of record `sample_id`, which a read of it
    /// will copy next, once its index entry is at hand (see
    /// [`prefetch_location`](Self::prefetch_location)): a hint, which does nothing for an id
    /// out of range or a file not yet mapped.
    #[inline]
    pub fn prefetch_record(&self, sample_id: u64) {
        if sample_id < self.len() {
            let segment = self.segment_of(sample_id);
            if let Some(index) = segment.index.get() {
                let loc = index.location(sample_id - segment.first);
                let map = segment
                    .shards
                    .get(loc.shard as usize)
                    .and_then(|s| s.map.get());
                if let Some(map) = map {
                    crate::mapping::prefetch_line(map, loc.offset as usize);
                }
            }
        }
    }

    /// Where record `sample_id` lives: its index entry (offsets within its shard) and shard.
    fn location(&self, sample_id: u64) -> Result<(Location, &Segment)> {
        let segment = self.segment_of(sample_id);
        let index = self.index(segment)?;
        Ok((index.location(sample_id - segment.first), segment))
    }

    /// Checks record `sample_id`'s `bytes`, read from `shard`, against the checksum its
    /// index holds (a column that only checked reads touch).
    fn check_digest(&self, sample_id: u64, shard: &Shard, bytes: &[u8]) -> Result<()> {
        let segment = self.segment_of(sample_id);
        let stored = self.index(segment)?.checksum(sample_id - segment.first);
        let digest = xxhash_rust::xxh3::xxh3_64(bytes);
        crate::ensure_intact!(
            digest == stored,
            &shard.path,
            "sample_id {sample_id} fails its checksum (stored {}, read {})",
            checksum_hex(stored),
            checksum_hex(digest)
        );
        Ok(())
    }

    /// Record `sample_id`'s index entry and shard, not yet mapped.
    fn shard_of(&self, sample_id: u64) -> Result<(Location, &Shard)> {
        self.check_usable()?;
        if sample_id >= self.len() {
            return Err(Error::SampleOutOfRange {
                sample_id,
                len: self.len(),
                name: self.manifest.name.clone(),
            });
        }
        let (loc, segment) = self.location(sample_id)?;
        let shard = segment.shards.get(loc.shard as usize).ok_or_else(|| {
            Error::corrupt(
                self.dir.join(&segment.index_file),
                format!(
                    "sample_id {sample_id} points to shard {} of {}",
                    loc.shard,
                    segment.shards.len()
                ),
            )
        })?;
        Ok((loc, shard))
    }

    fn checked_location(&self, sample_id: u64) -> Result<(Location, &Shard, &Arc<MappedFile>)> {
        let (loc, shard) = self.shard_of(sample_id)?;
        let map = self.mapping(shard)?;
        let end = loc.offset.checked_add(loc.length);
        crate::ensure_intact!(
            loc.offset >= SHARD_HEADER_LEN && end.is_some_and(|e| e <= map.len() as u64),
            &shard.path,
            "sample_id {sample_id} spans bytes {}..{} beyond the shard's {} bytes",
            loc.offset,
            loc.offset.saturating_add(loc.length),
            map.len()
        );
        if map.shrank() {
            // A view of this shard read past its new end: some of its pages are zeros now.
            self.poison();
            return Err(self.shrank());
        }
        Ok((loc, shard, map))
    }

    /// How the cache's records are compressed.
    pub fn codec(&self) -> Codec {
        self.codec
    }

    /// Record `sample_id` as a span of its mapped shard, or for a compressed cache of its
    /// decoded bytes, checked against its checksum (of the stored bytes) if `verify`. Must run
    /// in a guarded section; reading its bytes outside one is safe only if it is
    /// [`Span::viewable`].
    pub fn span(&self, sample_id: u64, verify: bool) -> Result<Span> {
        match self.stored_span(sample_id, verify)? {
            (stored, None) => Ok(stored),
            (stored, Some(_)) => self.decoded(sample_id, stored.bytes()),
        }
    }

    /// Record `sample_id` as a batch reads it: its stored bytes as a span of the mapped shard
    /// (checked against its checksum if `verify`), and for a compressed cache the length it
    /// decodes to, which [`decode_into`](Self::decode_into) fills. Must run in a guarded
    /// section.
    pub fn stored_span(&self, sample_id: u64, verify: bool) -> Result<(Span, Option<usize>)> {
        let (loc, shard, map) = self.checked_location(sample_id)?;
        let (start, end) = (loc.offset as usize, (loc.offset + loc.length) as usize);
        let stored = &map[start..end];
        if verify {
            self.check_digest(sample_id, shard, stored)?;
        }
        let decoded = if self.codec.is_none() {
            None
        } else {
            let len = self.codec.decoded_len(stored);
            Some(len.map_err(|why| damaged(shard, sample_id, &why))?)
        };
        Ok((Span::new(map.clone(), start, end), decoded))
    }

    /// Record `sample_id`, whose stored bytes [`stored_span`](Self::stored_span) gave as
    /// `stored`, decoded into memory of its own. Must run in a guarded section.
    pub fn decoded(&self, sample_id: u64, stored: &[u8]) -> Result<Span> {
        let decoded = self.codec.decompress(stored);
        Ok(Span::decoded(
            decoded.map_err(|why| self.damaged(sample_id, &why))?,
        ))
    }

    /// Decodes record `sample_id`, whose stored bytes [`stored_span`](Self::stored_span)
    /// gave as `stored`, into `out`, as long as the length it gave. Must run in a guarded
    /// section.
    pub fn decode_into(&self, sample_id: u64, stored: &[u8], out: &mut [u8]) -> Result<()> {
        let decoded = self.codec.decode_into(stored, out);
        decoded.map_err(|why| self.damaged(sample_id, &why))
    }

    /// The error for record `sample_id`, which cannot be decoded for reason `why`.
    fn damaged(&self, sample_id: u64, why: &str) -> Error {
        match self.shard_of(sample_id) {
            Ok((_, shard)) => damaged(shard, sample_id, why),
            Err(e) => e,
        }
    }

    /// [`span`](Self::span) in a guarded section: a shard that shrank under the read (with
    /// `verify`, every byte is read) is an error, and the reader stops serving.
    pub fn guarded_span(&self, sample_id: u64, verify: bool) -> Result<Span> {
        let (result, faulted) = crate::sigbus::guarded(|| self.span(sample_id, verify));
        if faulted {
            self.poison();
            return Err(self.shrank());
        }
        result
    }

    /// The bytes of record `sample_id` as stored (compressed, for a compressed cache), viewed
    /// in the mapped shard.
    pub fn record(&self, sample_id: u64) -> Result<&[u8]> {
        let (loc, _, map) = self.checked_location(sample_id)?;
        Ok(&map[loc.offset as usize..(loc.offset + loc.length) as usize])
    }

    /// The bytes of record `sample_id` as stored, after checking them against the index's
    /// checksum.
    pub fn record_verified(&self, sample_id: u64) -> Result<&[u8]> {
        let (loc, shard, map) = self.checked_location(sample_id)?;
        let bytes = &map[loc.offset as usize..(loc.offset + loc.length) as usize];
        self.check_digest(sample_id, shard, bytes)?;
        Ok(bytes)
    }
}

/// The error for record `sample_id` of `shard`, which cannot be decoded for reason `why`.
fn damaged(shard: &Shard, sample_id: u64, why: &str) -> Error {
    Error::corrupt(&shard.path, format!("sample_id {sample_id}: {why}"))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::format::{Part, FORMAT_VERSION, LOCATORS_VERSION};
    use crate::writer::{CacheWriter, ManifestInfo, WriteOptions};

    /// Writes `records` as a cache into `dir` (shared by the tests of other modules).
    pub(crate) fn build(dir: &Path, records: &[Vec<u8>], opts: WriteOptions) -> Manifest {
        let mut w = CacheWriter::create(dir, opts).unwrap();
        for r in records {
            w.append(r).unwrap();
        }
        std::fs::write(dir.join(Manifest::metadata_file(1)), b"meta").unwrap();
        w.finish(ManifestInfo {
            name: "t".into(),
            cache_id: "0123456789ab".into(),
            serializer: "pickle".into(),
            metadata_version: 1,
            parts: Vec::new(),
            plan_digest: None,
        })
        .unwrap()
    }

    fn records(n: usize) -> Vec<Vec<u8>> {
        (0..n)
            .map(|i| (0..(i * 37 % 300)).map(|j| (i + j) as u8).collect())
            .collect()
    }

    #[test]
    fn readers_of_one_file_share_its_mapping_until_the_file_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let opts = WriteOptions {
            shard_size: 4096,
            alignment: 64,
            ..WriteOptions::default()
        };
        build(dir.path(), &records(50), opts);
        let first = CacheReader::open(dir.path()).unwrap();
        let second = CacheReader::open(dir.path()).unwrap();
        assert!(Arc::ptr_eq(
            first.segments[0].shards[0].map.get().unwrap(),
            second.segments[0].shards[0].map.get().unwrap()
        ));
        // A rebuilt cache has new files (new inodes), so it gets mappings of its own.
        let rebuilt = tempfile::tempdir().unwrap();
        build(rebuilt.path(), &records(60), opts);
        drop(second);
        std::fs::remove_dir_all(dir.path().join("shards")).unwrap();
        std::fs::rename(rebuilt.path().join("shards"), dir.path().join("shards")).unwrap();
        std::fs::copy(
            rebuilt.path().join("manifest.json"),
            dir.path().join("manifest.json"),
        )
        .unwrap();
        std::fs::copy(
            rebuilt.path().join("index.arrow"),
            dir.path().join("index.arrow"),
        )
        .unwrap();
        let third = CacheReader::open(dir.path()).unwrap();
        assert!(!Arc::ptr_eq(
            first.segments[0].shards[0].map.get().unwrap(),
            third.segments[0].shards[0].map.get().unwrap()
        ));
        assert_eq!(third.len(), 60);
        assert_eq!(first.len(), 50);
    }

    #[test]
    fn write_read_round_trip_across_shards() {
        let dir = tempfile::tempdir().unwrap();
        let recs = records(500);
        let opts = WriteOptions {
            shard_size: 4096,
            alignment: 64,
            ..WriteOptions::default()
        };
        let manifest = build(dir.path(), &recs, opts);
        assert!(manifest.shards.len() > 10, "{}", manifest.shards.len());
        let reader = CacheReader::open(dir.path()).unwrap();
        assert_eq!(reader.len(), 500);
        assert_eq!(
            manifest.nbytes,
            recs.iter().map(|r| r.len() as u64).sum::<u64>()
        );
        for (i, r) in recs.iter().enumerate() {
            assert_eq!(reader.record(i as u64).unwrap(), &r[..]);
            assert_eq!(reader.record_verified(i as u64).unwrap(), &r[..]);
        }
    }

    #[test]
    fn records_are_aligned_and_shards_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let recs = records(300);
        for alignment in [1, 16, 64, 4096] {
            let sub = dir.path().join(alignment.to_string());
            std::fs::create_dir(&sub).unwrap();
            let opts = WriteOptions {
                shard_size: 8192,
                alignment,
                ..WriteOptions::default()
            };
            let manifest = build(&sub, &recs, opts);
            let reader = CacheReader::open(&sub).unwrap();
            for i in 0..reader.len() {
                let loc = reader.location(i).unwrap().0;
                assert_eq!(loc.offset % alignment, 0);
                let ptr = reader.record(i).unwrap().as_ptr() as u64;
                assert_eq!(ptr % alignment, 0, "mapped record {i} misaligned");
            }
            for s in &manifest.shards {
                assert!(s.size <= 8192, "{s:?}");
            }
        }
    }

    #[test]
    fn records_with_large_out_of_band_buffers_start_64_byte_aligned_whatever_the_alignment() {
        use crate::format::{MIN_OUT_OF_BAND, OOB_MAGIC, RECORD_ALIGN};
        let dir = tempfile::tempdir().unwrap();
        let oob = |len: usize| {
            let mut r = OOB_MAGIC.to_vec();
            r.resize(len, 7);
            r
        };
        // Odd lengths, so that alignment 1 would leave most of them unaligned.
        let recs = vec![
            vec![1u8; 3],
            oob(MIN_OUT_OF_BAND + 5),
            vec![2u8; 5],
            oob(MIN_OUT_OF_BAND + 11),
            oob(100), // too short to be viewed in place: the cache's alignment is enough
        ];
        let opts = WriteOptions {
            shard_size: 1 << 20,
            alignment: 1,
            ..WriteOptions::default()
        };
        build(dir.path(), &recs, opts);
        let reader = CacheReader::open(dir.path()).unwrap();
        for i in [1, 3] {
            assert_eq!(
                reader.location(i).unwrap().0.offset % RECORD_ALIGN as u64,
                0,
                "{i}"
            );
            assert_eq!(reader.record(i).unwrap(), &recs[i as usize][..]);
        }
        assert_ne!(
            reader.location(4).unwrap().0.offset % RECORD_ALIGN as u64,
            0
        );
    }

    #[test]
    fn oversized_record_gets_its_own_shard() {
        let dir = tempfile::tempdir().unwrap();
        let recs = vec![vec![1u8; 10], vec![2u8; 10_000], vec![3u8; 10]];
        let opts = WriteOptions {
            shard_size: 1024,
            alignment: 16,
            ..WriteOptions::default()
        };
        let manifest = build(dir.path(), &recs, opts);
        assert_eq!(manifest.shards.len(), 3);
        let reader = CacheReader::open(dir.path()).unwrap();
        assert_eq!(reader.record(1).unwrap(), &recs[1][..]);
    }

    #[test]
    fn shard_checksums_match_files() {
        let dir = tempfile::tempdir().unwrap();
        let manifest = build(dir.path(), &records(100), WriteOptions::default());
        for s in &manifest.shards {
            let bytes = std::fs::read(dir.path().join(&s.file)).unwrap();
            assert_eq!(checksum_hex(xxhash_rust::xxh3::xxh3_64(&bytes)), s.checksum);
        }
    }

    #[test]
    fn out_of_range_and_damaged_reads_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        build(dir.path(), &records(20), WriteOptions::default());
        let reader = CacheReader::open(dir.path()).unwrap();
        assert!(matches!(
            reader.record(20),
            Err(Error::SampleOutOfRange { sample_id: 20, .. })
        ));
        drop(reader);

        // Flip one payload byte: plain reads return it, verified reads catch it.
        let shard = dir.path().join("shards/00000.bin");
        let mut bytes = std::fs::read(&shard).unwrap();
        let reader = CacheReader::open(dir.path()).unwrap();
        let loc = reader.location(5).unwrap().0;
        drop(reader);
        bytes[loc.offset as usize] ^= 0xff;
        std::fs::write(&shard, &bytes).unwrap();
        let reader = CacheReader::open(dir.path()).unwrap();
        let err = reader.record_verified(5).unwrap_err();
        assert!(
            err.to_string().contains("sample_id 5 fails its checksum"),
            "{err}"
        );

        // Truncation is caught at open, naming the file.
        drop(reader);
        std::fs::write(&shard, &bytes[..bytes.len() - 1]).unwrap();
        let err = CacheReader::open(dir.path()).unwrap_err();
        assert!(err.to_string().contains("00000.bin"), "{err}");
        assert!(err.to_string().contains("truncated"), "{err}");
    }

    #[test]
    fn format_1_serializer_names_read_as_the_names_users_pass() {
        let dir = tempfile::tempdir().unwrap();
        build(dir.path(), &records(3), WriteOptions::default());
        let manifest_path = dir.path().join("manifest.json");
        let text = std::fs::read_to_string(&manifest_path).unwrap();
        assert!(text.contains("\"format_version\": 5"), "{text}");
        assert!(text.contains("\"serializer\": \"pickle\""), "{text}");
        for (stored, read) in [
            ("pickle-oob", "pickle"),
            ("pickle", "pickle-inband"),
            ("dill", "dill"),
        ] {
            let old = text
                .replace("\"format_version\": 5", "\"format_version\": 1")
                .replace(
                    "\"serializer\": \"pickle\"",
                    &format!("\"serializer\": \"{stored}\""),
                );
            std::fs::write(&manifest_path, old).unwrap();
            let manifest = CacheReader::open(dir.path()).unwrap().manifest().clone();
            assert_eq!(manifest.serializer, read, "format 1 {stored:?}");
            assert_eq!(manifest.format_version, 1, "the version read is kept");
        }
    }

    #[test]
    fn missing_shard_and_newer_format_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        build(dir.path(), &records(5), WriteOptions::default());
        let manifest_path = dir.path().join("manifest.json");
        let text = std::fs::read_to_string(&manifest_path).unwrap();
        std::fs::write(
            &manifest_path,
            text.replace("\"format_version\": 5", "\"format_version\": 99"),
        )
        .unwrap();
        assert!(matches!(
            CacheReader::open(dir.path()),
            Err(Error::UnsupportedVersion { found: 99, .. })
        ));
        std::fs::write(&manifest_path, &text).unwrap();
        std::fs::remove_file(dir.path().join("shards/00000.bin")).unwrap();
        let err = CacheReader::open(dir.path()).unwrap_err();
        assert!(err.to_string().contains("missing"), "{err}");
    }

    #[test]
    fn read_hints_take_any_id_and_change_no_read() {
        let dir = tempfile::tempdir().unwrap();
        let recs = records(40);
        build(dir.path(), &recs, WriteOptions::default());
        let reader = CacheReader::open(dir.path()).unwrap();
        // Before the index is mapped, in range and past the end: hints only, never a read.
        for id in [0, 39, 40, u64::MAX] {
            reader.prefetch_location(id);
            reader.prefetch_record(id);
        }
        assert_eq!(reader.copy_record(7, true).unwrap(), recs[7]);
        for id in [0, 39, 40, u64::MAX] {
            reader.prefetch_location(id);
            reader.prefetch_record(id);
        }
        for (i, r) in recs.iter().enumerate() {
            assert_eq!(&reader.copy_record(i as u64, true).unwrap(), r);
        }
    }

    #[test]
    fn index_pointing_outside_its_shard_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let manifest = build(dir.path(), &records(4), WriteOptions::default());
        let shard_len = manifest.shards[0].size;
        let mut bad = crate::index::IndexBuilder::default();
        let locs = [
            (0, shard_len - 2, 5), // runs past the end
            (0, 3, 5),             // inside the header
            (7, 64, 1),            // no such shard
            (0, u64::MAX - 1, 5),  // offset + length overflows
        ];
        for (shard, offset, length) in locs {
            let loc = Location {
                shard,
                offset,
                length,
            };
            bad.push(loc, 0).unwrap();
        }
        let index_path = dir.path().join("index.arrow");
        let (size, digest) = bad.write(&index_path).unwrap();
        let mut manifest = manifest;
        manifest.index.size = size;
        manifest.index.checksum = checksum_hex(digest);
        manifest.write(dir.path()).unwrap();
        let reader = CacheReader::open(dir.path()).unwrap();
        for id in 0..4 {
            let err = reader.record(id).unwrap_err().to_string();
            assert!(err.contains(&format!("sample_id {id}")), "{err}");
        }
    }

    #[test]
    fn compressed_caches_read_decoded_records_and_name_damaged_ones() {
        let dir = tempfile::tempdir().unwrap();
        let recs: Vec<Vec<u8>> = (0..40).map(|i| vec![i as u8; 1000 + i]).collect();
        let opts = WriteOptions {
            compression: Codec::Zstd { level: 5 },
            ..WriteOptions::default()
        };
        let manifest = build(dir.path(), &recs, opts);
        let text = std::fs::read_to_string(dir.path().join("manifest.json")).unwrap();
        for field in [
            "\"format_version\": 5",
            "\"compression\": \"zstd\"",
            "\"compression_level\": 5",
        ] {
            assert!(text.contains(field), "{field} not in {text}");
        }
        let raw: u64 = recs.iter().map(|r| r.len() as u64).sum();
        assert_eq!(
            manifest.nbytes, raw,
            "nbytes counts the records as serialized"
        );
        assert!(
            manifest.shards[0].size < raw / 10,
            "{}",
            manifest.shards[0].size
        );

        let reader = CacheReader::open(dir.path()).unwrap();
        assert_eq!(reader.codec(), Codec::Zstd { level: 5 });
        for (i, r) in recs.iter().enumerate() {
            assert_eq!(&reader.copy_record(i as u64, true).unwrap(), r);
            let span = reader.span(i as u64, false).unwrap();
            assert_eq!(
                span.bytes().as_ptr() as usize % crate::format::RECORD_ALIGN,
                0
            );
        }
        let loc = reader.location(5).unwrap().0;
        drop(reader);
        // A damaged length header: the checksum catches it, and a read without checking
        // fails to decode instead of returning wrong bytes.
        let shard = dir.path().join("shards/00000.bin");
        let mut bytes = std::fs::read(&shard).unwrap();
        bytes[loc.offset as usize] ^= 0x40;
        std::fs::write(&shard, &bytes).unwrap();
        let reader = CacheReader::open(dir.path()).unwrap();
        let err = reader.copy_record(5, true).unwrap_err().to_string();
        assert!(err.contains("sample_id 5 fails its checksum"), "{err}");
        let err = reader.copy_record(5, false).unwrap_err().to_string();
        assert!(
            err.contains("sample_id 5") && err.contains("00000.bin"),
            "{err}"
        );
        assert_eq!(reader.copy_record(6, false).unwrap(), recs[6]);
    }

    #[test]
    fn caches_of_format_3_open_and_keep_their_version_until_a_part_is_added() {
        let dir = tempfile::tempdir().unwrap();
        let recs = records(7);
        let mut manifest = build(dir.path(), &recs, WriteOptions::default());
        assert_eq!(manifest.format_version, FORMAT_VERSION);
        // The same cache as format 3 wrote it: its index as five columns.
        let index_path = dir.path().join("index.arrow");
        let index = Index::open(&index_path, 7).unwrap();
        let rows: Vec<_> = (0..7)
            .map(|i| (index.location(i), index.checksum(i)))
            .collect();
        drop(index);
        let (size, digest) = crate::index::write_columns(&index_path, &rows).unwrap();
        manifest.index.size = size;
        manifest.index.checksum = checksum_hex(digest);
        manifest.format_version = 3;
        manifest.write(dir.path()).unwrap();
        let reader = CacheReader::open(dir.path()).unwrap();
        assert_eq!(reader.manifest().format_version, 3);
        for (i, rec) in recs.iter().enumerate() {
            assert_eq!(reader.record_verified(i as u64).unwrap(), &rec[..]);
        }
        // Rewritten (as a metadata save does), it stays readable by the releases that
        // read version 3.
        reader.manifest().write(dir.path()).unwrap();
        let text = std::fs::read_to_string(dir.path().join("manifest.json")).unwrap();
        assert!(text.contains("\"format_version\": 3"), "{text}");
        assert!(!text.contains("compression_level"), "{text}");
        // A part appended now has a locator index: the cache becomes version 5.
        let mut grown = reader.manifest().clone();
        grown.add_part(Part {
            shards: Vec::new(),
            index: manifest.index.clone(),
            num_samples: 0,
            nbytes: 0,
        });
        assert_eq!(grown.format_version, LOCATORS_VERSION);
    }

    /// Copies shards from `from` into the cache directory on request, counting requests.
    struct CopyFetcher {
        from: PathBuf,
        to: PathBuf,
        calls: std::sync::Mutex<Vec<String>>,
        fail: bool,
    }

    impl Fetcher for CopyFetcher {
        fn fetch(&self, file: &str) -> std::result::Result<(), crate::fetch::FetchError> {
            self.calls.lock().unwrap().push(file.to_string());
            if !self.to.join(file).exists() {
                if self.fail {
                    return Err("the network is down".into());
                }
                std::fs::copy(self.from.join(file), self.to.join(file))?;
            }
            Ok(())
        }
    }

    #[test]
    fn a_cache_with_a_fetcher_maps_each_file_on_first_use_and_asks_for_it_once() {
        let dir = tempfile::tempdir().unwrap();
        let remote = tempfile::tempdir().unwrap();
        let recs = records(200);
        let opts = WriteOptions {
            shard_size: 4096,
            alignment: 64,
            ..WriteOptions::default()
        };
        let manifest = build(dir.path(), &recs, opts);
        for moved in ["shards", "index.arrow"] {
            std::fs::rename(dir.path().join(moved), remote.path().join(moved)).unwrap();
        }
        std::fs::create_dir(dir.path().join("shards")).unwrap();
        assert!(
            CacheReader::open(dir.path()).is_err(),
            "no fetcher: files checked at open"
        );

        let fetcher = Arc::new(CopyFetcher {
            from: remote.path().to_path_buf(),
            to: dir.path().to_path_buf(),
            calls: std::sync::Mutex::default(),
            fail: false,
        });
        crate::fetch::register(dir.path(), fetcher.clone());
        let reader = CacheReader::open(dir.path()).unwrap();
        assert!(reader.fetches());
        assert!(
            fetcher.calls.lock().unwrap().is_empty(),
            "opening fetched nothing"
        );
        assert_eq!(reader.len(), 200, "the manifest says how many records");
        assert!(fetcher.calls.lock().unwrap().is_empty());
        assert_eq!(reader.record(0).unwrap(), &recs[0][..]);
        assert_eq!(
            *fetcher.calls.lock().unwrap(),
            vec!["index.arrow", "shards/00000.bin"]
        );
        for (i, r) in recs.iter().enumerate() {
            assert_eq!(&reader.copy_record(i as u64, true).unwrap(), r);
        }
        let mut calls = fetcher.calls.lock().unwrap().clone();
        assert_eq!(calls.len(), 1 + manifest.shards.len(), "each file once");
        calls.sort();
        calls.dedup();
        assert_eq!(calls.len(), 1 + manifest.shards.len());
        assert!(crate::fetch::unregister(dir.path()));

        // A fetcher's failure reaches the reader's caller, naming the shard.
        std::fs::remove_file(dir.path().join("shards/00001.bin")).unwrap();
        let failing = Arc::new(CopyFetcher {
            from: remote.path().to_path_buf(),
            to: dir.path().to_path_buf(),
            calls: std::sync::Mutex::default(),
            fail: true,
        });
        crate::fetch::register(dir.path(), failing);
        let reader = CacheReader::open(dir.path()).unwrap();
        let id = (0..200u64)
            .find(|&i| reader.shard_file(i).unwrap() == "shards/00001.bin")
            .unwrap();
        let err = reader.record(id).unwrap_err();
        assert!(matches!(err, Error::Fetch { .. }), "{err:?}");
        assert!(err.to_string().contains("00001.bin"), "{err}");
        assert!(err.to_string().contains("the network is down"), "{err}");
        crate::fetch::unregister(dir.path());
    }

    #[test]
    fn empty_cache_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let manifest = build(dir.path(), &[], WriteOptions::default());
        assert!(manifest.shards.is_empty());
        assert!(CacheReader::open(dir.path()).unwrap().is_empty());
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(32))]
            #[test]
            fn any_records_round_trip(
                recs in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..600), 0..80),
                shard_size in 65u64..5000,
                align_pow in 0u32..8,
                codec in 0usize..3,
            ) {
                let dir = tempfile::tempdir().unwrap();
                let compression = [Codec::None, Codec::Zstd { level: 1 }, Codec::Lz4][codec];
                let opts = WriteOptions { shard_size, alignment: 1 << align_pow, compression };
                build(dir.path(), &recs, opts);
                let reader = CacheReader::open(dir.path()).unwrap();
                prop_assert_eq!(reader.len(), recs.len() as u64);
                prop_assert_eq!(reader.codec(), compression);
                for (i, r) in recs.iter().enumerate() {
                    prop_assert_eq!(&reader.copy_record(i as u64, true).unwrap(), r);
                }
            }
        }
    }
}
