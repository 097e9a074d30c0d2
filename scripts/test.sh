#!/usr/bin/env bash
# Builds the wheels users install and runs every check and test of dataset_rt against them,
# at both ends of the supported range. This is the README's test command; .ci/run calls it
# verbatim.
#
#   newest end: Python 3.13, the cp311-abi3 wheel, the newest Polars and PyTorch;
#               the Rust and Python linters and type checks run here.
#   oldest end: Python 3.10, the cp310 wheel, the lowest Polars pyproject.toml allows.
#
# Each end gets a virtual environment under .test-envs/. An interpreter is taken from PATH
# (python3.13, python3.10) or from pyenv. Without one the end is skipped with a message,
# except under CI=true, where both ends must run.
#
# Set CARGO_TARGET_DIR to share Rust build artifacts between checkouts: the Polars crates
# take minutes to compile, once per wheel.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== %s (%s)\n' "$*" "$(date +%H:%M:%S)"; }

# Prints the path of a CPython interpreter of version $1 (e.g. 3.10), or nothing.
find_python() {
    local candidate
    for candidate in "$(command -v "python$1" || true)" \
        "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$1".*/bin/"python$1"; do
        if [ -x "$candidate" ] && "$candidate" -c '' 2>/dev/null; then
            echo "$candidate"
            return
        fi
    done
}

target="${CARGO_TARGET_DIR:-$PWD/target}"
wheels="$PWD/dist/test-wheels"
newest="$(find_python 3.13)"
oldest="$(find_python 3.10)"
for end in "3.13:$newest" "3.10:$oldest"; do
    if [ -z "${end#*:}" ]; then
        if [ "${CI:-}" = true ]; then
            echo "error: no Python ${end%%:*} found (PATH or pyenv); CI runs both ends" >&2
            exit 1
        fi
        echo "warning: no Python ${end%%:*} found; its end of the range is skipped" >&2
    fi
done
[ -n "$newest" ] || newest="$(command -v python3)"

# Creates (if missing) the environment .test-envs/py$1 from interpreter $2, with maturin.
make_env() {
    local env=".test-envs/py$1"
    [ -x "$env/bin/python" ] || "$2" -m venv "$env"
    "$env/bin/python" -m pip install --quiet --upgrade pip "maturin>=1.9,<2"
}

step "virtual environments"
make_env new "$newest"
[ -z "$oldest" ] || make_env old "$oldest"
floor="$(.test-envs/pynew/bin/python -c '
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
(polars,) = [d for d in deps if re.match(r"polars\b", d)]
print(re.search(r">=\s*([\d.]+)", polars).group(1))')"

step "build the wheels (compiles the Rust extension, Polars' crates most of it)"
# Each build names the base interpreter, not the environment's: PyO3 recompiles itself and
# every crate above it (all of Polars) when the interpreter's path changes, and the path of
# an environment differs between checkouts.
rm -rf "$wheels"
.test-envs/pynew/bin/maturin build --release --features abi3 --out "$wheels" \
    --interpreter "$newest"
if [ -n "$oldest" ]; then
    # Its own target directory, for the same reason: builds for two interpreters would
    # otherwise invalidate each other's artifacts.
    CARGO_TARGET_DIR="$target/py3.10" .test-envs/pyold/bin/maturin build --release \
        --out "$wheels" --interpreter "$oldest"
fi
ls "$wheels"

step "install the wheels with their test dependencies"
# Each environment gets the wheel pip would choose for its interpreter from an index.
install() {
    local env=".test-envs/py$1" wheel
    wheel="$(echo "$wheels"/*-"$2"-*.whl)"
    "$env/bin/python" -m pip install --quiet --force-reinstall --no-deps "$wheel"
    "$env/bin/python" -m pip install --quiet "$wheel[test]" "${@:3}"
}
install new cp311-abi3
[ -z "$oldest" ] || install old cp310-cp310 "polars==$floor"

# Everything below runs against the installed wheels; the console scripts of the
# environments keep the checkout itself off sys.path.
export DATASET_RT_WHEELS="$wheels" DATASET_RT_TEST_INSTALLED=1
export PATH="$PWD/.test-envs/pynew/bin:$PATH"

# Checks the installed native module against its stub, in environment .test-envs/py$1. It
# runs from the wheels' directory: `python -m` puts the working directory first on sys.path,
# where the checkout's dataset_rt/ (without the compiled module) would shadow the installed
# package. The allowlist covers what only some Python versions show (see its comments).
stubtest() {
    local python="$PWD/.test-envs/py$1/bin/python" allow="$PWD/.mypy-stubtest-allowlist"
    (cd "$wheels" && "$python" -m mypy.stubtest dataset_rt._native --allowlist "$allow" \
        --ignore-unused-allowlist)
}

step "rust: format, lint, unit tests"
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test -p drt-core --locked

step "python: format, lint, types, stubs"
ruff format --check .
ruff check .
mypy
stubtest new

step "python $("$newest" -V | cut -d' ' -f2), newest Polars: tests, doctests and docs"
.test-envs/pynew/bin/python -c 'import polars; print("polars", polars.__version__)'
.test-envs/pynew/bin/pytest "$@"

if [ -n "$oldest" ]; then
    step "python $("$oldest" -V | cut -d' ' -f2), polars $floor: types, stubs, tests, doctests, docs"
    # mypy checks against the interpreter's own version: here the 3.10 standard library and
    # the floor Polars' annotations.
    .test-envs/pyold/bin/mypy
    stubtest old
    DATASET_RT_TEST_POLARS="$floor" .test-envs/pyold/bin/pytest "$@"
fi
