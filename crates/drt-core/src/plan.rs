//! A loader's snapshot of its metadata frame: which sample of which cache each row is, and
//! the alias table of its weights.
//!
//! The plan is written once to a file and memory-mapped by every process that reads for
//! the loader, so worker processes share its pages instead of each holding a copy.
//!
//! ```text
//! header (64 bytes): PLAN_MAGIC, rows u64, caches u32, flags u32, tokens u64
//! sample_id u64[rows] (unless row i is sample i) | cache u32[rows] (if several caches) |
//! threshold u32[rows] and alias u32[rows] (if weighted, unless uniform) | length u32[rows]
//! (if the rows are token documents)
//! ```
//!
//! Where every row weighs the same, the alias table would send every column to itself: a
//! uniform plan holds no table (flags `WEIGHTED | UNIFORM`), and a draw is its column alone,
//! the same row the table would give without a page of the table read. A reader that does
//! not know the flag finds the file shorter than its header says and passes it over.
//!
//! The plan of a whole cache's table in order (a saved version that re-weights every
//! sample) has no sample ids: row `i` is sample `i`, which saves 8 bytes per row on disk
//! and a page of the plan per draw.
//!
//! A plan of token documents holds each row's token count and, in its header, their sum:
//! a packed token stream over it reads nothing else to know where documents fall, so a
//! plan saved with a metadata version starts a stream in the same time at any size.

use std::io::Write;
use std::path::{Path, PathBuf};

use std::sync::Arc;

use crate::error::{Error, IoContext, Result};
use crate::index::HashingWriter;
use crate::mapping::{prefetch_line, MappedFile};
use crate::sampler::{pick, AliasTable, EpochRandom, MAX_ROWS};

const PLAN_MAGIC: &[u8; 8] = b"DRTPLAN1";
/// The magic of a weight file (see [`crate::program`]).
pub(crate) const TABLE_MAGIC: &[u8; 8] = b"DRTWGT01";
pub(crate) const HEADER_LEN: usize = 64;
const HAS_CACHES: u32 = 1;
const WEIGHTED: u32 = 2;
const LENGTHS: u32 = 4;
const IDENTITY: u32 = 8;
const UNIFORM: u32 = 16;

/// The rows of a loader: their samples and, when shuffling, the alias table of their weights.
pub struct Plan {
    path: PathBuf,
    map: Arc<MappedFile>,
    rows: u64,
    caches: u32,
    ids_at: Option<usize>,
    cache_at: Option<usize>,
    table_at: Option<usize>,
    uniform: bool,
    lengths_at: Option<usize>,
    tokens: u64,
}

impl std::fmt::Debug for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plan")
            .field("path", &self.path)
            .field("rows", &self.rows)
            .field("caches", &self.caches)
            .finish()
    }
}

/// Writes `values` as little-endian bytes, in place on little-endian machines.
pub(crate) fn write_le<T: LeBytes>(out: &mut impl Write, values: &[T], path: &Path) -> Result<()> {
    if cfg!(target_endian = "little") {
        // SAFETY: `T` is a plain integer type (see `LeBytes`): every byte of the slice is
        // initialised, u8 needs no alignment, and the bytes are already in file order.
        let bytes = unsafe {
            std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
        };
        return out.write_all(bytes).at(path);
    }
    for chunk in values.chunks(1 << 16) {
        let bytes: Vec<u8> = chunk.iter().flat_map(|v| v.le_bytes()).collect();
        out.write_all(&bytes).at(path)?;
    }
    Ok(())
}

/// The little-endian u32 at index `i` of the array starting at byte `base` of `map`.
#[inline]
fn u32_at(map: &[u8], base: usize, i: u64) -> u32 {
    let o = base + 4 * i as usize;
    u32::from_le_bytes([map[o], map[o + 1], map[o + 2], map[o + 3]])
}

/// The integer types a plan holds.
pub(crate) trait LeBytes: Copy {
    fn le_bytes(self) -> Vec<u8>;
}

impl LeBytes for u32 {
    fn le_bytes(self) -> Vec<u8> {
        self.to_le_bytes().to_vec()
    }
}

impl LeBytes for u64 {
    fn le_bytes(self) -> Vec<u8> {
        self.to_le_bytes().to_vec()
    }
}

