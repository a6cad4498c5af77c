#!/usr/bin/env bash
# The project's test command (README quick start; .ci/run calls it).
# Installs the package with its test extra at the exact versions of constraints.txt, then runs the
# whole suite, slow tests included (for the fast lane: python -m pytest -m "not slow").
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[test]"
exec python -m pytest -q "$@"
