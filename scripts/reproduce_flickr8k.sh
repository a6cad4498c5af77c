#!/usr/bin/env bash
# The Flickr8k benchmark from scratch: the three *_flickr8k presets, each scored on dev with the
# coco-caption metrics, attention correctness on COCO photos, and runs/flickr8k/results.md.
#
#   bash scripts/reproduce_flickr8k.sh DATA [COCO_MINI]
#
# DATA: Flickr8k in any layout the loader reads (../shared/data/flickr8k, the official
#   Flicker8k_Dataset/ + Flickr8k_text/ from captioner download flickr8k, or dataset_flickr8k.json).
# COCO_MINI (optional): a COCO folder with instances_train2017.json (../shared/data/coco2017-mini);
#   the models' captions of its photos are scored for attention correctness against its boxes.
# ENSEMBLE=1: also score the SAT soft and Transformer models decoded together (captioner evaluate A B,
#   the mean of their word probabilities; a minute or two more of scoring, no training).
# SCST=1: add a self-critical stage from the SAT soft model (train.objective=scst, 25 minutes).
# CONCEPTS=1: learn concept detectors from the captions (captioner concepts, on the shared feature cache)
#   and add SAT soft reading them, guided by their maps, without the doubly stochastic penalty.
#
# On a 2-core CPU: about 6 minutes of feature cache (once, shared by the three decoders in
# runs/flickr8k/features), then at most 45 minutes per decoder, and a minute or two of scoring each.
# Existing run folders are moved aside (--overwrite), never deleted.
set -euo pipefail
DATA=${1:?usage: bash scripts/reproduce_flickr8k.sh DATA [COCO_MINI]}
COCO_MINI=${2:-}
ROOT=${ROOT:-runs/flickr8k}
mkdir -p "$ROOT"

score() {  # run folder [checkpoints]: dev scores (coco-caption when Java and pycocoevalcap are there), COCO boxes
    local run=$1; shift  # the checkpoints: the run's own best, or an ensemble's members
    local checkpoints=("$@")
    [ ${#checkpoints[@]} -eq 0 ] && checkpoints=("$run/best.safetensors")
    captioner evaluate "${checkpoints[@]}" --data "$DATA" --split dev --beam 3 --no-progress --out "$run" >/dev/null
    if [ -n "$COCO_MINI" ]; then
        captioner evaluate "${checkpoints[@]}" --data "$COCO_MINI" --split train2017 --beam 3 --no-progress \
            --no-coco-caption --out "$run/coco2017-mini" >/dev/null
    fi
}

for decoder in sat_soft sat_hard transformer; do
    run="$ROOT/$decoder"
    echo "== $decoder: training ($(date +%H:%M))"
    captioner train --preset "${decoder}_flickr8k" --data "$DATA" --out "$run" --overwrite --no-progress
    score "$run"
done

if [ "${CONCEPTS:-0}" = 1 ]; then
    concepts="$ROOT/concepts.safetensors"
    echo "== concept detectors ($(date +%H:%M))"
    captioner concepts --preset sat_soft_flickr8k --data "$DATA" --out "$concepts" --no-progress \
        ${COCO_MINI:+--boxes "$COCO_MINI"}
    run="$ROOT/sat_soft_concepts"
    echo "== sat_soft + concepts ($(date +%H:%M))"
    captioner train --preset sat_soft_flickr8k --data "$DATA" --out "$run" --overwrite --no-progress \
        --set train.alpha_c=0 --set train.concepts="$concepts" --set train.concept_guide=0.5
    score "$run"
fi

if [ "${ENSEMBLE:-0}" = 1 ]; then
    echo "== ensemble of sat_soft and transformer ($(date +%H:%M))"
    score "$ROOT/ensemble" "$ROOT/sat_soft/best.safetensors" "$ROOT/transformer/best.safetensors"
fi

if [ "${SCST:-0}" = 1 ]; then
    run="$ROOT/sat_soft_scst"
    echo "== sat_soft + SCST ($(date +%H:%M))"
    captioner train --preset sat_soft_flickr8k --data "$DATA" --out "$run" --overwrite --no-progress \
        --init "$ROOT/sat_soft/best.safetensors" --set train.objective=scst --set train.lr=1e-4 \
        --set train.schedule=constant --set train.seed=1 --time-budget 1500
    score "$run"
fi

python scripts/flickr8k_results.py "$ROOT"
