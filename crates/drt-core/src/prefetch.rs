//! Reading batches ahead of the consumer on a native thread.
//!
//! A [`Prefetcher`] owns one thread that reads the batches assigned to it, in order, into
//! a bounded queue of `depth` ready batches. A batch is one contiguous buffer holding its
//! records back to back plus their offsets, so it crosses into Python as a single object.
//! The consumer blocks only when the queue is empty; the thread blocks when it is full.
//!
//! Large records that the consumer will only view (arrays stored out of band) can instead
//! stay in their mapped shard: the batch then holds a [`Span`] of the shard for them, and
//! the reader thread only touches their pages, so that the consumer's single copy (stacking
//! them into the batch tensor) finds them mapped.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::error::{Error, Result};
use crate::mapping::Span;
use crate::plan::Plan;
use crate::program::{draw_each, row_at, Program, PREFETCH_AHEAD};
use crate::reader::CacheReader;
use crate::sampler::EpochRandom;
use crate::schedule::Schedule;

/// The records of one batch, back to back.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Batch {
    /// The batch's number among this rank's batches (counted from the schedule's cursor).
    pub number: u64,
    /// The records' bytes, each starting at an address that is a multiple of
    /// [`BATCH_ALIGN`] (zero padding between them).
    pub data: Vec<u8>,
    /// Record `i` is `data[starts[i]..ends[i]]`, unless it is `outside[i]`.
    pub starts: Vec<u64>,
    /// See `starts`.
    pub ends: Vec<u64>,
    /// Each record's cache (an index into the loader's list of caches).
    pub caches: Vec<u32>,
    /// Each record's sample id within its cache.
    pub sample_ids: Vec<u64>,
    /// Records left in their mapped shard (`starts[i] == ends[i]` for them); empty if none.
    pub outside: Vec<Option<Span>>,
    /// Where `data` goes back when the batch is dropped, for the next batch to reuse.
    pub recycle: Recycle,
}

impl Drop for Batch {
    fn drop(&mut self) {
        if let Some(recycler) = self.recycle.0.take() {
            recycler.put(std::mem::take(&mut self.data));
        }
    }
}

/// Buffers of dropped batches, kept for the next ones: a fresh multi-megabyte buffer per
/// batch costs a page fault per 4 KiB page on first touch, which is what bounds a reader
/// of large records.
#[derive(Debug, Default)]
pub struct Recycler {
    free: Mutex<Vec<Vec<u8>>>,
}

impl Recycler {
    /// Most buffers kept: enough for the prefetch queue and the batches being decoded.
    const KEEP: usize = 16;

    /// An empty buffer with room for at least `capacity` bytes: a recycled one if any fits.
    pub fn take(&self, capacity: usize) -> Vec<u8> {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        match free.iter().position(|b| b.capacity() >= capacity) {
            Some(i) => free.swap_remove(i),
            None => {
                drop(free);
                Vec::with_capacity(capacity)
            }
        }
    }

    fn put(&self, mut buffer: Vec<u8>) {
        buffer.clear();
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.len() < Self::KEEP && buffer.capacity() > 0 {
            free.push(buffer);
        }
    }
}

/// A batch's link to its [`Recycler`]; batches compare equal whatever their links.
#[derive(Debug, Default, Clone)]
pub struct Recycle(pub Option<Arc<Recycler>>);

impl PartialEq for Recycle {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for Recycle {}

/// Records start at addresses that are multiples of this within a batch's buffer, so that
/// arrays viewed in place there are aligned as they were in the shard.
pub const BATCH_ALIGN: usize = crate::format::RECORD_ALIGN;

impl Batch {
    /// Records `sample_ids` of `reader`, in order, as one batch: each copied (or for a
    /// compressed cache decoded) into the batch's buffer at an aligned address, or left in
    /// its mapped shard where `views` says so. A shard that shrank under the reads is an
    /// error, and the reader stops serving.
    pub fn of_records(
        reader: &CacheReader,
        sample_ids: &[u64],
        verify: bool,
        views: Option<&ViewRule>,
    ) -> Result<Batch> {
        let (result, faulted) = crate::sigbus::guarded(|| {
            let stored = sample_ids
                .iter()
                .map(|&id| stored_for_batch(reader, id, verify, views))
                .collect::<Result<Vec<_>>>()?;
            let mut batch = Batch::default();
            batch.caches = vec![0; sample_ids.len()];
            batch.sample_ids = sample_ids.to_vec();
            batch.gather(stored, views, Vec::with_capacity, |_, id, bytes, out| {
                reader.decode_into(id, bytes, out)
            })?;
            Ok(batch)
        });
        if faulted {
            reader.poison();
            return Err(reader.shrank());
        }
        result
    }

