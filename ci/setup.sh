#!/usr/bin/env bash
# Creates (or reuses) the virtual environment .venv and installs dask_monarch with the given extras.
# Usage: bash ci/setup.sh EXTRAS        e.g. bash ci/setup.sh test
# TORCH_SPEC (default "torch") is installed first, so a CPU build can be chosen, e.g. TORCH_SPEC=torch==2.13.0.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-test}"
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "${TORCH_SPEC:-torch}"
.venv/bin/python -m pip install -q -e ".[${extras}]"
