//! Which positions of an epoch's global stream a rank reads, batch by batch.
//!
//! An epoch is one global stream of `total` positions (draws when shuffling, rows in frame
//! order otherwise). Ranks read it strided, as PyTorch's `DistributedSampler` does: rank `r`
//! of `w` reads positions `cursor + r`, `cursor + r + w`, ... . Every rank gets the same
//! number of positions, so DDP jobs never hang on an uneven last step: the stream is padded
//! past `total` (with more draws, or by wrapping around the frame), or cut with
//! `drop_last`. The cursor is the first position no rank has consumed; a saved cursor
//! resumes the same stream at any other world size or worker count.

use crate::error::Result;

/// The part of an epoch one rank reads from a cursor on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedule {
    /// Positions in the epoch.
    pub total: u64,
    /// First position not yet consumed by any rank.
    pub cursor: u64,
    /// This rank.
    pub rank: u64,
    /// Number of ranks.
    pub world_size: u64,
    /// Samples per batch on each rank.
    pub batch_size: u64,
    /// Drop the positions that do not fill a batch on every rank, instead of padding.
    pub drop_last: bool,
}

impl Schedule {
    /// The layout of `total` positions over `ranks` (rank, world size) in batches of
    /// `batch` (size, drop_last), from position `cursor` on; checks the arguments.
    pub fn new(total: u64, cursor: u64, ranks: (u64, u64), batch: (u64, bool)) -> Result<Self> {
        let ((rank, world_size), (batch_size, drop_last)) = (ranks, batch);
        if batch_size == 0 {
            crate::bail_arg!("batch_size must be at least 1");
        }
        if world_size == 0 || rank >= world_size {
            crate::bail_arg!("rank {rank} is not in 0..{world_size} (world_size)");
        }
        Ok(Self {
            total,
            cursor: cursor.min(total),
            rank,
            world_size,
            batch_size,
            drop_last,
        })
    }

    /// The same layout with its cursor at `cursor` (at most `total`).
    pub fn at(&self, cursor: u64) -> Self {
        Self {
            cursor: cursor.min(self.total),
            ..*self
        }
    }

    /// Positions this rank reads from the cursor on (the same for every rank).
    pub fn per_rank(&self) -> u64 {
        let remaining = self.total - self.cursor;
        if self.drop_last {
            remaining / self.world_size
        } else {
            remaining.div_ceil(self.world_size)
        }
    }

    /// Batches this rank reads from the cursor on (the same for every rank).
    pub fn num_batches(&self) -> u64 {
        let n = self.per_rank();
        if self.drop_last {
            n / self.batch_size
        } else {
            n.div_ceil(self.batch_size)
        }
    }

    /// The global positions of batch `b` (counted from the cursor) on this rank.
    pub fn batch_positions(&self, b: u64) -> impl Iterator<Item = u64> + use<> {
        let start = b * self.batch_size;
        let end = (start + self.batch_size).min(self.per_rank());
        let (cursor, rank, world) = (self.cursor, self.rank, self.world_size);
        (start..end.max(start)).map(move |j| cursor + rank + world * j)
    }

    /// The cursor once every rank has consumed its first `batches` batches.
    pub fn cursor_after(&self, batches: u64) -> u64 {
        if batches >= self.num_batches() {
            self.total
        } else {
            self.cursor + batches * self.batch_size * self.world_size
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn positions(s: &Schedule) -> Vec<u64> {
        (0..s.num_batches())
            .flat_map(|b| s.batch_positions(b))
            .collect()
    }

    #[test]
    fn ranks_are_disjoint_equal_and_cover_the_stream() {
        for total in [0, 1, 7, 10, 64, 101] {
            for world in 1..5 {
                for batch in [1, 3, 8] {
                    let mut all = Vec::new();
                    let mut counts = Vec::new();
                    for rank in 0..world {
                        let s = Schedule::new(total, 0, (rank, world), (batch, false)).unwrap();
                        counts.push(s.num_batches());
                        all.extend(positions(&s));
                    }
                    assert!(counts.windows(2).all(|w| w[0] == w[1]), "{counts:?}");
                    all.sort_unstable();
                    let distinct = all.len();
                    all.dedup();
                    assert_eq!(all.len(), distinct, "a position was read twice");
                    assert_eq!(all.len() as u64, total.div_ceil(world) * world);
                    assert!(all.iter().take(total as usize).copied().eq(0..total));
                }
            }
        }
    }

    #[test]
    fn drop_last_cuts_to_whole_batches_on_every_rank() {
        let s = Schedule::new(10, 0, (1, 3), (2, true)).unwrap();
        assert_eq!(s.per_rank(), 3);
        assert_eq!(s.num_batches(), 1);
        assert_eq!(positions(&s), vec![1, 4]);
    }

    #[test]
    fn resuming_at_another_world_size_continues_the_stream() {
        // Four ranks consume 2 batches of 3, then two ranks take over from the cursor.
        let first = Schedule::new(50, 0, (0, 4), (3, false)).unwrap();
        let cursor = first.cursor_after(2);
        assert_eq!(cursor, 24);
        let mut seen: Vec<u64> = (0..4)
            .flat_map(|r| {
                let s = Schedule::new(50, 0, (r, 4), (3, false)).unwrap();
                (0..2)
                    .flat_map(move |b| s.batch_positions(b))
                    .collect::<Vec<_>>()
            })
            .collect();
        for r in 0..2 {
            seen.extend(positions(
                &Schedule::new(50, cursor, (r, 2), (5, false)).unwrap(),
            ));
        }
        seen.sort_unstable();
        assert!(seen.iter().copied().take(50).eq(0..50));
        assert_eq!(seen.len(), 50, "no position repeated or padded here");
    }

    #[test]
    fn a_finished_epoch_has_no_batches_left() {
        let s = Schedule::new(10, 0, (0, 1), (4, false)).unwrap();
        assert_eq!(s.cursor_after(3), 10);
        let done = Schedule::new(10, 10, (0, 1), (4, false)).unwrap();
        assert_eq!(done.num_batches(), 0);
    }

    #[test]
    fn bad_arguments() {
        assert!(Schedule::new(10, 0, (0, 1), (0, false)).is_err());
        assert!(Schedule::new(10, 0, (2, 2), (1, false)).is_err());
        assert!(Schedule::new(10, 0, (0, 0), (1, false)).is_err());
    }
}
