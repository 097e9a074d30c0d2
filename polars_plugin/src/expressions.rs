//! The `#[polars_expr]` wrappers and their output-type functions.

use drt_core::error::quote;
use polars::prelude::*;
use pyo3_polars::derive::polars_expr;

/// Turns an engine error into a Polars compute error carrying the same message.
fn compute_err(err: drt_core::Error) -> PolarsError {
    polars_err!(ComputeError: "{err}")
}

/// Casts a numeric weight column to Float64, refusing other types by name.
fn weights_f64(s: &Series) -> PolarsResult<Float64Chunked> {
    polars_ensure!(
        s.dtype().is_primitive_numeric() || s.dtype().is_null(),
        ComputeError: "weight column {} must be numeric, not {}", quote(s.name()), s.dtype()
    );
    Ok(s.cast(&DataType::Float64)?.f64()?.clone())
}

/// Probabilities proportional to the weights: `pl.col("weight").drt.normalize()`.
#[polars_expr(output_type=Float64)]
fn normalize(inputs: &[Series]) -> PolarsResult<Series> {
    let s = &inputs[0];
    let weights = weights_f64(s)?;
    let total = drt_core::weights::checked_total(weights.iter(), s.name()).map_err(compute_err)?;
    Ok(weights.apply_values(|w| w / total).into_series())
}
