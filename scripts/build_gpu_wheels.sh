#!/usr/bin/env bash
# Builds the wheels a GPU validation run needs beyond the GPU machine's image, on a machine that
# can reach a package registry, into wheels/ (git-ignored; at most 64 MiB, so it can travel with
# the working tree to a machine that has no registry).
#   bash scripts/build_gpu_wheels.sh            # -> wheels/*.whl and wheels/MANIFEST.txt
#   WHEELS=/tmp/w bash scripts/build_gpu_wheels.sh
# The GPU image (Python 3.12, x86-64) already has torch 2.11 (CUDA 13), nvcc, ninja, transformers,
# accelerate, numpy, psutil, py-cpuinfo, msgpack, einops, tqdm, click, rich, pyyaml, pytest,
# packaging and nvidia-ml-py. It lacks DeepSpeed (published only as a source distribution),
# hjson and pydantic (with pydantic-core, annotated-types, typing-inspection, a new enough
# typing-extensions), and this project. scripts/gpu_validate.py installs them with
#   pip install --no-index --find-links wheels deepspeed elixir-tune ...
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-wheels}
PY=${PY:-.venv/bin/python}
LIMIT_BYTES=$((64 * 1024 * 1024))
DEEPSPEED=${DEEPSPEED:-deepspeed==0.19.8}
# Pure-Python or manylinux wheels for CPython 3.12 on x86-64; versions pinned so a rerun is reproducible.
BINARY=(hjson==3.1.0 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
        typing-extensions==4.16.0)

"$PY" -c "import torch" || { echo "needs $PY with torch (the CPU build) to build DeepSpeed"; exit 1; }
mkdir -p "$WHEELS"
rm -f "$WHEELS"/*.whl "$WHEELS"/MANIFEST.txt
PLATFORMS=()
for tag in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do PLATFORMS+=(--platform "$tag"); done

echo "== binary wheels for CPython 3.12 x86-64"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$WHEELS" "${BINARY[@]}"

echo "== DeepSpeed: the sdist, built into a wheel with every op left to JIT compilation (DS_BUILD_OPS=0)"
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
"$PY" -m pip download --quiet --no-deps --no-binary=:all: -d "$src" "$DEEPSPEED"
# --no-build-isolation: setup.py imports torch; isolation would download a (CUDA) torch.
# The ops are compiled on first use on the GPU machine (it has nvcc and ninja), so the wheel is
# pure Python and independent of this machine's Python version.
DS_BUILD_OPS=0 DS_BUILD_AIO=0 DS_BUILD_GDS=0 "$PY" -m pip wheel --quiet --no-deps --no-build-isolation \
    -w "$WHEELS" "$src"/deepspeed-*.tar.gz

echo "== this project"
"$PY" -m pip wheel --quiet --no-deps --no-build-isolation -w "$WHEELS" .

total=$(du -cb "$WHEELS"/*.whl | tail -1 | cut -f1)
ls -l "$WHEELS"/*.whl | awk '{print $5, $9}' | tee "$WHEELS/MANIFEST.txt"
echo "total $total bytes ($((total / 1024 / 1024)) MiB) in $WHEELS" | tee -a "$WHEELS/MANIFEST.txt"
if [ "$total" -gt "$LIMIT_BYTES" ]; then
    echo "over the 64 MiB that can travel with the working tree"
    exit 1
fi
