#!/usr/bin/env bash
# The GPU suite (bench/gpu_suite.py): bench/gpu_suite.sh PART [--smoke] [--out DIR] [--wheels DIR] [--budget SECONDS]
# Runs with $PYTHON, else the checkout's .venv when there is one, else python3 (on the GPU machine: the one with torch).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then py="$PYTHON"; elif [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
exec "$py" bench/gpu_suite.py "$@"
