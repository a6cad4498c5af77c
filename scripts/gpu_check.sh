#!/usr/bin/env bash
# One prepared GPU check (device machine): SAT step fp32 vs bf16, the CUDA demo, the train_loop
# benchmark (bf16 and fp32 rows). Needs $OUT; wheels for packages the GPU image lacks in .whl/.
# Each stage has its own time limit so that a slow one leaves the others' results in $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
SECONDS=0
timeout 90 python3 scripts/benchmark.py --only sat_train --json 2>&1 | tee "$OUT/sat_train.json"
echo "sat_train: ${SECONDS}s"
SECONDS=0
timeout "${DEMO_LIMIT:-240}" python3 -m captioner demo --device cuda --jobs 3 --encoder-budget 30 \
    --budget sat_soft=60,sat_hard=60,transformer=60 --out /tmp/demo_gpu 2>&1 | tee "$OUT/demo.log" | tail -40
cp /tmp/demo_gpu/report.json "$OUT/demo_report.json" 2>/dev/null
echo "demo: ${SECONDS}s"
SECONDS=0
timeout "${LOOP_LIMIT:-200}" python3 scripts/benchmark.py --only train_loop --json 2>&1 | tee "$OUT/train_loop.json" | tail -5
echo "train_loop: ${SECONDS}s"
