#!/usr/bin/env bash
# Installs the test dependencies and runs every check and test of dataset_rt.
# This is the README's test command; .ci/run calls it verbatim.
#
# It builds into a virtual environment in .venv (created if missing). Set CARGO_TARGET_DIR
# to share Rust build artifacts between checkouts: the Polars crates take minutes to compile.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== %s (%s)\n' "$*" "$(date +%H:%M:%S)"; }

step "virtual environment"
[ -x .venv/bin/python ] || python3 -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install --quiet --upgrade pip

step "install dataset_rt with its test dependencies (compiles the Rust extension)"
python -m pip install --quiet -e ".[test]"

step "rust: format, lint, unit tests"
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test -p drt-core --locked

step "python: format, lint, types, stubs"
ruff format --check .
ruff check .
mypy
python -m mypy.stubtest dataset_rt._native --allowlist .mypy-stubtest-allowlist

step "python: tests, doctests and docs"
python -m pytest "$@"
