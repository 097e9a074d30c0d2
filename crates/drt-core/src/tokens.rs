//! Token streams: documents of token ids, drawn by a loader's weights, joined into one
//! stream per epoch and cut into fixed-length rows in place.
//!
//! A token record (written by `serializer="tokens"`) is an 8-byte header — `DRTTOK`, the
//! struct code of its ids' type (`H` u16, `I` u32, `i` i32, `q` i64) and a zero byte —
//! followed by the ids, little-endian.
//!
//! An epoch's stream is the documents of draws `0, 1, 2, ...` (each followed by the
//! separator, if there is one), the draws being those of the loader's plan and program
//! (draws past the epoch's `total` take the phase of its last draw, as padding does). It
//! never ends: the loader decides how many of its tokens an epoch takes. A [`Cursor`] names
//! a token of it by its draw and offset, so that reading resumes in O(1) from a saved
//! cursor; moving it forward reads the documents' lengths only.

use crate::error::{Error, Result};
use crate::prefetch::Source;

/// The first bytes of a token record.
pub const TOKEN_MAGIC: &[u8; 6] = b"DRTTOK";
/// Bytes before a token record's ids.
pub const TOKEN_HEADER: usize = 8;

/// The ids of a token record: their bytes and the width of one id.
#[derive(Debug, Clone, Copy)]
pub struct Ids<'a> {
    bytes: &'a [u8],
    code: u8,
}

impl<'a> Ids<'a> {
    /// Reads a token record's header; `Err` says what is wrong with it.
    pub fn parse(record: &'a [u8]) -> std::result::Result<Self, String> {
        let Some((header, bytes)) = record.split_first_chunk::<TOKEN_HEADER>() else {
            return Err(format!(
                "a token record of {} bytes is shorter than its header",
                record.len()
            ));
        };
        if &header[..6] != TOKEN_MAGIC || header[7] != 0 {
            return Err("it is not a token record (serializer='tokens')".into());
        }
        let code = header[6];
        let ids = Self { bytes, code };
        let width = ids.width().ok_or_else(|| {
            format!(
                "its ids are of an unknown type {:?}",
                char::from(code).escape_default().to_string()
            )
        })?;
        if !bytes.len().is_multiple_of(width) {
            return Err(format!(
                "its {} bytes of ids are not a whole number of {width}-byte ids",
                bytes.len()
            ));
        }
        Ok(ids)
    }

    fn width(&self) -> Option<usize> {
        match self.code {
            b'H' => Some(2),
            b'I' | b'i' => Some(4),
            b'q' => Some(8),
            _ => None,
        }
    }

    /// The number of ids.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.width().unwrap_or(1)
    }

    /// Whether the record holds no id.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Writes ids `from..from + out.len()` into `out`, widened to i64.
    pub fn copy_to(&self, from: usize, out: &mut [i64]) {
        let n = out.len();
        match self.code {
            b'H' => widen::<2>(&self.bytes[2 * from..2 * (from + n)], out, |b| {
                i64::from(u16::from_le_bytes(b))
            }),
            b'I' => widen::<4>(&self.bytes[4 * from..4 * (from + n)], out, |b| {
                i64::from(u32::from_le_bytes(b))
            }),
            b'i' => widen::<4>(&self.bytes[4 * from..4 * (from + n)], out, |b| {
                i64::from(i32::from_le_bytes(b))
            }),
            _ => widen::<8>(
                &self.bytes[8 * from..8 * (from + n)],
                out,
                i64::from_le_bytes,
            ),
        }
    }
}

#[inline]
fn widen<const W: usize>(bytes: &[u8], out: &mut [i64], id: impl Fn([u8; W]) -> i64) {
    let (chunks, _) = bytes.as_chunks::<W>();
    for (slot, chunk) in out.iter_mut().zip(chunks) {
        *slot = id(*chunk);
    }
}