impl Plan {
    /// Writes the plan of rows `sample_ids[i]` of cache `caches[i]` (one cache when
    /// `caches` is `None`), weighted by `weights` when the loader shuffles, with the token
    /// counts `lengths` of token documents. Returns the xxh3-64 of the file: two plans with
    /// the same digest draw the same rows.
    pub fn write(
        path: &Path,
        sample_ids: &[u64],
        caches: Option<(&[u32], u32)>,
        weights: Option<&[f64]>,
        lengths: Option<&[u32]>,
    ) -> Result<u64> {
        let rows = sample_ids.len();
        if rows as u64 > MAX_ROWS {
            crate::bail_arg!("{rows} rows exceed the loader's limit of {MAX_ROWS}");
        }
        if caches.is_some_and(|(c, _)| c.len() != rows)
            || weights.is_some_and(|w| w.len() != rows)
            || lengths.is_some_and(|l| l.len() != rows)
        {
            crate::bail_arg!("plan columns differ in length");
        }
        if let Some(row) = lengths.and_then(|l| l.iter().position(|&n| n == 0)) {
            crate::bail_arg!("row {row} has length 0: a token document holds at least one id");
        }
        let tokens: u64 = lengths.map_or(0, |l| l.iter().map(|&n| u64::from(n)).sum());
        if let Some((codes, n)) = caches {
            if let Some(bad) = codes.iter().find(|&&c| c >= n) {
                crate::bail_arg!("cache code {bad} out of range for {n} caches");
            }
        }
        let table = weights.map(|w| AliasTable::new(w, "weight")).transpose()?;
        let uniform = table.as_ref().is_some_and(sends_every_column_to_itself);
        let file = std::fs::File::create(path).at(path)?;
        let mut out = HashingWriter::new(std::io::BufWriter::with_capacity(
            crate::format::WRITE_BUFFER,
            file,
        ));
        let mut header = [0u8; HEADER_LEN];
        header[..8].copy_from_slice(PLAN_MAGIC);
        header[8..16].copy_from_slice(&(rows as u64).to_le_bytes());
        header[16..20].copy_from_slice(&caches.map_or(1, |(_, n)| n).to_le_bytes());
        let identity = caches.is_none() && sample_ids.iter().zip(0u64..).all(|(&id, i)| id == i);
        let flags = if caches.is_some() { HAS_CACHES } else { 0 }
            | if identity { IDENTITY } else { 0 }
            | if table.is_some() { WEIGHTED } else { 0 }
            | if uniform { UNIFORM } else { 0 }
            | if lengths.is_some() { LENGTHS } else { 0 };
        header[20..24].copy_from_slice(&flags.to_le_bytes());
        header[24..32].copy_from_slice(&tokens.to_le_bytes());
        out.write_all(&header).at(path)?;
        if !identity {
            write_le(&mut out, sample_ids, path)?;
        }
        if let Some((codes, _)) = caches {
            write_le(&mut out, codes, path)?;
        }
        if let Some(table) = table.as_ref().filter(|_| !uniform) {
            write_le(&mut out, &table.threshold, path)?;
            write_le(&mut out, &table.alias, path)?;
        }
        if let Some(lengths) = lengths {
            write_le(&mut out, lengths, path)?;
        }
        let (_, digest, inner) = out.finish();
        inner.into_inner().map_err(|e| e.into_error()).at(path)?;
        Ok(digest)
    }

