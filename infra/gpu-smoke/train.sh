#!/usr/bin/env bash
# GPU smoke test of the trainer (not CI): the tiny pipeline's data, then DDP and FSDP2 training on
# every visible GPU with nccl and bf16 autocast, then the offline simulator on the exported draft.
#   infra/gpu-smoke/train.sh [RUN_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
RUN=${1:-runs/gpu-smoke-train}
EAGLE3=${EAGLE3:-.venv/bin/eagle3}
PY=${PY:-.venv/bin/python}
GPUS=$(nvidia-smi -L | wc -l)
SET=(--config configs/tiny-cpu.yaml --set "run.dir=$RUN" --set target.path=runs/targets/tiny --set training.batch_size=$((16 * GPUS)))

"$EAGLE3" make-tiny-target runs/targets/tiny
"$EAGLE3" data regenerate "${SET[@]}"
"$EAGLE3" vocab build "${SET[@]}"
"$EAGLE3" data capture "${SET[@]}"
"$PY" -m torch.distributed.run --standalone --nproc-per-node "$GPUS" -m eagle3.train "${SET[@]}" --set training.max_steps=200
rm -rf "$RUN/train"
"$PY" -m torch.distributed.run --standalone --nproc-per-node "$GPUS" -m eagle3.train "${SET[@]}" --set training.max_steps=200 --set training.fsdp=true
"$EAGLE3" convert "$RUN/train/best" "$RUN/export/sglang" --to sglang --engine-version 0.5.13 --overwrite
"$EAGLE3" simulate "${SET[@]}"