/// A token of an epoch's stream: the draw whose document holds it, its offset in that
/// document (the separator after a document is at offset = the document's length), and
/// its place in the whole stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cursor {
    /// The draw (position in the epoch) of the document.
    pub draw: u64,
    /// The token's offset in the document.
    pub offset: u64,
    /// The token's number in the epoch's stream.
    pub token: u64,
}

/// A document's part of a row: the row's tokens `column..column + count` are the
/// document's `offset..offset + count` (its separator, if any, at offset = its length).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// The row, counted from the first row asked for.
    pub row: u32,
    /// Where in the row the piece starts.
    pub column: u64,
    /// The draw whose document it is.
    pub draw: u64,
    /// The plan's row drawn there.
    pub plan_row: u64,
    /// Where in the document the piece starts.
    pub offset: u64,
    /// How many tokens of the row it fills.
    pub count: u64,
}

/// One epoch's token stream over a loader's plan and caches.
pub struct TokenStream {
    source: Source,
    separator: Option<i64>,
}

impl TokenStream {
    /// The stream of `source`'s epoch, whose plan holds each row's token count (checked
    /// against each record read); `separator` follows every document.
    pub fn new(source: Source, separator: Option<i64>) -> Result<Self> {
        if source.plan.tokens().is_none() {
            crate::bail_arg!(
                "the loader's plan holds no document lengths: a token stream needs a plan \
                 written with each row's token count"
            );
        }
        Ok(Self { source, separator })
    }

    /// The number of ids of the plan's row `row`.
    fn length(&self, row: u64) -> u64 {
        u64::from(self.source.plan.length(row))
    }

    /// Tokens of the document of plan row `row`, its separator included.
    fn tokens_of(&self, row: u64) -> u64 {
        self.length(row) + u64::from(self.separator.is_some())
    }

    /// Tokens of the document drawn at `draw`, its separator included.
    fn tokens(&self, draw: u64) -> u64 {
        self.tokens_of(self.source.row(draw))
    }

    /// Moves `cursor` `n` tokens forward, reading the documents' lengths only.
    pub fn advance(&self, cursor: &mut Cursor, n: u64) {
        let end = cursor.token + n;
        loop {
            let left = self.tokens(cursor.draw) - cursor.offset;
            if cursor.token + left > end {
                cursor.offset += end - cursor.token;
                cursor.token = end;
                return;
            }
            cursor.token += left;
            cursor.draw += 1;
            cursor.offset = 0;
        }
    }

    /// The documents behind `rows` rows of `width` tokens, row `i` starting `i * stride`
    /// tokens after `start`: one [`Piece`] per document per row, in order. Reads the
    /// documents' lengths only.
    pub fn pieces(&self, start: Cursor, rows: usize, stride: u64, width: u64) -> Vec<Piece> {
        let mut out = Vec::new();
        let mut first = start;
        for row in 0..rows {
            let mut cursor = first;
            let mut column = 0;
            while column < width {
                let plan_row = self.source.row(cursor.draw);
                let left = self.tokens_of(plan_row) - cursor.offset;
                let count = left.min(width - column);
                out.push(Piece {
                    row: row as u32,
                    column,
                    draw: cursor.draw,
                    plan_row,
                    offset: cursor.offset,
                    count,
                });
                column += count;
                self.advance(&mut cursor, count);
            }
            self.advance(&mut first, stride);
        }
        out
    }