    /// Fills the batch with the records `stored` (one per record, in order, as
    /// [`CacheReader::stored_span`] gives them): those that `views` applies to stay in their
    /// shard (their pages touched now), the others are copied into a buffer from
    /// `buffer(capacity)`, or decoded into it by `decode(cache, sample_id, stored, out)`
    /// where the cache is compressed. Must run in a guarded section.
    fn gather(
        &mut self,
        stored: Vec<(Span, Option<usize>)>,
        views: Option<&ViewRule>,
        buffer: impl FnOnce(usize) -> Vec<u8>,
        mut decode: impl FnMut(u32, u64, &[u8], &mut [u8]) -> Result<()>,
    ) -> Result<()> {
        // Records still to decode go into the buffer, their one copy.
        let outside: Vec<bool> = stored
            .iter()
            .map(|(span, decoded)| decoded.is_none() && views.is_some_and(|r| r.applies(span)))
            .collect();
        for ((span, _), _) in stored.iter().zip(&outside).filter(|(_, &out)| out) {
            touch(span.bytes());
        }
        // Records left in place take no room in the buffer.
        let total: usize = stored
            .iter()
            .zip(&outside)
            .filter(|(_, &out)| !out)
            .map(|((span, decoded), _)| decoded.unwrap_or(span.bytes().len()))
            .sum();
        let room = total + (stored.len() + 1) * (BATCH_ALIGN - 1);
        self.data = buffer(room);
        // Room for every record and its worst-case padding, so the buffer never moves
        // while it is filled and the addresses computed from `base` stay true.
        self.data.reserve_exact(room);
        self.starts.reserve_exact(stored.len());
        self.ends.reserve_exact(stored.len());
        let base = self.data.as_ptr() as usize;
        for (i, ((span, decoded), &out)) in stored.iter().zip(&outside).enumerate() {
            let misalign = (base + self.data.len()) % BATCH_ALIGN;
            if misalign != 0 {
                self.data
                    .resize(self.data.len() + BATCH_ALIGN - misalign, 0);
            }
            let start = self.data.len();
            self.starts.push(start as u64);
            match (out, decoded) {
                (true, _) => {}
                (false, None) => self.data.extend_from_slice(span.bytes()),
                (false, &Some(len)) => {
                    self.data.resize(start + len, 0);
                    let (cache, id) = (self.caches[i], self.sample_ids[i]);
                    decode(cache, id, span.bytes(), &mut self.data[start..])?;
                }
            }
            self.ends.push(self.data.len() as u64);
        }
        debug_assert_eq!(self.data.as_ptr() as usize, base, "the batch buffer moved");
        if outside.iter().any(|&out| out) {
            self.outside = stored
                .into_iter()
                .zip(outside)
                .map(|((span, _), out)| out.then_some(span))
                .collect();
        }
        Ok(())
    }

    /// The bytes of record `i`. Those of a record left in its shard may be read outside a
    /// guarded section only because its file is registered with [`crate::sigbus`].
    pub fn record(&self, i: usize) -> &[u8] {
        match self.outside(i) {
            Some(span) => span.bytes(),
            None => &self.data[self.starts[i] as usize..self.ends[i] as usize],
        }
    }

    /// Record `i`'s span of its mapped shard, if it was left there.
    pub fn outside(&self, i: usize) -> Option<&Span> {
        self.outside.get(i).and_then(Option::as_ref)
    }

    /// The records' total length, padding excluded.
    pub fn payload_len(&self) -> u64 {
        let inside: u64 = self.starts.iter().zip(&self.ends).map(|(s, e)| e - s).sum();
        let outside: usize = self.outside.iter().flatten().map(|s| s.bytes().len()).sum();
        inside + outside as u64
    }

    /// Number of records.
    pub fn len(&self) -> usize {
        self.sample_ids.len()
    }

