#!/usr/bin/env bash
# The model shipped with the package (captioner.load("flickr8k")), from scratch, resumable.
#
#   bash scripts/train_shipped_model.sh DATA
#
# DATA: Flickr8k in the layout `captioner download flickr8k` writes (or captions_coco_format.json +
#   splits.tsv + images/).
#
# Stages (each kept when an earlier call finished it: the script resumes where it stopped):
#   1. base       SAT soft (sat_soft_flickr8k) with the top stage of its EfficientNet-Lite0 encoder trained
#                 beside the decoder, from the photos (no feature cache: the encoder changes)
#   2. scst       self-critical training from it (CIDEr-D reward, SCST_SECONDS), the encoder frozen as
#                 trained, on a feature cache of it
#   3. release    the better of the two by dev CIDEr-D, packed as the release file (float16; the trunk
#                 stages that still equal the wheel's by reference): $ROOT/release/flickr8k.safetensors
# With DISTILL=1, before the release (sequence-level distillation, Kim & Rush 2016):
#   d1. teachers  two more: the base recipe from another seed (teacher_finetune) and SAT soft on the
#                 frozen encoder (teacher_sat)
#   d2. teacher   base_scst and the two decoded together (captioner evaluate A B C, beam 3) on the
#                 training photos: one teacher caption per photo, in place of its five human ones
#                 (captioner distill captions --teacher-only)
#   d3. words     only with WORD_WEIGHT > 0: the three teachers read their captions word by word, their top 8
#                 next words at each step (word-level distillation, captioner distill words)
#   d4. student   base_scst trained STUDENT_EPOCHS (3) epochs on the teacher's captions (with WORD_WEIGHT > 0,
#                 plus WORD_WEIGHT x the KL to the teachers' top 8 at each step); then STUDENT_SCST_STAGES (2)
#                 SCST stages of STUDENT_SCST_SECONDS (1200) each, each from the one before with another seed
#   and the release takes the best of every run by dev CIDEr-D.
# With EVERYDAY=FOLDER (a folder holding flickr8k/ in the layout above, coco2014-val168/ and
# coco2017-mini/annotations/captions_val2017_text_only.json, as ../shared/data does), after the release:
#   4. everyday   the release taught to read its encoder's ImageNet labels (encoder.labels) and the COCO
#                 caption words, by two captioner commands: captioner evaluate (its own captions of the Flickr8k
#                 training photos, beam 3), then captioner train --preset flickr8k_labels (the label stage: 2,000
#                 steps on those captions beside COCO caption-only rows, the Flickr8k rows' attention held to
#                 the release's, train.labels.attend_kd 1) in $ROOT/everyday/run, whose release.safetensors becomes
#                 $ROOT/release/flickr8k.safetensors (the step 3 file kept as flickr8k_stage3.safetensors)
# Settings (environment): ROOT (runs/shipped), DEVICE (cpu; cuda on a GPU), JOBS (1: stages one after
# the other; 2 trains the two new teachers at once, on a GPU), SCST_SECONDS (2100), WORKERS (data loader
# workers, 0), STUDENT_EPOCHS (3), WORD_WEIGHT (0: off; 3 is the best weight measured), STUDENT_SCST_STAGES (2),
# STUDENT_SCST_SECONDS (1200), CAPTIONER (the command), EXTRA (--set arguments added to every training run),
# EVERYDAY (off), EVERYDAY_STEPS (2000).
set -euo pipefail
DATA=${1:?usage: bash scripts/train_shipped_model.sh DATA}
ROOT=${ROOT:-runs/shipped}
DEVICE=${DEVICE:-cpu}
JOBS=${JOBS:-1}
SCST_SECONDS=${SCST_SECONDS:-2100}
WORKERS=${WORKERS:-0}
read -r -a CAPTIONER <<< "${CAPTIONER:-captioner}"
mkdir -p "$ROOT"
read -r -a EXTRA <<< "${EXTRA:-}"  # settings added to every training run (a short dry run: train.epochs=1 ...)
common=(--device "$DEVICE" --no-progress --set data.num_workers="$WORKERS"
        --set data.feature_cache_dir="$ROOT/features" "${EXTRA[@]+"${EXTRA[@]}"}")

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
        --set train.schedule=constant --set train.seed="${SCST_SEED:-1}" --time-budget "$SCST_SECONDS"
}

wait_all() { local p; for p in "$@"; do wait "$p"; done; }

# 1-2. the base model (the encoder's top stage trained with the decoder, from the photos) and its SCST stage
finetune=(--preset sat_soft_flickr8k --set encoder.fine_tune=true --set encoder.fine_tune_stages=1
          --set train.encoder_lr=1e-4)
train "$ROOT/base" "$DATA" "${finetune[@]}" --set data.feature_cache_dir=
scst "$ROOT/base_scst" "$ROOT/base" "${finetune[@]}" --set encoder.fine_tune=false

