#!/usr/bin/env bash
# elixir-tune end to end on this machine's CPU, from a fresh clone: install, profile the tiny
# GPT-2, probe the machine, search a plan for 2 processes, show it, and train it with elixir-run
# (2 CPU workers, gloo) on a bundled public-domain text. A few minutes on 2 cores.
#   bash scripts/demo.sh                 # everything
#   STEPS=400 bash scripts/demo.sh       # train longer
# Outputs go to runs/demo/ (git-ignored): profile.yaml, hardware.yaml, plan.yaml, train.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
STEPS=${STEPS:-200}
OUT=runs/demo
started=$(date +%s)

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# A plain `torch` requirement would pull the newest CUDA build (gigabytes); take the CPU build first.
.venv/bin/python -c "import torch" 2>/dev/null || "${PIP[@]}" torch==2.13.0
# Install this checkout (editable, with transformers) unless it already is.
.venv/bin/python - <<'EOF' 2>/dev/null || "${PIP[@]}" -c constraints/tested.txt -e '.[hf]'
import os, sys, transformers, elixir_tune
sys.exit(0 if os.path.realpath(elixir_tune.__file__).startswith(os.path.realpath("elixir_tune")) else 1)
EOF
[ -x .venv/bin/elixir-run ] || "${PIP[@]}" -c constraints/tested.txt -e '.[hf]'
mkdir -p "$OUT"
BIN=.venv/bin

section() { printf '\n\033[1m== [demo] %s ==\033[0m\n' "$*"; }

section "1/5 profile the tiny GPT-2 on the meta device"
"$BIN/elixir-tune" profile configs/models/gpt2-tiny.yaml --batch-size 8 --seq-len 128 --out "$OUT/profile.yaml"

section "2/5 probe this machine (quick)"
# --allow-loaded: the demo goes on when other work loads the machine (the file records it, search warns).
"$BIN/elixir-tune" probe --quick --allow-loaded --out "$OUT/hardware.yaml"

section "3/5 search a plan for 2 processes"
# the pretrain recipe runs model.forward_backward(micro_batches) on elixir_tune.data_rank()'s slice, so the
# search may also offer pipeline, tensor and layered plans (--loop forward_backward).
"$BIN/elixir-tune" search --gpus 2 --profile "$OUT/profile.yaml" --hardware "$OUT/hardware.yaml" \
    --global-batch-size 16 --loop forward_backward --out "$OUT/plan.yaml"

section "4/5 the plan"
"$BIN/elixir-tune" show "$OUT/plan.yaml"

section "5/5 train it with elixir-run: $STEPS steps on 2 CPU workers"
"$BIN/elixir-run" "$OUT/plan.yaml" pretrain --steps "$STEPS" --log "$OUT/train.json"

section "done in $(( $(date +%s) - started )) s"
"$BIN/python" - "$OUT/train.json" <<'EOF'
import json, sys
summary = json.load(open(sys.argv[1]))["summary"]
print(f"loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f} over {summary['steps_done']} steps, "
      f"{summary['mean_tokens_per_s']:,.0f} tokens/s")
EOF
echo "outputs: $OUT/profile.yaml $OUT/hardware.yaml $OUT/plan.yaml $OUT/train.json"
