#!/usr/bin/env bash
# The model shipped with the package (captioner.load("flickr8k")), from scratch, resumable.
#
#   bash scripts/train_shipped_model.sh DATA [COCO_MINI]
#
# DATA: Flickr8k in the layout `captioner download flickr8k` writes (or captions_coco_format.json +
#   splits.tsv + images/). COCO_MINI (optional): a COCO folder with instances_train2017.json, for
#   attention correctness on its boxes.
#
# Stages (each kept when an earlier call finished it: the script resumes where it stopped):
#   1. base       SAT soft (sat_soft_flickr8k) with the top stage of its EfficientNet-Lite0 encoder trained
#                 beside the decoder, from the photos (no feature cache: the encoder changes)
#   2. scst       self-critical training from it (CIDEr-D reward, SCST_SECONDS), the encoder frozen as
#                 trained, on a feature cache of it
#   3. release    the better of the two by dev CIDEr-D, packed as the release file (float16; the trunk
#                 stages that still equal the wheel's by reference): $ROOT/release/flickr8k.safetensors
# With DISTILL=1, before the release (sequence-level distillation, Kim & Rush 2016):
#   d1. concepts  concept detectors learnt from the captions (captioner concepts)
#   d2. teachers  SAT soft reading the concepts (input, guide, prior), the Transformer reading them
#                 (memory tokens, guide 0.3) and plain SAT soft
#   d3. teacher   the three decoded together (captioner evaluate A B C, beam 3) on the training photos: one
#                 teacher caption per photo beside its five human ones (captioner.training.distill)
#   d4. student   SAT soft reading the concepts on the human + teacher captions, then its SCST stage
#   and the release takes the best of every run by dev CIDEr-D.
#
# Settings (environment): ROOT (runs/shipped), DEVICE (cpu; cuda on a GPU), JOBS (1: stages one after
# the other; 3 or more trains the teachers at once, on a GPU), SCST_SECONDS (2100), WORKERS (data loader
# workers, 0), PROBES=1 (with DISTILL=1: SCST from the concept teacher without distillation, and the
# recipe's SAT soft with a frozen encoder beside the fine-tuned one), CAPTIONER (the command), EXTRA
# (--set arguments added to every training run), CONCEPT_EPOCHS.
set -euo pipefail
DATA=${1:?usage: bash scripts/train_shipped_model.sh DATA [COCO_MINI]}
COCO_MINI=${2:-}
ROOT=${ROOT:-runs/shipped}
DEVICE=${DEVICE:-cpu}
JOBS=${JOBS:-1}
SCST_SECONDS=${SCST_SECONDS:-2100}
WORKERS=${WORKERS:-0}
read -r -a CAPTIONER <<< "${CAPTIONER:-captioner}"
mkdir -p "$ROOT"
concepts=$ROOT/concepts.safetensors
read -r -a EXTRA <<< "${EXTRA:-}"  # settings added to every training run (a short dry run: train.epochs=1 ...)
common=(--device "$DEVICE" --no-progress --set data.num_workers="$WORKERS"
        --set data.feature_cache_dir="$ROOT/features" "${EXTRA[@]+"${EXTRA[@]}"}")
sat_concepts=(--preset sat_soft_flickr8k --set train.alpha_c=0 --set train.concept_guide=1
              --set train.concepts="$concepts" --set decoder.concept_prior=true)
tf_concepts=(--preset transformer_flickr8k --set train.concepts="$concepts" --set train.concept_guide=0.3)

log() { echo "== $* ($(date +%H:%M:%S))"; }

train() {  # run folder, data folder, captioner train arguments: train unless done, resume if stopped
    local run=$1 data=$2; shift 2
    if [ -f "$run/done" ]; then log "$run: trained already, kept"; return; fi
    local start=--overwrite
    [ -f "$run/train_state.pt" ] && start=--resume
    log "$run: training"
    if [ "$start" = --resume ]; then
        "${CAPTIONER[@]}" train --out "$run" --resume --no-progress > "$run.log" 2>&1
    else
        "${CAPTIONER[@]}" train "${common[@]}" "$@" --data "$data" --out "$run" --overwrite > "$run.log" 2>&1
    fi
    touch "$run/done"
    log "$run: done"
}

scst() {  # run folder, from run, extra settings: the self-critical stage
    local run=$1 from=$2; shift 2
    train "$run" "$DATA" "$@" --init "$from/best.safetensors" --set train.objective=scst --set train.lr=1e-4 \
        --set train.schedule=constant --set train.seed=1 --time-budget "$SCST_SECONDS"
}

wait_all() { local p; for p in "$@"; do wait "$p"; done; }

