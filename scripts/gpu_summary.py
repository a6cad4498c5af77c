#!/usr/bin/env python
"""The GPU check's figures in one place: ``python scripts/gpu_summary.py OUT [WORK]``.

Reads what ``scripts/gpu_check.sh`` left in OUT (``<stage>.json``, ``<stage>.log``, the Flickr8k runs'
``metrics.csv``, the GPU memory samples), prints one line per figure against its target and
writes ``OUT/summary.json``. Missing stages show as ``missing`` (see ``OUT/stages.txt`` for why).
"""

from __future__ import annotations

import csv
import json
import re
import sys
from pathlib import Path


def _json(out: Path, name: str) -> dict:
    path = out / f"{name}.json"
    try:
        return json.loads(path.read_text().strip().splitlines()[-1]).get(name, {})
    except (OSError, ValueError, IndexError):
        return {}


def _peak_mib(path: Path) -> int | None:
    try:
        values = [int(x) for x in path.read_text().split() if x.strip().isdigit()]
    except OSError:
        return None
    return max(values) if values else None


def _f8k(out: Path, name: str) -> dict:
    """Epoch row, the captured-step bookkeeping and the projected epoch time of one Flickr8k run."""
    row: dict = {}
    try:
        with open(out / name / "metrics.csv", newline="") as f:
            epochs = [r for r in csv.DictReader(f) if r["kind"] == "epoch"]
    except OSError:
        epochs = []
    if epochs:
        last = epochs[-1]
        row = {k: last.get(k) for k in ("captions_per_s", "seconds", "BLEU-4", "CIDEr-D", "partial", "step", "loss")}
    log = (out / f"{name}.log").read_text(errors="replace") if (out / f"{name}.log").exists() else ""
    m = re.search(r"(\d+) captions of (\d+) images", log)
    if m:
        row["train_captions"] = int(m.group(1))
        if row.get("captions_per_s"):
            row["projected_epoch_train_s"] = round(int(m.group(1)) / float(row["captions_per_s"]), 1)
    m = re.search(r"train\.cuda_graph: (\{.*\})", log)
    if m:
        row["graph_stats"] = m.group(1)
    row["peak_gpu_memory_mib_sampled"] = _peak_mib(out / f"gpu_memory_{name}_mib.txt")
    return row


def _fmt(value: object, target: str = "") -> str:
    text = "missing" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)
    return f"{text}  (target {target})" if target else text


def main(argv: list[str]) -> int:
    out = Path(argv[1])
    sat, beam, scale = _json(out, "sat_graph"), _json(out, "beam_graph"), _json(out, "coco_scale")
    f8k = {name: _f8k(out, name) for name in ("f8k_graph", "f8k_eager")}
    summary = {"sat_graph": sat, "beam_graph": beam, "coco_scale": scale, **f8k}
    tests = (out / "cuda_tests.out").read_text(errors="replace").strip().splitlines() \
        if (out / "cuda_tests.out").exists() else []
    summary["cuda_tests"] = tests[-1] if tests else None
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    lines = [
        f"device: {sat.get('device') or beam.get('device') or scale.get('device') or 'unknown'}",
        f"capture tests: {_fmt(summary['cuda_tests'])}",
        "-- SAT training step, B 32, paper sizes (captions/s) --",
        *(f"  {k}: {_fmt(sat.get(f'{k}_captions_per_s'))}"
          for k in ("tutorial", "fp32", "fp32_graph", "bf16", "bf16_graph", "hard", "hard_graph")),
        f"  captured fp32 / tutorial: {_fmt(sat.get('graph_over_tutorial'), '>= 3')}",
        f"  best (fp32 or bf16 captured) / tutorial: {_fmt(sat.get('best_over_tutorial'), '>= 3')}",
        f"  bf16 captured / fp32 captured: {_fmt(sat.get('bf16_graph_over_fp32_graph'), '>= 1')}",
        f"  captured / eager (fp32): {_fmt(sat.get('graph_over_eager'))}; bf16 eager / fp32 eager: "
        f"{_fmt(sat.get('bf16_over_fp32_eager'))}; hard captured / eager: {_fmt(sat.get('hard_graph_over_eager'))}",
        f"  check, captured vs eager: loss diff {_fmt(sat.get('check_loss_abs_diff'))}, max relative gradient "
        f"diff {_fmt(sat.get('check_grad_max_rel_diff'))}; bf16 loss vs fp32 {_fmt(sat.get('check_bf16_loss_rel_diff'))}",
        f"  graphs: {sat.get('graph_stats', 'missing')}",
        "-- decoding, images/s --",
        *(f"  {k}: eager {_fmt(beam.get(f'{k}_eager_images_per_s'))} -> graphed "
          f"{_fmt(beam.get(f'{k}_graph_images_per_s'))} ({_fmt(beam.get(f'{k}_speedup'))}x); same captions "
          f"{_fmt(beam.get(f'{k}_same_captions'))}/{_fmt(beam.get('images'))}" for k in ("greedy", "beam3")),
        "-- COCO-sized cache through the loader --",
        f"  {_fmt(scale.get('images'))} images, {_fmt(scale.get('cache_gib'))} GiB written in "
        f"{_fmt(scale.get('cache_write_s'))} s; {_fmt(scale.get('steps'))} steps, {_fmt(scale.get('mode'))}",
        f"  captions/s {_fmt(scale.get('captions_per_s'))} (steady {_fmt(scale.get('steady_captions_per_s'))}); "
        f"model alone {_fmt(scale.get('model_captions_per_s'))}; efficiency {_fmt(scale.get('efficiency'), '>= 0.8')}",
        f"  loader wait {_fmt(scale.get('loader_wait_fraction'))} of the time (steady "
        f"{_fmt(scale.get('steady_loader_wait_fraction'))}); projected epoch {_fmt(scale.get('projected_epoch_s'))} s "
        f"for {_fmt(scale.get('epoch_captions'))} captions; peak GPU memory {_fmt(scale.get('peak_gpu_memory_mib'))} MiB",
        f"  the row-by-row loader it replaced, same run: captions/s "
        f"{_fmt((scale.get('row_by_row') or {}).get('steady_captions_per_s'))}, efficiency "
        f"{_fmt((scale.get('row_by_row') or {}).get('efficiency'))}, loader wait "
        f"{_fmt((scale.get('row_by_row') or {}).get('steady_loader_wait_fraction'))}; whole batches / row by row "
        f"{_fmt(scale.get('batch_over_row_by_row'))}",
        "-- Flickr8k recipe, 448 px (14 x 14), one epoch (time-budgeted) --",
        *(f"  {name}: captions/s {_fmt(r.get('captions_per_s'))}, projected epoch (training) "
          f"{_fmt(r.get('projected_epoch_train_s'))} s, partial {_fmt(r.get('partial'))}, dev BLEU-4 "
          f"{_fmt(r.get('BLEU-4'))} CIDEr-D {_fmt(r.get('CIDEr-D'))}, peak GPU memory (sampled, whole GPU) "
          f"{_fmt(r.get('peak_gpu_memory_mib_sampled'))} MiB; graphs {r.get('graph_stats', '-')}"
          for name, r in f8k.items()),
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
