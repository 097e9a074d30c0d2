//! Polars expression plugins of dataset_rt.
//!
//! Each `#[polars_expr]` function here converts its input columns, calls one function of
//! `drt-core`, and converts the result back; the arithmetic lives in the core so that the
//! loader and these expressions share it. The functions are exported as C symbols from the
//! `dataset_rt._native` module, which Python registers with `register_plugin_function`.

#![allow(missing_docs)] // the macro generates undocumented exported symbols

mod expressions;

pub use expressions::*;
