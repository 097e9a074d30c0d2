//! Sampling programs: which weights each draw of a loader uses, over the whole run.
//!
//! A loader without a program draws position `k` of epoch `e` from one alias table (the
//! plan's). A program generalises that to weights that change with training progress: the
//! run's draws are numbered globally, `g = e * total + k` (`total` draws per epoch), and
//! cut into segments at increasing starts. A segment draws from one table, or blends two
//! linearly across its span: draw `g` of a blend from table `a` to table `b` over
//! `[start, end)` comes from `b` with probability `(g - start) / (end - start)`, so the
//! probability of a row moves linearly from its share under `a` to its share under `b`.
//!
//! Draw `g` stays a pure function of `(seed, e, k)` and the program: nothing is replayed
//! to reach it, so resuming anywhere (mid-phase, at another world size or worker count)
//! is O(1). A segment of one table uses exactly the random bits a loader without a program
//! uses, so a single-phase program draws what the plain loader draws.
//!
//! Tables live in files mapped by every process that reads for the loader: the plan's own
//! table, or weight files written by [`write_table`]:
//!
//! ```text
//! header (64 bytes): TABLE_MAGIC, rows u64 | threshold u32[rows] | alias u32[rows]
//! ```

use std::path::Path;

use crate::error::{IoContext, Result};
use crate::plan::{MappedTable, Plan, TABLE_MAGIC};
use crate::sampler::{build_alias, mix64, EpochRandom};

const HEADER_LEN: usize = crate::plan::HEADER_LEN;

/// Writes the alias table of `weights` to `path`: to a temporary name first, synced to disk
/// if `sync` says so, then renamed. Returns the xxh3-64 of the file. Errors name `column`
/// and the first bad weight's row.
pub fn write_table(path: &Path, weights: &[f64], column: &str, sync: bool) -> Result<u64> {
    let partial = path.with_extension("partial");
    let n = weights.len();
    let len = HEADER_LEN + 8 * n;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&partial)
        .at(&partial)?;
    // The table is built in the file's own pages: no copy of it on the heap. The space is
    // reserved first, so that a full disk (or /dev/shm) is an error here rather than a
    // SIGBUS when a page of the mapping is first written.
    reserve(&file, len).at(&partial)?;
    // SAFETY: the file is this call's own, under a temporary name no other process opens,
    // and its `len` bytes are allocated; the mapping is dropped before the file is renamed.
    let mut map = unsafe { memmap2::MmapMut::map_mut(&file) }.at(&partial)?;
    let (header, body) = map.split_at_mut(HEADER_LEN);
    header[..8].copy_from_slice(TABLE_MAGIC);
    header[8..16].copy_from_slice(&(n as u64).to_le_bytes());
    header[16..].fill(0);
    let (thresholds, aliases) = body.split_at_mut(4 * n);
    let (threshold, alias) = (as_u32s(thresholds), as_u32s(aliases));
    build_alias(weights, column, threshold, alias)?;
    if cfg!(target_endian = "big") {
        threshold.iter_mut().for_each(|v| *v = v.to_le());
        alias.iter_mut().for_each(|v| *v = v.to_le());
    }
    let digest = xxhash_rust::xxh3::xxh3_64(&map);
    if sync {
        map.flush().at(&partial)?;
        file.sync_all().at(&partial)?;
    }
    drop(map);
    std::fs::rename(&partial, path).at(path)?;
    Ok(digest)
}

/// Allocates `len` bytes of `file`'s blocks.
fn reserve(file: &std::fs::File, len: usize) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let len = libc::off_t::try_from(len).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    // SAFETY: a plain system call on an open descriptor.
    match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) } {
        0 => Ok(()),
        code => Err(std::io::Error::from_raw_os_error(code)),
    }
}

/// The u32 values of a 4-byte-aligned region of a mapping.
fn as_u32s(bytes: &mut [u8]) -> &mut [u32] {
    // SAFETY: every bit pattern is a valid u32, and the region is checked to be aligned.
    let (head, values, tail) = unsafe { bytes.align_to_mut::<u32>() };
    assert!(
        head.is_empty() && tail.is_empty(),
        "a table region is 4-byte aligned"
    );
    values
}

