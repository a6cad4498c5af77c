#!/usr/bin/env python
"""Attention supervision on real COCO boxes: fine-tune a checkpoint on half of coco2017-mini
with and without ``train.attention_supervision``, and score the attention on the other half's boxes.

    python scripts/experiments/grounding_coco.py runs/flickr8k/transformer/best.safetensors --out runs/grounding_coco \\
        --coco ../shared/data/coco2017-mini --epochs 10 --weights 0,1

The 80 photos of ``coco2017-mini`` (``annotations/instances_train2017.json`` holds their boxes) are
split by image id into two folds of 40 (``<out>/folds``: split folders ``a`` and ``b`` of symlinks, with
their captions and instances files). For each weight, the checkpoint is fine-tuned (``--init``: its
weights and vocabulary, a fresh optimiser) on fold ``a`` for ``--epochs`` epochs, then scored on fold
``b``, which it never trained on, twice:

* ``captioner evaluate`` (beam 3): attention correctness of the words it generates (few: a small
  model names few COCO objects on 40 photos);
* teacher-forced on the 200 reference captions of fold ``b``: the attention mass inside the box of
  every reference word that names an object (the words and boxes the supervision uses), against
  uniform attention. Many more words, so a steadier figure.

The starting checkpoint itself is scored the same way (row ``base``). One JSON line per row goes to
``<out>/coco.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def make_folds(coco: Path, out: Path) -> Path:
    """Two folds ``a``, ``b`` of the mini set's photos (every other image id), as a flat COCO folder."""
    caps = json.loads((coco / "annotations" / "captions_train2017.json").read_text())
    inst = json.loads((coco / "annotations" / "instances_train2017.json").read_text())
    ids = sorted(im["id"] for im in caps["images"])
    for name, keep in (("a", set(ids[0::2])), ("b", set(ids[1::2]))):
        (out / name).mkdir(parents=True, exist_ok=True)
        for im in caps["images"]:
            link = out / name / im["file_name"]
            if im["id"] in keep and not link.exists():
                os.symlink((coco / "train2017" / im["file_name"]).resolve(), link)
        for kind, data in (("captions", caps), ("instances", inst)):
            part = {k: v for k, v in data.items() if k not in ("images", "annotations")}
            part["images"] = [im for im in data["images"] if im["id"] in keep]
            part["annotations"] = [a for a in data["annotations"] if a["image_id"] in keep]
            (out / f"{kind}_{name}.json").write_text(json.dumps(part))
    return out


def teacher_forced_mass(checkpoint: Path, data: Path, split: str) -> dict[str, float]:
    """Mean attention mass inside the named object's box over the reference words that name one."""
    import torch

    from captioner.data.coco import load_caption_set, load_instances
    from captioner.data.images import load_image
    from captioner.inference import load
    from captioner.training.attention_terms import GroundingTargets

    engine = load(checkpoint, device="cpu")
    model, vocab, encoder = engine.model.eval(), engine.vocab, engine.config.encoder
    cs, instances = load_caption_set(data, split), load_instances(data, split)
    targets = GroundingTargets.for_encoder(cs.images, instances, vocab, encoder)
    mass = uniform = words = 0.0
    with torch.no_grad():
        for index, record in enumerate(cs.images):
            features, _ = model.encoder(engine.transform(load_image(record.path)).unsqueeze(0))  # (1, N, D)
            for caption in cs.references(record.image_id):
                tokens = torch.tensor([vocab.encode(caption, 30)])  # (1, T)
                cov = targets.coverage(tokens[:, 1:], torch.tensor([index]))[0]  # (T-1, N)
                att = model.decoder(features, tokens[:, :-1]).attention[0].float()  # (T-1, N)
                named = cov.sum(-1) > 0
                mass += float((att * cov).sum(-1)[named].sum())
                uniform += float(cov.mean(-1)[named].sum())
                words += float(named.sum())
    return {"tf_in_box": mass / words, "tf_uniform": uniform / words, "tf_ratio": mass / uniform, "tf_words": words}


def score(checkpoint: Path, folds: Path, out_dir: Path) -> dict[str, float]:
    from captioner.evaluation.evaluate import evaluate_checkpoint

    metrics = evaluate_checkpoint(checkpoint, folds, "b", beam_size=3, out_dir=out_dir, progress=False, meteor=False,
                                  coco_caption=False)
    att = metrics["attention_correctness"] or {}
    row = {"BLEU-4": metrics["BLEU-4"], "CIDEr-D": metrics["CIDEr-D"],
           **{k: att.get(k) for k in ("attention_correctness", "uniform_baseline", "ratio", "words_scored")}}
    return {**row, **teacher_forced_mass(checkpoint, folds, "b")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--coco", type=Path, default=Path("../shared/data/coco2017-mini"))
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--weights", default="0,1")
    parser.add_argument("--lr", type=float, default=1e-4)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    from captioner.checkpoint.store import load_checkpoint
    from captioner.config import Config
    from captioner.training.loop import train

    folds = make_folds(args.coco, args.out / "folds")
    rows = [{"run": "base", **score(args.checkpoint, folds, args.out / "base")}]
    base = Config.from_dict(json.loads((args.checkpoint.parent / "config.json").read_text())) \
        if (args.checkpoint.parent / "config.json").is_file() else Config(model=load_checkpoint(args.checkpoint).config)
    for weight in (float(w) for w in args.weights.split(",")):
        cfg = base.override(**{
            "data.root": str(folds), "data.train_split": "a", "data.val_split": "a", "data.feature_cache_dir": None,
            "train.init": str(args.checkpoint), "train.epochs": args.epochs, "train.patience": 0,
            "train.schedule": "constant", "train.lr": args.lr, "train.time_budget": None, "train.val_max_images": 10,
            "train.log_every": 5, "train.attention_supervision": weight, "train.device": "cpu"})
        run = args.out / f"w{weight:g}"
        train(cfg, run, progress=False, overwrite=True)
        rows.append({"run": f"w{weight:g}", **score(run / "latest.safetensors", folds, run)})
    with open(args.out / "coco.jsonl", "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    for row in rows:
        print("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
