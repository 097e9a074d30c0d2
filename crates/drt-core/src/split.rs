//! Deterministic splits by a stable hash of an id.
//!
//! An id's split depends only on the id, the seed and the fractions: not on the other rows,
//! their order, the process, the platform or the Polars version. The hash is xxh3-64 over
//! the id's little-endian bytes (integers, as i64) or UTF-8 bytes (strings), which is
//! specified byte for byte and never changes with the library that computes it.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::error::{Error, Result};

/// The hash of an integer id.
#[inline]
pub fn hash_int(id: i64, seed: u64) -> u64 {
    xxh3_64_with_seed(&id.to_le_bytes(), seed)
}

/// The hash of a string id.
#[inline]
pub fn hash_str(id: &str, seed: u64) -> u64 {
    xxh3_64_with_seed(id.as_bytes(), seed)
}

/// Maps a hash to a uniform number in `[0, 1)` with 53 bits of precision.
#[inline]
pub fn unit_interval(hash: u64) -> f64 {
    (hash >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Bucket boundaries of a split: validated fractions turned into cumulative upper bounds.
#[derive(Debug, Clone)]
pub struct Splitter {
    bounds: Vec<f64>,
}

impl Splitter {
    /// Checks that `fractions` are positive, finite and sum to 1 (within 1e-9).
    pub fn new(fractions: &[f64]) -> Result<Self> {
        if fractions.is_empty() {
            return Err(Error::InvalidArgument(
                "a split needs at least one part".into(),
            ));
        }
        let mut bounds = Vec::with_capacity(fractions.len());
        let mut total = 0.0;
        for (i, &f) in fractions.iter().enumerate() {
            if !(f.is_finite() && f > 0.0) {
                return Err(Error::InvalidArgument(format!(
                    "split fraction {i} is {f}; fractions must be positive"
                )));
            }
            total += f;
            bounds.push(total);
        }
        if (total - 1.0).abs() > 1e-9 {
            return Err(Error::InvalidArgument(format!(
                "split fractions sum to {total}, not 1"
            )));
        }
        // Rounding must never leave a hash without a bucket.
        if let Some(last) = bounds.last_mut() {
            *last = f64::INFINITY;
        }
        Ok(Self { bounds })
    }

    /// The part a hash falls into.
    #[inline]
    pub fn part(&self, hash: u64) -> usize {
        let u = unit_interval(hash);
        self.bounds.partition_point(|&b| b <= u)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_are_the_specified_xxh3_values() {
        // Pinned values: a change here would move ids between train and validation sets.
        assert_eq!(hash_int(0, 0), 0xc77b_3abb_6f87_acd9);
        assert_eq!(hash_str("a", 0), xxh3_64_with_seed(b"a", 0));
        assert_ne!(hash_int(1, 0), hash_int(1, 1));
    }

    #[test]
    fn fractions_are_validated() {
        assert!(Splitter::new(&[]).is_err());
        assert!(Splitter::new(&[0.5, 0.4]).is_err());
        assert!(Splitter::new(&[1.1, -0.1]).is_err());
        assert!(Splitter::new(&[f64::NAN, 1.0]).is_err());
        assert!(Splitter::new(&[0.9, 0.1]).is_ok());
    }

    #[test]
    fn parts_follow_the_fractions() {
        let s = Splitter::new(&[0.7, 0.2, 0.1]).unwrap();
        let n = 200_000;
        let mut counts = [0usize; 3];
        for id in 0..n {
            counts[s.part(hash_int(id, 42))] += 1;
        }
        for (count, f) in counts.iter().zip([0.7, 0.2, 0.1]) {
            let expected = f * n as f64;
            let sigma = (n as f64 * f * (1.0 - f)).sqrt();
            assert!((*count as f64 - expected).abs() < 5.0 * sigma, "{counts:?}");
        }
        assert_eq!(s.part(u64::MAX), 2);
        assert_eq!(s.part(0), 0);
    }
}