    /// Whether the batch has no records.
    pub fn is_empty(&self) -> bool {
        self.sample_ids.is_empty()
    }
}

/// Everything a reading thread needs: the plan, the caches, and which stream to read.
#[derive(Clone)]
pub struct Source {
    /// The loader's rows.
    pub plan: Arc<Plan>,
    /// The caches, indexed by the plan's cache codes.
    pub caches: Arc<Vec<CacheReader>>,
    /// The epoch's random bits.
    pub random: EpochRandom,
    /// The weights of each draw over the run, when they change with progress; `None`: the
    /// plan's own table for every draw.
    pub program: Option<Arc<Program>>,
    /// The global number of the epoch's first draw (`epoch * total`), where the program
    /// places this epoch.
    pub first_draw: u64,
    /// This rank's part of the epoch.
    pub schedule: Schedule,
    /// Check every record against its checksum.
    pub verify: bool,
    /// Buffers of dropped batches, reused by the next ones.
    pub recycler: Arc<Recycler>,
    /// Which records to leave in their mapped shard; `None`: copy every record.
    pub views: Option<Arc<ViewRule>>,
}

/// Records left in their mapped shard instead of copied into the batch: those at least
/// `min_len` bytes long that start with `prefix` at an address aligned to `align` bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ViewRule {
    /// The leading bytes of records to leave in place (the out-of-band record header).
    pub prefix: &'static [u8],
    /// The shortest record worth leaving in place.
    pub min_len: usize,
    /// Where a record left in place must start: a multiple of this many bytes.
    pub align: usize,
}

impl ViewRule {
    /// The rule of loaders over caches of the default serializer: records with out-of-band
    /// buffers of [`MIN_OUT_OF_BAND`](crate::format::MIN_OUT_OF_BAND) bytes or more, at a
    /// [`BATCH_ALIGN`]-aligned address (as a copy in the batch would be), which their arrays
    /// view.
    pub fn out_of_band() -> Self {
        Self {
            prefix: crate::format::OOB_MAGIC,
            min_len: crate::format::MIN_OUT_OF_BAND,
            align: BATCH_ALIGN,
        }
    }

    /// Every record stored as it is, wherever it starts: the rule of loaders whose decoders
    /// take each record as `bytes`, a copy they make anyway. Copying it into the batch first
    /// would be a second copy, on the reading thread, which bounds raw reads of small records.
    pub fn every_record() -> Self {
        Self {
            prefix: b"",
            min_len: 0,
            align: 1,
        }
    }

    /// Whether the record at `span` is left in place.
    pub fn applies(&self, span: &Span) -> bool {
        let bytes = span.bytes();
        span.viewable()
            && (bytes.as_ptr() as usize).is_multiple_of(self.align)
            && bytes.len() >= self.min_len
            && bytes.starts_with(self.prefix)
    }

    /// Whether a compressed record that decodes to `len` bytes gets memory of its own (and
    /// the rule applied to it), instead of being decoded into the batch's buffer: when it is
    /// long enough for arrays to view it, which may outlive the batch. Never under
    /// [`every_record`](Self::every_record), whose consumers copy every record.
    fn own_memory(&self, len: usize) -> bool {
        self.min_len > 0 && len >= self.min_len
    }
}

/// Record `sample_id` of `reader` as [`Batch::gather`] takes it: its stored bytes, with the
/// length they decode to for a compressed cache (decoded into the batch's buffer, no memory
/// of its own between). A compressed record long enough for `views` is decoded into memory
/// of its own now instead, as before batches decoded in place: arrays left viewing it keep
/// that record alive, not the whole batch's buffer.
fn stored_for_batch(
    reader: &CacheReader,
    sample_id: u64,
    verify: bool,
    views: Option<&ViewRule>,
) -> Result<(Span, Option<usize>)> {
    let (span, decoded) = reader.stored_span(sample_id, verify)?;
    match (decoded, views) {
        (Some(len), Some(rule)) if rule.own_memory(len) => {
            Ok((reader.decoded(sample_id, span.bytes())?, None))
        }
        _ => Ok((span, decoded)),
    }
}

/// Reads one byte of every page of `bytes`: the kernel maps the pages (and reads them from
/// disk if needed) here, on the reader thread, instead of when the consumer copies them.
fn touch(bytes: &[u8]) {
    const PAGE: usize = 4096;
    let mut sum = 0u8;
    for offset in (0..bytes.len()).step_by(PAGE) {
        sum ^= std::hint::black_box(bytes[offset]);
    }
    if let Some(&last) = bytes.last() {
        sum ^= std::hint::black_box(last);
    }
    std::hint::black_box(sum);
}

