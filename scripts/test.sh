#!/usr/bin/env bash
# Installs what the tests need into .venv (created or reused) and runs the whole test suite.
#   bash scripts/test.sh            # all tests
#   bash scripts/test.sh -k plan    # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# A plain `torch` requirement would pull the newest CUDA build (gigabytes); take the CPU build first.
.venv/bin/python -c "import torch" 2>/dev/null || "${PIP[@]}" torch==2.13.0
"${PIP[@]}" -e '.[test]'
exec .venv/bin/python -m pytest "$@"
