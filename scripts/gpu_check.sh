#!/usr/bin/env bash
# One call on a GPU machine (torch + triton, no install needed): check and time every workload.
#   bash scripts/gpu_check.sh              # writes $OUT/gpu_check.{json,md}, cases in priority order until --budget-s
#   bash scripts/gpu_check.sh --interpret  # same path on the CPU through Triton's interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PRISM_SERVE_CACHE="${PRISM_SERVE_CACHE:-/tmp/prism-cache}"  # not under $OUT: only the results travel back
PY=python3
[ -x .venv/bin/python ] && [ "${1:-}" = "--interpret" ] && PY=.venv/bin/python
exec "$PY" scripts/gpu_check.py --out "${OUT:-out}" "$@"