/// What a loader's reading needs besides its plan and caches.
#[derive(Debug, Clone, Copy)]
pub struct SourceOptions {
    /// The loader's seed.
    pub seed: u64,
    /// The epoch to read.
    pub epoch: u64,
    /// Check every record against its checksum.
    pub verify: bool,
    /// Leave records with large out-of-band buffers in their shard
    /// ([`ViewRule::out_of_band`]), for decoders that view them; otherwise every record
    /// stored as it is ([`ViewRule::every_record`]), for decoders that copy each into `bytes`.
    pub views: bool,
}

impl Source {
    /// Opens a loader's plan and caches for reading this rank's part of an epoch. Each cache
    /// must still be the build the loader was made from: `cache_ids[i]` for `cache_dirs[i]`.
    pub fn open(
        plan: &Path,
        cache_dirs: &[PathBuf],
        cache_ids: &[String],
        schedule: Schedule,
        options: SourceOptions,
    ) -> Result<Self> {
        let plan = Plan::open(plan)?;
        let mut caches = Vec::with_capacity(cache_dirs.len());
        for (dir, expected) in cache_dirs.iter().zip(cache_ids) {
            let reader = CacheReader::open(dir)?;
            let found = &reader.manifest().cache_id;
            if found != expected {
                return Err(Error::Rebuilt {
                    name: reader.manifest().name.clone(),
                    expected: expected.clone(),
                    found: found.clone(),
                });
            }
            caches.push(reader);
        }
        Ok(Self {
            plan: Arc::new(plan),
            caches: Arc::new(caches),
            random: EpochRandom::new(options.seed, options.epoch),
            program: None,
            first_draw: options.epoch.saturating_mul(schedule.total),
            schedule,
            verify: options.verify,
            recycler: Arc::default(),
            views: Some(Arc::new(if options.views {
                ViewRule::out_of_band()
            } else {
                ViewRule::every_record()
            })),
        })
    }

    /// The shards this rank's batches read, in the order they are first needed, each once:
    /// `(cache, file, batch)`, with `file` relative to cache `cache`'s directory and `batch`
    /// the first batch reading it. Reads the plan and the indexes only, so it serves to
    /// fetch a remote cache's shards ahead of the batches that read them.
    pub fn shards_in_order(&self) -> Result<Vec<(u32, String, u64)>> {
        let mut seen = std::collections::HashSet::new();
        let mut order = Vec::new();
        for number in 0..self.schedule.num_batches() {
            for position in self.schedule.batch_positions(number) {
                let (cache, sample_id) = self.draw(position);
                let file = self.reader(cache)?.shard_file(sample_id)?;
                if seen.insert((cache, file)) {
                    order.push((cache, file.to_string(), number));
                }
            }
        }
        Ok(order)
    }

    /// Draws from `program` instead of the plan's own table; its tables must draw from the
    /// plan's rows.
    pub fn with_program(mut self, program: Arc<Program>) -> Result<Self> {
        if program.rows() != self.plan.rows() {
            crate::bail_arg!(
                "the sampling program draws from {} rows but the plan has {}",
                program.rows(),
                self.plan.rows()
            );
        }
        self.program = Some(program);
        Ok(self)
    }

    /// The (cache, sample id) drawn at `position` of the epoch.
    fn draw(&self, position: u64) -> (u32, u64) {
        self.plan.sample(self.row(position))
    }

    /// The plan row drawn at `position` of the epoch.
    pub(crate) fn row(&self, position: u64) -> u64 {
        row_at(
            &self.plan,
            self.program.as_deref(),
            self.random,
            self.first_draw,
            self.schedule.total,
            position,
        )
        .0
    }

    /// Whether every record of `reader` stays in its shard for the consumer to copy (the
    /// [`ViewRule::every_record`] rule over an uncompressed cache): this thread never reads
    /// their bytes then, and loading them into its core's cache measured slower for the
    /// consumer's copy on the other core, not faster.
    fn leaves_every_record(&self, reader: &CacheReader) -> bool {
        self.views.as_deref().is_some_and(|rule| rule.min_len == 0) && reader.codec().is_none()
    }

    /// The reader of cache `cache` of the plan.
    pub(crate) fn reader(&self, cache: u32) -> Result<&CacheReader> {
        self.caches
            .get(cache as usize)
            .ok_or_else(|| Error::Internal(format!("cache code {cache} has no open cache")))
    }

