#!/usr/bin/env bash
# On a machine with CUDA: runs the probe's GPU tests, then a full probe of the local GPUs.
#   bash scripts/probe_gpu.sh                 # writes hardware-gpu.yaml
#   bash scripts/probe_gpu.sh my-node.yaml    # or another path
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA here')"
"$PYTHON" -m pytest tests/gpu/test_probe_gpu.py -q
"$PYTHON" -m elixir_tune.cli.main probe --out "${1:-hardware-gpu.yaml}"
