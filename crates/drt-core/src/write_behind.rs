//! Write-behind: a [`CacheWriter`] on its own thread, fed batches of records.
//!
//! Serializing records (in Python) and writing them (hashing, copying into the page cache,
//! syncing finished shards) then overlap instead of taking turns on the caller's thread.
//! The caller only copies each record into a batch buffer; at most [`MAX_BATCHES_IN_FLIGHT`]
//! batches of about [`BATCH_BYTES`] wait for the writer, which bounds the memory used.

use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Mutex;
use std::thread::JoinHandle;

use crate::error::{Error, Result};
use crate::format::{Manifest, Part};
use crate::writer::{CacheWriter, ManifestInfo};

/// A batch is handed to the writer thread once it holds this many bytes.
pub const BATCH_BYTES: usize = 4 << 20;
/// Batches queued for the writer thread before the caller blocks.
pub const MAX_BATCHES_IN_FLIGHT: usize = 4;

struct Chunk {
    bytes: Vec<u8>,
    ends: Vec<usize>,
}

impl Chunk {
    fn with_capacity() -> Self {
        Self {
            bytes: Vec::with_capacity(BATCH_BYTES + BATCH_BYTES / 4),
            ends: Vec::new(),
        }
    }

    fn records(&self) -> impl Iterator<Item = &[u8]> {
        let mut start = 0;
        self.ends.iter().map(move |&end| {
            let record = &self.bytes[start..end];
            start = end;
            record
        })
    }
}

/// Appends records through a writer thread; see the module documentation.
pub struct WriteBehind {
    batch: Chunk,
    tx: Option<SyncSender<Chunk>>,
    // Written batches come back to be refilled: their pages are already faulted in, so
    // copying a record into a batch costs a memcpy and nothing more.
    // (In a Mutex only to make the writer Sync; `&mut self` reaches it without locking.)
    recycled: Mutex<Receiver<Chunk>>,
    thread: Option<JoinHandle<Result<CacheWriter>>>,
    num_samples: u64,
    nbytes: u64,
}

fn write_batches(
    mut writer: CacheWriter,
    rx: Receiver<Chunk>,
    recycle: SyncSender<Chunk>,
) -> Result<CacheWriter> {
    for mut batch in rx {
        for record in batch.records() {
            writer.append(record)?;
        }
        batch.bytes.clear();
        batch.ends.clear();
        // The caller may have gone; then the batch is simply freed.
        let _ = recycle.try_send(batch);
    }
    Ok(writer)
}

impl WriteBehind {
    /// Moves `writer` onto a new thread.
    pub fn spawn(writer: CacheWriter) -> Result<Self> {
        let (tx, rx) = sync_channel(MAX_BATCHES_IN_FLIGHT);
        let (recycle, recycled) = sync_channel(MAX_BATCHES_IN_FLIGHT + 1);
        let dir = writer.dir().to_path_buf();
        let thread = std::thread::Builder::new()
            .name("drt-cache-writer".into())
            .spawn(move || write_batches(writer, rx, recycle))
            .map_err(|source| Error::Io { path: dir, source })?;
        Ok(Self {
            batch: Chunk::with_capacity(),
            tx: Some(tx),
            recycled: Mutex::new(recycled),
            thread: Some(thread),
            num_samples: 0,
            nbytes: 0,
        })
    }

    /// Records appended so far.
    pub fn num_samples(&self) -> u64 {
        self.num_samples
    }

    /// Payload bytes appended so far.
    pub fn nbytes(&self) -> u64 {
        self.nbytes
    }

    /// Queues one record; returns its sample id. A write error of an earlier record is
    /// reported here or by [`WriteBehind::finish`].
    pub fn append(&mut self, record: &[u8]) -> Result<u64> {
        self.batch.bytes.extend_from_slice(record);
        self.batch.ends.push(self.batch.bytes.len());
        let sample_id = self.num_samples;
        self.num_samples += 1;
        self.nbytes += record.len() as u64;
        if self.batch.bytes.len() >= BATCH_BYTES {
            self.send()?;
        }
        Ok(sample_id)
    }

