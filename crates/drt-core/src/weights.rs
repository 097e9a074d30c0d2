//! Column arithmetic on sampling weights, shared by the Polars expressions and the loader.

use crate::error::{quote, Error, Result};

/// Checks that every weight is finite and non-negative and that they do not sum to zero;
/// returns the sum. `column` names the column in error messages.
pub fn checked_total(weights: impl IntoIterator<Item = Option<f64>>, column: &str) -> Result<f64> {
    let mut total = 0.0;
    for (row, w) in weights.into_iter().enumerate() {
        let Some(w) = w else {
            return Err(Error::InvalidArgument(format!(
                "weight column {} is null at row {row}",
                quote(column)
            )));
        };
        if !w.is_finite() || w < 0.0 {
            return Err(Error::InvalidArgument(format!(
                "weight column {} holds {w} at row {row}; weights must be finite and \
                 non-negative",
                quote(column)
            )));
        }
        total += w;
    }
    if total <= 0.0 {
        return Err(Error::InvalidArgument(format!(
            "weight column {} sums to zero; at least one row needs a positive weight",
            quote(column)
        )));
    }
    Ok(total)
}

/// Scales weights into probabilities that sum to 1.
pub fn normalize(weights: &[Option<f64>], column: &str) -> Result<Vec<f64>> {
    let total = checked_total(weights.iter().copied(), column)?;
    Ok(weights.iter().map(|w| w.unwrap_or(0.0) / total).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalize_sums_to_one() {
        let p = normalize(&[Some(1.0), Some(3.0), Some(0.0)], "w").unwrap();
        assert_eq!(p, vec![0.25, 0.75, 0.0]);
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
