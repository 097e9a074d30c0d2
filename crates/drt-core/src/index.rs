//! The sample index: an uncompressed Arrow IPC file saying where each sample's record lives
//! and holding its xxh3-64 checksum.
//!
//! Since format version 5 its row `i` is sample `i`, in two columns: `locator`, 16 bytes per
//! row (offset u64, length u32, shard u32, little-endian), the one thing a draw reads; and
//! `checksum`, read only by `verify` and by reads with `verify=True`. Versions 1 to 4 stored
//! the sample id, shard, offset, length and checksum as five columns (36 bytes per row, of
//! which a draw touched 28 in four places); such indexes still open.
//!
//! The file holds one record batch of fixed-width, non-null columns. Reading it maps the file
//! and views the columns in place, so opening costs the same for a thousand samples as for a
//! hundred million, and every process that opens the cache shares the pages.

use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::{UInt32Type, UInt64Type};
use arrow_array::{Array, ArrayRef, FixedSizeBinaryArray, RecordBatch, UInt64Array};
use arrow_buffer::{Buffer, ScalarBuffer};
use arrow_ipc::reader::FileDecoder;
use arrow_ipc::writer::FileWriter;
use arrow_schema::{DataType, Field, Schema};

use crate::ensure_intact;
use crate::error::{Error, IoContext, Result};
use crate::mapping::MappedFile;

/// Where one record lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    /// Shard id.
    pub shard: u32,
    /// Byte offset of the record within its shard.
    pub offset: u64,
    /// Length of the record in bytes (at most [`MAX_RECORD_LEN`]).
    pub length: u64,
}

/// The longest record an index can locate: its length is stored in 32 bits.
pub const MAX_RECORD_LEN: u64 = u32::MAX as u64;
/// Bytes per row of the `locator` column.
const LOCATOR_LEN: usize = 16;

impl Location {
    /// The row of the `locator` column: offset, length, shard.
    fn encode(&self) -> Result<[u8; LOCATOR_LEN]> {
        let length = u32::try_from(self.length).map_err(|_| {
            Error::Internal(format!(
                "a record of {} bytes reached the index",
                self.length
            ))
        })?;
        let mut row = [0u8; LOCATOR_LEN];
        row[..8].copy_from_slice(&self.offset.to_le_bytes());
        row[8..12].copy_from_slice(&length.to_le_bytes());
        row[12..].copy_from_slice(&self.shard.to_le_bytes());
        Ok(row)
    }

    #[inline]
    fn decode(row: &[u8]) -> Self {
        let (mut offset, mut length, mut shard) = ([0u8; 8], [0u8; 4], [0u8; 4]);
        offset.copy_from_slice(&row[..8]);
        length.copy_from_slice(&row[8..12]);
        shard.copy_from_slice(&row[12..LOCATOR_LEN]);
        Location {
            offset: u64::from_le_bytes(offset),
            length: u64::from(u32::from_le_bytes(length)),
            shard: u32::from_le_bytes(shard),
        }
    }
}

fn schema() -> Schema {
    Schema::new(vec![
        Field::new(
            "locator",
            DataType::FixedSizeBinary(LOCATOR_LEN as i32),
            false,
        ),
        Field::new("checksum", DataType::UInt64, false),
    ])
}

/// The five columns of format versions 1 to 4.
fn columns_schema() -> Schema {
    Schema::new(vec![
        Field::new("sample_id", DataType::UInt64, false),
        Field::new("shard", DataType::UInt32, false),
        Field::new("offset", DataType::UInt64, false),
        Field::new("length", DataType::UInt64, false),
        Field::new("checksum", DataType::UInt64, false),
    ])
}

/// Collects locations while a cache is written; [`IndexBuilder::write`] stores them.
#[derive(Debug, Default)]
pub struct IndexBuilder {
    locators: Vec<u8>,
    checksum: Vec<u64>,
}

impl IndexBuilder {
    /// Records the location of the next sample and the xxh3-64 of its stored bytes.
    pub fn push(&mut self, loc: Location, checksum: u64) -> Result<()> {
        self.locators.extend_from_slice(&loc.encode()?);
        self.checksum.push(checksum);
        Ok(())
    }

