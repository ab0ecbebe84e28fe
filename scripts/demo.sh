#!/usr/bin/env bash
# The main job on a built-in default. Until profile/search/elixir-run exist it runs what exists:
# installs the package and validates the example plan.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
.venv/bin/python -c "import torch" 2>/dev/null || "${PIP[@]}" torch==2.13.0
"${PIP[@]}" -e '.[hf]'
echo "[demo] profile, probe, search and elixir-run are not built yet; validating the example plan:"
.venv/bin/elixir-tune validate configs/plans/example.yaml
