#!/usr/bin/env python
"""With and without attention supervision, on the demo's scenes and frozen encoder, at a
fixed number of epochs: the comparison a time-budgeted ``captioner demo`` cannot give on a busy machine.

    python scripts/experiments/grounding_ablation.py --out runs/grounding --decoders sat_soft,transformer --epochs 4 \\
        --weights 0,1                                  # one run per decoder and weight, one at a time
    python scripts/experiments/grounding_ablation.py --out runs/grounding_unseen4 --unseen-pairs 4 --decoders transformer

Writes the demo's scenes (``<out>/shapes``, ``--unseen-pairs K`` for the compositional split), its
word-detector encoder (``<out>/encoder.safetensors``, ``--encoder-budget`` seconds: time-budgeted, but
shared by every arm) and feature cache once, then trains each ``<decoder>`` preset of the demo for
``--epochs`` epochs with ``train.attention_supervision`` = each of ``--weights`` (the learning rate
annealed over those epochs by a cosine schedule, in place of the demo's time-based
``train.budget_decay``), scores the best checkpoint on the test split with beam 3 as the demo does,
and appends one JSON line per run to ``<out>/ablation.jsonl``. Prints a table at the end.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

KEYS = ("BLEU-4", "CIDEr-D", "objects_correct", "attention_correctness", "ratio", "attention_entropy",
        "objects_correct_seen", "objects_correct_unseen", "unseen_pairs_named", "seen_pairs_named")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--decoders", default="sat_soft,sat_hard,transformer")
    parser.add_argument("--weights", default="0,1", help="train.attention_supervision values, comma-separated")
    parser.add_argument("--form", default="cross_entropy", help="train.attention_supervision_form")
    parser.add_argument("--epochs", default="sat_soft=4,sat_hard=4,transformer=3",
                        help="epochs: one number or decoder=epochs pairs")
    parser.add_argument("--unseen-pairs", type=int, default=0)
    parser.add_argument("--encoder-budget", type=float, default=60.0)
    parser.add_argument("--encoder-steps", type=int, default=1300,
                        help="word-detector pretraining steps (the demo's 60 s reach about 1,300 on an idle "
                             "2-core machine; on a busy one its seconds give far fewer); 0: --encoder-budget seconds")
    parser.add_argument("--encoder-boxes", action="store_true",
                        help="pretrain the word detectors region by region on the scenes' boxes as well")
    parser.add_argument("--recolour", type=float, default=0.0,
                        help="share of the word-detector images shown recoloured (the demo's 0.5), their colour "
                             "words left out of the loss")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--images", type=int, default=3000, help="scenes to generate (the demo's 3000)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (the demo's workers use one each: its small ops scale badly)")
    parser.add_argument("--set", action="append", default=[], help="extra key=value overrides for every run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    import torch

    torch.set_num_threads(args.threads)

    from captioner.config.parse import parse_override
    from captioner.demo.pipeline import _train_and_score, build_feature_caches
    from captioner.demo.pipeline import DemoOptions, demo_config, ensure_scenes, parse_budgets

    out = Path(args.out)
    decoders = tuple(d for d in args.decoders.split(",") if d)
    epochs = {k: int(v) for k, v in parse_budgets(args.epochs, "--epochs").items()}
    options = DemoOptions(data=out / "shapes", out=out, decoders=decoders, seed=args.seed, images=args.images,
                          encoder_budget=args.encoder_budget, unseen_pairs=args.unseen_pairs, progress=False)
    ensure_scenes(options)
    weights_file = out / "encoder.safetensors"
    if not weights_file.exists():  # --encoder-steps steps, or (0) --encoder-budget seconds, with the flags' signals
        from captioner.training.detectors import pretrain_word_detectors

        result = pretrain_word_detectors(demo_config(decoders[0], options), weights_file,
                                         max_steps=args.encoder_steps or None,
                                         seconds=None if args.encoder_steps else args.encoder_budget,
                                         progress=False, boxes=args.encoder_boxes, recolour=args.recolour)
        logging.info("encoder: %d word-detector steps in %.0f s", result.steps, result.seconds)
    extra = dict(parse_override(text) for text in args.set)
    rows = []
    for name in decoders:
        for weight in (float(w) for w in args.weights.split(",")):
            cfg = demo_config(name, options, weights_file).override(**{
                "train.time_budget": None, "train.budget_decay": False, "train.epochs": epochs[name],
                "train.patience": 0, "train.schedule": "cosine", "train.warmup_steps": 1,
                "train.attention_supervision": weight, "train.attention_supervision_form": args.form, **extra})
            build_feature_caches(cfg, progress=False)
            run_dir = out / (f"{name}_w{weight:g}" + ("" if args.form == "cross_entropy" else f"_{args.form}"))
            began = time.monotonic()
            done = _train_and_score(name, cfg, run_dir, beam_size=3, overlays=2, train_captions=1, progress=False)
            row = {"decoder": name, "weight": weight, "form": args.form, "epochs": epochs[name],
                   "steps": done["row"]["steps"], "seconds": round(time.monotonic() - began),
                   **{k: done["row"].get(k) for k in KEYS}}
            metrics = json.loads(Path(done["run"]["metrics_file"]).read_text())["attention_correctness"] or {}
            row.update({k: metrics.get(k) for k in KEYS if row.get(k) is None})
            rows.append(row)
            with open(out / "ablation.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
    for row in rows:
        print("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
