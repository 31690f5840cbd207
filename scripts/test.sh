#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the whole test suite; prints the suite's wall time.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
start=$(date +%s)
status=0
.venv/bin/ruff check . || { echo "lint failed: run '.venv/bin/ruff check . --fix' and fix the rest by hand"; exit 1; }
.venv/bin/python -m pytest "${@:-tests}" || status=$?
echo "test suite wall time: $(( $(date +%s) - start )) s (exit status $status)"
exit $status
