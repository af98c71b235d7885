#!/usr/bin/env bash
# GPU smoke test of the trainer (not CI): the tiny pipeline's data, one-process training on cuda:0, DDP and
# FSDP2 training on every visible GPU (one GPU too) with nccl and bf16 autocast, the offline simulator on the
# exported draft, then the Kimi-shaped draft's step with its memory against the plan's.
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
# One process without torchrun must take cuda:0 (it used to train on the CPU whenever WORLD_SIZE was 1).
"$PY" -m eagle3.train "${SET[@]}" --set training.max_steps=50 --set training.batch_size=16 | tee "$RUN/single-gpu.log"
grep -q "on cuda:0" "$RUN/single-gpu.log" || { echo "train.sh: one-process training did not run on cuda:0" >&2; exit 1; }
rm -rf "$RUN/train"
"$PY" -m torch.distributed.run --standalone --nproc-per-node "$GPUS" -m eagle3.train "${SET[@]}" --set training.max_steps=200
rm -rf "$RUN/train"
"$PY" -m torch.distributed.run --standalone --nproc-per-node "$GPUS" -m eagle3.train "${SET[@]}" --set training.max_steps=200 --set training.fsdp=true
"$EAGLE3" convert "$RUN/train/best" "$RUN/export/sglang" --to sglang --release 0.5.13 --overwrite
"$EAGLE3" simulate "${SET[@]}"
# The Kimi-shaped draft's step at seq 4,096, TTT 7, 2 sequences: tokens/s, MFU, peak memory against eagle3 plan's.
# Its "measured MFU of the draft training step" line replaces the assumed node.mfu.train in `eagle3 plan`.
"$PY" benchmarks/train_throughput.py --steps 5