/// A run of global draws, from `start` to the next segment's start, with the same weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// The first global draw of the segment.
    pub start: u64,
    /// The table drawn from (an index into the program's tables).
    pub from: u32,
    /// For a linear blend: the table the segment blends into, and the global draw by which
    /// the blend is complete (from then on, the segment draws from that table).
    pub to: Option<(u32, u64)>,
}

/// The weights of every draw of a run: segments over the global draw count.
#[derive(Debug, Clone)]
pub struct Program {
    tables: Vec<MappedTable>,
    segments: Vec<Segment>,
}

/// Random bits for a blend's choice between its two tables, independent of the bits the
/// table's column and coin come from.
const BLEND: u64 = 0x8cb9_2ba7_2f3d_8dd7;

impl Program {
    /// Checks that the segments start at draw 0 in increasing order, that blends end after
    /// they start, and that the tables exist and hold the same rows.
    pub fn new(tables: Vec<MappedTable>, segments: Vec<Segment>) -> Result<Self> {
        let Some(first) = segments.first() else {
            crate::bail_arg!("a sampling program needs at least one segment");
        };
        if first.start != 0 {
            crate::bail_arg!(
                "the first segment must start at draw 0, not {}",
                first.start
            );
        }
        for pair in segments.windows(2) {
            if pair[1].start <= pair[0].start {
                crate::bail_arg!(
                    "segments must start in increasing order: {} follows {}",
                    pair[1].start,
                    pair[0].start
                );
            }
        }
        for s in &segments {
            if let Some((_, end)) = s.to {
                if end <= s.start {
                    crate::bail_arg!(
                        "the blend from draw {} must end after it, not at {end}",
                        s.start
                    );
                }
            }
            for t in std::iter::once(s.from).chain(s.to.map(|(t, _)| t)) {
                if t as usize >= tables.len() {
                    crate::bail_arg!("segment at {} uses table {t} of {}", s.start, tables.len());
                }
            }
        }
        if let Some(t) = tables.iter().find(|t| t.rows() != tables[0].rows()) {
            crate::bail_arg!(
                "the program's tables differ in rows: {} and {}",
                tables[0].rows(),
                t.rows()
            );
        }
        Ok(Self { tables, segments })
    }

    /// Rows the tables draw from.
    pub fn rows(&self) -> u64 {
        self.tables.first().map_or(0, MappedTable::rows)
    }

    /// The index of the segment holding global draw `g`.
    #[inline]
    pub fn segment_of(&self, g: u64) -> usize {
        self.segments.partition_point(|s| s.start <= g) - 1
    }

    /// The row of global draw `g`, which is position `position` of its epoch drawn with
    /// `random`, and the segment it falls in.
    #[inline]
    pub fn draw(&self, random: EpochRandom, g: u64, position: u64) -> (u64, u32) {
        let (i, table, bits) = self.table_of(random, g, position);
        (self.tables[table as usize].draw(bits), i as u32)
    }

    /// Asks the processor to load what [`draw`](Self::draw) reads for the same arguments.
    #[inline]
    pub fn prefetch(&self, random: EpochRandom, g: u64, position: u64) {
        let (_, table, bits) = self.table_of(random, g, position);
        self.tables[table as usize].prefetch(bits);
    }

