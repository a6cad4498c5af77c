#!/usr/bin/env python
"""Write ``runs/flickr8k/results.md``: one row per Flickr8k model and stage, beside the published rows.

    python scripts/flickr8k_results.py runs/flickr8k            # reads the run folders below it

Each run folder (``runs/flickr8k/<name>/``) is read for:

* ``config.json`` (training): the encoder; an ensemble's folder (``captioner evaluate A B --out``)
  names its members' runs instead;
* ``metrics.csv`` (training): the wall time of training, from its last epoch row;
* ``metrics_dev.json`` (``captioner evaluate ... --split dev``): the coco-caption scores (PTB
  tokenisation, as the papers report them) when they were computed, else the built-in ones, and the
  attention entropy per word against uniform;
* ``coco2017-mini/metrics_train2017.json`` (``captioner evaluate ... --data coco2017-mini``), when
  present: attention correctness on the real COCO boxes, as a ratio to uniform attention with its
  95% interval, of the words the model wrote and of the reference captions' words (teacher-forced).

Writes the table to ``<root>/results.md`` and prints it.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path

# Flickr8k test, coco-caption scoring, x100 (Xu et al. 2015 Table 1 and the papers it names)
PUBLISHED = [
    ("Xu et al. 2015, soft attention", "VGG, frozen", "67 / 44.8 / 29.9 / 19.5", "18.93", "-", "-"),
    ("Xu et al. 2015, hard attention", "VGG, frozen", "67 / 45.7 / 31.4 / 21.3", "20.30", "-", "-"),
    ("Adaptive attention (Lu et al. 2017), public reimplementation", "VGG-16 frozen, beam 3",
     "62.4 / 44.0 / 30.3 / 20.5", "19.9", "-", "52.4"),
    ("the same", "ResNet-152 fine-tuned, beam 5", "65.9 / 48.0 / 33.9 / 23.5", "20.7", "-", "58.9"),
    ("SCA-CNN (Chen et al. 2017)", "ResNet-152", "68.2 / 49.6 / 35.9 / 25.8", "22.4", "-", "-"),
]
HEADER = ("| system | encoder | BLEU-1/2/3/4 | METEOR | ROUGE-L | CIDEr-D | attention entropy (uniform) "
          "| attention correctness, COCO boxes | training time |")


def _score(report: dict, key: str) -> float | None:
    """The coco-caption score when it was computed, else the built-in one."""
    value = report.get(f"coco/{key}")
    return value if value is not None else report.get(key)


def _x100(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{100 * value:.{digits}f}"


def _training_seconds(run: Path) -> float | None:
    path = run / "metrics.csv"
    if not path.exists():
        return None
    rows = [r for r in csv.DictReader(path.open()) if r.get("kind") == "epoch" and r.get("seconds")]
    return float(rows[-1]["seconds"]) if rows else None


def _entropy(report: dict) -> str:
    att = report.get("attention") or {}
    mean, uniform = att.get("attention_entropy"), att.get("uniform_entropy")
    if mean is None:
        return "-"
    return f"{mean:.2f} ({uniform:.2f})" if uniform is not None else f"{mean:.2f}"


def _correctness(run: Path) -> str:
    path = run / "coco2017-mini" / "metrics_train2017.json"
    if not path.exists():
        return "-"
    report = json.loads(path.read_text())
    corr = report.get("attention_correctness") or {}
    ratio, words, spread = corr.get("ratio"), corr.get("words_scored"), corr.get("ratio_interval")
    if ratio is None:
        return "-"
    shown = _ratio(ratio, spread)
    shown = f"{shown} ({words} words)" if words is not None else shown
    forced = report.get("reference_attention_correctness") or {}
    if forced.get("ratio") is not None:  # the same words for every model: the references, teacher-forced
        shown += f"; references {_ratio(forced['ratio'], forced.get('ratio_interval'))}"
    return shown


def _ratio(ratio: float, spread: list[float] | None) -> str:
    """``1.38x``, with its 95% interval when there is one: ``1.38x [1.21-1.55]``."""
    return f"{ratio:.2f}x" + (f" [{spread[0]:.2f}-{spread[1]:.2f}]" if spread else "")


ENCODER_NAMES = {"efficientnet_lite0": "EfficientNet-Lite0", "efficientnet_lite1": "EfficientNet-Lite1",
                 "efficientnet_lite2": "EfficientNet-Lite2"}


def _encoder_of(run: Path) -> str:
    """The encoder a run trained on, from its ``config.json`` (EfficientNet-Lite0, the recipe's, without one)."""
    try:
        name = json.loads((run / "config.json").read_text())["model"]["encoder"]["name"]
    except (OSError, ValueError, KeyError, TypeError):
        return ENCODER_NAMES["efficientnet_lite0"]
    return ENCODER_NAMES.get(name, name)


def _encoder(run: Path, report: dict) -> str:
    """The row's encoder column; for an ensemble (``captioner evaluate A B``), its members' runs and encoders."""
    checkpoint = report.get("checkpoint")
    if isinstance(checkpoint, list):
        members = [Path(c) if Path(c).is_dir() else Path(c).parent for c in checkpoint]
        return "ensemble of " + " + ".join(f"{m.name} ({_encoder_of(m)})" for m in members)
    return f"{_encoder_of(run)} frozen"


def row(run: Path) -> str | None:
    """One table row for a run folder with ``metrics_dev.json``; None without it."""
    path = run / "metrics_dev.json"
    if not path.exists():
        return None
    report = json.loads(path.read_text())
    bleu = " / ".join(_x100(_score(report, f"BLEU-{n}")) for n in range(1, 5))
    cider = _score(report, "CIDEr-D")
    seconds = _training_seconds(run)
    minutes = "-" if seconds is None else f"{seconds / 60:.0f} min"
    scoring = "coco-caption" if report.get("coco/BLEU-4") is not None else "built-in"
    return (f"| **{run.name}** (dev, {scoring}) | {_encoder(run, report)}, beam {report.get('beam_size', 3)} | {bleu} "
            f"| {_x100(_score(report, 'METEOR'), 2)} | {_x100(_score(report, 'ROUGE-L'))} "
            f"| {_x100(cider) if cider is not None and not math.isnan(cider) else '-'} | {_entropy(report)} "
            f"| {_correctness(run)} | {minutes} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path, help="the folder holding the Flickr8k run folders (runs/flickr8k)")
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        print(f"flickr8k_results: {args.root} is not a folder", file=sys.stderr)
        return 1
    ours = [r for r in (row(p) for p in sorted(args.root.iterdir()) if p.is_dir()) if r]
    lines = [HEADER, "|" + " --- |" * (HEADER.count("|") - 1)]
    lines += [f"| {name} (test) | {enc} | {bleu} | {meteor} | {rouge} | {cider} | - | - | - |"
              for name, enc, bleu, meteor, rouge, cider in PUBLISHED]
    lines += ours
    text = "\n".join(lines) + "\n"
    (args.root / "results.md").write_text(text)
    print(text, end="")
    return 0 if ours else 1


if __name__ == "__main__":
    sys.exit(main())
