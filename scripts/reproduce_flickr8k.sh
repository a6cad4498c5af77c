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
# SCST=1: add a self-critical stage (train.objective=scst, 25 minutes) from the SAT soft model with the
#   higher dev CIDEr-D: the recipe's, or with CONCEPTS=1 the one reading concepts.
# CONCEPTS=1: learn concept detectors from the captions (captioner concepts, on the shared feature cache)
#   and add SAT soft reading them, guided by their maps and attending through the concept prior, without
#   the doubly stochastic penalty.
#
# RESUME=1: go on from where an earlier call stopped: a run already scored is kept as it is, a run with
#   a train_state.pt resumes its training (captioner train --resume), and the rest start afresh.
#
# On a 2-core CPU: about 6 minutes of feature cache (once, shared by the three decoders in the cache
# root's features/: $CAPTIONER_CACHE, else ~/.cache/captioner), then at most 45 minutes per decoder, and a
# minute or two of scoring each.
# Existing run folders are moved aside (--overwrite), never deleted, unless RESUME=1 keeps them.
set -euo pipefail
DATA=${1:?usage: bash scripts/reproduce_flickr8k.sh DATA [COCO_MINI]}
COCO_MINI=${2:-}
ROOT=${ROOT:-runs/flickr8k}
mkdir -p "$ROOT"

score() {  # run folder [checkpoints]: dev scores (coco-caption when Java and pycocoevalcap are there), COCO boxes
    local run=$1; shift  # the checkpoints: the run's own best, or an ensemble's members
    local checkpoints=("$@")
    [ ${#checkpoints[@]} -eq 0 ] && checkpoints=("$run/best.safetensors")
    captioner evaluate "${checkpoints[@]}" --data "$DATA" --split dev --beam 3 --no-progress --force --out "$run" >/dev/null
    if [ -n "$COCO_MINI" ]; then
        captioner evaluate "${checkpoints[@]}" --data "$COCO_MINI" --split train2017 --beam 3 --no-progress --force \
            --no-coco-caption --out "$run/coco2017-mini" >/dev/null
    fi
}

scored() {  # run folder: true when RESUME=1 and the run was trained and scored by an earlier call
    [ "${RESUME:-0}" = 1 ] && [ -f "$1/metrics_dev.json" ] &&
        { [ -z "$COCO_MINI" ] || [ -f "$1/coco2017-mini/metrics_train2017.json" ]; }
}

stage() {  # name, run folder, captioner train arguments: train (or resume) and score, unless scored already
    local name=$1 run=$2; shift 2
    if scored "$run"; then
        echo "== $name: trained and scored already, kept"
        return
    fi
    local start=--overwrite how=""
    if [ "${RESUME:-0}" = 1 ] && [ -f "$run/train_state.pt" ]; then start=--resume how=", resumed"; fi
    echo "== $name: training ($(date +%H:%M)$how)"
    captioner train "$@" --data "$DATA" --out "$run" "$start" --no-progress
    score "$run"
}

for decoder in sat_soft sat_hard transformer; do
    stage "$decoder" "$ROOT/$decoder" --preset "${decoder}_flickr8k"
done

if [ "${CONCEPTS:-0}" = 1 ]; then
    concepts="$ROOT/concepts.safetensors"
    if [ "${RESUME:-0}" = 1 ] && [ -f "$concepts" ]; then
        echo "== concept detectors: $concepts already, kept"
    else
        echo "== concept detectors ($(date +%H:%M))"
        captioner concepts --preset sat_soft_flickr8k --data "$DATA" --out "$concepts" --no-progress \
            ${COCO_MINI:+--boxes "$COCO_MINI"}
    fi
    with_concepts=(--set train.concepts="$concepts" --set concepts.prior=true)
    stage "sat_soft + concepts" "$ROOT/sat_soft_concepts" --preset sat_soft_flickr8k \
        --set train.alpha_c=0 --set train.concept_guide=1 "${with_concepts[@]}"
fi

if [ "${ENSEMBLE:-0}" = 1 ]; then
    if scored "$ROOT/ensemble"; then
        echo "== ensemble of sat_soft and transformer: scored already, kept"
    else
        echo "== ensemble of sat_soft and transformer ($(date +%H:%M))"
        score "$ROOT/ensemble" "$ROOT/sat_soft/best.safetensors" "$ROOT/transformer/best.safetensors"
    fi
fi

cider() {  # run folder: its dev CIDEr-D (coco-caption's when scored with it), 0 when not scored
    local file=$1/metrics_dev.json value=""
    if [ -s "$file" ]; then
        value=$(grep -oE '"coco/CIDEr-D": *[0-9.eE+-]+' "$file" | grep -oE '[0-9.eE+-]+$' || true)
        [ -n "$value" ] || value=$(grep -oE '"CIDEr-D": *[0-9.eE+-]+' "$file" | grep -oE '[0-9.eE+-]+$' || true)
    fi
    echo "${value:-0}"
}

if [ "${SCST:-0}" = 1 ]; then
    from=sat_soft from_settings=()
    if [ "${CONCEPTS:-0}" = 1 ] &&
        awk -v a="$(cider "$ROOT/sat_soft_concepts")" -v b="$(cider "$ROOT/sat_soft")" 'BEGIN { exit !(a > b) }'; then
        from=sat_soft_concepts from_settings=("${with_concepts[@]}")
    fi
    echo "== self-critical stage from $from (dev CIDEr-D $(cider "$ROOT/$from"))"
    stage "$from + SCST" "$ROOT/${from}_scst" --preset sat_soft_flickr8k \
        --init "$ROOT/$from/best.safetensors" "${from_settings[@]}" --set train.objective=scst \
        --set train.lr=1e-4 --set train.schedule=constant --set train.seed=1 --time-budget 1500
fi

python scripts/flickr8k_results.py "$ROOT"
