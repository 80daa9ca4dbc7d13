#!/usr/bin/env bash
# One call on a GPU machine (torch + triton, no install needed): check and time every workload.
#   bash scripts/gpu_check.sh              # writes $OUT/gpu_check.{json,md}, ~8 min on an H200
#   bash scripts/gpu_check.sh --interpret  # same path on the CPU through Triton's interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PRISM_SERVE_CACHE="${PRISM_SERVE_CACHE:-${OUT:-/tmp}/prism-cache}"
PY=python3
[ -x .venv/bin/python ] && [ "${1:-}" = "--interpret" ] && PY=.venv/bin/python
exec "$PY" scripts/gpu_check.py --out "${OUT:-out}" "$@"
