#!/usr/bin/env bash
# One-GPU smoke test of SGLang hidden-state capture, for the day a GPU and SGLang are at hand (not CI).
#
# It builds the tiny target, regenerates a few answers locally, captures hidden states twice, once
# with transformers and once with SGLang (tp 1), and compares the two datasets row by row.
#
#   SGLANG_PYTHON=/opt/sglang/bin/python infra/gpu-smoke/capture.sh [RUN_DIR]
# SGLANG_PYTHON is the python of an environment holding SGLang 0.5.23 and this project
# (`pip install --no-deps -e .` there).
set -euo pipefail
cd "$(dirname "$0")/../.."
RUN=${1:-runs/gpu-smoke-capture}
SGLANG_PYTHON=${SGLANG_PYTHON:-python}
EAGLE3=${EAGLE3:-.venv/bin/eagle3}
PY=${PY:-.venv/bin/python}
TARGET=runs/targets/tiny
COMMON=(--config configs/tiny-cpu.yaml --set "target.path=$TARGET" --set data.num_samples=32)

"$EAGLE3" make-tiny-target "$TARGET"
"$EAGLE3" data regenerate "${COMMON[@]}" --set "run.dir=$RUN/local"
"$EAGLE3" data capture "${COMMON[@]}" --set "run.dir=$RUN/local"

mkdir -p "$RUN/sglang/data"
rm -rf "$RUN/sglang/data/regen" && cp -r "$RUN/local/data/regen" "$RUN/sglang/data/regen"
"$EAGLE3" data capture "${COMMON[@]}" --set "run.dir=$RUN/sglang" --set data.feature_backend=sglang \
  --set "data.sglang_python=$SGLANG_PYTHON" --set serving.tp=1 --set data.batch_size=8

"$PY" infra/gpu-smoke/compare_capture.py "$RUN/local/data/hidden" "$RUN/sglang/data/hidden"