# 1-2. the base model (the encoder's top stage trained with the decoder, from the photos) and its SCST stage
finetune=(--preset sat_soft_flickr8k --set encoder.fine_tune=true --set encoder.fine_tune_stages=1
          --set train.encoder_lr=1e-4)
train "$ROOT/base" "$DATA" "${finetune[@]}" --set data.feature_cache_dir=
scst "$ROOT/base_scst" "$ROOT/base" "${finetune[@]}" --set encoder.fine_tune=false

if [ "${DISTILL:-0}" = 1 ]; then
    # d1. concept detectors (they build the feature cache the decoders share)
    if [ -f "$concepts" ]; then
        log "concepts: $concepts already, kept"
    else
        log "concepts"
        "${CAPTIONER[@]}" concepts --preset sat_soft_flickr8k --data "$DATA" --out "$concepts" --no-progress \
            --set train.device="$DEVICE" --set data.num_workers="$WORKERS" --set data.feature_cache_dir="$ROOT/features" \
            ${CONCEPT_EPOCHS:+--epochs "$CONCEPT_EPOCHS"} ${COCO_MINI:+--boxes "$COCO_MINI"} > "$ROOT/concepts.log" 2>&1
    fi

    # d2. the teachers (and, with PROBES=1, the plain recipe with a frozen encoder)
    pids=()
    run_job() { if [ "$JOBS" -gt 1 ]; then "$@" & pids+=($!); else "$@"; fi; }
    run_job train "$ROOT/teacher_sat_concepts" "$DATA" "${sat_concepts[@]}"
    if [ "$JOBS" -gt 1 ]; then  # the first run builds the dev split's cache; the others start once it has
        for _ in $(seq 900); do
            grep -qs "^dev split" "$ROOT/teacher_sat_concepts.log" && break
            sleep 1
        done
    fi
    run_job train "$ROOT/teacher_transformer_concepts" "$DATA" "${tf_concepts[@]}"
    run_job train "$ROOT/teacher_sat" "$DATA" --preset sat_soft_flickr8k  # also the frozen-encoder probe
    wait_all "${pids[@]+"${pids[@]}"}"

    # d3. the teachers' captions of the training photos, beside the human ones
    distilled=$ROOT/distilled
    if [ -f "$distilled/done" ]; then
        log "teacher captions: kept"
    else
        log "teacher captions: the three teachers decoded together on the training photos"
        "${CAPTIONER[@]}" evaluate "$ROOT"/teacher_sat_concepts/best.safetensors \
            "$ROOT"/teacher_transformer_concepts/best.safetensors "$ROOT"/teacher_sat/best.safetensors \
            --data "$DATA" --split train --beam 3 --no-progress --no-coco-caption --device "$DEVICE" \
            --out "$ROOT/teacher" > "$ROOT/teacher.log" 2>&1
        python -c "import sys, json; from captioner.training.distill import teacher_dataset; \
    print(json.dumps(teacher_dataset(sys.argv[1], sys.argv[2], sys.argv[3])))" \
            "$DATA" "$ROOT/teacher/captions_train_results.json" "$distilled" | tee "$ROOT/distilled.json"
        touch "$distilled/done"
    fi

    # d4. the student, its SCST stage (and, with PROBES=1, SCST from the concept teacher alone)
    pids=()
    if [ "${PROBES:-0}" = 1 ]; then
        run_job scst "$ROOT/probe_teacher_scst" "$ROOT/teacher_sat_concepts" "${sat_concepts[@]}"
    fi
    train "$ROOT/student" "$distilled/$(basename "$DATA")" "${sat_concepts[@]}"
    scst "$ROOT/student_scst" "$ROOT/student" "${sat_concepts[@]}"
    wait_all "${pids[@]+"${pids[@]}"}"
fi

# 3. the release file: the best run by dev CIDEr-D (training's validation, beam 3)
log "release"
python - "$ROOT" <<'EOF'
import csv, json, sys
from pathlib import Path
from captioner.checkpoint.release import pack_release
root = Path(sys.argv[1])
def cider(run):
    rows = [r for r in csv.DictReader(open(run / "metrics.csv")) if r.get("CIDEr-D")]
    return max(float(r["CIDEr-D"]) for r in rows) if rows else -1.0
runs = [p for p in root.iterdir() if (p / "best.safetensors").exists() and (p / "metrics.csv").exists()]
best = max(runs, key=cider)
out = root / "release" / "flickr8k.safetensors"
out.parent.mkdir(exist_ok=True)
info = pack_release(best / "best.safetensors", out, metadata={"trained_from": best.name})
print(json.dumps({"from": best.name, "dev_CIDEr-D_validation": cider(best), **info}))
EOF
