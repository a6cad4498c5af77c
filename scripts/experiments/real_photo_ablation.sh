#!/usr/bin/env bash
# Real-photo attention, one change at a time at the same budget: each configuration trains SAT soft (or
# the Transformer) on the Flickr8k feature cache for EPOCHS epochs (cosine over them, one seed), then is
# scored on dev (coco-caption, beam 3) and for attention correctness on the COCO boxes.
#
#   bash scripts/experiments/real_photo_ablation.sh DATA COCO_MINI CONCEPTS [NAME ...]
#
# DATA: Flickr8k (e.g. ../shared/data/flickr8k); COCO_MINI: a COCO folder with boxes
# (../shared/data/coco2017-mini); CONCEPTS: a concepts file from `captioner concepts` over the same
# encoder. NAMEs pick configurations (default: all of them). EPOCHS (default 1), ROOT (runs/ablation).
# The finer grid (a0_fine*: encoder.dilate, 14 x 14 regions at 224 px) builds its own feature cache (four
# times larger), a0_lite1 and a0_lite2 the Lite1 and Lite2 ones; a0_fine_input_guide reads CONCEPTS_FINE, a concepts file learnt
# over the 14 x 14 cache (captioner concepts ... --set encoder.dilate=true --set encoder.grid=14). The
# *_sharp configurations guide attention towards the concept maps raised to the power SHARPNESS (default 3).
# The *_prior configurations multiply the attention by the maps of the concepts the decoder expects to name
# next (concepts.prior). With a CONCEPTS file holding fold heads (captioner concepts --folds F), every
# configuration trains on cross-fitted concepts; a0_input_guide_prior_no_cross_fit is the same run without.
# The doubly stochastic penalty: base keeps the recipe's (weight 1, excess form), a0 drops it, ds_small
# weighs it 0.3, ds_sum uses the paper's sum form; input reads the concepts with the penalty kept.
set -euo pipefail
DATA=${1:?usage: real_photo_ablation.sh DATA COCO_MINI CONCEPTS [NAME ...]}
COCO_MINI=${2:?usage: real_photo_ablation.sh DATA COCO_MINI CONCEPTS [NAME ...]}
CONCEPTS=${3:?usage: real_photo_ablation.sh DATA COCO_MINI CONCEPTS [NAME ...]}
shift 3
EPOCHS=${EPOCHS:-1}
ROOT=${ROOT:-runs/ablation}
mkdir -p "$ROOT"

declare -A SETTINGS=(
    [base]="--preset sat_soft_flickr8k"
    [a0]="--preset sat_soft_flickr8k --set train.alpha_c=0"
    [ds_small]="--preset sat_soft_flickr8k --set train.alpha_c=0.3"
    [ds_sum]="--preset sat_soft_flickr8k --set train.ds_form=sum"
    [input]="--preset sat_soft_flickr8k --set train.concepts=$CONCEPTS"
    [a0_input]="--preset sat_soft_flickr8k --set train.alpha_c=0 --set train.concepts=$CONCEPTS"
    [a0_guide]="--preset sat_soft_flickr8k --set train.alpha_c=0 --set train.concepts=$CONCEPTS --set train.concept_input=false --set train.concept_guide=1"
    [a0_input_guide]="--preset sat_soft_flickr8k --set train.alpha_c=0 --set train.concepts=$CONCEPTS --set train.concept_guide=1"
    [a0_input_guide_sharp]="--preset sat_soft_flickr8k --set train.alpha_c=0 --set train.concepts=$CONCEPTS --set train.concept_guide=1 --set train.concept_guide_sharpness=${SHARPNESS:-3}"
    [a0_input_guide_prior]="--preset sat_soft_flickr8k --set train.alpha_c=0 --set train.concepts=$CONCEPTS --set train.concept_guide=1 --set concepts.prior=true"
    [a0_input_guide_prior_no_cross_fit]="--preset sat_soft_flickr8k --set train.alpha_c=0 --set train.concepts=$CONCEPTS --set train.concept_guide=1 --set concepts.prior=true --set train.concept_cross_fit=false"
    [a0_input_prior]="--preset sat_soft_flickr8k --set train.alpha_c=0 --set train.concepts=$CONCEPTS --set concepts.prior=true"
    [hard_a0]="--preset sat_hard_flickr8k --set train.alpha_c=0"
    [hard_a0_input_guide]="--preset sat_hard_flickr8k --set train.alpha_c=0 --set train.concepts=$CONCEPTS --set train.concept_guide=1"
    [a0_fine]="--preset sat_soft_flickr8k --set train.alpha_c=0 --set encoder.dilate=true --set encoder.grid=14"
    [a0_fine_input_guide]="--preset sat_soft_flickr8k --set train.alpha_c=0 --set encoder.dilate=true --set encoder.grid=14 --set train.concepts=${CONCEPTS_FINE:-CONCEPTS_FINE-is-not-set} --set train.concept_guide=0.5"
    [a0_lite1]="--preset sat_soft_flickr8k --set train.alpha_c=0 --set encoder.name=efficientnet_lite1"
    [a0_lite2]="--preset sat_soft_flickr8k --set train.alpha_c=0 --set encoder.name=efficientnet_lite2"
    [tf]="--preset transformer_flickr8k"
    [tf_guide]="--preset transformer_flickr8k --set train.concepts=$CONCEPTS --set train.concept_input=false --set train.concept_guide=1"
    [tf_input_guide]="--preset transformer_flickr8k --set train.concepts=$CONCEPTS --set train.concept_guide=0.3"
    [tf_input_guide_prior]="--preset transformer_flickr8k --set train.concepts=$CONCEPTS --set train.concept_guide=0.3 --set concepts.prior=true"
    [tf_input_guide_sharp]="--preset transformer_flickr8k --set train.concepts=$CONCEPTS --set train.concept_guide=0.3 --set train.concept_guide_sharpness=${SHARPNESS:-3}"
)
NAMES=("$@")
[ ${#NAMES[@]} -eq 0 ] && NAMES=(base a0 a0_input a0_guide a0_input_guide tf tf_guide tf_input_guide a0_fine a0_lite2)

for name in "${NAMES[@]}"; do
    settings=${SETTINGS[$name]:?unknown configuration $name (one of ${!SETTINGS[*]})}
    run="$ROOT/$name"
    start=$(date +%s)
    # shellcheck disable=SC2086
    captioner train $settings --data "$DATA" --out "$run" --overwrite --epochs "$EPOCHS" --no-progress \
        > "$ROOT/$name.log" 2>&1
    trained=$(( $(date +%s) - start ))
    captioner evaluate "$run/best.safetensors" --data "$DATA" --split dev --beam 3 --no-progress --force --out "$run" \
        > "$ROOT/$name.dev.txt" 2>&1
    captioner evaluate "$run/best.safetensors" --data "$COCO_MINI" --split train2017 --beam 3 --no-progress --force \
        --no-coco-caption --out "$run/coco2017-mini" > "$ROOT/$name.coco.txt" 2>&1
    echo "$name: trained in ${trained}s; $(tail -n 3 "$ROOT/$name.dev.txt" | tr '\n' ' ')"
done
