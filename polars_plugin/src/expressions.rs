//! The `#[polars_expr]` wrappers: each converts its columns, calls `drt-core`, converts back.

use drt_core::error::quote;
use drt_core::split::{hash_int, hash_str, Splitter};
use polars::prelude::*;
use pyo3_polars::derive::polars_expr;
use serde::Deserialize;

/// Turns an engine error into a Polars compute error carrying the same message.
fn compute_err(err: drt_core::Error) -> PolarsError {
    polars_err!(ComputeError: "{err}")
}

// Output types are computed by functions (`output_type_func`), not declared with
// `output_type=`: the macro wraps only the former in `catch_unwind`, and a panic while Polars
// plans a query (an input dtype the FFI import cannot take) would otherwise abort Python.
// The same functions refuse unusable input dtypes by column and dtype before any row is read.

/// Whether a weight column of this dtype can be read as Float64.
fn numeric(dtype: &DataType) -> bool {
    dtype.is_primitive_numeric() || dtype.is_decimal() || dtype.is_null()
}

/// The first input field, refused unless `accept` takes its dtype (an extension dtype is
/// judged by its storage, which is what the expressions read).
fn first_input<'a>(
    fields: &'a [Field],
    what: &str,
    accept: fn(&DataType) -> bool,
    wanted: &str,
) -> PolarsResult<&'a Field> {
    let field = fields
        .first()
        .ok_or_else(|| polars_err!(ComputeError: "{what} needs an input column"))?;
    polars_ensure!(
        accept(&field.dtype().to_storage()),
        ComputeError: "{what} column {} must be {wanted}, not {}", quote(field.name()), field.dtype()
    );
    Ok(field)
}

fn weight_to_f64(fields: &[Field]) -> PolarsResult<Field> {
    let field = first_input(fields, "weight", numeric, "numeric")?;
    Ok(Field::new(field.name().clone(), DataType::Float64))
}

fn weight_to_i64(fields: &[Field]) -> PolarsResult<Field> {
    let field = first_input(fields, "weight", numeric, "numeric")?;
    Ok(Field::new(field.name().clone(), DataType::Int64))
}

fn groups_to_f64(fields: &[Field]) -> PolarsResult<Field> {
    let field = first_input(fields, "balance group", |_| true, "any")?;
    Ok(Field::new(field.name().clone(), DataType::Float64))
}

fn mixture_to_f64(fields: &[Field]) -> PolarsResult<Field> {
    let labels = |dtype: &DataType| {
        dtype.is_string() || dtype.is_categorical() || dtype.is_enum() || dtype.is_integer()
    };
    let field = first_input(fields, "mix group", labels, "strings or integers")?;
    Ok(Field::new(field.name().clone(), DataType::Float64))
}

fn ids_to_string(fields: &[Field]) -> PolarsResult<Field> {
    let ids = |dtype: &DataType| dtype.is_integer() || dtype.is_string() || dtype.is_null();
    let field = first_input(fields, "split id", ids, "integers or strings")?;
    Ok(Field::new(field.name().clone(), DataType::String))
}

/// Casts a numeric weight column to Float64, refusing other types by name.
fn weights_f64(s: &Series) -> PolarsResult<Float64Chunked> {
    let s = s.to_storage();
    polars_ensure!(
        numeric(s.dtype()),
        ComputeError: "weight column {} must be numeric, not {}", quote(s.name()), s.dtype()
    );
    Ok(s.cast(&DataType::Float64)?.f64()?.clone())
}

/// A checked weight column that `balance` and `mix` keep within each group, as values.
fn base_weights(s: &Series) -> PolarsResult<Vec<f64>> {
    let ca = weights_f64(s)?;
    drt_core::weights::checked_total(ca.iter(), s.name()).map_err(compute_err)?;
    Ok(ca.into_no_null_iter().collect())
}

/// Probabilities proportional to the weights: `pl.col("weight").drt.normalize()`.
#[polars_expr(output_type_func=weight_to_f64)]
fn normalize(inputs: &[Series]) -> PolarsResult<Series> {
    let s = &inputs[0];
    let weights = weights_f64(s)?;
    let total = drt_core::weights::checked_total(weights.iter(), s.name()).map_err(compute_err)?;
    Ok(weights.apply_values(|w| w / total).into_series())
}