    /// The segment of global draw `g`, the table it draws from there, and its random bits.
    #[inline]
    fn table_of(&self, random: EpochRandom, g: u64, position: u64) -> (usize, u32, u64) {
        let i = self.segment_of(g);
        let segment = self.segments[i];
        let bits = random.bits(position);
        let table = match segment.to {
            None => segment.from,
            Some((to, end)) => {
                let t = (g - segment.start) as f64 / (end - segment.start) as f64;
                let u = (mix64(bits ^ BLEND) >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
                if u < t {
                    to
                } else {
                    segment.from
                }
            }
        };
        (i, table, bits)
    }
}

/// Draws of an epoch at chosen positions, with the samples they select.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Drawn {
    /// The positions, in the order asked for.
    pub positions: Vec<u64>,
    /// The plan row each position drew.
    pub rows: Vec<u64>,
    /// Each row's cache code.
    pub caches: Vec<u32>,
    /// Each row's sample id.
    pub sample_ids: Vec<u64>,
    /// The program segment of each draw (0 without a program).
    pub segments: Vec<u32>,
}

/// The row at `position` of an epoch of `total` draws whose first global draw is `first`:
/// from the program when there is one, else from the plan (its table, or rows in order).
///
/// Padding positions past `total` (drawn so that every rank gets as many batches) count as
/// the epoch's last draw when the program places them: they belong to their own epoch, so a
/// change of weights from the next epoch on leaves them as they were.
#[inline]
pub fn row_at(
    plan: &Plan,
    program: Option<&Program>,
    random: EpochRandom,
    first: u64,
    total: u64,
    position: u64,
) -> (u64, u32) {
    match program {
        Some(p) => p.draw(random, global_draw(first, total, position), position),
        None => (plan.row_at(random, position), 0),
    }
}

/// How many draws ahead a loop over draws asks for the reads it will make: enough that more
/// of them are in flight than the processor would find on its own.
pub const PREFETCH_AHEAD: usize = 16;

/// The draws at `positions` of an epoch whose first global draw and length are
/// `(first, total)`: `put(i, (row, segment))` for each, in order, each draw's reads asked
/// for [`PREFETCH_AHEAD`] draws before it.
pub fn draw_each(
    plan: &Plan,
    program: Option<&Program>,
    random: EpochRandom,
    (first, total): (u64, u64),
    positions: &[u64],
    mut put: impl FnMut(usize, (u64, u32)),
) {
    for (i, &position) in positions.iter().enumerate() {
        if let Some(&ahead) = positions.get(i + PREFETCH_AHEAD) {
            prefetch_row_at(plan, program, random, first, total, ahead);
        }
        put(i, row_at(plan, program, random, first, total, position));
    }
}

/// Asks the processor to load what [`row_at`] reads for the same arguments.
#[inline]
fn prefetch_row_at(
    plan: &Plan,
    program: Option<&Program>,
    random: EpochRandom,
    first: u64,
    total: u64,
    position: u64,
) {
    match program {
        Some(p) => p.prefetch(random, global_draw(first, total, position), position),
        None => plan.prefetch_row(random, position),
    }
}

/// The global draw that position `position` of an epoch (of `total` draws, the first of
/// them global draw `first`) counts as for the program: padding past the epoch's end counts
/// as its last draw.
#[inline]
fn global_draw(first: u64, total: u64, position: u64) -> u64 {
    first.saturating_add(position.min(total.saturating_sub(1)))
}