    /// Number of samples recorded so far.
    pub fn len(&self) -> u64 {
        self.checksum.len() as u64
    }

    /// Whether no sample was recorded.
    pub fn is_empty(&self) -> bool {
        self.checksum.is_empty()
    }

    /// Writes the index to `path`; returns the file's size and xxh3-64.
    pub fn write(self, path: &Path) -> Result<(u64, u64)> {
        let internal = |e: arrow_schema::ArrowError| Error::Internal(format!("index batch: {e}"));
        let locators = FixedSizeBinaryArray::try_new(
            LOCATOR_LEN as i32,
            Buffer::from_vec(self.locators),
            None,
        )
        .map_err(internal)?;
        let columns: Vec<ArrayRef> = vec![
            Arc::new(locators),
            Arc::new(UInt64Array::from(self.checksum)),
        ];
        let schema = Arc::new(schema());
        let batch = RecordBatch::try_new(schema.clone(), columns).map_err(internal)?;
        write_batch(path, &schema, &batch)
    }
}

/// Writes `batch` as an IPC file at `path`, flushed to disk; returns its size and xxh3-64.
fn write_batch(path: &Path, schema: &Schema, batch: &RecordBatch) -> Result<(u64, u64)> {
    let file = std::fs::File::create(path).at(path)?;
    let mut out = HashingWriter::new(std::io::BufWriter::with_capacity(
        crate::format::WRITE_BUFFER,
        file,
    ));
    let ipc_err = |e: arrow_schema::ArrowError| Error::Io {
        path: path.to_path_buf(),
        source: std::io::Error::other(e.to_string()),
    };
    let mut writer = FileWriter::try_new(&mut out, schema).map_err(ipc_err)?;
    writer.write(batch).map_err(ipc_err)?;
    writer.finish().map_err(ipc_err)?;
    drop(writer);
    let (size, digest, inner) = out.finish();
    let file = inner.into_inner().map_err(|e| e.into_error()).at(path)?;
    file.sync_all().at(path)?;
    Ok((size, digest))
}

/// A `Write` that hashes and counts what passes through it.
pub(crate) struct HashingWriter<W> {
    inner: W,
    hasher: xxhash_rust::xxh3::Xxh3,
    written: u64,
}

impl<W: Write> HashingWriter<W> {
    pub(crate) fn new(inner: W) -> Self {
        Self {
            inner,
            hasher: xxhash_rust::xxh3::Xxh3::new(),
            written: 0,
        }
    }

    /// The inner writer.
    pub(crate) fn get_ref(&self) -> &W {
        &self.inner
    }

    /// Bytes written so far.
    pub(crate) fn position(&self) -> u64 {
        self.written
    }

