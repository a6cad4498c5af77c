#!/usr/bin/env bash
# The project's test command (README quick start; .ci/run calls it).
# Installs the package with its test extra from pyproject.toml, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check -e ".[test]"
exec python -m pytest -q "$@"
