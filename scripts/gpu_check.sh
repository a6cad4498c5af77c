#!/usr/bin/env bash
# The prepared GPU check, one call on the device machine, from the repository root:
#
#   OUT=DIR bash scripts/gpu_check.sh                 # the GPU: ~5-6 minutes, stages stop at TOTAL_LIMIT (390 s)
#   DRY_RUN=1 OUT=/tmp/gc bash scripts/gpu_check.sh   # the same stages on the CPU at tiny sizes (~1-2 min)
#
# Stages, in order of importance; each has its own time limit (cut to what is left of TOTAL_LIMIT), writes
# $OUT/<stage>.json (or run folders) and $OUT/<stage>.log as it goes, and a failing stage is reported in
# $OUT/stages.txt while the others still run. Every figure lands in $OUT/summary.json and $OUT/summary.txt.
#   cuda_tests     the capture tests that skip without CUDA (captured step and graphed search against eager)
#   sat_graph      training step at paper sizes: tutorial, fp32 / bf16 eager and captured, hard eager / captured
#   beam_graph     greedy and beam-3 images/s over 256 images, eager vs graphed steps (same captions?)
#   coco_scale     a 20,000-image memory-mapped feature cache (15 GiB) through the training loader, captured step
#   f8k_graph      the Flickr8k recipe at 448 px (14 x 14), train.cuda_graph, one epoch (time-budgeted)
#   f8k_eager      the same, eager, on the cache the previous stage built
#   (ONLY="stage ..." runs just those stages, e.g. a short rerun; FULL=1 adds the earlier sat_train and train_loop benchmarks, if TOTAL_LIMIT leaves time)
# Wheels for packages the GPU image lacks come from .whl/ (scripts/gpu_env.sh); the Flickr8k data from
# F8K_DATA (default .gpu_data/flickr8k; in the dry run a small synthetic scene set).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder for the results}"
mkdir -p "$OUT"
DRY=${DRY_RUN:-0}
TOTAL=${TOTAL_LIMIT:-390}
T0=$(date +%s)
: > "$OUT/stages.txt"
if [ "$DRY" = 1 ]; then
    export CUDA_VISIBLE_DEVICES=""
    export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
    QUICK=--quick
    COLLECT=--collect-only  # the suite runs these tests itself; a dry run checks that they are found
    echo "dry run on the CPU (tiny sizes)" | tee "$OUT/machine.txt"
else
    source scripts/gpu_env.sh || echo "gpu_env: wheels not installed; stages that need them will fail" \
        | tee -a "$OUT/stages.txt"
    QUICK=
    COLLECT=
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
WORK=${WORK:-/tmp/gpu_check_work}
rm -rf "$WORK"; mkdir -p "$WORK"

stage() {  # stage NAME LIMIT_S COMMAND...: stdout to $OUT/NAME.json (benchmarks) or the log, stderr to the log
    local name=$1 limit=$2; shift 2
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi  # ONLY="sat_graph beam_graph": a rerun
    local left=$(( TOTAL - ($(date +%s) - T0) ))
    if (( left < 30 )); then
        echo "$name: skipped, ${left}s left of TOTAL_LIMIT=${TOTAL}" | tee -a "$OUT/stages.txt"; return
    fi
    (( limit > left )) && limit=$left
    local began=$(date +%s)
    timeout -k 10 "$limit" "$@" > "$OUT/$name.out" 2> "$OUT/$name.log"
    local rc=$?
    local note=ok
    (( rc == 124 || rc == 137 )) && note="timed out"
    (( rc != 0 && rc != 124 && rc != 137 )) && note="failed: $(grep -v '^\s*$' "$OUT/$name.log" | tail -1 | cut -c1-200)"
    echo "$name: rc=$rc ${note}, $(( $(date +%s) - began ))s (limit ${limit}s)" | tee -a "$OUT/stages.txt"
    if [ -s "$OUT/$name.out" ] && head -c1 "$OUT/$name.out" | grep -q '{'; then mv "$OUT/$name.out" "$OUT/$name.json"; fi
}

gpu_memory() {  # sample the GPU's used memory every second into $OUT/$1 until killed
    ( while sleep 1; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null; done ) \
        > "$OUT/$1" &
    echo $!
}

stage cuda_tests 60 python3 -m pytest -q -p no:cacheprovider $COLLECT tests/test_cuda_graph.py tests/test_decoding_graphs.py
stage sat_graph 100 python3 scripts/benchmark.py --only sat_graph --json $QUICK
stage beam_graph 80 python3 scripts/benchmark.py --only beam_graph --json $QUICK
export SCALE_DIR=$WORK SCALE_SECONDS=${SCALE_SECONDS:-30}
stage coco_scale 120 python3 scripts/benchmark.py --only coco_scale --json $QUICK

# Flickr8k at 448 px: one epoch of SAT soft under a time budget (the Clock starts before the feature
# cache is built, so the first run's budget is larger); validation on 250 dev images, beam 3.
if [ "$DRY" = 1 ]; then
    F8K_DATA=${F8K_DATA:-$WORK/shapes}
    python3 -m captioner make-shapes --out "$F8K_DATA" --images 60 --image-size 64 > "$OUT/make_shapes.log" 2>&1
    F8K=(--preset sat_soft_tiny --device cpu --set data.val_split=val)
    BUDGET_GRAPH=20 BUDGET_EAGER=15
else
    F8K_DATA=${F8K_DATA:-.gpu_data/flickr8k}
    F8K=(--preset sat_soft_flickr8k --device cuda --set encoder.image_size=448 --set encoder.grid=14
         --set data.num_workers=8 --set train.amp=off)
    BUDGET_GRAPH=110 BUDGET_EAGER=50
fi
F8K+=(--data "$F8K_DATA" --no-progress --epochs 1 --set data.feature_cache_dir="$WORK/features"
      --set train.val_max_images=250)
sampler=$(gpu_memory gpu_memory_f8k_graph_mib.txt)
stage f8k_graph 150 python3 -m captioner train "${F8K[@]}" --out "$WORK/f8k_graph" \
    --set train.time_budget="$BUDGET_GRAPH" --set train.cuda_graph=true
kill "$sampler" 2>/dev/null
sampler=$(gpu_memory gpu_memory_f8k_eager_mib.txt)
stage f8k_eager 90 python3 -m captioner train "${F8K[@]}" --out "$WORK/f8k_eager" --set train.time_budget="$BUDGET_EAGER"
kill "$sampler" 2>/dev/null
for run in f8k_graph f8k_eager; do
    mkdir -p "$OUT/$run"
    cp "$WORK/$run"/metrics.csv "$WORK/$run"/config.json "$OUT/$run/" 2>/dev/null
done

if [ "${FULL:-0}" = 1 ]; then  # the earlier checks (docs/benchmarks.md), when TOTAL_LIMIT leaves room
    stage sat_train 90 python3 scripts/benchmark.py --only sat_train --json $QUICK
    stage train_loop 200 python3 scripts/benchmark.py --only train_loop --json $QUICK
fi

python3 scripts/gpu_summary.py "$OUT" "$WORK" 2> "$OUT/summary.log" | tee "$OUT/summary.txt"
echo "total: $(( $(date +%s) - T0 ))s" | tee -a "$OUT/stages.txt"