    /// Returns (bytes written, xxh3-64 of them, the inner writer).
    pub(crate) fn finish(self) -> (u64, u64, W) {
        (self.written, self.hasher.digest(), self.inner)
    }
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// The index of an open cache, viewed in place in the mapped file.
#[derive(Debug, Clone)]
pub struct Index {
    checksum: ScalarBuffer<u64>,
    layout: Layout,
}

/// How an index stores its locations.
#[derive(Debug, Clone)]
enum Layout {
    /// Format 5: 16 bytes per row; row `i` is sample `i`.
    Locators(Buffer),
    /// Formats 1 to 4: a column per field, and the sample ids stored.
    Columns {
        sample_id: ScalarBuffer<u64>,
        shard: ScalarBuffer<u32>,
        offset: ScalarBuffer<u64>,
        length: ScalarBuffer<u64>,
    },
}

impl Index {
    /// Maps the index file at `path`, expecting `num_samples` rows.
    ///
    /// Only the file's footer and message headers are parsed; no per-sample work is done.
    pub fn open(path: &Path, num_samples: u64) -> Result<Index> {
        let file = std::fs::File::open(path).at(path)?;
        // Index files are written once, before the cache is published, and never modified in
        // place afterwards; readers only ever see complete files. Every reader of this
        // process shares one mapping of a file, so an epoch or a loader after the first finds
        // the pages of the index that earlier ones touched still mapped.
        let map = MappedFile::open(&file, path)?;
        let len = map.len();
        let ptr = NonNull::new(map.as_ptr() as *mut u8)
            .ok_or_else(|| Error::corrupt(path, "empty index file"))?;
        // SAFETY: `ptr` and `len` describe the mapping, which the buffer keeps alive by owning
        // it; the mapping is read-only and is never written through the buffer.
        let buffer = unsafe { Buffer::from_custom_allocation(ptr, len, map) };
        // The IPC decoder validates the flatbuffers it reads, but a damaged file must never
        // take the process down, so a panic deep inside it is turned into a corruption error.
        let parsed = catch_unwind(AssertUnwindSafe(|| decode(&buffer)))
            .map_err(|_| Error::corrupt(path, "index file is not a readable Arrow IPC file"))?;
        let batch = parsed.map_err(|msg| Error::corrupt(path, msg))?;
        let fields = batch.schema_ref().fields();
        let compact = fields == schema().fields();
        ensure_intact!(
            compact || fields == columns_schema().fields(),
            path,
            "unexpected index schema {:?}",
            batch.schema()
        );
        ensure_intact!(
            batch.num_rows() as u64 == num_samples,
            path,
            "index has {} rows but the manifest promises {num_samples} samples",
            batch.num_rows()
        );
        for column in batch.columns() {
            ensure_intact!(column.null_count() == 0, path, "index holds nulls");
        }
        let u64_col = |i: usize| {
            batch
                .column(i)
                .as_primitive::<UInt64Type>()
                .values()
                .clone()
        };
        let layout = if compact {
            let locators = batch.column(0).as_fixed_size_binary();
            ensure_intact!(
                locators.value_data().len() >= locators.len() * LOCATOR_LEN,
                path,
                "index locators hold {} bytes for {} rows",
                locators.value_data().len(),
                locators.len()
            );
            Layout::Locators(locators.values().clone())
        } else {
            Layout::Columns {
                sample_id: u64_col(0),
                shard: batch
                    .column(1)
                    .as_primitive::<UInt32Type>()
                    .values()
                    .clone(),
                offset: u64_col(2),
                length: u64_col(3),
            }
        };
        let checksum = u64_col(batch.num_columns() - 1);
        Ok(Index { checksum, layout })
    }

    /// Number of samples.
    pub fn len(&self) -> u64 {
        self.checksum.len() as u64
    }

    /// Whether the index has no samples.
    pub fn is_empty(&self) -> bool {
        self.checksum.is_empty()
    }

    /// Asks the processor to load the locator [`location`](Self::location) reads for
    /// `sample_id` (format 5; older layouts are left alone).
    #[inline]
    pub fn prefetch(&self, sample_id: u64) {
        if let Layout::Locators(rows) = &self.layout {
            crate::mapping::prefetch_line(rows, sample_id as usize * LOCATOR_LEN);
        }
    }

    /// The location of `sample_id`, which the caller has checked to be `< len()`.
    #[inline]
    pub fn location(&self, sample_id: u64) -> Location {
        let i = sample_id as usize;
        match &self.layout {
            Layout::Locators(rows) => {
                let start = i * LOCATOR_LEN;
                Location::decode(&rows[start..start + LOCATOR_LEN])
            }
            Layout::Columns {
                shard,
                offset,
                length,
                ..
            } => Location {
                shard: shard[i],
                offset: offset[i],
                length: length[i],
            },
        }
    }

    /// The xxh3-64 of record `sample_id`'s stored bytes (`sample_id < len()`).
    #[inline]
    pub fn checksum(&self, sample_id: u64) -> u64 {
        self.checksum[sample_id as usize]
    }

