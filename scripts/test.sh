#!/usr/bin/env bash
# Install the test dependencies and run every check: ruff, mypy, and the CPU test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k quant).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
scripts/install.sh --test
. "$VENV/bin/activate"
echo "== ruff"; ruff check stratad stratactl kernels bench tests
echo "== mypy"; mypy
echo "== pytest"
# Triton kernels run on the CPU through Triton's interpreter.
export TRITON_INTERPRET=1
# One worker a core, at most 4 (pytest-xdist), each test file whole on one worker so that its
# module fixtures (models, daemons) are made once; `scripts/test.sh -n 0` runs in one process.
workers=$(nproc)
((workers > 4)) && workers=4
exec python -m pytest -m "not gpu" -q -n "$workers" --dist loadfile --durations=25 "$@"
