#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite; kernels run through Triton's interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TRITON_INTERPRET=1
exec .venv/bin/python -m pytest -q "$@"