    fn send(&mut self) -> Result<()> {
        let next = match self.recycled.get_mut() {
            Ok(recycled) => recycled.try_recv().ok(),
            Err(_) => None,
        }
        .unwrap_or_else(Chunk::with_capacity);
        let batch = std::mem::replace(&mut self.batch, next);
        let sent = match &self.tx {
            Some(tx) => tx.send(batch).is_ok(),
            None => false,
        };
        if sent {
            Ok(())
        } else {
            // The writer thread stopped early: its error says why.
            self.join().map(|_| ())
        }
    }

    fn join(&mut self) -> Result<CacheWriter> {
        self.tx = None;
        let thread = self
            .thread
            .take()
            .ok_or_else(|| Error::Internal("the cache writer already stopped".into()))?;
        match thread.join() {
            Ok(result) => result,
            Err(_) => Err(Error::Internal("the cache writer thread panicked".into())),
        }
    }

    /// Writes the queued records, then the index and the manifest.
    pub fn finish(mut self, info: ManifestInfo) -> Result<Manifest> {
        if !self.batch.ends.is_empty() {
            self.send()?;
        }
        self.join()?.finish(info)
    }

    /// Writes the queued records, then the part's index (see [`CacheWriter::finish_part`]).
    pub fn finish_part(mut self) -> Result<Part> {
        if !self.batch.ends.is_empty() {
            self.send()?;
        }
        self.join()?.finish_part()
    }
}

impl Drop for WriteBehind {
    fn drop(&mut self) {
        if self.thread.is_some() {
            let _ = self.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reader::CacheReader;
    use crate::writer::WriteOptions;

    #[test]
    fn records_arrive_in_order_across_batches() {
        let dir = tempfile::tempdir().unwrap();
        let writer = CacheWriter::create(dir.path(), WriteOptions::default()).unwrap();
        let mut wb = WriteBehind::spawn(writer).unwrap();
        let records: Vec<Vec<u8>> = (0..3000u32)
            .map(|i| vec![(i % 251) as u8; (i as usize * 97) % 9000])
            .collect();
        for (i, r) in records.iter().enumerate() {
            assert_eq!(wb.append(r).unwrap(), i as u64);
        }
        assert_eq!(wb.num_samples(), 3000);
        std::fs::write(dir.path().join(Manifest::metadata_file(1)), b"m").unwrap();
        let manifest = wb
            .finish(ManifestInfo {
                name: "wb".into(),
                cache_id: "000000000000".into(),
                serializer: "pickle".into(),
                metadata_version: 1,
                parts: Vec::new(),
                plan_digest: None,
            })
            .unwrap();
        assert_eq!(manifest.num_samples, 3000);
        let reader = CacheReader::open(dir.path()).unwrap();
        for (i, r) in records.iter().enumerate() {
            assert_eq!(reader.record_verified(i as u64).unwrap(), &r[..]);
        }
    }

    #[test]
    fn a_write_error_surfaces_to_the_caller() {
        let dir = tempfile::tempdir().unwrap();
        let writer = CacheWriter::create(dir.path(), WriteOptions::default()).unwrap();
        // Remove the shards directory under the writer: opening the first shard fails.
        std::fs::remove_dir_all(dir.path().join("shards")).unwrap();
        let mut wb = WriteBehind::spawn(writer).unwrap();
        let big = vec![0u8; BATCH_BYTES];
        let mut failed = None;
        for _ in 0..(MAX_BATCHES_IN_FLIGHT + 4) {
            if let Err(e) = wb.append(&big) {
                failed = Some(e);
                break;
            }
        }
        let err = failed.expect("the error reaches append");
        assert!(err.to_string().contains("shards"), "{err}");
    }
}
