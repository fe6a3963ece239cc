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
# the files of the longest tests first (pytest collects a file named twice once): a worker
# that takes one last would otherwise run alone at the end
heavy=()
if (($# == 0)); then
  for f in offload restarts docs_examples batch kv_format offload_types backend_offload \
    kv_window offload_recurrent; do heavy+=("tests/test_$f.py"); done
  heavy+=(tests)
fi
exec python -m pytest -m "not gpu" -q -n "$workers" --dist loadfile --durations=25 ${heavy[@]+"${heavy[@]}"} "$@"