    /// Fills `rows` rows of `width` tokens, row `i` starting `i * stride` tokens after
    /// `start`: `ids[i * width + j]` is the token, `docs` (if given) the number of its
    /// document within the row (0 for the document the row starts in). A mapped file that
    /// shrank meanwhile is an error.
    pub fn fill(
        &self,
        start: Cursor,
        rows: usize,
        stride: u64,
        ids: &mut [i64],
        mut docs: Option<&mut [i32]>,
    ) -> Result<()> {
        if rows == 0 || !ids.len().is_multiple_of(rows) {
            crate::bail_arg!("{} ids do not split into {rows} rows", ids.len());
        }
        let width = ids.len() / rows;
        if docs.as_ref().is_some_and(|d| d.len() != ids.len()) {
            crate::bail_arg!("the document ids need as many slots as the token ids");
        }
        self.source.guarded(|| {
            let mut cursor = start;
            for (i, row) in ids.chunks_exact_mut(width).enumerate() {
                let row_docs = docs
                    .as_deref_mut()
                    .map(|d| &mut d[i * width..(i + 1) * width]);
                self.fill_row(cursor, row, row_docs)?;
                self.advance(&mut cursor, stride);
            }
            Ok(())
        })
    }

    fn fill_row(
        &self,
        mut cursor: Cursor,
        out: &mut [i64],
        mut docs: Option<&mut [i32]>,
    ) -> Result<()> {
        let mut at = 0usize;
        let mut doc = 0i32;
        while at < out.len() {
            let row = self.source.row(cursor.draw);
            let (cache, sample_id) = self.source.plan.sample(row);
            let reader = self.source.reader(cache)?;
            let span = reader.span(sample_id, self.source.verify)?;
            let record = Ids::parse(span.bytes()).map_err(|msg| Error::Corrupt {
                path: reader.dir().to_path_buf(),
                msg: format!("sample {sample_id}: {msg}"),
            })?;
            let expected = self.length(row) as usize;
            if record.len() != expected {
                crate::bail_arg!(
                    "sample {sample_id} of cache {:?} holds {} tokens but the loader's frame \
                     gives it length {expected}: keep the cache's length column as it is",
                    reader.manifest().name,
                    record.len()
                );
            }
            let offset = cursor.offset as usize;
            let take = (expected.saturating_sub(offset)).min(out.len() - at);
            if take > 0 {
                record.copy_to(offset, &mut out[at..at + take]);
            }
            let mut end = at + take;
            if let Some(sep) = self.separator {
                if end < out.len() && offset + take == expected {
                    out[end] = sep;
                    end += 1;
                }
            }
            if let Some(d) = docs.as_deref_mut() {
                d[at..end].fill(doc);
            }
            let used = (end - at) as u64;
            at = end;
            doc += 1;
            cursor.offset += used;
            cursor.token += used;
            if cursor.offset == self.tokens_of(row) {
                cursor.draw += 1;
                cursor.offset = 0;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(code: u8, ids: &[u8]) -> Vec<u8> {
        let mut r = TOKEN_MAGIC.to_vec();
        r.extend([code, 0]);
        r.extend(ids);
        r
    }

    #[test]
    fn ids_widen_from_each_type() {
        let u16s = record(b'H', &[1, 0, 0xff, 0xff]);
        let ids = Ids::parse(&u16s).unwrap();
        let mut out = [0i64; 2];
        ids.copy_to(0, &mut out);
        assert_eq!(out, [1, 65535]);
        let i32s = record(b'i', &(-5i32).to_le_bytes());
        let mut one = [0i64; 1];
        Ids::parse(&i32s).unwrap().copy_to(0, &mut one);
        assert_eq!(one, [-5]);
        let i64s = record(b'q', &[7u8, 0, 0, 0, 0, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0]);
        Ids::parse(&i64s).unwrap().copy_to(1, &mut one);
        assert_eq!(one, [9]);
    }

    #[test]
    fn damaged_records_are_refused() {
        assert!(Ids::parse(b"DRT").unwrap_err().contains("shorter"));
        assert!(Ids::parse(b"DRTOOB01")
            .unwrap_err()
            .contains("not a token record"));
        assert!(Ids::parse(&record(b'x', &[]))
            .unwrap_err()
            .contains("unknown type"));
        assert!(Ids::parse(&record(b'I', &[1, 2, 3]))
            .unwrap_err()
            .contains("whole number"));
    }
}
