#!/usr/bin/env bash
# Creates (or reuses) the virtual environment .venv and installs dask_monarch with the given extras.
# Usage: bash ci/setup.sh EXTRAS        e.g. bash ci/setup.sh test
# TORCH_SPEC (default "torch") is what pip installs first when .venv has no torch yet, so a build can be chosen,
# e.g. TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu" (words are split like pip arguments).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-test}"
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python" -m venv .venv
read -r -a torch_spec <<< "${TORCH_SPEC:-torch}"
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "${torch_spec[@]}"
.venv/bin/python -m pip install -q -e ".[${extras}]"
