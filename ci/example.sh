#!/usr/bin/env bash
# The README's main-job command: set up .venv (see ci/setup.sh) and train the digits MLP data-parallel on an
# embedded local Dask cluster. Extra arguments go to examples/train_digits.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh examples
exec .venv/bin/python examples/train_digits.py "$@"
