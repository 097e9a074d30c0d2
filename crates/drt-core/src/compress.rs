//! Per-record compression.
//!
//! A cache is compressed or not as a whole, decided at build time and recorded in the
//! manifest (`compression`, and `compression_level` for zstd). Each record is compressed on
//! its own, so that a reader decodes exactly the records it draws. A compressed record is
//! stored as its uncompressed length (8 bytes, little-endian) followed by the codec's block;
//! the index's length and checksum are those of the stored bytes, so `verify` checks a
//! compressed cache without decoding it.
//!
//! Decoded records live in a [`Decoded`] buffer, 64-byte aligned like a record in a shard, so
//! that arrays decoded from it are as aligned as when they were written.

use std::cell::RefCell;

use crate::error::{Error, Result};

/// Where a decoded record starts: at a multiple of this many bytes, the alignment of a
/// record with out-of-band arrays in a shard (the format checks that the two agree).
pub const DECODED_ALIGN: usize = 64;

/// Bytes before a compressed record's block: its uncompressed length.
pub const HEADER_LEN: usize = 8;
/// The zstd level used when none is given: zstd's own default.
pub const ZSTD_DEFAULT_LEVEL: i32 = 3;
/// The largest uncompressed record accepted when reading: a length beyond this in a record's
/// header means the header is damaged.
const MAX_DECODED_LEN: u64 = 1 << 40;
/// An lz4 block decodes to at most about 255 times its length.
const LZ4_MAX_RATIO: u64 = 256;

/// How a cache's records are compressed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Codec {
    /// Stored as they were serialized; read in place from the mapped shard.
    #[default]
    None,
    /// Zstandard at a level from 1 (fastest) to 22 (smallest), or negative for faster still.
    Zstd {
        /// The compression level (used when writing only).
        level: i32,
    },
    /// LZ4 (block format): the fastest to decode, a lower ratio than zstd.
    Lz4,
}

impl Codec {
    /// The codec named `name` (`none`, `zstd` or `lz4`), with a `level` for zstd only.
    pub fn parse(name: &str, level: Option<i32>) -> Result<Codec> {
        let codec = match name {
            "none" => Codec::None,
            "zstd" => {
                let level = level.unwrap_or(ZSTD_DEFAULT_LEVEL);
                let range = zstd::compression_level_range();
                if !range.contains(&level) || level == 0 {
                    crate::bail_arg!(
                        "zstd level must be from {} to {} and not 0, got {level}",
                        range.start(),
                        range.end()
                    );
                }
                return Ok(Codec::Zstd { level });
            }
            "lz4" => Codec::Lz4,
            other => {
                crate::bail_arg!("unknown compression {other:?}; choose \"zstd\", \"lz4\" or none")
            }
        };
        if let Some(level) = level {
            crate::bail_arg!("compression {name:?} takes no level, got {level}");
        }
        Ok(codec)
    }