/// What `count` positions `start, start + step, ...` of epoch `epoch` (of `total` draws)
/// draw under `seed`. Large counts are split across the machine's cores: each draw is a
/// few independent reads of the mapped plan and tables, so threads scale it.
pub fn draw_positions(
    plan: &Plan,
    program: Option<&Program>,
    seed: u64,
    epoch: u64,
    total: u64,
    (start, step, count): (u64, u64, usize),
) -> Result<Drawn> {
    if let Some(p) = program.filter(|p| p.rows() != plan.rows()) {
        crate::bail_arg!(
            "the sampling program draws from {} rows but the plan has {}",
            p.rows(),
            plan.rows()
        );
    }
    let random = EpochRandom::new(seed, epoch);
    let first = epoch.saturating_mul(total);
    let mut out = Drawn {
        positions: zeroed(count)?,
        rows: zeroed(count)?,
        caches: zeroed(count)?,
        sample_ids: zeroed(count)?,
        segments: zeroed(count)?,
    };
    // Two passes: all rows first, then their samples. Each pass's reads of the mapped
    // files are independent of one another, so the processor keeps many in flight at once.
    let fill = |offset: usize, part: DrawnPart<'_>| {
        let DrawnPart(positions, rows, caches, sample_ids, segments) = part;
        for (i, position) in positions.iter_mut().enumerate() {
            *position = start + step * (offset + i) as u64;
        }
        draw_each(
            plan,
            program,
            random,
            (first, total),
            positions,
            |i, drawn| {
                (rows[i], segments[i]) = drawn;
            },
        );
        for i in 0..rows.len() {
            if let Some(&ahead) = rows.get(i + PREFETCH_AHEAD) {
                plan.prefetch_sample(ahead);
            }
            (caches[i], sample_ids[i]) = plan.sample(rows[i]);
        }
    };
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(count.div_ceil(1 << 16));
    if threads <= 1 {
        fill(0, out.part(0, count));
        return Ok(out);
    }
    let chunk = count.div_ceil(threads);
    let parts: Vec<DrawnPart<'_>> = out.parts(chunk);
    std::thread::scope(|scope| {
        for (k, part) in parts.into_iter().enumerate() {
            let fill = &fill;
            scope.spawn(move || fill(k * chunk, part));
        }
    });
    Ok(out)
}

/// `count` zeros, or an error instead of aborting when there is no memory for them.
fn zeroed<T: Copy + Default>(count: usize) -> Result<Vec<T>> {
    let mut values = Vec::new();
    if values.try_reserve_exact(count).is_err() {
        crate::bail_arg!("{count} draws do not fit in memory at once; ask for fewer steps");
    }
    values.resize(count, T::default());
    Ok(values)
}

/// Mutable slices of the same positions of each column of a [`Drawn`].
struct DrawnPart<'a>(
    &'a mut [u64],
    &'a mut [u64],
    &'a mut [u32],
    &'a mut [u64],
    &'a mut [u32],
);