    /// Reads batch `number` of the schedule. A mapped file that shrank meanwhile (SIGBUS)
    /// is an error, and the caches stop serving reads.
    pub fn read(&self, number: u64) -> Result<Batch> {
        self.guarded(|| self.read_mapped(number))
    }

    /// Runs `f`, which reads the caches' mapped files. A mapped file that shrank meanwhile
    /// (SIGBUS) is an error, and the caches stop serving reads.
    pub(crate) fn guarded<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let (result, faulted) = crate::sigbus::guarded(f);
        if faulted {
            for reader in self.caches.iter() {
                reader.poison();
            }
            return Err(self.caches.first().map_or_else(
                || Error::Internal("a mapped file shrank, but the source has no caches".into()),
                CacheReader::shrank,
            ));
        }
        result
    }

    fn read_mapped(&self, number: u64) -> Result<Batch> {
        let mut batch = Batch::default();
        batch.number = number;
        let positions: Vec<u64> = self.schedule.batch_positions(number).collect();
        let mut rows = vec![0; positions.len()];
        draw_each(
            &self.plan,
            self.program.as_deref(),
            self.random,
            (self.first_draw, self.schedule.total),
            &positions,
            |i, (row, _)| rows[i] = row,
        );
        for i in 0..rows.len() {
            if let Some(&ahead) = rows.get(i + PREFETCH_AHEAD) {
                self.plan.prefetch_sample(ahead);
            }
            let (cache, sample_id) = self.plan.sample(rows[i]);
            batch.caches.push(cache);
            batch.sample_ids.push(sample_id);
        }
        let mut stored = Vec::with_capacity(batch.len());
        for (i, (&cache, &sample_id)) in batch.caches.iter().zip(&batch.sample_ids).enumerate() {
            // Each record's index entry is asked for PREFETCH_AHEAD records before its read,
            // and its first bytes half as many before, once the entry is at hand: the misses
            // of a sparse pass overlap instead of following one another.
            let ahead = |k: usize| batch.caches.get(i + k).zip(batch.sample_ids.get(i + k));
            if let Some((&cache, &sample_id)) = ahead(PREFETCH_AHEAD) {
                if let Ok(reader) = self.reader(cache) {
                    reader.prefetch_location(sample_id);
                }
            }
            if let Some((&cache, &sample_id)) = ahead(PREFETCH_AHEAD / 2) {
                if let Ok(reader) = self.reader(cache) {
                    if !self.leaves_every_record(reader) {
                        reader.prefetch_record(sample_id);
                    }
                }
            }
            let reader = self.reader(cache)?;
            stored.push(stored_for_batch(
                reader,
                sample_id,
                self.verify,
                self.views.as_deref(),
            )?);
        }
        batch.recycle = Recycle(Some(self.recycler.clone()));
        batch.gather(
            stored,
            self.views.as_deref(),
            |capacity| self.recycler.take(capacity),
            |cache, sample_id, bytes, out| self.reader(cache)?.decode_into(sample_id, bytes, out),
        )?;
        Ok(batch)
    }
}

