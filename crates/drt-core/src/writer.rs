//! Writing a cache: records into size-bounded, aligned payload shards, then the index and
//! the manifest.
//!
//! A [`CacheWriter`] writes into a build directory that nobody reads; the
//! [`Store`](crate::store::Store) publishes it under the cache's name only when it is complete.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::compress::{Codec, Compressor};
use crate::error::{Error, IoContext, Result};
use crate::format::{
    checksum_hex, shard_file, FileEntry, Manifest, Part, FORMAT_VERSION, INDEX_FILE, METADATA_DIR,
    MIN_OUT_OF_BAND, OOB_MAGIC, RECORD_ALIGN, SHARDS_DIR, SHARD_HEADER_LEN, SHARD_MAGIC,
    WRITE_BUFFER,
};
use crate::index::{HashingWriter, IndexBuilder, Location, MAX_RECORD_LEN};

/// How records are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteOptions {
    /// A shard is closed before a record would take it past this many bytes; a record larger
    /// than this gets a shard of its own.
    pub shard_size: u64,
    /// Every record starts at a multiple of this within its shard (a power of two, ≤ 4096).
    pub alignment: u64,
    /// How each record is compressed.
    pub compression: Codec,
}

impl WriteOptions {
    /// The options of a cache written in shards of `shard_size` bytes, records aligned to
    /// `alignment`, compressed with the codec named `compression` (`none`, `zstd`, `lz4`)
    /// at `level`.
    pub fn parse(
        shard_size: u64,
        alignment: u64,
        compression: &str,
        level: Option<i32>,
    ) -> Result<Self> {
        Ok(Self {
            shard_size,
            alignment,
            compression: Codec::parse(compression, level)?,
        })
    }
}

impl Default for WriteOptions {
    fn default() -> Self {
        Self {
            shard_size: 256 << 20,
            alignment: 16,
            compression: Codec::None,
        }
    }
}

impl WriteOptions {
    fn check(&self) -> Result<()> {
        if !self.alignment.is_power_of_two() || self.alignment > 4096 {
            crate::bail_arg!(
                "alignment must be a power of two up to 4096, got {}",
                self.alignment
            );
        }
        if self.shard_size < SHARD_HEADER_LEN + 1 {
            crate::bail_arg!(
                "shard_size must be more than {SHARD_HEADER_LEN} bytes, got {}",
                self.shard_size
            );
        }
        Ok(())
    }
}

/// Where in its shard a record starts: at a multiple of the cache's `alignment`, and of
/// [`RECORD_ALIGN`] for records with large out-of-band buffers, so that readers can view
/// their arrays in the mapped shard (aligned as a copy in a batch would be) instead of
/// copying them.
pub fn record_alignment(record: &[u8], alignment: u64) -> u64 {
    if record.len() >= MIN_OUT_OF_BAND && record.starts_with(OOB_MAGIC) {
        alignment.max(RECORD_ALIGN as u64)
    } else {
        alignment
    }
}

/// What the manifest records besides the layout.
#[derive(Debug, Clone)]
pub struct ManifestInfo {
    /// The cache's name.
    pub name: String,
    /// The build's unique id.
    pub cache_id: String,
    /// How records were serialized.
    pub serializer: String,
    /// The metadata version written into the build directory.
    pub metadata_version: u32,
    /// Parts other writers put in the build directory (paths relative to it), whose
    /// records follow this writer's.
    pub parts: Vec<Part>,
    /// The digest of the version's loader plan, as it was written (None: no plan).
    pub plan_digest: Option<u64>,
}

struct OpenShard {
    id: u32,
    path: PathBuf,
    out: HashingWriter<BufWriter<File>>,
    /// Bytes already handed to the kernel for writeback.
    flushed: u64,
}

/// Writeback is started after every this many bytes, so that the fsync when a shard is
/// closed waits for the last few megabytes only, not for the whole shard.
const WRITEBACK_BYTES: u64 = 16 << 20;