    /// The sample id stored in row `row`, for verification: only indexes of format versions
    /// 1 to 4 store one (in format 5, row `i` is sample `i` by construction).
    pub fn stored_sample_id(&self, row: u64) -> Option<u64> {
        match &self.layout {
            Layout::Locators(_) => None,
            Layout::Columns { sample_id, .. } => Some(sample_id[row as usize]),
        }
    }
}

/// Decodes the single record batch of an IPC file held in `buffer`.
fn decode(buffer: &Buffer) -> std::result::Result<RecordBatch, String> {
    const TRAILER: usize = 10; // footer length (i32) + "ARROW1"
    let len = buffer.len();
    if len < TRAILER + 8 {
        return Err(format!("{len} bytes is too short for an Arrow IPC file"));
    }
    let mut trailer = [0u8; TRAILER];
    trailer.copy_from_slice(&buffer[len - TRAILER..]);
    let footer_len = arrow_ipc::reader::read_footer_length(trailer).map_err(|e| e.to_string())?;
    let footer_start = len
        .checked_sub(TRAILER + footer_len)
        .ok_or("footer length exceeds the file")?;
    let footer = arrow_ipc::root_as_footer(&buffer[footer_start..len - TRAILER])
        .map_err(|e| format!("bad footer: {e}"))?;
    let fb_schema = footer.schema().ok_or("footer has no schema")?;
    let schema =
        Arc::new(arrow_ipc::convert::try_fb_to_schema(fb_schema).map_err(|e| e.to_string())?);
    let decoder = FileDecoder::new(schema, footer.version()).with_require_alignment(true);
    let blocks = footer
        .recordBatches()
        .ok_or("footer lists no record batches")?;
    if blocks.len() != 1 {
        return Err(format!("expected 1 record batch, found {}", blocks.len()));
    }
    let block = blocks.get(0);
    let start = usize::try_from(block.offset()).map_err(|_| "negative block offset")?;
    let block_len = usize::try_from(block.metaDataLength())
        .ok()
        .zip(usize::try_from(block.bodyLength()).ok())
        .and_then(|(m, b)| m.checked_add(b))
        .ok_or("bad block length")?;
    if start
        .checked_add(block_len)
        .is_none_or(|end| end > footer_start)
    {
        return Err("record batch block lies outside the file".into());
    }
    decoder
        .read_record_batch(block, &buffer.slice_with_length(start, block_len))
        .map_err(|e| e.to_string())?
        .ok_or_else(|| "record batch block is empty".to_string())
}

/// Writes an index as format versions 1 to 4 did, for tests of caches written then.
#[cfg(test)]
pub(crate) fn write_columns(path: &Path, rows: &[(Location, u64)]) -> Result<(u64, u64)> {
    let n = rows.len() as u64;
    let columns: Vec<ArrayRef> = vec![
        Arc::new(UInt64Array::from_iter_values(0..n)),
        Arc::new(arrow_array::UInt32Array::from_iter_values(
            rows.iter().map(|(l, _)| l.shard),
        )),
        Arc::new(UInt64Array::from_iter_values(
            rows.iter().map(|(l, _)| l.offset),
        )),
        Arc::new(UInt64Array::from_iter_values(
            rows.iter().map(|(l, _)| l.length),
        )),
        Arc::new(UInt64Array::from_iter_values(rows.iter().map(|&(_, c)| c))),
    ];
    let schema = Arc::new(columns_schema());
    let batch = RecordBatch::try_new(schema.clone(), columns)
        .map_err(|e| Error::Internal(e.to_string()))?;
    write_batch(path, &schema, &batch)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: u64) -> Vec<(Location, u64)> {
        (0..n)
            .map(|i| {
                let loc = Location {
                    shard: (i / 3) as u32,
                    offset: 64 + i * 16 + (i << 33),
                    length: (i + 1) * 0x0101_0101 % (MAX_RECORD_LEN + 1),
                };
                (loc, i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            })
            .collect()
    }

    fn sample(n: u64) -> IndexBuilder {
        let mut b = IndexBuilder::default();
        for (loc, checksum) in rows(n) {
            b.push(loc, checksum).unwrap();
        }
        b
    }

    #[test]
    fn round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("index.arrow");
        let (size, digest) = sample(1000).write(&path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(size, bytes.len() as u64);
        assert_eq!(digest, xxhash_rust::xxh3::xxh3_64(&bytes));
        // 16 bytes per row for the locators and 8 for the checksums, and a few hundred for
        // the IPC framing.
        assert!(size < 1000 * 24 + 1024, "{size} bytes");
        let index = Index::open(&path, 1000).unwrap();
        assert_eq!(index.len(), 1000);
        let expected = rows(1000);
        for i in [0, 1, 2, 3, 500, 999] {
            assert_eq!(index.location(i), expected[i as usize].0);
            assert_eq!(index.checksum(i), expected[i as usize].1);
            assert_eq!(index.stored_sample_id(i), None);
        }
    }

    #[test]
    fn readers_of_one_index_share_its_mapping_until_the_file_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("index.arrow");
        sample(1000).write(&path).unwrap();
        let first = |index: &Index| match &index.layout {
            Layout::Locators(buffer) => buffer.as_ptr(),
            Layout::Columns { .. } => unreachable!("a format-5 index"),
        };
        let (a, b) = (
            Index::open(&path, 1000).unwrap(),
            Index::open(&path, 1000).unwrap(),
        );
        assert_eq!(first(&a), first(&b));
        // A file written anew under the name is another file: it gets its own mapping.
        let new = dir.path().join("new.arrow");
        sample(1000).write(&new).unwrap();
        std::fs::rename(&new, &path).unwrap();
        let c = Index::open(&path, 1000).unwrap();
        assert_ne!(first(&a), first(&c));
        assert_eq!(c.location(999), a.location(999));
    }

