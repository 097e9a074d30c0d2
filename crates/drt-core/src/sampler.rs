//! Weighted sampling with replacement, by counter-based randomness.
//!
//! Draw `k` of epoch `e` is a pure function of `(seed, e, k)`: a keyed mix of the three
//! picks a column of a Walker/Vose alias table. Nothing is replayed to reach draw `k`, so
//! any worker, rank or resumed process computes exactly the draws it needs in O(1) each,
//! and the stream is the same whatever the number of workers, ranks or restarts.
//!
//! The alias table costs 8 bytes per row (a 32-bit acceptance threshold and a 32-bit
//! alias) and is built in O(n).

use crate::error::{Error, Result};
use crate::weights::checked_total;

/// The splitmix64 finalizer: a bijective mix of 64 bits.
#[inline]
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// The randomness of one `(seed, epoch)`: 64 random bits for every draw index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpochRandom {
    key: u64,
}

impl EpochRandom {
    /// The random bits of epoch `epoch` under `seed`.
    pub fn new(seed: u64, epoch: u64) -> Self {
        let key = mix64(mix64(seed ^ 0x6a09_e667_f3bc_c908) ^ epoch.wrapping_mul(GOLDEN));
        Self { key }
    }

    /// The random bits of draw `k`.
    #[inline]
    pub fn bits(&self, k: u64) -> u64 {
        mix64(
            self.key
                .wrapping_add(k.wrapping_add(1).wrapping_mul(GOLDEN)),
        )
    }
}

/// A Walker/Vose alias table over rows with non-negative weights.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AliasTable {
    /// Acceptance threshold of each column, out of 2^32.
    pub threshold: Vec<u32>,
    /// The row a rejected draw of each column goes to.
    pub alias: Vec<u32>,
}

/// Largest number of rows a table holds (row numbers are 32-bit).
pub const MAX_ROWS: u64 = u32::MAX as u64;

impl AliasTable {
    /// Builds the table for `weights`; P(row i) = w_i / Σw. Rows of weight zero are never
    /// drawn. Errors name the first bad weight's row.
    pub fn new(weights: &[f64], column: &str) -> Result<Self> {
        let mut threshold = vec![0u32; weights.len()];
        let mut alias = vec![0u32; weights.len()];
        build_alias(weights, column, &mut threshold, &mut alias)?;
        Ok(Self { threshold, alias })
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.threshold.len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.threshold.is_empty()
    }
}

/// Builds the alias table of `weights` into `threshold` and `alias` (as long as
/// `weights`): Vose's method, the same table [`AliasTable::new`] holds.
///
/// A row's scaled weight (a large row's residual, as it shrinks) is kept in its own
/// threshold and alias slots, as the two halves of an f64, instead of in a scaled copy of
/// the weights: the slots get their final values when the row leaves the work lists,
/// after its weight was last read.
pub fn build_alias(
    weights: &[f64],
    column: &str,
    threshold: &mut [u32],
    alias: &mut [u32],
) -> Result<()> {
    let n = weights.len();
    if n as u64 > MAX_ROWS {
        return Err(Error::InvalidArgument(format!(
            "{n} rows exceed the sampler's limit of {MAX_ROWS}"
        )));
    }
    assert!(
        threshold.len() == n && alias.len() == n,
        "table slots for every row"
    );
    // The checks without a branch per weight; the checked sum (same order, same value)
    // finds what is wrong when something is.
    let (mut total, mut valid) = (0.0f64, true);
    for &w in weights {
        total += w;
        valid &= w >= 0.0 && w.is_finite();
    }
    if !(valid && total.is_finite() && total > 0.0) {
        total = checked_total(weights.iter().map(|&w| Some(w)), column)?;
    }
    let scale = n as f64 / total;
    // One buffer holds both work lists: small from the front, large from the back. Each
    // row is written to both ends of the free middle and kept at one: no branch on the
    // weight, which random weights would mispredict half the time.
    let mut work = vec![0u32; n];
    let (mut small, mut large) = (0usize, n);
    for (i, &w) in weights.iter().enumerate() {
        let p = w * scale;
        store(threshold, alias, i, p);
        let is_small = usize::from(p < 1.0);
        work[small] = i as u32;
        work[large - 1] = i as u32;
        small += is_small;
        large -= 1 - is_small;
    }
    let mut small_top = small;
    let mut large_top = large;
    // `work[..small_top]` are pending small rows, `work[large_top..]` pending large rows.
    while small_top > 0 && large_top < n {
        small_top -= 1;
        let s = work[small_top] as usize;
        let l = work[large_top] as usize;
        let ps = load(threshold, alias, s);
        let pl = (load(threshold, alias, l) + ps) - 1.0;
        threshold[s] = to_threshold(ps);
        alias[s] = l as u32;
        store(threshold, alias, l, pl);
        // If `l` becomes small, it moves from the large list to the small list (the slot
        // `s` left is free either way).
        let moves = usize::from(pl < 1.0);
        work[small_top] = l as u32;
        large_top += moves;
        small_top += moves;
    }
    // Leftovers are 1 up to rounding; rows of weight zero must still never be drawn.
    let any_positive = weights.iter().position(|&w| w > 0.0).unwrap_or(0) as u32;
    for &i in work[..small_top].iter().chain(&work[large_top..]) {
        let i = i as usize;
        if weights[i] > 0.0 {
            threshold[i] = u32::MAX;
            alias[i] = i as u32;
        } else {
            threshold[i] = 0;
            alias[i] = any_positive;
        }
    }
    Ok(())
}