    /// Maps a plan file written by [`Plan::write`].
    pub fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).at(path)?;
        // Plan files are written completely before any reader opens them and are never
        // modified afterwards; sizes are checked against the header below. Every loader of
        // this process over the same plan (a saved version's) shares one mapping.
        let map = MappedFile::open(&file, path)?;
        crate::ensure_intact!(
            map.len() >= HEADER_LEN && &map[..8] == PLAN_MAGIC,
            path,
            "not a dataset_rt loader plan"
        );
        let u64_at = |o: usize| u64::from_le_bytes(map[o..o + 8].try_into().unwrap_or([0; 8]));
        let u32_at = |o: usize| u32::from_le_bytes(map[o..o + 4].try_into().unwrap_or([0; 4]));
        let rows = u64_at(8);
        let caches = u32_at(16);
        let flags = u32_at(20);
        let n = usize::try_from(rows).map_err(|_| Error::corrupt(path, "row count"))?;
        let mut at = HEADER_LEN;
        let ids_at = (flags & IDENTITY == 0).then(|| {
            let a = at;
            at += 8 * n;
            a
        });
        let cache_at = (flags & HAS_CACHES != 0).then(|| {
            let a = at;
            at += 4 * n;
            a
        });
        let uniform = flags & WEIGHTED != 0 && flags & UNIFORM != 0;
        let table_at = (flags & WEIGHTED != 0 && !uniform).then(|| {
            let a = at;
            at += 8 * n;
            a
        });
        let lengths_at = (flags & LENGTHS != 0).then(|| {
            let a = at;
            at += 4 * n;
            a
        });
        let tokens = u64_at(24);
        crate::ensure_intact!(map.len() == at, path, "plan file has the wrong size");
        Ok(Self {
            path: path.to_path_buf(),
            map,
            rows,
            caches,
            ids_at,
            cache_at,
            table_at,
            uniform,
            lengths_at,
            tokens,
        })
    }

    /// Number of rows.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Number of caches the rows come from.
    pub fn caches(&self) -> u32 {
        self.caches
    }

    /// The plan's alias table, if it holds one.
    pub fn table(&self) -> Option<MappedTable> {
        if self.uniform {
            return Some(MappedTable::uniform(self.map.clone(), self.rows));
        }
        self.table_at
            .map(|at| MappedTable::new(self.map.clone(), at, self.rows))
    }

    /// Whether the plan's rows are drawn by weight (the loader shuffles).
    pub fn weighted(&self) -> bool {
        self.table_at.is_some() || self.uniform
    }

    /// The rows' tokens in all, if the plan holds token documents' lengths.
    pub fn tokens(&self) -> Option<u64> {
        self.lengths_at.map(|_| self.tokens)
    }

    /// The token count of `row`'s document; 0 when the plan holds no lengths.
    #[inline]
    pub fn length(&self, row: u64) -> u32 {
        self.lengths_at.map_or(0, |at| self.u32_at(at, row))
    }

    #[inline]
    fn u32_at(&self, base: usize, i: u64) -> u32 {
        u32_at(&self.map, base, i)
    }

    /// The row at `position` of the epoch drawn with `random` (rows in order, wrapping, when the
    /// plan is not weighted).
    #[inline]
    pub fn row_at(&self, random: EpochRandom, position: u64) -> u64 {
        match self.table_at {
            Some(t) => {
                let n = self.rows;
                pick(
                    random.bits(position),
                    n,
                    |c| self.u32_at(t, c),
                    |c| self.u32_at(t + 4 * n as usize, c),
                )
            }
            None if self.uniform => column(random.bits(position), self.rows) as u64,
            None => position % self.rows.max(1),
        }
    }

    /// Asks the processor to load what [`row_at`](Self::row_at) reads for `position`.
    #[inline]
    pub fn prefetch_row(&self, random: EpochRandom, position: u64) {
        if let Some(t) = self.table_at {
            let c = column(random.bits(position), self.rows);
            prefetch_line(&self.map, t + 4 * c);
            prefetch_line(&self.map, t + 4 * (self.rows as usize + c));
        }
    }

    /// Asks the processor to load what [`sample`](Self::sample) reads for `row`.
    #[inline]
    pub fn prefetch_sample(&self, row: u64) {
        if let Some(ids) = self.ids_at {
            prefetch_line(&self.map, ids + 8 * row as usize);
        }
        if let Some(c) = self.cache_at {
            prefetch_line(&self.map, c + 4 * row as usize);
        }
    }

    /// The cache code and sample id of `row`.
    #[inline]
    pub fn sample(&self, row: u64) -> (u32, u64) {
        let id = self.ids_at.map_or(row, |ids| {
            let o = ids + 8 * row as usize;
            let mut id = [0u8; 8];
            id.copy_from_slice(&self.map[o..o + 8]);
            u64::from_le_bytes(id)
        });
        let cache = self.cache_at.map_or(0, |c| self.u32_at(c, row));
        (cache, id)
    }
}

/// An alias table in a mapped file (a weight file, or a plan's own table).
#[derive(Clone)]
pub struct MappedTable {
    map: Arc<MappedFile>,
    /// Where the thresholds start; the aliases follow them.
    at: usize,
    rows: u64,
    /// Every row weighs the same: a draw is its column, and the map holds no table.
    uniform: bool,
}

impl std::fmt::Debug for MappedTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedTable")
            .field("rows", &self.rows)
            .finish()
    }
}

impl MappedTable {
    /// The table of `rows` rows at `at` in `map`; the caller has checked the bounds.
    pub(crate) fn new(map: Arc<MappedFile>, at: usize, rows: u64) -> Self {
        Self {
            map,
            at,
            rows,
            uniform: false,
        }
    }

    /// The table of `rows` rows of equal weight (held by `map`, a uniform plan, for its
    /// lifetime only).
    fn uniform(map: Arc<MappedFile>, rows: u64) -> Self {
        Self {
            map,
            at: 0,
            rows,
            uniform: true,
        }
    }

