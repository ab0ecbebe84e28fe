#!/usr/bin/env bash
# Installs what the tests need into .venv (created or reused), checks lint, format and types, then
# runs the tests. Stops at the first step that fails.
#   bash scripts/test.sh            # ruff check, ruff format --check, mypy, then every test but the heavy ones
#   bash scripts/test.sh --all      # the same with the heavy tests (8 processes on the CPU)
#   bash scripts/test.sh --fast     # the same checks, then every test but the slow ones (a few minutes)
#   bash scripts/test.sh -k plan    # other arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
MARKERS="not heavy"
PYTEST_ARGS=()
for arg in "$@"; do
    case "$arg" in
        --fast) MARKERS="not slow" ;;
        --all) MARKERS="" ;;
        *) PYTEST_ARGS+=("$arg") ;;
    esac
done
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# A plain `torch` requirement would pull the newest CUDA build (gigabytes); take the CPU build first.
.venv/bin/python -c "import torch" 2>/dev/null || "${PIP[@]}" torch==2.13.0
"${PIP[@]}" -e '.[test,lint]'
echo "== ruff check"
.venv/bin/ruff check .
echo "== ruff format --check"
.venv/bin/ruff format --check .
echo "== mypy (settings in pyproject.toml)"
.venv/bin/mypy
echo "== pytest"
if [ -n "$MARKERS" ]; then
    PYTEST_ARGS=(-m "$MARKERS" ${PYTEST_ARGS[@]+"${PYTEST_ARGS[@]}"})
fi
exec .venv/bin/python -m pytest ${PYTEST_ARGS[@]+"${PYTEST_ARGS[@]}"}
