#!/usr/bin/env bash
# Installs what the tests need into .venv (created or reused), checks lint, format and types, then
# runs the tests. Stops at the first step that fails.
#   bash scripts/test.sh            # ruff check, ruff format --check, mypy, then every test but the heavy ones
#   bash scripts/test.sh --all      # the same with the heavy tests (8 processes on the CPU)
#   bash scripts/test.sh --fast     # the same checks, then every test but the slow ones (a few minutes)
#   bash scripts/test.sh -k plan    # other arguments go to pytest
# Which versions (each in a virtual environment of its own):
#   (default)   .venv: the tested versions, constraints/tested.txt (what CI runs)
#   --latest    .venv-latest: the newest release of every package; run it each round, since a new
#               upstream release can break a user who installs today
#   --oldest    .venv-oldest: the lower bounds of setup.cfg, constraints/oldest.txt
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
MARKERS="not heavy"
VENV=.venv
CONSTRAINTS=(-c constraints/tested.txt)
# trl (the drop-in TRL test's) needs datasets>=4.7: the oldest set, datasets 4.0, goes without it and skips that test.
EXTRAS="test,lint,trl"
PYTEST_ARGS=()
for arg in "$@"; do
    case "$arg" in
        --fast) MARKERS="not slow" ;;
        --all) MARKERS="" ;;
        --latest) VENV=.venv-latest CONSTRAINTS=() ;;
        --oldest) VENV=.venv-oldest CONSTRAINTS=(-c constraints/oldest.txt) EXTRAS="test,lint" ;;
        *) PYTEST_ARGS+=("$arg") ;;
    esac
done
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# A plain `torch` requirement would pull the newest CUDA build (gigabytes); take the CPU build first.
"$VENV/bin/python" -c "import torch" 2>/dev/null || "${PIP[@]}" torch==2.13.0
if [ ${#CONSTRAINTS[@]} -eq 0 ]; then
    # The newest of everything but torch, whose newer releases here are CUDA builds of gigabytes.
    TORCH_PIN="$VENV/torch-pin.txt"
    "$VENV/bin/python" -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > "$TORCH_PIN"
    "${PIP[@]}" --upgrade --upgrade-strategy eager -c "$TORCH_PIN" -e ".[$EXTRAS]"
else
    "${PIP[@]}" "${CONSTRAINTS[@]}" -e ".[$EXTRAS]"
fi
"$VENV/bin/python" -c "import torch, transformers; print('== versions: torch', torch.__version__, '| transformers', transformers.__version__)"
echo "== ruff check"
"$VENV/bin/ruff" check .
echo "== ruff format --check"
"$VENV/bin/ruff" format --check .
echo "== mypy (settings in pyproject.toml)"
"$VENV/bin/mypy"
echo "== pytest"
if [ -n "$MARKERS" ]; then
    PYTEST_ARGS=(-m "$MARKERS" ${PYTEST_ARGS[@]+"${PYTEST_ARGS[@]}"})
fi
exec "$VENV/bin/python" -m pytest ${PYTEST_ARGS[@]+"${PYTEST_ARGS[@]}"}