    /// Maps the table of a weight file from [`write_table`], or of a weighted plan.
    pub fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).at(path)?;
        // Weight files are written to a temporary name and renamed into place once complete,
        // and never modified afterwards; the size is checked against the header.
        let map = MappedFile::open(&file, path)?;
        if map.len() >= 8 && &map[..8] != TABLE_MAGIC {
            return Plan::open(path)?
                .table()
                .ok_or_else(|| Error::corrupt(path, "the plan holds no weights"));
        }
        crate::ensure_intact!(
            map.len() >= HEADER_LEN,
            path,
            "not a dataset_rt weight file"
        );
        let rows = u64::from_le_bytes(map[8..16].try_into().unwrap_or([0; 8]));
        let expected = usize::try_from(rows)
            .ok()
            .and_then(|n| n.checked_mul(8))
            .and_then(|n| n.checked_add(HEADER_LEN));
        crate::ensure_intact!(
            expected == Some(map.len()),
            path,
            "weight file has the wrong size"
        );
        Ok(Self::new(map, HEADER_LEN, rows))
    }

    /// Number of rows.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    #[inline]
    fn u32_at(&self, base: usize, i: u64) -> u32 {
        u32_at(&self.map, base, i)
    }

    /// Asks the processor to load what [`draw`](Self::draw) reads for `bits`.
    #[inline]
    pub fn prefetch(&self, bits: u64) {
        if self.uniform {
            return;
        }
        let c = column(bits, self.rows);
        prefetch_line(&self.map, self.at + 4 * c);
        prefetch_line(&self.map, self.at + 4 * (self.rows as usize + c));
    }

    /// The row that random bits `bits` select (as [`AliasTable::draw`] does).
    #[inline]
    pub fn draw(&self, bits: u64) -> u64 {
        let n = self.rows;
        if self.uniform {
            return column(bits, n) as u64;
        }
        let aliases = self.at + 4 * n as usize;
        pick(
            bits,
            n,
            |c| self.u32_at(self.at, c),
            |c| self.u32_at(aliases, c),
        )
    }
}

/// Whether `table` draws each column's own row for every coin: the table of equal weights
/// (each scaled weight exactly 1), which [`column`] alone reproduces.
fn sends_every_column_to_itself(table: &AliasTable) -> bool {
    table
        .threshold
        .iter()
        .zip(&table.alias)
        .zip(0u32..)
        .all(|((&t, &a), i)| t == u32::MAX && a == i)
}

