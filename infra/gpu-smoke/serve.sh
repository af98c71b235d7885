#!/usr/bin/env bash
# One-GPU smoke test of serving (not CI): real SGLang serving the tiny target with a draft trained
# here, benchmarked with the same client as the reference server, and compared with the reference
# server and the offline simulator.
#   SGLANG_PYTHON=/opt/sglang/bin/python infra/gpu-smoke/serve.sh [RUN_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
RUN=${1:-runs/gpu-smoke-serve}
SGLANG_PYTHON=${SGLANG_PYTHON:-python}
EAGLE3=${EAGLE3:-.venv/bin/eagle3}
PY=${PY:-.venv/bin/python}
RELEASE=$("$SGLANG_PYTHON" -c "import sglang; print(sglang.__version__)")
SET=(--config configs/tiny-cpu.yaml --set "run.dir=$RUN" --set target.path=runs/targets/tiny --set "serving.release=$RELEASE")

"$EAGLE3" make-tiny-target runs/targets/tiny
"$EAGLE3" data regenerate "${SET[@]}"
"$EAGLE3" vocab build "${SET[@]}"
"$EAGLE3" data capture "${SET[@]}"
"$PY" -m eagle3.train "${SET[@]}"
"$EAGLE3" convert "$RUN/train/best" "$RUN/export/sglang" --to sglang --release "$RELEASE" --overwrite
"$EAGLE3" simulate "${SET[@]}"

"$SGLANG_PYTHON" -m sglang.launch_server --model-path runs/targets/tiny --speculative-algorithm EAGLE3 \
  --speculative-draft-model-path "$RUN/export/sglang" --speculative-num-steps 3 --speculative-eagle-topk 1 \
  --speculative-num-draft-tokens 4 --tp 1 --host 127.0.0.1 --port 30010 --context-length 2048 > "$RUN/sglang.log" 2>&1 &
SGLANG=$!
"$EAGLE3" serve --target runs/targets/tiny --draft "$RUN/export/sglang" --release "$RELEASE" --port 30011 > "$RUN/reference.log" 2>&1 &
REFERENCE=$!
trap 'kill $SGLANG $REFERENCE 2>/dev/null || true' EXIT
for port in 30010 30011; do
  until curl -sf "http://127.0.0.1:$port/health_generate" > /dev/null; do sleep 5; done
done

"$EAGLE3" bench --url http://127.0.0.1:30010 "${SET[@]}" --out "$RUN/bench/sglang.json"
"$EAGLE3" bench --url http://127.0.0.1:30011 "${SET[@]}" --out "$RUN/bench/reference.json"
"$PY" - "$RUN" <<'PY'
import json, sys
run = sys.argv[1]
numbers = {name: json.load(open(f"{run}/bench/{name}.json"))["accept_length"] for name in ("sglang", "reference")}
numbers["simulated"] = json.load(open(f"{run}/bench/simulated.json"))["accept_length"]
print("accept length:", numbers)
spread = max(numbers.values()) / min(numbers.values()) - 1
print(f"spread {spread:.1%}: " + ("consistent" if spread < 0.05 else "MISMATCH: run the diagnosis"))
PY
