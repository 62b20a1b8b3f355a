#!/usr/bin/env bash
# Builds the documentation site into build/docs: the Markdown pages of docs/ and the API reference from the
# docstrings, with Sphinx (docs/conf.py). Any warning is an error (a broken link or anchor, a page in no contents,
# a docstring docutils cannot parse), and every page is read again each time (-E), so an unchanged page or a
# changed docstring cannot pass on an earlier build. Sets up .venv with the "docs" extra first (ci/setup.sh).
# Usage: bash ci/docs.sh [sphinx-build options]; then open build/docs/index.html
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh docs
exec .venv/bin/python -m sphinx -W --keep-going -E -q -b html "$@" docs build/docs