/// Keeps `p` in row `i`'s threshold (low half) and alias (high half) slots.
#[inline]
fn store(threshold: &mut [u32], alias: &mut [u32], i: usize, p: f64) {
    let bits = p.to_bits();
    threshold[i] = bits as u32;
    alias[i] = (bits >> 32) as u32;
}

/// The value [`store`] kept for row `i`.
#[inline]
fn load(threshold: &[u32], alias: &[u32], i: usize) -> f64 {
    f64::from_bits(u64::from(threshold[i]) | (u64::from(alias[i]) << 32))
}

#[inline]
fn to_threshold(p: f64) -> u32 {
    // p in [0, 1): scaled to 2^32, clamped so that rounding never overflows.
    (p * 4_294_967_296.0).min(u32::MAX as f64) as u32
}

/// The row that random bits `bits` select from a table of `n` columns, given each
/// column's threshold and alias.
#[inline]
pub fn pick(bits: u64, n: u64, threshold: impl Fn(u64) -> u32, alias: impl Fn(u64) -> u32) -> u64 {
    let column = ((bits as u128 * n as u128) >> 64) as u64;
    // The low 32 bits are independent of the high bits that chose the column.
    let coin = mix64(bits ^ 0xd1b5_4a32_d192_ed03) as u32;
    // Both reads are issued before either is needed, so that over a large table their
    // cache misses overlap instead of the alias waiting for the threshold.
    let (threshold, alias) = (threshold(column), alias(column));
    if coin < threshold {
        column
    } else {
        u64::from(alias)
    }
}

impl AliasTable {
    /// The row drawn by random bits `bits`.
    #[inline]
    pub fn draw(&self, bits: u64) -> u64 {
        pick(
            bits,
            self.len() as u64,
            |c| self.threshold[c as usize],
            |c| self.alias[c as usize],
        )
    }
}

