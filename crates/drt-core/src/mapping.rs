//! This process's mappings of a cache's files (shards, indexes, plans and weight files),
//! shared by every reader of a file.
//!
//! One of the engine's three pieces of process-wide state (with [`crate::sigbus`]'s table
//! of guarded ranges and [`crate::fetch`]'s fetchers): a table of live mappings by file
//! identity, so that every reader of a file, in every loader and epoch of this process,
//! shares one mapping and its resident pages. A sparse pass faults in a page of the plan and
//! of the index for most draws; the next epoch, or the next loader over the same saved
//! version, finds them mapped. Entries are weak: a mapping goes when its last
//! reader or [`Span`] does.
//! A forked child inherits the table with the mappings, which stay valid there.

use std::collections::HashMap;
use std::ops::Deref;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::{Arc, Mutex, Weak};

use memmap2::Mmap;

use crate::error::{IoContext, Result};

/// A mapped file, shared by its readers and by every [`Span`] handed out of it: the mapping
/// lives as long as any of them. It is registered with [`crate::sigbus`] so that views of it
/// survive the file shrinking under them.
pub struct MappedFile {
    map: Mmap,
    slot: Option<usize>,
}

/// The files this process has mapped, by file identity (device, inode): every reader of a
/// file shares one mapping while any of them lives, so a loader's next epoch finds the pages
/// it touched still mapped instead of faulting them in again. A live mapping keeps its inode
/// allocated, so an identity found here cannot belong to another file.
static MAPPED: Mutex<Option<Mappings>> = Mutex::new(None);

/// Live mappings by (device, inode).
type Mappings = HashMap<(u64, u64), Weak<MappedFile>>;

impl MappedFile {
    fn new(map: Mmap) -> Self {
        let slot = crate::sigbus::register(map.as_ptr() as usize, map.len());
        Self { map, slot }
    }

    /// Maps `file` read-only, or shares this process's live mapping of it.
    pub fn open(file: &std::fs::File, path: &Path) -> Result<Arc<Self>> {
        let meta = file.metadata().at(path)?;
        let key = (meta.dev(), meta.ino());
        let mut mapped = MAPPED.lock().unwrap_or_else(|e| e.into_inner());
        let mapped = mapped.get_or_insert_with(HashMap::new);
        if let Some(live) = mapped.get(&key).and_then(Weak::upgrade) {
            if live.len() as u64 == meta.len() && !live.shrank() {
                return Ok(live);
            }
        }
        // SAFETY: a cache's files (and a loader's plan) are written once, before anyone
        // opens them, and never modified in place; callers check the size against the
        // manifest or the file's header, and every read is bounds-checked against the
        // mapping's length. A file truncated under its mapping reads as zeros there (see
        // `crate::sigbus`) instead of raising SIGBUS.
        let map = unsafe { Mmap::map(file) }.at(path)?;
        let live = Arc::new(Self::new(map));
        if mapped.len() >= 64 && mapped.len().is_power_of_two() {
            mapped.retain(|_, file| file.strong_count() > 0);
        }
        mapped.insert(key, Arc::downgrade(&live));
        Ok(live)
    }

    /// Whether the file's pages may be read outside guarded sections (it found a slot).
    pub fn viewable(&self) -> bool {
        self.slot.is_some()
    }

    /// Whether a view of the file found it shrunk (some pages read as zeros since).
    pub fn shrank(&self) -> bool {
        self.slot.is_some_and(crate::sigbus::shrank)
    }
}

impl Deref for MappedFile {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.map
    }
}

impl Drop for MappedFile {
    fn drop(&mut self) {
        // Before the mapping goes (its field is dropped after this).
        if let Some(slot) = self.slot {
            crate::sigbus::unregister(slot);
        }
    }
}

/// What a [`Span`] reads from.
#[derive(Clone)]
enum Backing {
    /// A mapped shard: the record as stored.
    Mapped(Arc<MappedFile>),
    /// A record decoded from a compressed shard into memory of its own.
    Decoded(Arc<crate::compress::Decoded>),
}

/// A record's bytes, keeping what holds them alive: its mapped shard, or for a compressed
/// cache its decoded copy.
#[derive(Clone)]
pub struct Span {
    backing: Backing,
    start: usize,
    end: usize,
}

impl Span {
    /// Bytes `start..end` of `file`, which the caller has checked lie inside it.
    pub(crate) fn new(file: Arc<MappedFile>, start: usize, end: usize) -> Self {
        debug_assert!(start <= end && end <= file.len());
        Self {
            backing: Backing::Mapped(file),
            start,
            end,
        }
    }

    /// All of a decoded record.
    pub(crate) fn decoded(record: crate::compress::Decoded) -> Self {
        let end = record.bytes().len();
        Self {
            backing: Backing::Decoded(Arc::new(record)),
            start: 0,
            end,
        }
    }

    /// The record's bytes.
    pub fn bytes(&self) -> &[u8] {
        match &self.backing {
            Backing::Mapped(file) => &file[self.start..self.end],
            Backing::Decoded(record) => &record.bytes()[self.start..self.end],
        }
    }

    /// Whether the bytes may be read outside guarded sections: always for a decoded record.
    pub fn viewable(&self) -> bool {
        match &self.backing {
            Backing::Mapped(file) => file.viewable(),
            Backing::Decoded(_) => true,
        }
    }

    /// Whether a view found the file shrunk: some of its pages read as zeros now. Never for a
    /// decoded record, whose bytes are its own.
    pub fn shrank(&self) -> bool {
        match &self.backing {
            Backing::Mapped(file) => file.shrank(),
            Backing::Decoded(_) => false,
        }
    }
}

impl std::fmt::Debug for Span {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Span")
            .field("start", &self.start)
            .field("end", &self.end)
            .finish()
    }
}

impl PartialEq for Span {
    fn eq(&self, other: &Self) -> bool {
        self.bytes() == other.bytes()
    }
}

impl Eq for Span {}

/// A hint to load the cache line of byte `at` of `map`, if it lies in it; loads that draws
/// will make anyway, issued early so that many are in flight at once.
#[inline]
pub(crate) fn prefetch_line(map: &[u8], at: usize) {
    #[cfg(target_arch = "x86_64")]
    if at < map.len() {
        // SAFETY: a prefetch reads nothing and cannot fault; the address lies in `map`.
        unsafe {
            std::arch::x86_64::_mm_prefetch(
                map.as_ptr().add(at).cast::<i8>(),
                std::arch::x86_64::_MM_HINT_T0,
            );
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (map, at);
}