/// Reads a sequence of batches on a native thread, `depth` batches ahead.
pub struct Prefetcher {
    rx: Mutex<Receiver<Result<Batch>>>,
    /// Batches read and waiting in the queue.
    ready: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Prefetcher {
    /// Starts reading `numbers` (batch numbers of `source.schedule`, in the order they will
    /// be consumed).
    pub fn start(
        source: Source,
        numbers: impl Iterator<Item = u64> + Send + 'static,
        depth: usize,
    ) -> Result<Self> {
        let (tx, rx) = sync_channel(depth.max(1));
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let ready = Arc::new(AtomicUsize::new(0));
        let queued = ready.clone();
        let thread = std::thread::Builder::new()
            .name("drt-prefetch".into())
            .spawn(move || {
                for number in numbers {
                    if stopping.load(Ordering::Relaxed) {
                        return;
                    }
                    // A panic while reading must reach the consumer as an error, never
                    // abort the process or leave it waiting.
                    let result = catch_unwind(AssertUnwindSafe(|| source.read(number)))
                        .unwrap_or_else(|_| {
                            Err(Error::Internal(format!("reading batch {number} panicked")))
                        });
                    let failed = result.is_err();
                    // Counted before sending, so that the consumer never sees it below 0.
                    queued.fetch_add(1, Ordering::Relaxed);
                    if tx.send(result).is_err() || failed {
                        return;
                    }
                }
            })
            .map_err(|source| Error::System {
                what: "cannot start the prefetch thread".into(),
                source,
            })?;
        Ok(Self {
            rx: Mutex::new(rx),
            ready,
            stop,
            thread: Some(thread),
        })
    }

    /// The next batch, waiting for it if needed; `None` once all were read.
    pub fn next(&self) -> Option<Result<Batch>> {
        let rx = self
            .rx
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let next = rx.recv().ok();
        if next.is_some() {
            self.ready.fetch_sub(1, Ordering::Relaxed);
        }
        next
    }

    /// Batches already read and waiting: 0 means the consumer's next call will wait.
    pub fn ready(&self) -> usize {
        self.ready.load(Ordering::Relaxed)
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Empty the queue so that a thread blocked on a full queue can see the stop flag.
        if let Ok(rx) = self.rx.get_mut() {
            while rx.try_recv().is_ok() {}
        }
        let (tx, rx) = sync_channel(0);
        drop(tx);
        if let Ok(old) = self.rx.get_mut() {
            drop(std::mem::replace(old, rx));
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compress::Codec;
    use crate::format::Manifest;
    use crate::writer::{CacheWriter, ManifestInfo, WriteOptions};

    fn cache(dir: &std::path::Path, n: u64) -> CacheReader {
        let mut w = CacheWriter::create(dir, WriteOptions::default()).unwrap();
        for i in 0..n {
            w.append(format!("record-{i}").as_bytes()).unwrap();
        }
        std::fs::write(dir.join(Manifest::metadata_file(1)), b"m").unwrap();
        w.finish(ManifestInfo {
            name: "p".into(),
            cache_id: "000000000000".into(),
            serializer: "pickle".into(),
            metadata_version: 1,
            parts: Vec::new(),
            plan_digest: None,
        })
        .unwrap();
        CacheReader::open(dir).unwrap()
    }

    fn source(dir: &std::path::Path, weighted: bool, batch: u64) -> Source {
        let reader = cache(&dir.join("c"), 20);
        let ids: Vec<u64> = (0..20).rev().collect();
        let weights = [1.0; 20];
        let plan_path = dir.join("plan");
        Plan::write(
            &plan_path,
            &ids,
            None,
            weighted.then_some(&weights[..]),
            None,
        )
        .unwrap();
        Source {
            plan: Arc::new(Plan::open(&plan_path).unwrap()),
            caches: Arc::new(vec![reader]),
            random: EpochRandom::new(0, 0),
            program: None,
            first_draw: 0,
            schedule: Schedule::new(20, 0, (0, 1), (batch, false)).unwrap(),
            verify: true,
            recycler: Arc::default(),
            views: None,
        }
    }

    fn records(batch: &Batch) -> Vec<String> {
        (0..batch.len())
            .map(|i| {
                let record = batch.record(i);
                let address = record.as_ptr() as usize;
                assert_eq!(address % BATCH_ALIGN, 0, "record {i} is not aligned");
                String::from_utf8(record.to_vec()).unwrap()
            })
            .collect()
    }

    #[test]
    fn batches_hold_the_scheduled_records_in_order() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("c")).unwrap();
        let src = source(dir.path(), false, 8);
        let pre = Prefetcher::start(src, 0..3, 2).unwrap();
        let mut got = Vec::new();
        while let Some(batch) = pre.next() {
            got.extend(records(&batch.unwrap()));
        }
        let expected: Vec<String> = (0..20).rev().map(|i| format!("record-{i}")).collect();
        assert_eq!(got, expected);
    }

    #[test]
    fn records_matching_the_view_rule_stay_in_their_shard() {
        let dir = tempfile::tempdir().unwrap();
        let records: Vec<Vec<u8>> = (0..12u8)
            .map(|i| match i % 3 {
                0 => [b"VIEW".as_slice(), &vec![i; 10_000]].concat(), // left in place
                1 => [b"VIEW".as_slice(), &[i; 10]].concat(),         // too short
                _ => vec![i; 10_000],                                 // no prefix
            })
            .collect();
        let opts = WriteOptions {
            shard_size: 256 << 20,
            alignment: 64,
            ..WriteOptions::default()
        };
        crate::reader::tests::build(dir.path(), &records, opts);
        let ids: Vec<u64> = (0..12).collect();
        let plan_path = dir.path().join("plan");
        Plan::write(&plan_path, &ids, None, None, None).unwrap();
        let src = Source {
            plan: Arc::new(Plan::open(&plan_path).unwrap()),
            caches: Arc::new(vec![CacheReader::open(dir.path()).unwrap()]),
            random: EpochRandom::new(0, 0),
            program: None,
            first_draw: 0,
            schedule: Schedule::new(12, 0, (0, 1), (12, false)).unwrap(),
            verify: true,
            recycler: Arc::default(),
            views: Some(Arc::new(ViewRule {
                prefix: b"VIEW",
                min_len: 1000,
                align: BATCH_ALIGN,
            })),
        };
        let batch = src.read(0).unwrap();
        let total: usize = records.iter().map(Vec::len).sum();
        assert_eq!(batch.payload_len(), total as u64);
        for (i, record) in records.iter().enumerate() {
            assert_eq!(batch.record(i), &record[..], "record {i}");
            assert_eq!(batch.outside(i).is_some(), i % 3 == 0, "record {i}");
            assert_eq!(batch.record(i).as_ptr() as usize % BATCH_ALIGN, 0);
        }
        // Only the records copied into the batch take room in its buffer.
        assert!(batch.data.len() < 5 * 10_000 + 4 * 14 + 13 * BATCH_ALIGN);
        // A span keeps its mapping alive after the reader and the source are gone.
        let span = batch.outside(3).unwrap().clone();
        drop((batch, src));
        assert_eq!(span.bytes(), &records[3][..]);
    }

    /// `records` written as a cache into `dir` with `compression`, open.
    fn cache_of(dir: &Path, records: &[Vec<u8>], compression: Codec) -> CacheReader {
        let opts = WriteOptions {
            compression,
            ..WriteOptions::default()
        };
        crate::reader::tests::build(dir, records, opts);
        CacheReader::open(dir).unwrap()
    }

    /// Checks that `batch` holds records `ids` of `records`, in order.
    fn assert_holds(batch: &Batch, ids: &[u64], records: &[Vec<u8>], what: &str) {
        for (i, &id) in ids.iter().enumerate() {
            assert_eq!(batch.record(i), &records[id as usize][..], "{what} {i}");
        }
        let total: usize = ids.iter().map(|&id| records[id as usize].len()).sum();
        assert_eq!(batch.payload_len(), total as u64, "{what}");
    }

    /// Changes one byte of the stored bytes of record `sample_id` of the cache in `dir`, at
    /// `at(len)` of its `len` stored bytes.
    fn damage(dir: &Path, reader: CacheReader, sample_id: u64, at: impl Fn(usize) -> usize) {
        let stored = reader.record(sample_id).unwrap().to_vec();
        drop(reader);
        let shard = dir.join("shards/00000.bin");
        let mut bytes = std::fs::read(&shard).unwrap();
        let start = bytes
            .windows(stored.len())
            .position(|w| w == stored)
            .unwrap();
        let i = start + at(stored.len());
        bytes[i] = bytes[i].wrapping_add(1);
        std::fs::write(&shard, &bytes).unwrap();
    }

    #[test]
    fn compressed_records_are_decoded_into_the_batch_and_damage_is_named() {
        // Records with the view prefix, short and long: a long one is decoded into memory of
        // its own and left out of the buffer, a short one decoded into it.
        let records: Vec<Vec<u8>> = (0..9u8)
            .map(|i| {
                [
                    b"VIEW".as_slice(),
                    &vec![i; 100 + 3000 * usize::from(i % 3)],
                ]
                .concat()
            })
            .collect();
        let rule = ViewRule {
            prefix: b"VIEW",
            min_len: 1000,
            align: BATCH_ALIGN,
        };
        for compression in [Codec::Zstd { level: 3 }, Codec::Lz4] {
            let dir = tempfile::tempdir().unwrap();
            let reader = cache_of(dir.path(), &records, compression);
            let ids: Vec<u64> = vec![8, 0, 4, 4, 1];
            let batch = Batch::of_records(&reader, &ids, true, Some(&rule)).unwrap();
            let what = format!("{compression:?}");
            assert_holds(&batch, &ids, &records, &what);
            for (i, &id) in ids.iter().enumerate() {
                assert_eq!(batch.record(i).as_ptr() as usize % BATCH_ALIGN, 0);
                assert_eq!(batch.outside(i).is_some(), id % 3 != 0, "{what} {i}");
            }
            drop(batch);
            // Record 4's header says it decodes to one byte more than it does.
            damage(dir.path(), reader, 4, |_| 0);
            let reader = CacheReader::open(dir.path()).unwrap();
            let err = Batch::of_records(&reader, &[0, 4], false, None).unwrap_err();
            let text = err.to_string();
            assert!(
                text.contains("sample_id 4") && text.contains("00000.bin"),
                "{text}"
            );
            assert!(matches!(err, Error::Corrupt { .. }), "{err:?}");
            let fine = Batch::of_records(&reader, &[0, 5], false, None).unwrap();
            assert_holds(&fine, &[0, 5], &records, &what);
        }
    }

    #[test]
    fn compressed_batches_name_damage_and_stop_at_a_truncated_shard() {
        let dir = tempfile::tempdir().unwrap();
        // 24 records of 64 KiB, in one shard.
        let records: Vec<Vec<u8>> = (0..24u32)
            .map(|i| (0..65_536u32).map(|j| (j / (i + 1) % 251) as u8).collect())
            .collect();
        let reader = cache_of(dir.path(), &records, Codec::Zstd { level: 3 });
        let ids: Vec<u64> = (0..24).rev().chain([3, 3, 20]).collect();
        let batch = Batch::of_records(&reader, &ids, true, None).unwrap();
        assert_holds(&batch, &ids, &records, "zstd");
        drop(batch);
        // One damaged record among them fails the batch, named.
        damage(dir.path(), reader, 2, |len| len - 3);
        let reader = CacheReader::open(dir.path()).unwrap();
        let err = Batch::of_records(&reader, &ids, false, None).unwrap_err();
        assert!(err.to_string().contains("sample_id 2"), "{err}");
        // A shard truncated under the mapping: an error, and the reader stops serving.
        let healthy: Vec<u64> = (3..24).collect();
        Batch::of_records(&reader, &healthy, false, None).unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(dir.path().join("shards/00000.bin"))
            .unwrap()
            .set_len(4096)
            .unwrap();
        let err = Batch::of_records(&reader, &healthy, false, None).unwrap_err();
        assert!(err.to_string().contains("shrank"), "{err}");
        let err = Batch::of_records(&reader, &[0], false, None).unwrap_err();
        assert!(err.to_string().contains("shrank"), "{err}");
    }

    #[test]
    fn under_the_every_record_rule_stored_records_stay_in_place_and_compressed_ones_decode_in() {
        let records: Vec<Vec<u8>> = (0..10u8)
            .map(|i| vec![i; 37 + 500 * usize::from(i)])
            .collect();
        for compression in [Codec::None, Codec::Lz4] {
            let dir = tempfile::tempdir().unwrap();
            let reader = cache_of(dir.path(), &records, compression);
            let ids: Vec<u64> = vec![9, 1, 1, 0, 5];
            let rule = ViewRule::every_record();
            let batch = Batch::of_records(&reader, &ids, true, Some(&rule)).unwrap();
            assert_holds(&batch, &ids, &records, &format!("{compression:?}"));
            for i in 0..ids.len() {
                // Left in the shard when stored as they are: nothing copied into the buffer.
                assert_eq!(batch.outside(i).is_some(), compression.is_none());
            }
            // At most alignment padding in the buffer when every record stayed in place.
            assert_eq!(batch.data.len() < BATCH_ALIGN, compression.is_none());
        }
    }

    #[test]
    fn dropping_a_prefetcher_mid_stream_stops_its_thread() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("c")).unwrap();
        let src = source(dir.path(), true, 1);
        let pre = Prefetcher::start(src, 0..u64::MAX, 1).unwrap();
        assert!(pre.next().is_some());
        drop(pre); // must return: the thread is blocked on a full queue
    }

    #[test]
    fn a_read_error_ends_the_stream_with_that_error() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("c")).unwrap();
        let mut src = source(dir.path(), false, 4);
        src.caches = Arc::new(Vec::new());
        let pre = Prefetcher::start(src, 0..5, 2).unwrap();
        let err = pre.next().unwrap().unwrap_err();
        assert!(err.to_string().contains("cache code 0"), "{err}");
        assert!(pre.next().is_none());
    }
}