/// The alias-table column that random bits `bits` select among `n` (as `pick` does).
#[inline]
fn column(bits: u64, n: u64) -> usize {
    ((u128::from(bits) * u128::from(n)) >> 64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loaders_of_one_plan_share_its_mapping() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plan");
        let weights: Vec<f64> = (0..1000).map(|i| (i % 7 + 1) as f64).collect();
        let ids: Vec<u64> = (0..1000).collect();
        Plan::write(&path, &ids, None, Some(&weights), None).unwrap();
        let (a, b) = (Plan::open(&path).unwrap(), Plan::open(&path).unwrap());
        assert!(Arc::ptr_eq(&a.map, &b.map));
        let table = MappedTable::open(&path).unwrap();
        assert!(Arc::ptr_eq(&a.map, &table.map));
        drop((a, b, table));
        // Once no reader holds it, the mapping goes; the next reader maps the file again.
        let c = Plan::open(&path).unwrap();
        assert_eq!(c.rows(), 1000);
    }

    #[test]
    fn plan_round_trip_matches_the_in_memory_table() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plan");
        let ids: Vec<u64> = (0..1000).map(|i| i * 3).collect();
        let codes: Vec<u32> = (0..1000).map(|i| (i % 3) as u32).collect();
        let weights: Vec<f64> = (0..1000).map(|i| (i % 7) as f64).collect();
        Plan::write(&path, &ids, Some((&codes, 3)), Some(&weights), None).unwrap();
        let plan = Plan::open(&path).unwrap();
        assert_eq!(plan.rows(), 1000);
        assert_eq!(plan.caches(), 3);
        assert_eq!(plan.sample(10), (1, 30));
        let table = AliasTable::new(&weights, "w").unwrap();
        let random = EpochRandom::new(3, 1);
        for k in 0..5000 {
            assert_eq!(plan.row_at(random, k), table.draw(random.bits(k)));
        }
    }

    #[test]
    fn plans_of_equal_weights_hold_no_table_and_draw_what_one_would() {
        let dir = tempfile::tempdir().unwrap();
        let ids: Vec<u64> = (0..1000).collect();
        let random = EpochRandom::new(5, 2);
        for (name, weight) in [("ones", 1.0), ("halves", 0.5), ("fifths", 0.2)] {
            let path = dir.path().join(name);
            let weights = vec![weight; ids.len()];
            Plan::write(&path, &ids, None, Some(&weights), None).unwrap();
            let plan = Plan::open(&path).unwrap();
            let table = AliasTable::new(&weights, "w").unwrap();
            // Each row's scaled weight is exactly 1 unless the sum rounds (0.2 does): only
            // then does the file hold the table.
            let uniform = table.threshold.iter().all(|&t| t == u32::MAX);
            assert_eq!(plan.uniform, uniform, "{name}");
            let size = std::fs::metadata(&path).unwrap().len();
            assert_eq!(size, 64 + if uniform { 0 } else { 8 * 1000 }, "{name}");
            assert!(plan.weighted());
            let mapped = plan.table().unwrap();
            for k in 0..20_000 {
                let want = table.draw(random.bits(k));
                assert_eq!(plan.row_at(random, k), want, "{name}");
                assert_eq!(mapped.draw(random.bits(k)), want, "{name}");
            }
            assert!(MappedTable::open(&path).is_ok(), "{name}");
        }
        // The plan of equal weights that a cache's first version saves draws every row.
        let plan = Plan::open(&dir.path().join("ones")).unwrap();
        let drawn: std::collections::HashSet<u64> =
            (0..20_000).map(|k| plan.row_at(random, k)).collect();
        assert_eq!(drawn.len(), 1000);
    }

    #[test]
    fn unweighted_plans_read_rows_in_order_and_wrap() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plan");
        Plan::write(&path, &[5, 6, 7], None, None, None).unwrap();
        let plan = Plan::open(&path).unwrap();
        let s = EpochRandom::new(0, 0);
        assert_eq!(
            (0..5).map(|p| plan.row_at(s, p)).collect::<Vec<_>>(),
            vec![0, 1, 2, 0, 1]
        );
        assert_eq!(plan.sample(2), (0, 7));
        assert!(!plan.weighted());
    }

    #[test]
    fn a_plan_of_every_sample_in_order_leaves_the_ids_out() {
        let dir = tempfile::tempdir().unwrap();
        let (whole, filtered) = (dir.path().join("whole"), dir.path().join("filtered"));
        let weights = [1.0, 3.0, 0.5, 2.0];
        Plan::write(&whole, &[0, 1, 2, 3], None, Some(&weights), None).unwrap();
        Plan::write(&filtered, &[0, 1, 3, 4], None, Some(&weights), None).unwrap();
        let size = |p: &Path| std::fs::metadata(p).unwrap().len();
        assert_eq!(size(&filtered) - size(&whole), 4 * 8);
        let (a, b) = (Plan::open(&whole).unwrap(), Plan::open(&filtered).unwrap());
        assert_eq!(
            (0..4).map(|r| a.sample(r)).collect::<Vec<_>>(),
            [(0, 0), (0, 1), (0, 2), (0, 3)]
        );
        assert_eq!(
            (0..4).map(|r| b.sample(r)).collect::<Vec<_>>(),
            [(0, 0), (0, 1), (0, 3), (0, 4)]
        );
        let random = EpochRandom::new(9, 2);
        for k in 0..1000 {
            assert_eq!(
                a.row_at(random, k),
                b.row_at(random, k),
                "the same table draws alike"
            );
        }
    }

    #[test]
    fn token_plans_hold_each_rows_length_and_their_sum() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plan");
        Plan::write(
            &path,
            &[4, 5, 6],
            None,
            Some(&[1.0, 2.0, 3.0]),
            Some(&[7, 1, 300]),
        )
        .unwrap();
        let plan = Plan::open(&path).unwrap();
        assert_eq!(plan.tokens(), Some(308));
        assert_eq!(
            (0..3).map(|r| plan.length(r)).collect::<Vec<_>>(),
            [7, 1, 300]
        );
        assert!(plan.weighted());
        let err = Plan::write(&path, &[4, 5], None, None, Some(&[3, 0])).unwrap_err();
        assert!(err.to_string().contains("row 1 has length 0"), "{err}");
        Plan::write(&path, &[4], None, None, None).unwrap();
        assert_eq!(Plan::open(&path).unwrap().tokens(), None);
    }

    #[test]
    fn damaged_plans_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plan");
        Plan::write(&path, &[1, 2, 3], None, Some(&[1.0, 1.0, 1.0]), None).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
        assert!(Plan::open(&path).is_err());
        assert!(Plan::write(&path, &[1], Some((&[4], 2)), None, None).is_err());
    }
}