    #[test]
    fn indexes_of_format_4_and_before_still_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("index.arrow");
        let expected = rows(100);
        write_columns(&path, &expected).unwrap();
        let index = Index::open(&path, 100).unwrap();
        for i in 0..100 {
            assert_eq!(index.location(i), expected[i as usize].0);
            assert_eq!(index.checksum(i), expected[i as usize].1);
            assert_eq!(index.stored_sample_id(i), Some(i));
        }
    }

    #[test]
    fn a_record_over_4_gib_cannot_be_indexed() {
        let mut b = IndexBuilder::default();
        let loc = Location {
            shard: 0,
            offset: 64,
            length: MAX_RECORD_LEN + 1,
        };
        assert!(b.push(loc, 0).is_err());
        assert!(b.is_empty());
    }

    #[test]
    fn empty_index_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("index.arrow");
        sample(0).write(&path).unwrap();
        assert!(Index::open(&path, 0).unwrap().is_empty());
    }

    #[test]
    fn row_count_must_match_manifest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("index.arrow");
        sample(10).write(&path).unwrap();
        let err = Index::open(&path, 11).unwrap_err();
        assert!(err.to_string().contains("promises 11"), "{err}");
    }

    #[test]
    fn truncated_or_garbled_files_are_errors_not_crashes() {
        let dir = tempfile::tempdir().unwrap();
        for legacy in [false, true] {
            let path = dir.path().join("index.arrow");
            if legacy {
                write_columns(&path, &rows(100)).unwrap();
            } else {
                sample(100).write(&path).unwrap();
            }
            let good = std::fs::read(&path).unwrap();
            let damaged = dir.path().join("damaged.arrow");
            for cut in [0, 5, 17, good.len() / 2, good.len() - 1] {
                std::fs::write(&damaged, &good[..cut]).unwrap();
                assert!(Index::open(&damaged, 100).is_err(), "cut at {cut}");
            }
            for pos in 0..good.len() {
                let mut bytes = good.clone();
                bytes[pos] ^= 0xff;
                std::fs::write(&damaged, &bytes).unwrap();
                // Either a clean error or, where the flip hit a value, a readable index
                // whose every row can be looked up.
                if let Ok(index) = Index::open(&damaged, 100) {
                    for i in 0..index.len() {
                        let _ = (index.location(i), index.checksum(i));
                    }
                }
            }
        }
    }
}
