//! Column arithmetic on sampling weights, shared by the Polars expressions and the loader.

use crate::error::{quote, Error, Result};

/// Where a column of sampling weights breaks the rule: every weight finite and
/// non-negative, and a finite, positive sum.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fault {
    /// The weight of this row is missing.
    Null(usize),
    /// The weight of this row is negative, NaN or infinite.
    Invalid(usize, f64),
    /// Every weight is zero, or there are none: nothing could ever be drawn.
    Zero,
    /// The weights each fit, but their sum does not.
    Unbounded(f64),
}

impl Fault {
    /// The error, naming the column and the faulty row through `row` (e.g. "row 3" or
    /// "sample_id 17").
    pub fn error(self, column: &str, row: impl Fn(usize) -> String) -> Error {
        let column = quote(column);
        Error::Weight(match self {
            Fault::Null(r) => format!("weight column {column} is null at {}", row(r)),
            Fault::Invalid(r, w) => format!(
                "weight column {column} holds {w} at {}; weights must be finite and \
                 non-negative",
                row(r)
            ),
            Fault::Zero => format!(
                "weight column {column} sums to zero (or has no rows): nothing could ever be \
                 drawn"
            ),
            Fault::Unbounded(total) => format!(
                "weight column {column} sums to {total}; the weights must sum to a finite \
                 number"
            ),
        })
    }
}

/// The one rule for sampling weights: passes each checked weight to `each` and returns
/// their sum, or the first [`Fault`].
pub fn fold(
    weights: impl IntoIterator<Item = Option<f64>>,
    mut each: impl FnMut(f64),
) -> std::result::Result<f64, Fault> {
    let mut total = 0.0;
    for (row, w) in weights.into_iter().enumerate() {
        let w = w.ok_or(Fault::Null(row))?;
        if !w.is_finite() || w < 0.0 {
            return Err(Fault::Invalid(row, w));
        }
        each(w);
        total += w;
    }
    if !total.is_finite() {
        Err(Fault::Unbounded(total))
    } else if total > 0.0 {
        Ok(total)
    } else {
        Err(Fault::Zero)
    }
}

/// Checks weights by the rule of [`fold`]; returns their sum. `column` names the column
/// in error messages, and rows are named by their index.
pub fn checked_total(weights: impl IntoIterator<Item = Option<f64>>, column: &str) -> Result<f64> {
    fold(weights, |_| ()).map_err(|fault| fault.error(column, |r| format!("row {r}")))
}

/// Scales weights into probabilities that sum to 1.
pub fn normalize(weights: &[Option<f64>], column: &str) -> Result<Vec<f64>> {
    let total = checked_total(weights.iter().copied(), column)?;
    Ok(weights.iter().map(|w| w.unwrap_or(0.0) / total).collect())
}

/// Refuses base weights that are not one per row.
fn check_base(base: Option<&[f64]>, rows: usize) -> Result<()> {
    match base {
        Some(base) if base.len() != rows => Err(Error::InvalidArgument(format!(
            "{} base weights for {rows} rows",
            base.len()
        ))),
        _ => Ok(()),
    }
}

/// Per-row weights that give every group the same total (`power = 1`), leave the natural
/// distribution (`power = 0`), or anything in between (a temperature).
///
/// `group_of_row[i]` is row i's group, `0 <= g < num_groups`. With `base` weights, a group's
/// size is the sum of its base weights and each row keeps its share within its group. Row i
/// gets `base_i * total_g^(-power)`, scaled so that the weights sum to what the base weights
/// (or the row count) summed to: balancing changes the shares, not the overall scale.
pub fn balance(
    group_of_row: &[u32],
    num_groups: usize,
    power: f64,
    base: Option<&[f64]>,
) -> Result<Vec<f64>> {
    if !(0.0..=1.0).contains(&power) {
        return Err(Error::InvalidArgument(format!(
            "power must lie between 0 (natural distribution) and 1 (equal groups), got {power}"
        )));
    }
    check_base(base, group_of_row.len())?;
    let base_of = |i: usize| base.map_or(1.0, |b| b[i]);
    let mut totals = vec![0.0f64; num_groups];
    for (i, &g) in group_of_row.iter().enumerate() {
        let slot = totals
            .get_mut(g as usize)
            .ok_or_else(|| Error::Internal(format!("row {i} is in group {g} of {num_groups}")))?;
        *slot += base_of(i);
    }
    let factors: Vec<f64> = totals
        .iter()
        .map(|&t| if t > 0.0 { t.powf(-power) } else { 0.0 })
        .collect();
    let mut weights: Vec<f64> = group_of_row
        .iter()
        .enumerate()
        .map(|(i, &g)| base_of(i) * factors[g as usize])
        .collect();
    let wanted: f64 = totals.iter().sum();
    let got: f64 = weights.iter().sum();
    if got > 0.0 {
        let scale = wanted / got;
        weights.iter_mut().for_each(|w| *w *= scale);
    }
    Ok(weights)
}