/// How many times each row is drawn in draws `0..n` under `random`.
pub fn draw_counts(table: &AliasTable, random: EpochRandom, n: u64) -> Vec<u64> {
    let mut counts = vec![0u64; table.len()];
    for k in 0..n {
        counts[table.draw(random.bits(k)) as usize] += 1;
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Vose's method with a scaled copy of the weights: the table every plan and weight file
    /// held before their residuals moved into the table's own slots.
    fn vose_with_a_copy(weights: &[f64]) -> (Vec<u32>, Vec<u32>) {
        let n = weights.len();
        let total: f64 = weights.iter().sum();
        let mut scaled: Vec<f64> = weights.iter().map(|&w| w * (n as f64 / total)).collect();
        let (mut threshold, mut alias) = (vec![0u32; n], vec![0u32; n]);
        let mut work = vec![0u32; n];
        let (mut small, mut large) = (0usize, n);
        for (i, &p) in scaled.iter().enumerate() {
            if p < 1.0 {
                work[small] = i as u32;
                small += 1;
            } else {
                large -= 1;
                work[large] = i as u32;
            }
        }
        while small > 0 && large < n {
            small -= 1;
            let (s, l) = (work[small] as usize, work[large] as usize);
            threshold[s] = to_threshold(scaled[s]);
            alias[s] = l as u32;
            scaled[l] = (scaled[l] + scaled[s]) - 1.0;
            if scaled[l] < 1.0 {
                large += 1;
                work[small] = l as u32;
                small += 1;
            }
        }
        let any = weights.iter().position(|&w| w > 0.0).unwrap_or(0) as u32;
        for &i in work[..small].iter().chain(&work[large..]) {
            let i = i as usize;
            (threshold[i], alias[i]) = if weights[i] > 0.0 {
                (u32::MAX, i as u32)
            } else {
                (0, any)
            };
        }
        (threshold, alias)
    }

    #[test]
    fn tables_are_those_of_vose_with_a_scaled_copy() {
        let mut state = 7u64;
        for n in [1usize, 2, 3, 10, 1000, 100_000] {
            for kind in 0..4 {
                let weights: Vec<f64> = (0..n)
                    .map(|i| {
                        state = mix64(state);
                        let u = (state >> 11) as f64 / (1u64 << 53) as f64;
                        match kind {
                            0 => u,
                            1 => (i % 7) as f64,
                            2 => -u.ln() * if i % 50 == 0 { 1000.0 } else { 1.0 },
                            _ => {
                                if i % 3 == 0 {
                                    0.0
                                } else {
                                    1.0
                                }
                            }
                        }
                    })
                    .collect();
                if weights.iter().sum::<f64>() == 0.0 {
                    continue;
                }
                let table = AliasTable::new(&weights, "w").unwrap();
                let (threshold, alias) = vose_with_a_copy(&weights);
                assert!(
                    table.threshold == threshold && table.alias == alias,
                    "n={n} kind={kind}"
                );
            }
        }
    }

    #[test]
    fn draws_follow_the_weights() {
        let weights = [1.0, 0.0, 3.0, 6.0];
        let table = AliasTable::new(&weights, "w").unwrap();
        let n = 400_000u64;
        let counts = draw_counts(&table, EpochRandom::new(7, 0), n);
        assert_eq!(counts[1], 0, "zero weight drawn");
        for (i, &w) in weights.iter().enumerate() {
            let p = w / 10.0;
            let sigma = (n as f64 * p * (1.0 - p)).sqrt();
            let expected = n as f64 * p;
            assert!(
                (counts[i] as f64 - expected).abs() <= 5.0 * sigma + 1e-9,
                "{counts:?}"
            );
        }
    }

    #[test]
    fn random_bits_are_pure_functions_of_seed_epoch_and_index() {
        let a = EpochRandom::new(1, 2);
        assert_eq!(a.bits(5), EpochRandom::new(1, 2).bits(5));
        assert_ne!(a.bits(5), EpochRandom::new(1, 3).bits(5));
        assert_ne!(a.bits(5), EpochRandom::new(2, 2).bits(5));
        assert_ne!(a.bits(5), a.bits(6));
    }

    #[test]
    fn zero_weights_are_never_drawn_even_with_rounding() {
        // Many tiny and zero weights next to a huge one stress the leftover handling.
        let mut weights = vec![0.0; 1000];
        for i in (0..1000).step_by(3) {
            weights[i] = 1e-300;
        }
        weights[999] = 1e300;
        let table = AliasTable::new(&weights, "w").unwrap();
        let random = EpochRandom::new(0, 0);
        for k in 0..100_000 {
            let row = table.draw(random.bits(k)) as usize;
            assert!(weights[row] > 0.0, "row {row} of weight zero drawn");
        }
    }

    #[test]
    fn bad_weights_are_refused() {
        assert!(AliasTable::new(&[], "w").is_err());
        assert!(AliasTable::new(&[0.0, 0.0], "w").is_err());
        assert!(AliasTable::new(&[1.0, -1.0], "w").is_err());
        assert!(AliasTable::new(&[1.0, f64::NAN], "w").is_err());
        // Each finite, but their sum is not: scaling would make every row equally likely.
        assert!(AliasTable::new(&[1e308, 1e308], "w").is_err());
    }

    #[test]
    fn pinned_draws_do_not_change_between_releases() {
        let table = AliasTable::new(&[1.0, 2.0, 3.0, 4.0], "w").unwrap();
        let random = EpochRandom::new(0, 0);
        let rows: Vec<u64> = (0..12).map(|k| table.draw(random.bits(k))).collect();
        assert_eq!(rows, PINNED);
    }

    const PINNED: [u64; 12] = [2, 2, 2, 3, 3, 1, 3, 3, 2, 2, 1, 3];

    mod properties {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(64))]
            #[test]
            fn table_probabilities_match_weights(
                weights in proptest::collection::vec(prop_oneof![Just(0.0), 0.0f64..100.0], 1..40),
            ) {
                prop_assume!(weights.iter().sum::<f64>() > 0.0);
                let table = AliasTable::new(&weights, "w").unwrap();
                // The exact probability of each row from the table's columns.
                let n = weights.len() as f64;
                let mut prob = vec![0.0; weights.len()];
                for c in 0..weights.len() {
                    let accept = table.threshold[c] as f64 / 4_294_967_296.0;
                    prob[c] += accept / n;
                    prob[table.alias[c] as usize] += (1.0 - accept) / n;
                }
                let total: f64 = weights.iter().sum();
                for (i, &w) in weights.iter().enumerate() {
                    prop_assert!((prob[i] - w / total).abs() < 1e-6, "row {}: {} vs {}", i, prob[i], w / total);
                    if w == 0.0 {
                        prop_assert!(prob[i] == 0.0);
                    }
                }
            }
        }
    }
}