/// Kish's effective sample size of a weight column, as a one-row aggregation.
#[polars_expr(output_type_func=weight_to_f64)]
fn effective_size(inputs: &[Series]) -> PolarsResult<Series> {
    let s = &inputs[0];
    let weights = weights_f64(s)?;
    let ess = drt_core::weights::effective_size(weights.iter(), s.name()).map_err(compute_err)?;
    Ok(Series::new(s.name().clone(), [ess]))
}

/// The group of every row, numbered in order of first appearance; nulls form a group.
fn group_ids(keys: &[Series]) -> PolarsResult<(Vec<u32>, usize)> {
    let height = keys.first().map_or(0, |s| s.len());
    let names: Vec<String> = (0..keys.len()).map(|i| format!("key{i}")).collect();
    let columns = keys
        .iter()
        .zip(&names)
        .map(|(s, name)| {
            s.to_storage()
                .clone()
                .with_name(name.as_str().into())
                .into_column()
        })
        .collect();
    let frame = DataFrame::new(height, columns)?;
    let grouped = frame.group_by_stable(&names)?;
    let groups = grouped.get_groups();
    let mut ids = vec![0u32; height];
    for (g, indicator) in groups.iter().enumerate() {
        let g = u32::try_from(g).map_err(|_| polars_err!(ComputeError: "more than 2^32 groups"))?;
        match indicator {
            GroupsIndicator::Idx((_, rows)) => rows.iter().for_each(|&r| ids[r as usize] = g),
            GroupsIndicator::Slice([first, len]) => {
                ids[first as usize..(first + len) as usize].fill(g)
            }
        }
    }
    Ok((ids, groups.len()))
}

#[derive(Deserialize)]
struct BalanceKwargs {
    power: f64,
    /// Whether the last input is a base weight column rather than a group key.
    weighted: bool,
}

/// Weights that equalise the groups formed by the key columns (`power = 1`), or temper
/// them (`0 < power < 1`); see `drt_core::weights::balance`.
#[polars_expr(output_type_func=groups_to_f64)]
fn balance(inputs: &[Series], kwargs: BalanceKwargs) -> PolarsResult<Series> {
    let (keys, base) = match (kwargs.weighted, inputs.split_last()) {
        (true, Some((base, keys))) => (keys, Some(base)),
        _ => (inputs, None),
    };
    polars_ensure!(!keys.is_empty(), ComputeError: "balance needs at least one group column");
    let base = base.map(base_weights).transpose()?;
    let (ids, num_groups) = group_ids(keys)?;
    let weights = drt_core::weights::balance(&ids, num_groups, kwargs.power, base.as_deref())
        .map_err(compute_err)?;
    Ok(Float64Chunked::from_vec(keys[0].name().clone(), weights).into_series())
}

#[derive(Deserialize)]
struct MixKwargs {
    /// The groups' labels, as their column's values cast to strings read.
    names: Vec<String>,
    shares: Vec<f64>,
    /// Whether a second input holds base weights to keep within each group.
    weighted: bool,
}

/// Probabilities that give every named group exactly its share of the draws; see
/// `drt_core::weights::mix`.
#[polars_expr(output_type_func=mixture_to_f64)]
fn mix(inputs: &[Series], kwargs: MixKwargs) -> PolarsResult<Series> {
    let column = &inputs[0];
    let labels = column.to_storage().cast(&DataType::String)?;
    let index: std::collections::HashMap<&str, u32> = kwargs
        .names
        .iter()
        .enumerate()
        .map(|(g, name)| (name.as_str(), g as u32))
        .collect();
    let mut groups = Vec::with_capacity(labels.len());
    for (row, label) in labels.str()?.iter().enumerate() {
        let label = label.ok_or_else(|| {
            polars_err!(ComputeError: "mix group column {} is null at row {row}; every row needs a group", quote(column.name()))
        })?;
        let group = index.get(label).ok_or_else(|| {
            polars_err!(
                ComputeError: "row {row} is in group {} of column {}, which mix() does not name (it names {}); filter the row out or give the group a share",
                quote(label), quote(column.name()), kwargs.names.iter().map(|n| quote(n)).collect::<Vec<_>>().join(", ")
            )
        })?;
        groups.push(*group);
    }
    let base = match (kwargs.weighted, inputs.get(1)) {
        (true, Some(s)) => Some(base_weights(s)?),
        _ => None,
    };
    let (shares, names) = (&kwargs.shares, &kwargs.names);
    let weights = drt_core::weights::mix(&groups, shares, names, base.as_deref(), column.name())
        .map_err(compute_err)?;
    Ok(Float64Chunked::from_vec(column.name().clone(), weights).into_series())
}