if [ "${DISTILL:-0}" = 1 ]; then
    # d1. two more teachers beside base_scst: the base recipe from another seed, and SAT soft on the
    #     frozen encoder (its own feature cache; the key holds the encoder's weights)
    pids=()
    run_job() { if [ "$JOBS" -gt 1 ]; then "$@" & pids+=($!); else "$@"; fi; }
    run_job train "$ROOT/teacher_finetune" "$DATA" "${finetune[@]}" --set data.feature_cache_dir= --set train.seed=1
    run_job train "$ROOT/teacher_sat" "$DATA" --preset sat_soft_flickr8k
    wait_all "${pids[@]+"${pids[@]}"}"

    # d2. the three decoded together on the training photos: their caption replaces the five human
    #     ones of each training photo (dev keeps its human captions, so validation is unchanged)
    distilled=$ROOT/distilled
    if [ -f "$distilled/done" ]; then
        log "teacher captions: kept"
    else
        log "teacher captions: the three teachers decoded together on the training photos"
        "${CAPTIONER[@]}" evaluate "$ROOT"/base_scst/best.safetensors "$ROOT"/teacher_finetune/best.safetensors \
            "$ROOT"/teacher_sat/best.safetensors --data "$DATA" --split train --beam 3 --no-progress \
            --no-coco-caption --no-meteor --device "$DEVICE" --force --out "$ROOT/teacher" > "$ROOT/teacher.log" 2>&1
        "${CAPTIONER[@]}" distill captions "$DATA" "$ROOT/teacher/captions_train_results.json" --out "$distilled" \
            --teacher-only | tee "$ROOT/distilled.json"
        touch "$distilled/done"
    fi

    # d3. word-level distillation (off by default: after SCST it gave no lasting gain): the teachers' top 8
    #     next words at each step of their captions
    student_words=()
    if awk -v w="${WORD_WEIGHT:-0}" 'BEGIN { exit !(w + 0 > 0) }'; then
        words=$ROOT/words.safetensors
        if [ -f "$words" ]; then
            log "teacher words: kept"
        else
            log "teacher words: the three teachers read their captions word by word"
            "${CAPTIONER[@]}" distill words "$ROOT"/base_scst/best.safetensors \
                "$ROOT"/teacher_finetune/best.safetensors "$ROOT"/teacher_sat/best.safetensors \
                --data "$distilled/$(basename "$DATA")" --out "$words" --top-k 8 --device "$DEVICE" --no-progress \
                | tee "$ROOT/words.json"
        fi
        student_words=(--set train.word_distill="$words" --set train.word_distill_weight="$WORD_WEIGHT")
    fi

    # d4. the student: base_scst trained on the teacher's captions (STUDENT_EPOCHS), then its SCST stages
    train "$ROOT/student" "$distilled/$(basename "$DATA")" "${finetune[@]}" --set encoder.fine_tune=false \
        --init "$ROOT/base_scst/best.safetensors" --set train.lr=1e-4 --set train.schedule=constant \
        --set train.seed=3 --epochs "${STUDENT_EPOCHS:-3}" "${student_words[@]+"${student_words[@]}"}"
    previous=$ROOT/student
    for stage in $(seq 1 "${STUDENT_SCST_STAGES:-2}"); do
        run=$ROOT/student_scst; [ "$stage" -gt 1 ] && run=$ROOT/student_scst$stage
        # each stage from the one before, with another seed (another order of the batches)
        SCST_SEED=$((stage + 1)) SCST_SECONDS=${STUDENT_SCST_SECONDS:-1200} scst "$run" "$previous" \
            "${finetune[@]}" --set encoder.fine_tune=false
        previous=$run
    done
fi

# 3. the release file: the best run by dev CIDEr-D (training's validation, beam 3)
log "release"
python - "$ROOT" <<'EOF'
import csv, json, sys
from pathlib import Path
from captioner.checkpoint.store import pack_release
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

# 4. everyday: the release reads its encoder's labels and learns the COCO caption words (the label stage)
if [ -n "${EVERYDAY:-}" ]; then
    release=$ROOT/release/flickr8k.safetensors stage3=$ROOT/release/flickr8k_stage3.safetensors
    [ -f "$stage3" ] || cp "$release" "$stage3"
    if [ -f "$ROOT/everyday/done" ]; then log "everyday: trained already, kept"; else
        log "everyday: the release's own captions of the training photos"
        mkdir -p "$ROOT/everyday"  # one level below $ROOT: step 3 does not take its run for a candidate
        "${CAPTIONER[@]}" evaluate "$stage3" --data "$EVERYDAY/flickr8k" --split train --beam 3 --no-progress \
            --no-coco-caption --no-meteor --device "$DEVICE" --force --out "$ROOT/everyday/teacher" \
            > "$ROOT/everyday/teacher.log" 2>&1
        log "everyday: the label stage"
        "${CAPTIONER[@]}" train --preset flickr8k_labels --init "$stage3" --data "$EVERYDAY/flickr8k" \
            --out "$ROOT/everyday/run" --overwrite --device "$DEVICE" --no-progress \
            --set train.labels.steps="${EVERYDAY_STEPS:-2000}" \
            --set train.labels.teacher="$ROOT/everyday/teacher/captions_train_results.json" \
            --set train.labels.text="$EVERYDAY/coco2017-mini/annotations/captions_val2017_text_only.json" \
            --set train.labels.text_exclude="$EVERYDAY/coco2014-val168/annotations/captions_val2014.json" \
            --set data.feature_cache_dir="$ROOT/features" > "$ROOT/everyday/run.log" 2>&1
        touch "$ROOT/everyday/done"
    fi
    cp "$ROOT/everyday/run/release.safetensors" "$release"
    log "everyday: $release"
fi
