#!/usr/bin/env bash
# The Flickr8k recipe on one CUDA GPU, plus the SAT step and train_loop benchmarks, in one call.
#
#   OUT=/tmp/out bash scripts/gpu_flickr8k.sh DATA
#
# DATA: a Flickr8k folder in the layout of ../shared/data/flickr8k (captions_coco_format.json,
# splits.tsv, images/). Wheels for packages the GPU image lacks may sit in .whl/.
# Stages, each with its own time limit so that a slow one leaves the others' results in $OUT:
#   1. scripts/benchmark.py --only sat_train (fp32 and bf16 rows)
#   2. the three *_flickr8k presets at 224 px (7 x 7, the CPU recipe as it is) and at 448 px (a real
#      14 x 14 grid of the same encoder), six runs side by side on the one GPU (launch-bound: one run
#      leaves the GPU mostly idle); fp32, batch 32, the recipe's epochs
#   3. scripts/benchmark.py --only train_loop
# $OUT gets machine.txt, sat_train.json, train_loop.json, flickr8k_summary.txt (one row per run:
# best dev BLEU-4 / CIDEr-D, attention entropy, seconds per epoch, peak GPU memory) and
# flickr8k_runs.tar.gz (every run's metrics.csv, config.json and log).
set -uo pipefail
DATA=${1:?usage: OUT=DIR bash scripts/gpu_flickr8k.sh DATA}
export OMP_NUM_THREADS=2
source "$(dirname "$0")/gpu_env.sh"

SECONDS=0
timeout "${BENCH_LIMIT:-100}" python3 scripts/benchmark.py --only sat_train --json 2>&1 | tee "$OUT/sat_train.json"
echo "sat_train: ${SECONDS}s"

RUNS=${RUNS:-/tmp/f8k_runs}
mkdir -p "$RUNS"
SECONDS=0
pids=()
train_run() {  # preset size: one run in the background
    local preset=$1 size=$2 name="${1%_flickr8k}_$2"
    timeout "${RUN_LIMIT:-330}" python3 -m captioner train --preset "$preset" --data "$DATA" --out "$RUNS/$name" \
        --device "${DEVICE:-cuda}" --no-progress --set train.amp=off --set data.num_workers=4 ${EXTRA:-} \
        --set data.feature_cache_dir="$RUNS/features" --set encoder.image_size="$size" --set encoder.grid=$(($2 / 32)) \
        > "$RUNS/$name.log" 2>&1 &
    pids+=($!)
}
# One cache per resolution, shared by its three decoders: SAT soft builds it (a second writer would be
# refused by the cache's lock), and the other two start once its train and dev caches are complete.
train_run sat_soft_flickr8k 224
train_run sat_soft_flickr8k 448
for _ in $(seq 300); do
    [ "$(ls "$RUNS"/features/*.feats 2>/dev/null | wc -l)" -ge 4 ] && break
    sleep 1
done
echo "feature caches (224 and 448 px): ${SECONDS}s"
for size in 224 448; do
    train_run sat_hard_flickr8k "$size"
    train_run transformer_flickr8k "$size"
done
# peak GPU memory of the whole machine, sampled every 2 s while the runs go
( while sleep 2; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null; done ) \
    > "$RUNS/gpu_memory_mib.txt" &
sampler=$!
wait "${pids[@]}"
kill "$sampler" 2>/dev/null
echo "flickr8k runs: ${SECONDS}s"
python3 - "$RUNS" <<'EOF' | tee "$OUT/flickr8k_summary.txt"
import csv, sys
from pathlib import Path
runs = Path(sys.argv[1])
print("run | epochs | best dev BLEU-4 | best dev CIDEr-D | attention entropy | train s/epoch (last) | captions/s")
for d in sorted(p for p in runs.iterdir() if p.is_dir() and p.name != "features"):
    rows = list(csv.DictReader(open(d / "metrics.csv"))) if (d / "metrics.csv").exists() else []
    val = [r for r in rows if r["kind"] == "epoch" and r["CIDEr-D"]]
    if not val:
        print(f"{d.name} | 0 | - | - | - | - | -"); continue
    best = max(val, key=lambda r: float(r["CIDEr-D"]))
    secs = [float(r["seconds"]) for r in val]
    per_epoch = secs[-1] - secs[-2] if len(secs) > 1 else secs[-1]
    print(f"{d.name} | {len(val)} | {float(best['BLEU-4']):.4f} | {float(best['CIDEr-D']):.4f} | "
          f"{best['attention_entropy']} | {per_epoch:.0f} | {val[-1]['captions_per_s']}")
mem = [int(x) for x in open(runs / "gpu_memory_mib.txt").read().split() if x.strip().isdigit()]
print(f"peak GPU memory, all six runs together: {max(mem) if mem else 'n/a'} MiB")
EOF
tar -czf "$OUT/flickr8k_runs.tar.gz" -C "$RUNS" --exclude='*.safetensors' --exclude='train_state.pt' --exclude='features' . 2>/dev/null

SECONDS=0
timeout "${LOOP_LIMIT:-100}" python3 scripts/benchmark.py --only train_loop --json 2>&1 | tee "$OUT/train_loop.json" | tail -5
echo "train_loop: ${SECONDS}s"
