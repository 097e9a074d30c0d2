//! The sample index: an uncompressed Arrow IPC file mapping `sample_id` to where its record
//! lives (`shard`, `offset`, `length`) and its xxh3-64 `checksum`.
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
use arrow_array::{Array, ArrayRef, RecordBatch, UInt32Array, UInt64Array};
use arrow_buffer::{Buffer, ScalarBuffer};
use arrow_ipc::reader::FileDecoder;
use arrow_ipc::writer::FileWriter;
use arrow_schema::{DataType, Field, Schema};
use memmap2::Mmap;

use crate::ensure_intact;
use crate::error::{Error, IoContext, Result};

/// Where one record lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    /// Shard id.
    pub shard: u32,
    /// Byte offset of the record within its shard.
    pub offset: u64,
    /// Length of the record in bytes.
    pub length: u64,
    /// xxh3-64 of the record's bytes.
    pub checksum: u64,
}

fn schema() -> Schema {
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
    shard: Vec<u32>,
    offset: Vec<u64>,
    length: Vec<u64>,
    checksum: Vec<u64>,
}

impl IndexBuilder {
    /// Records the location of the next sample.
    pub fn push(&mut self, loc: Location) {
        self.shard.push(loc.shard);
        self.offset.push(loc.offset);
        self.length.push(loc.length);
        self.checksum.push(loc.checksum);
    }

    /// Number of samples recorded so far.
    pub fn len(&self) -> u64 {
        self.shard.len() as u64
    }

    /// Whether no sample was recorded.
    pub fn is_empty(&self) -> bool {
        self.shard.is_empty()
    }

    /// Writes the index to `path`; returns the file's size and xxh3-64.
    pub fn write(self, path: &Path) -> Result<(u64, u64)> {
        let n = self.shard.len() as u64;
        let columns: Vec<ArrayRef> = vec![
            Arc::new(UInt64Array::from_iter_values(0..n)),
            Arc::new(UInt32Array::from(self.shard)),
            Arc::new(UInt64Array::from(self.offset)),
            Arc::new(UInt64Array::from(self.length)),
            Arc::new(UInt64Array::from(self.checksum)),
        ];
        let schema = Arc::new(schema());
        let batch = RecordBatch::try_new(schema.clone(), columns)
            .map_err(|e| Error::Internal(format!("index batch: {e}")))?;
        let file = std::fs::File::create(path).at(path)?;
        let mut out = HashingWriter::new(std::io::BufWriter::with_capacity(1 << 20, file));
        let ipc_err = |e: arrow_schema::ArrowError| Error::Io {
            path: path.to_path_buf(),
            source: std::io::Error::other(e.to_string()),
        };
        let mut writer = FileWriter::try_new(&mut out, &schema).map_err(ipc_err)?;
        writer.write(&batch).map_err(ipc_err)?;
        writer.finish().map_err(ipc_err)?;
        drop(writer);
        let (size, digest, inner) = out.finish();
        let file = inner.into_inner().map_err(|e| e.into_error()).at(path)?;
        file.sync_all().at(path)?;
        Ok((size, digest))
    }
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
    sample_id: ScalarBuffer<u64>,
    shard: ScalarBuffer<u32>,
    offset: ScalarBuffer<u64>,
    length: ScalarBuffer<u64>,
    checksum: ScalarBuffer<u64>,
}

impl Index {
    /// Maps the index file at `path`, expecting `num_samples` rows.
    ///
    /// Only the file's footer and message headers are parsed; no per-sample work is done.
    pub fn open(path: &Path, num_samples: u64) -> Result<Index> {
        let file = std::fs::File::open(path).at(path)?;
        // SAFETY: index files are written once, before the cache is published, and never
        // modified in place afterwards; readers only ever see complete files.
        let map = unsafe { Mmap::map(&file) }.at(path)?;
        let len = map.len();
        let ptr = NonNull::new(map.as_ptr() as *mut u8)
            .ok_or_else(|| Error::corrupt(path, "empty index file"))?;
        // SAFETY: `ptr` and `len` describe the mapping, which the buffer keeps alive by owning
        // it; the mapping is read-only and is never written through the buffer.
        let buffer = unsafe { Buffer::from_custom_allocation(ptr, len, Arc::new(map)) };
        // The IPC decoder validates the flatbuffers it reads, but a damaged file must never
        // take the process down, so a panic deep inside it is turned into a corruption error.
        let parsed = catch_unwind(AssertUnwindSafe(|| decode(&buffer)))
            .map_err(|_| Error::corrupt(path, "index file is not a readable Arrow IPC file"))?;
        let batch = parsed.map_err(|msg| Error::corrupt(path, msg))?;
        ensure_intact!(
            batch.schema().fields() == schema().fields(),
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
        Ok(Index {
            sample_id: u64_col(0),
            shard: batch
                .column(1)
                .as_primitive::<UInt32Type>()
                .values()
                .clone(),
            offset: u64_col(2),
            length: u64_col(3),
            checksum: u64_col(4),
        })
    }

    /// Number of samples.
    pub fn len(&self) -> u64 {
        self.shard.len() as u64
    }

    /// Whether the index has no samples.
    pub fn is_empty(&self) -> bool {
        self.shard.is_empty()
    }

    /// The location of `sample_id`, which the caller has checked to be `< len()`.
    #[inline]
    pub fn location(&self, sample_id: u64) -> Location {
        let i = sample_id as usize;
        Location {
            shard: self.shard[i],
            offset: self.offset[i],
            length: self.length[i],
            checksum: self.checksum[i],
        }
    }

    /// The `sample_id` column as stored, for verification.
    pub fn stored_sample_id(&self, row: u64) -> u64 {
        self.sample_id[row as usize]
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

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(n: u64) -> IndexBuilder {
        let mut b = IndexBuilder::default();
        for i in 0..n {
            b.push(Location {
                shard: (i / 3) as u32,
                offset: 64 + i * 16,
                length: i + 1,
                checksum: i.wrapping_mul(0x9e37_79b9_7f4a_7c15),
            });
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
        let index = Index::open(&path, 1000).unwrap();
        assert_eq!(index.len(), 1000);
        for i in [0, 1, 2, 3, 500, 999] {
            let loc = index.location(i);
            assert_eq!(loc.shard, (i / 3) as u32);
            assert_eq!(loc.offset, 64 + i * 16);
            assert_eq!(loc.length, i + 1);
            assert_eq!(index.stored_sample_id(i), i);
        }
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
        let path = dir.path().join("index.arrow");
        sample(100).write(&path).unwrap();
        let good = std::fs::read(&path).unwrap();
        let damaged = dir.path().join("damaged.arrow");
        for cut in [0, 5, 17, good.len() / 2, good.len() - 1] {
            std::fs::write(&damaged, &good[..cut]).unwrap();
            assert!(Index::open(&damaged, 100).is_err(), "cut at {cut}");
        }
        for pos in (0..good.len()).step_by(7) {
            let mut bytes = good.clone();
            bytes[pos] ^= 0xff;
            std::fs::write(&damaged, &bytes).unwrap();
            // Either a clean error or, where the flip hit a value, a readable index.
            let _ = Index::open(&damaged, 100);
        }
    }
}