#[derive(Deserialize)]
struct SplitKwargs {
    names: Vec<String>,
    fractions: Vec<f64>,
    /// The u64 seed's bits as an i64: the kwargs decoder stops at `i64::MAX`.
    seed_bits: i64,
}

/// The split every id falls into, by a stable hash of the id; see `drt_core::split`.
#[polars_expr(output_type_func=ids_to_string)]
fn split(inputs: &[Series], kwargs: SplitKwargs) -> PolarsResult<Series> {
    let s = inputs[0].to_storage();
    polars_ensure!(
        kwargs.names.len() == kwargs.fractions.len(),
        ComputeError: "{} split names for {} fractions", kwargs.names.len(), kwargs.fractions.len()
    );
    let splitter = Splitter::new(&kwargs.fractions).map_err(compute_err)?;
    let name_of = |hash: u64| kwargs.names[splitter.part(hash)].as_str();
    let seed = kwargs.seed_bits as u64;
    let out: StringChunked = match s.dtype() {
        DataType::UInt64 => s
            .u64()?
            .iter()
            .map(|v| v.map(|v| name_of(hash_int(v as i64, seed))))
            .collect(),
        dt if dt.is_integer() => s
            .cast(&DataType::Int64)?
            .i64()?
            .iter()
            .map(|v| v.map(|v| name_of(hash_int(v, seed))))
            .collect(),
        DataType::Null => StringChunked::full_null(s.name().clone(), s.len()),
        DataType::String => s
            .str()?
            .iter()
            .map(|v| v.map(|v| name_of(hash_str(v, seed))))
            .collect(),
        dt => polars_bail!(
            ComputeError: "split ids must be integers or strings; column {} is {}", quote(s.name()), dt
        ),
    };
    Ok(out.with_name(s.name().clone()).into_series())
}

#[derive(Deserialize)]
struct DrawKwargs {
    /// Number of draws; the column's length when absent.
    n: Option<u64>,
    /// The u64 seed's bits as an i64 (the kwargs decoder stops at `i64::MAX`).
    seed_bits: i64,
    epoch: u64,
}

/// The alias table of a weight column and the epoch's random bits, as the loader builds them.
fn table_and_random(
    s: &Series,
    kwargs: &DrawKwargs,
) -> PolarsResult<(
    drt_core::sampler::AliasTable,
    drt_core::sampler::EpochRandom,
    u64,
)> {
    let weights = weights_f64(s)?;
    // Checked here first so that a null is reported as a null, not as the NaN below.
    drt_core::weights::checked_total(weights.iter(), s.name()).map_err(compute_err)?;
    let values: Vec<f64> = weights.iter().map(|w| w.unwrap_or(f64::NAN)).collect();
    let table = drt_core::sampler::AliasTable::new(&values, s.name()).map_err(compute_err)?;
    let random = drt_core::sampler::EpochRandom::new(kwargs.seed_bits as u64, kwargs.epoch);
    let n = kwargs.n.unwrap_or(s.len() as u64);
    Ok((table, random, n))
}

/// How many times each row is drawn in an epoch of `n` weighted draws with replacement:
/// exactly the draws a loader with the same seed and epoch makes.
#[polars_expr(output_type_func=weight_to_i64)]
fn draws(inputs: &[Series], kwargs: DrawKwargs) -> PolarsResult<Series> {
    let s = &inputs[0];
    let (table, random, n) = table_and_random(s, &kwargs)?;
    let counts = drt_core::sampler::draw_counts(&table, random, n);
    let counts: Vec<i64> = counts.into_iter().map(|c| c as i64).collect();
    Ok(Int64Chunked::from_vec(s.name().clone(), counts).into_series())
}

/// The row drawn at every position of an epoch of `n` draws, in draw order.
#[polars_expr(output_type_func=weight_to_i64)]
fn draw_rows(inputs: &[Series], kwargs: DrawKwargs) -> PolarsResult<Series> {
    let s = &inputs[0];
    let (table, random, n) = table_and_random(s, &kwargs)?;
    let rows: Vec<i64> = (0..n).map(|k| table.draw(random.bits(k)) as i64).collect();
    Ok(Int64Chunked::from_vec(s.name().clone(), rows).into_series())
}