/// Per-row probabilities that give each group exactly its share of the draws: a mixture.
///
/// `group_of_row[i]` is row i's group, an index into `shares` and `names` (the groups'
/// names, for messages). Shares are non-negative and scaled here to sum to 1; within a group,
/// rows divide its share in proportion to their `base` weights (equally without them). Row i
/// of group g gets `share_g / Σshares · base_i / Σ_{j in g} base_j`, so the probabilities of
/// group g's rows sum to exactly its share. A group with a positive share must have rows,
/// and base weights that are not all zero; a group with share 0 gets probability 0.
/// `column` names the group column in error messages.
pub fn mix(
    group_of_row: &[u32],
    shares: &[f64],
    names: &[String],
    base: Option<&[f64]>,
    column: &str,
) -> Result<Vec<f64>> {
    if names.len() != shares.len() {
        return Err(Error::Internal(format!(
            "{} group names for {} shares",
            names.len(),
            shares.len()
        )));
    }
    check_base(base, group_of_row.len())?;
    let total_share = checked_shares(names, shares)?;
    let base_of = |i: usize| base.map_or(1.0, |b| b[i]);
    let mut totals = vec![0.0f64; shares.len()];
    let mut rows = vec![0usize; shares.len()];
    for (i, &g) in group_of_row.iter().enumerate() {
        let g = g as usize;
        let slot = totals.get_mut(g).ok_or_else(|| {
            Error::Internal(format!("row {i} is in group {g} of {}", shares.len()))
        })?;
        *slot += base_of(i);
        rows[g] += 1;
    }
    for (g, name) in names.iter().enumerate() {
        if shares[g] > 0.0 && rows[g] == 0 {
            return Err(Error::InvalidArgument(format!(
                "group {} of column {} has a share of {} but no rows: its draws would have \
                 nowhere to go",
                quote(name),
                quote(column),
                shares[g]
            )));
        }
        if shares[g] > 0.0 && totals[g] <= 0.0 {
            return Err(Error::InvalidArgument(format!(
                "the {} rows of group {} of column {} all weigh zero, so its share of {} \
                 cannot be drawn",
                rows[g],
                quote(name),
                quote(column),
                shares[g]
            )));
        }
    }
    let factors: Vec<f64> = (0..shares.len())
        .map(|g| {
            if totals[g] > 0.0 {
                shares[g] / total_share / totals[g]
            } else {
                0.0
            }
        })
        .collect();
    Ok(group_of_row
        .iter()
        .enumerate()
        .map(|(i, &g)| base_of(i) * factors[g as usize])
        .collect())
}

/// Checks the shares of named groups: each finite and non-negative, not all zero. Returns
/// their sum.
pub fn checked_shares(names: &[String], shares: &[f64]) -> Result<f64> {
    let mut total = 0.0;
    for (name, &share) in names.iter().zip(shares) {
        if !share.is_finite() || share < 0.0 {
            return Err(Error::Weight(format!(
                "the share of group {} is {share}; shares must be finite and non-negative",
                quote(name)
            )));
        }
        total += share;
    }
    if !total.is_finite() {
        Err(Error::Weight(format!(
            "the shares sum to {total}; they must sum to a finite number"
        )))
    } else if total > 0.0 {
        Ok(total)
    } else {
        Err(Error::Weight(
            "every share is zero: nothing could ever be drawn".to_string(),
        ))
    }
}

