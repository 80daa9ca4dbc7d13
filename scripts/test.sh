#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite; kernels run through Triton's interpreter.
# Two worker processes (PRISM_TEST_WORKERS), each taking whole files: most tests run one core. Files go
# out in collection order (tests/conftest.py puts the ones that take minutes first), not xdist's default
# of the files with the most tests first, which could leave a warmup's file to start last.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TRITON_INTERPRET=1
exec .venv/bin/python -m pytest -q -n "${PRISM_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