impl OpenShard {
    fn start_writeback(&mut self) -> Result<()> {
        let pos = self.out.position();
        if pos - self.flushed < WRITEBACK_BYTES {
            return Ok(());
        }
        self.out.flush().at(&self.path)?;
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            let fd = self.out.get_ref().get_ref().as_raw_fd();
            // SAFETY: `fd` is an open file owned by this shard; the call only asks the
            // kernel to start writing back the given range and touches no memory of ours.
            // Its result is advisory: a failure here resurfaces in the fsync at close.
            unsafe {
                libc::sync_file_range(
                    fd,
                    self.flushed as libc::off64_t,
                    (pos - self.flushed) as libc::off64_t,
                    libc::SYNC_FILE_RANGE_WRITE,
                );
            }
        }
        self.flushed = pos;
        Ok(())
    }
}

/// Appends records to a build directory.
pub struct CacheWriter {
    dir: PathBuf,
    opts: WriteOptions,
    shard: Option<OpenShard>,
    shards: Vec<FileEntry>,
    index: IndexBuilder,
    nbytes: u64,
    compressor: Compressor,
    /// Where compressed records are written, reused from record to record.
    compressed: Vec<u8>,
}

const ZEROS: [u8; 4096] = [0; 4096];

impl CacheWriter {
    /// Starts writing a cache into `dir`, an existing empty directory.
    pub fn create(dir: &Path, opts: WriteOptions) -> Result<Self> {
        let metadata = dir.join(METADATA_DIR);
        std::fs::create_dir_all(&metadata).at(&metadata)?;
        Self::create_part(dir, opts)
    }