impl Drawn {
    fn part(&mut self, from: usize, to: usize) -> DrawnPart<'_> {
        DrawnPart(
            &mut self.positions[from..to],
            &mut self.rows[from..to],
            &mut self.caches[from..to],
            &mut self.sample_ids[from..to],
            &mut self.segments[from..to],
        )
    }

    /// The columns cut into consecutive parts of `chunk` positions.
    fn parts(&mut self, chunk: usize) -> Vec<DrawnPart<'_>> {
        let mut positions = self.positions.chunks_mut(chunk);
        let mut rows = self.rows.chunks_mut(chunk);
        let mut caches = self.caches.chunks_mut(chunk);
        let mut sample_ids = self.sample_ids.chunks_mut(chunk);
        let mut segments = self.segments.chunks_mut(chunk);
        let mut out = Vec::new();
        while let (Some(p), Some(r), Some(c), Some(i), Some(s)) = (
            positions.next(),
            rows.next(),
            caches.next(),
            sample_ids.next(),
            segments.next(),
        ) {
            out.push(DrawnPart(p, r, c, i, s));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::AliasTable;

    fn table(dir: &Path, name: &str, weights: &[f64]) -> MappedTable {
        let path = dir.join(name);
        write_table(&path, weights, "w", true).unwrap();
        MappedTable::open(&path).unwrap()
    }

    #[test]
    fn a_weight_file_draws_what_the_in_memory_table_draws() {
        let dir = tempfile::tempdir().unwrap();
        let weights: Vec<f64> = (0..500).map(|i| (i % 9) as f64).collect();
        let mapped = table(dir.path(), "w", &weights);
        let memory = AliasTable::new(&weights, "w").unwrap();
        let random = EpochRandom::new(4, 2);
        for k in 0..5000 {
            assert_eq!(mapped.draw(random.bits(k)), memory.draw(random.bits(k)));
        }
        assert_eq!(
            crate::format::file_checksum(&dir.path().join("w"))
                .unwrap()
                .1,
            write_table(&dir.path().join("w2"), &weights, "w", false).unwrap()
        );
    }

    #[test]
    fn a_single_segment_draws_what_the_plan_draws() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plan");
        let ids: Vec<u64> = (0..300).collect();
        let weights: Vec<f64> = (0..300).map(|i| 1.0 + (i % 5) as f64).collect();
        Plan::write(&path, &ids, None, Some(&weights), None).unwrap();
        let plan = Plan::open(&path).unwrap();
        let program = Program::new(
            vec![MappedTable::open(&path).unwrap()],
            vec![Segment {
                start: 0,
                from: 0,
                to: None,
            }],
        )
        .unwrap();
        let plain = draw_positions(&plan, None, 9, 3, 300, (0, 1, 1000)).unwrap();
        let programmed = draw_positions(&plan, Some(&program), 9, 3, 300, (0, 1, 1000)).unwrap();
        assert_eq!(plain.rows, programmed.rows);
        // Many positions are drawn on several threads, in the same order as one by one.
        let many = draw_positions(&plan, Some(&program), 9, 3, 300, (5, 3, 200_000)).unwrap();
        let random = EpochRandom::new(9, 3);
        for (i, &position) in many.positions.iter().enumerate() {
            assert_eq!(position, 5 + 3 * i as u64);
            let (row, _) = program.draw(random, 900 + position.min(299), position);
            assert_eq!(many.rows[i], row);
            assert_eq!(many.sample_ids[i], row);
        }
    }

    #[test]
    fn phases_switch_at_their_starts_and_blends_move_linearly() {
        let dir = tempfile::tempdir().unwrap();
        // Table 0 draws only row 0, table 1 only row 1.
        let only0 = table(dir.path(), "a", &[1.0, 0.0]);
        let only1 = table(dir.path(), "b", &[0.0, 1.0]);
        let segments = vec![
            Segment {
                start: 0,
                from: 0,
                to: None,
            },
            Segment {
                start: 100,
                from: 0,
                to: Some((1, 100_100)),
            },
            Segment {
                start: 100_100,
                from: 1,
                to: None,
            },
        ];
        let program = Program::new(vec![only0, only1], segments).unwrap();
        let random = EpochRandom::new(0, 0);
        assert!((0..100).all(|g| program.draw(random, g, g) == (0, 0)));
        assert!((100_100..100_200).all(|g| program.draw(random, g, g) == (1, 2)));
        // Across the blend, the share of row 1 grows linearly from 0 to 1.
        for quarter in 0..4u64 {
            let from = 100 + quarter * 25_000;
            let ones = (from..from + 25_000)
                .filter(|&g| program.draw(random, g, g).0 == 1)
                .count() as f64;
            let expected = 25_000.0 * (quarter as f64 + 0.5) / 4.0;
            assert!(
                (ones - expected).abs() < 5.0 * 25_000f64.sqrt(),
                "{quarter}: {ones}"
            );
        }
    }

    #[test]
    fn bad_programs_and_damaged_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let t = table(dir.path(), "a", &[1.0, 2.0]);
        let seg = |start, to| Segment { start, from: 0, to };
        assert!(Program::new(vec![t.clone()], vec![]).is_err());
        assert!(Program::new(vec![t.clone()], vec![seg(5, None)]).is_err());
        assert!(Program::new(vec![t.clone()], vec![seg(0, None), seg(0, None)]).is_err());
        assert!(Program::new(vec![t.clone()], vec![seg(0, Some((0, 0)))]).is_err());
        assert!(Program::new(vec![t.clone()], vec![seg(0, Some((3, 9))), seg(9, None)]).is_err());
        let other = table(dir.path(), "b", &[1.0, 2.0, 3.0]);
        assert!(Program::new(vec![t, other], vec![seg(0, None)]).is_err());
        let path = dir.path().join("a");
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 4]).unwrap();
        assert!(MappedTable::open(&path).is_err());
        assert!(write_table(&dir.path().join("c"), &[0.0, 0.0], "w", true).is_err());
        assert!(!dir.path().join("c").exists());
    }
}
