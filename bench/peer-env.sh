#!/usr/bin/env bash
# Creates the virtual environment the original DatasetRT (PyPI dataset-rt 0.4.8) runs in for
# bench/run.py. Its import name is ours, so it never goes next to this checkout's dataset_rt:
# the runner starts that system's processes with this environment's python (bench/peers.py,
# DatasetRTPeer.python). torch is for its DataLoader ("2 workers").
#
#     bench/peer-env.sh              # at ${XDG_CACHE_HOME:-~/.cache}/drt-peer-0.4.8
#     bench/peer-env.sh DIR          # elsewhere; then export DATASET_RT_PEER_PYTHON=DIR/bin/python
#
# PYTHON picks the interpreter the environment is made from (default python3; 3.10 to 3.13).
set -euo pipefail
dir="${1:-${XDG_CACHE_HOME:-$HOME/.cache}/drt-peer-0.4.8}"
"${PYTHON:-python3}" -m venv "$dir"
"$dir/bin/pip" install "dataset-rt==0.4.8" torch numpy
"$dir/bin/python" -c "import dataset_rt; dataset_rt.DatasetRuntime; print('ok:', dataset_rt.__file__)"
if [ "$#" -gt 0 ]; then
    echo "export DATASET_RT_PEER_PYTHON=$dir/bin/python"
fi