    /// Starts writing a part (shards and an index, no metadata) into `dir`, an existing empty
    /// directory.
    pub fn create_part(dir: &Path, opts: WriteOptions) -> Result<Self> {
        opts.check()?;
        let shards = dir.join(SHARDS_DIR);
        std::fs::create_dir_all(&shards).at(&shards)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            opts,
            shard: None,
            shards: Vec::new(),
            index: IndexBuilder::default(),
            nbytes: 0,
            compressor: Compressor::new(opts.compression)?,
            compressed: Vec::new(),
        })
    }

    /// The build directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Number of records appended so far.
    pub fn num_samples(&self) -> u64 {
        self.index.len()
    }

    /// Payload bytes appended so far, as serialized (before compression; padding excluded).
    pub fn nbytes(&self) -> u64 {
        self.nbytes
    }

    /// Appends one record, compressed if the cache is; returns its sample id.
    pub fn append(&mut self, record: &[u8]) -> Result<u64> {
        let mut buffer = std::mem::take(&mut self.compressed);
        let stored = self.compressor.compress(record, &mut buffer)?;
        let sample_id = self.append_stored(stored)?;
        self.nbytes += record.len() as u64;
        self.compressed = buffer;
        Ok(sample_id)
    }

    /// Appends a record's bytes as they are to be stored.
    fn append_stored(&mut self, record: &[u8]) -> Result<u64> {
        let len = record.len() as u64;
        if len > MAX_RECORD_LEN {
            crate::bail_arg!(
                "record {} is {len} bytes as stored; a cache holds records of up to {} bytes \
                 (4 GiB) each",
                self.index.len(),
                MAX_RECORD_LEN
            );
        }
        let align = record_alignment(record, self.opts.alignment);
        let needs_new = match &self.shard {
            None => true,
            Some(s) => {
                let start = s.out.position().next_multiple_of(align);
                start > SHARD_HEADER_LEN && start + len > self.opts.shard_size
            }
        };
        if needs_new {
            self.close_shard()?;
            self.open_shard()?;
        }
        let Some(shard) = self.shard.as_mut() else {
            // INVARIANT: open_shard() above either set a shard or returned an error.
            unreachable!("a shard is open after open_shard")
        };
        let pos = shard.out.position();
        let pad = (pos.next_multiple_of(align) - pos) as usize;
        shard.out.write_all(&ZEROS[..pad]).at(&shard.path)?;
        let offset = shard.out.position();
        shard.out.write_all(record).at(&shard.path)?;
        shard.start_writeback()?;
        let sample_id = self.index.len();
        let location = Location {
            shard: shard.id,
            offset,
            length: len,
        };
        self.index
            .push(location, xxhash_rust::xxh3::xxh3_64(record))?;
        Ok(sample_id)
    }

    fn open_shard(&mut self) -> Result<()> {
        let id = u32::try_from(self.shards.len())
            .map_err(|_| Error::InvalidArgument("more than 2^32 shards".into()))?;
        let path = self.dir.join(shard_file(id));
        let file = File::create(&path).at(&path)?;
        let mut out = HashingWriter::new(BufWriter::with_capacity(WRITE_BUFFER, file));
        let mut header = [0u8; SHARD_HEADER_LEN as usize];
        header[..8].copy_from_slice(SHARD_MAGIC);
        header[8..16].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        out.write_all(&header).at(&path)?;
        self.shard = Some(OpenShard {
            id,
            path,
            out,
            flushed: 0,
        });
        Ok(())
    }

    fn close_shard(&mut self) -> Result<()> {
        let Some(shard) = self.shard.take() else {
            return Ok(());
        };
        let (size, digest, out) = shard.out.finish();
        let file = out
            .into_inner()
            .map_err(|e| e.into_error())
            .at(&shard.path)?;
        file.sync_all().at(&shard.path)?;
        self.shards.push(FileEntry {
            file: shard_file(shard.id),
            size,
            checksum: checksum_hex(digest),
        });
        Ok(())
    }

    /// Closes the last shard, writes the index and the manifest; returns the manifest.
    ///
    /// The metadata file named by `info.metadata_version` must already be in the build
    /// directory (and its loader plan, if it has one): the manifest is the last file
    /// written, and its presence is what makes the directory a cache.
    pub fn finish(mut self, info: ManifestInfo) -> Result<Manifest> {
        self.close_shard()?;
        let metadata = self
            .dir
            .join(Manifest::metadata_file(info.metadata_version));
        if !metadata.is_file() {
            return Err(Error::corrupt(
                &metadata,
                "the metadata table was not written before finishing the build",
            ));
        }
        let (_, metadata_digest) = crate::format::file_checksum(&metadata)?;
        let mut plan_checksums = std::collections::BTreeMap::new();
        if let Some(plan_digest) = info.plan_digest {
            plan_checksums.insert(info.metadata_version, checksum_hex(plan_digest));
        }
        let written = self.finish_part()?;
        let mut manifest = Manifest {
            format_version: FORMAT_VERSION,
            name: info.name,
            cache_id: info.cache_id,
            num_samples: written.num_samples,
            nbytes: written.nbytes,
            alignment: self.opts.alignment,
            serializer: info.serializer,
            compression: self.opts.compression.name().into(),
            compression_level: self.opts.compression.level(),
            created_at: crate::format::utc_now_iso(),
            shards: written.shards,
            index: written.index,
            parts: Vec::new(),
            metadata_version: info.metadata_version,
            metadata_versions: vec![info.metadata_version],
            metadata_checksums: [(info.metadata_version, checksum_hex(metadata_digest))].into(),
            plan_checksums,
        };
        for part in info.parts {
            manifest.add_part(part);
        }
        crate::format::sync_dir(&self.dir.join(METADATA_DIR))?;
        manifest.write(&self.dir)?;
        Ok(manifest)
    }

    /// Closes the last shard and writes the index, both flushed to disk; returns what was
    /// written, with paths relative to the writer's directory.
    pub fn finish_part(&mut self) -> Result<Part> {
        self.close_shard()?;
        let num_samples = self.index.len();
        let index_path = self.dir.join(INDEX_FILE);
        let (size, digest) = std::mem::take(&mut self.index).write(&index_path)?;
        crate::format::sync_dir(&self.dir.join(SHARDS_DIR))?;
        crate::format::sync_dir(&self.dir)?;
        Ok(Part {
            shards: std::mem::take(&mut self.shards),
            index: FileEntry {
                file: INDEX_FILE.into(),
                size,
                checksum: checksum_hex(digest),
            },
            num_samples,
            nbytes: self.nbytes,
        })
    }
}