    /// The name the manifest records.
    pub fn name(&self) -> &'static str {
        match self {
            Codec::None => "none",
            Codec::Zstd { .. } => "zstd",
            Codec::Lz4 => "lz4",
        }
    }

    /// The level the manifest records (zstd only).
    pub fn level(&self) -> Option<i32> {
        match self {
            Codec::Zstd { level } => Some(*level),
            _ => None,
        }
    }

    /// Whether records are stored as they were serialized.
    pub fn is_none(&self) -> bool {
        *self == Codec::None
    }

    /// Decodes a stored record into memory of its own: `Err` says what is wrong with it
    /// (the caller names the file and the sample). Must not be called for [`Codec::None`].
    pub fn decompress(&self, stored: &[u8]) -> std::result::Result<Decoded, String> {
        let mut decoded = Decoded::zeroed(self.decoded_len(stored)?)?;
        self.decode_into(stored, decoded.bytes_mut())?;
        Ok(decoded)
    }

    /// A stored record's decoded length, from its header: checked against what its codec
    /// block can hold, so that a damaged header never makes a reader allocate more than the
    /// record could decode to. Must not be called for [`Codec::None`].
    pub fn decoded_len(&self, stored: &[u8]) -> std::result::Result<usize, String> {
        let Some((header, block)) = stored.split_first_chunk::<HEADER_LEN>() else {
            return Err(format!(
                "a compressed record of {} bytes is shorter than its header",
                stored.len()
            ));
        };
        let len = u64::from_le_bytes(*header);
        if len > MAX_DECODED_LEN {
            return Err(format!(
                "its header records an implausible length of {len} bytes"
            ));
        }
        match self {
            Codec::None => return Err("the cache is not compressed".into()),
            Codec::Zstd { .. } => {
                let framed = zstd::zstd_safe::get_frame_content_size(block)
                    .ok()
                    .flatten();
                if framed != Some(len) {
                    let framed = framed.map_or_else(|| "records none".into(), |n| n.to_string());
                    return Err(format!(
                        "its header records {len} bytes, its zstd frame {framed}"
                    ));
                }
            }
            Codec::Lz4 if len > (block.len() as u64).saturating_mul(LZ4_MAX_RATIO) => {
                return Err(format!(
                    "its header records {len} bytes, more than its lz4 block of {} can hold",
                    block.len()
                ));
            }
            Codec::Lz4 => {}
        }
        usize::try_from(len).map_err(|_| format!("{len} bytes do not fit in memory"))
    }

    /// Decodes the stored record `stored` into `out`, as long as
    /// [`decoded_len`](Self::decoded_len) of it (which checked its header): a reader decodes
    /// straight into the place the record goes (a batch's buffer), with no buffer of the
    /// record's own between.
    pub fn decode_into(&self, stored: &[u8], out: &mut [u8]) -> std::result::Result<(), String> {
        let len = out.len();
        let block = stored.get(HEADER_LEN..).unwrap_or_default();
        let written = match self {
            Codec::None => return Err("the cache is not compressed".into()),
            Codec::Zstd { .. } => DECOMPRESSOR
                .with(|slot| {
                    let mut slot = slot.borrow_mut();
                    if slot.is_none() {
                        *slot = Some(zstd::bulk::Decompressor::new()?);
                    }
                    let Some(decompressor) = slot.as_mut() else {
                        unreachable!("the context was made above")
                    };
                    decompressor.decompress_to_buffer(block, out)
                })
                .map_err(|e| e.to_string()),
            Codec::Lz4 => {
                let size =
                    i32::try_from(len).map_err(|_| format!("{len} bytes is too long for lz4"))?;
                lz4::block::decompress_to_buffer(block, Some(size), out).map_err(|e| e.to_string())
            }
        }
        .map_err(|e| format!("cannot decompress it ({}): {e}", self.name()))?;
        if written != len {
            return Err(format!(
                "it decompresses to {written} bytes, but its header records {len}"
            ));
        }
        Ok(())
    }
}

thread_local! {
    /// Each reading thread's zstd context, made on its first compressed record.
    static DECOMPRESSOR: RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { RefCell::new(None) };
}

/// Compresses records for a writer, reusing its context and output buffer.
pub struct Compressor {
    codec: Codec,
    zstd: Option<zstd::bulk::Compressor<'static>>,
}

impl Compressor {
    /// A compressor for `codec`.
    pub fn new(codec: Codec) -> Result<Self> {
        let zstd = match codec {
            Codec::Zstd { level } => Some(
                zstd::bulk::Compressor::new(level)
                    .map_err(|e| Error::InvalidArgument(format!("zstd level {level}: {e}")))?,
            ),
            _ => None,
        };
        Ok(Self { codec, zstd })
    }

    /// The codec.
    pub fn codec(&self) -> Codec {
        self.codec
    }

    /// `raw` as stored: itself, or its header and compressed block written into `out` (a
    /// buffer reused from record to record).
    pub fn compress<'a>(&mut self, raw: &'a [u8], out: &'a mut Vec<u8>) -> Result<&'a [u8]> {
        let bound = match self.codec {
            Codec::None => return Ok(raw),
            Codec::Zstd { .. } => zstd::zstd_safe::compress_bound(raw.len()),
            Codec::Lz4 => {
                lz4::block::compress_bound(raw.len()).map_err(|_| too_long(raw, "lz4"))?
            }
        };
        // Grown, never shrunk: its bytes are zeroed once and overwritten from then on.
        if out.len() < HEADER_LEN + bound {
            out.resize(HEADER_LEN + bound, 0);
        }
        let (header, block) = out.split_at_mut(HEADER_LEN);
        header.copy_from_slice(&(raw.len() as u64).to_le_bytes());
        let block = &mut block[..bound];
        let written = match (&mut self.zstd, self.codec) {
            (Some(zstd), _) => zstd
                .compress_to_buffer(raw, block)
                .map_err(|e| Error::Internal(format!("zstd compression failed: {e}")))?,
            (None, Codec::Lz4) => lz4::block::compress_to_buffer(raw, None, false, block)
                .map_err(|_| too_long(raw, "lz4"))?,
            (None, _) => unreachable!("a zstd compressor has its context"),
        };
        Ok(&out[..HEADER_LEN + written])
    }
}