/// Kish's effective sample size `(Σw)² / Σw²`: how many equally weighted samples carry as
/// much information as these weighted ones.
pub fn effective_size(weights: impl IntoIterator<Item = Option<f64>>, column: &str) -> Result<f64> {
    let mut squares = 0.0;
    let total = fold(weights, |w| squares += w * w)
        .map_err(|fault| fault.error(column, |r| format!("row {r}")))?;
    Ok(total * total / squares)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|g| format!("g{g}")).collect()
    }

    #[test]
    fn mix_gives_each_group_exactly_its_share() {
        let groups = [0, 0, 0, 1, 2, 2];
        let base = [1.0, 2.0, 1.0, 5.0, 0.0, 3.0];
        let p = mix(&groups, &[6.0, 3.0, 1.0], &names(3), Some(&base), "g").unwrap();
        let share = |g: u32| -> f64 { (0..6).filter(|&i| groups[i] == g).map(|i| p[i]).sum() };
        assert!((share(0) - 0.6).abs() < 1e-12);
        assert!((share(1) - 0.3).abs() < 1e-12);
        assert!((share(2) - 0.1).abs() < 1e-12);
        assert!(
            (p[1] - 2.0 * p[0]).abs() < 1e-12,
            "rows keep their shares within a group"
        );
        assert_eq!(p[4], 0.0);
        let equal = mix(&groups, &[1.0, 1.0, 0.0], &names(3), None, "g").unwrap();
        assert_eq!(equal[4], 0.0);
        assert!((equal[0] - 0.5 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn mix_refuses_shares_that_cannot_be_drawn() {
        let err = |groups: &[u32], shares: &[f64], base: Option<&[f64]>| {
            mix(groups, shares, &names(shares.len()), base, "g")
                .unwrap_err()
                .to_string()
        };
        assert!(err(&[0, 0], &[1.0, 1.0], None).contains("group 'g1' of column 'g' has a share"));
        assert!(err(&[0, 1], &[1.0, 1.0], Some(&[1.0, 0.0])).contains("all weigh zero"));
        assert!(err(&[0], &[0.0], None).contains("every share is zero"));
        assert!(err(&[0], &[-1.0], None).contains("finite and non-negative"));
        assert!(err(&[0], &[f64::NAN], None).contains("finite and non-negative"));
    }

    #[test]
    fn normalize_sums_to_one() {
        let p = normalize(&[Some(1.0), Some(3.0), Some(0.0)], "w").unwrap();
        assert_eq!(p, vec![0.25, 0.75, 0.0]);
    }

    fn group_totals(groups: &[u32], weights: &[f64], n: usize) -> Vec<f64> {
        let mut totals = vec![0.0; n];
        for (&g, &w) in groups.iter().zip(weights) {
            totals[g as usize] += w;
        }
        totals
    }

    #[test]
    fn balance_equalises_group_totals_and_keeps_the_scale() {
        let groups = [0, 0, 0, 1, 2, 2];
        let w = balance(&groups, 3, 1.0, None).unwrap();
        let totals = group_totals(&groups, &w, 3);
        for t in &totals {
            assert!((t - 2.0).abs() < 1e-12, "{totals:?}");
        }
        assert!((w.iter().sum::<f64>() - 6.0).abs() < 1e-12);
        assert_eq!(balance(&groups, 3, 0.0, None).unwrap(), vec![1.0; 6]);
    }

    #[test]
    fn balance_temperature_lies_between() {
        let groups = [0, 0, 0, 0, 1];
        let w = balance(&groups, 2, 0.5, None).unwrap();
        let totals = group_totals(&groups, &w, 2);
        // Group totals proportional to sqrt(size): 2 : 1.
        assert!((totals[0] / totals[1] - 2.0).abs() < 1e-12, "{totals:?}");
    }

    #[test]
    fn balance_with_base_weights_keeps_shares_within_groups() {
        let groups = [0, 0, 1];
        let base = [1.0, 3.0, 2.0];
        let w = balance(&groups, 2, 1.0, Some(&base)).unwrap();
        assert!((w[1] / w[0] - 3.0).abs() < 1e-12);
        let totals = group_totals(&groups, &w, 2);
        assert!((totals[0] - totals[1]).abs() < 1e-12);
        assert!((w.iter().sum::<f64>() - 6.0).abs() < 1e-12);
    }

    #[test]
    fn balance_rejects_bad_power_and_groups() {
        assert!(balance(&[0], 1, 1.5, None).is_err());
        assert!(balance(&[0], 1, f64::NAN, None).is_err());
        assert!(balance(&[3], 1, 1.0, None).is_err());
    }

    #[test]
    fn effective_size_of_uniform_and_skewed_weights() {
        let uniform = vec![Some(2.0); 10];
        assert!((effective_size(uniform, "w").unwrap() - 10.0).abs() < 1e-12);
        let skewed = vec![Some(1.0), Some(0.0), Some(0.0)];
        assert!((effective_size(skewed, "w").unwrap() - 1.0).abs() < 1e-12);
        assert!(effective_size(vec![Some(-1.0)], "w").is_err());
    }

    #[test]
    fn bad_weights_name_the_row() {
        for (bad, needle) in [
            (vec![Some(1.0), Some(-1.0)], "row 1"),
            (vec![Some(f64::NAN)], "row 0"),
            (vec![Some(1.0), Some(f64::INFINITY)], "row 1"),
            (vec![Some(1.0), None], "null at row 1"),
            (vec![Some(0.0), Some(0.0)], "sums to zero"),
            (vec![], "sums to zero"),
        ] {
            let err = normalize(&bad, "weight").unwrap_err().to_string();
            assert!(err.contains(needle), "{err}");
        }
    }
}
