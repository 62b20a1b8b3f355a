#!/usr/bin/env bash
# The README's test command: set up .venv (see ci/setup.sh) and run the test suite on CPU workers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh test
exec .venv/bin/python -m pytest -q "$@"