fn too_long(raw: &[u8], codec: &str) -> Error {
    Error::InvalidArgument(format!(
        "a record of {} bytes is too long for {codec} (at most {} bytes); use zstd",
        raw.len(),
        i32::MAX
    ))
}

/// 64 bytes, 64-byte aligned: the unit a [`Decoded`] buffer is allocated in.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; DECODED_ALIGN]);
const _: () = assert!(std::mem::align_of::<Line>() == DECODED_ALIGN);

/// A decoded record in memory of its own, starting at a 64-byte aligned address.
pub struct Decoded {
    lines: Vec<Line>,
    len: usize,
}

impl Decoded {
    fn zeroed(len: usize) -> std::result::Result<Self, String> {
        let count = len.div_ceil(DECODED_ALIGN);
        let mut lines = Vec::new();
        lines
            .try_reserve_exact(count)
            .map_err(|_| format!("cannot allocate {len} bytes to decode it into"))?;
        lines.resize(count, Line([0; DECODED_ALIGN]));
        Ok(Self { lines, len })
    }

    /// The record's bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `lines` holds at least `len` initialized bytes (`Line` is plain bytes
        // without padding), borrowed from `self` for the slice's lifetime.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<u8>(), self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, borrowed mutably from `self`.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<u8>(), self.len) }
    }
}

impl std::fmt::Debug for Decoded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Decoded").field("len", &self.len).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i % 7 + i / 1000) as u8).collect()
    }

    #[test]
    fn every_codec_round_trips_records_of_any_length() {
        for codec in [
            Codec::Zstd { level: 3 },
            Codec::Zstd { level: -5 },
            Codec::Lz4,
        ] {
            let mut compressor = Compressor::new(codec).unwrap();
            let mut out = Vec::new();
            for len in [0, 1, 63, 64, 65, 4096, 300_000] {
                let raw = sample(len);
                let stored = compressor.compress(&raw, &mut out).unwrap().to_vec();
                if len >= 4096 {
                    assert!(stored.len() < len / 4, "{codec:?} {len}: {}", stored.len());
                }
                let decoded = codec.decompress(&stored).unwrap();
                assert_eq!(decoded.bytes(), &raw[..], "{codec:?} {len}");
                assert_eq!(decoded.bytes().as_ptr() as usize % DECODED_ALIGN, 0);
            }
        }
    }

    #[test]
    fn damaged_records_are_errors_not_panics() {
        for codec in [Codec::Zstd { level: 3 }, Codec::Lz4] {
            let raw = sample(10_000);
            let mut out = Vec::new();
            let mut compressor = Compressor::new(codec).unwrap();
            let stored = compressor.compress(&raw, &mut out).unwrap().to_vec();
            assert!(codec
                .decompress(&stored[..5])
                .unwrap_err()
                .contains("header"));
            let mut longer = stored.clone();
            longer[..8].copy_from_slice(&20_000u64.to_le_bytes());
            assert!(codec.decompress(&longer).is_err(), "{codec:?}");
            let mut huge = stored.clone();
            huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
            assert!(codec.decompress(&huge).unwrap_err().contains("implausible"));
            // Large but plausible on its own: refused before anything is allocated.
            let mut large = stored.clone();
            large[..8].copy_from_slice(&(1u64 << 35).to_le_bytes());
            let err = codec.decompress(&large).unwrap_err();
            assert!(
                err.contains("its header records 34359738368 bytes"),
                "{err}"
            );
            let truncated = &stored[..stored.len() - 10];
            assert!(codec.decompress(truncated).is_err(), "{codec:?}");
        }
    }

    #[test]
    fn names_and_levels_are_checked() {
        assert_eq!(
            Codec::parse("zstd", None).unwrap(),
            Codec::Zstd { level: 3 }
        );
        assert_eq!(Codec::parse("zstd", Some(19)).unwrap().level(), Some(19));
        assert_eq!(Codec::parse("lz4", None).unwrap(), Codec::Lz4);
        assert_eq!(Codec::parse("none", None).unwrap(), Codec::None);
        for (name, level) in [
            ("zstd", Some(99)),
            ("zstd", Some(0)),
            ("lz4", Some(1)),
            ("gzip", None),
        ] {
            let err = Codec::parse(name, level).unwrap_err().to_string();
            assert!(err.contains(name) || err.contains("level"), "{err}");
        }
    }
}
