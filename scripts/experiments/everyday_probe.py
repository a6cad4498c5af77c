"""Quick probes of decoding levers for everyday photos: the shipped model's captions of the everyday dev
set (both halves, a seeded split) and Flickr8k dev from cached regions, scored with the package's BLEU-4
and CIDEr-D, CHAIR and the share of captions that repeat a content word. Settings are chosen here on
these probes; the figures a note reports come from ``captioner evaluate`` (coco-caption scoring).

    python scripts/experiments/everyday_probe.py --cache runs/probe SETTING [SETTING ...]

A SETTING is ``name:field=value,field=value`` over ``DecodeOptions`` (``plain:`` for the defaults).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

import captioner
from captioner.config import DecodeOptions
from captioner.evaluation.chair import chair_scores
from captioner.evaluation.metrics import bleu, cider_d
from captioner.inference import search_features
from captioner.text import STOP_WORDS, tokenize

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def dev_sets(data: Path) -> dict[str, tuple[list[Path], list[list[str]]]]:
    """name -> (photos, their reference captions): Flickr8k dev and the everyday dev set."""
    coco = json.loads((data / "flickr8k" / "captions_coco_format.json").read_text())
    dev = {line.split("\t")[0] for line in (data / "flickr8k" / "splits.tsv").read_text().splitlines()
           if line.endswith("\tdev")}
    names = {i["id"]: i["file_name"] for i in coco["images"] if i["file_name"] in dev}
    refs: dict[str, list[str]] = {}
    for a in coco["annotations"]:
        if a["image_id"] in names:
            refs.setdefault(names[a["image_id"]], []).append(a["caption"])
    flickr = sorted(refs)
    every = json.loads((data / "coco2014-val168" / "annotations" / "captions_val2014.json").read_text())
    files = {i["id"]: i["file_name"] for i in every["images"]}
    erefs: dict[str, list[str]] = {}
    for a in every["annotations"]:
        erefs.setdefault(files[a["image_id"]], []).append(a["caption"])
    everyday = sorted(erefs)
    return {"flickr8k_dev": ([data / "flickr8k" / "images" / n for n in flickr], [refs[n] for n in flickr]),
            "everyday": ([data / "coco2014-val168" / "val2014" / n for n in everyday], [erefs[n] for n in everyday])}


def repeats(caption: str) -> bool:
    """Whether the caption uses a content word (not a stop word) twice."""
    words = [w for w in tokenize(caption) if w not in STOP_WORDS]
    return len(words) != len(set(words))


def scores(captions: list[str], refs: list[list[str]]) -> dict[str, float]:
    chair = chair_scores(captions, refs)
    return {"B4": 100 * bleu(captions, refs)["BLEU-4"], "CIDEr-D": 100 * cider_d(captions, refs),
            "CHAIR-s": 100 * (chair.chair_s or 0), "CHAIR-i": 100 * (chair.chair_i or 0),
            "coverage": 100 * (chair.coverage or 0), "repeats": 100 * sum(map(repeats, captions)) / len(captions)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("settings", nargs="+")
    parser.add_argument("--cache", type=Path, default=Path("runs/probe"))
    parser.add_argument("--model", default="flickr8k")
    args = parser.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    model = captioner.load(args.model)
    sets = dev_sets(DATA)
    half = list(range(len(sets["everyday"][0])))
    random.Random(0).shuffle(half)
    halves = {"A": sorted(half[:len(half) // 2]), "B": sorted(half[len(half) // 2:])}
    features = {}
    for name, (photos, _) in sets.items():
        path = args.cache / f"{name}.pt"
        if not path.exists():
            torch.save(torch.cat([model.encode([str(p) for p in photos[i:i + 50]])[0]
                                  for i in range(0, len(photos), 50)]), path)
        features[name] = torch.load(path)
    for setting in args.settings:
        label, _, fields = setting.partition(":")
        kw = {k: type(getattr(DecodeOptions(), k))(v) if not isinstance(getattr(DecodeOptions(), k), bool)
              else v == "1" for k, v in (f.split("=") for f in fields.split(",") if f)}
        options = DecodeOptions(**kw)
        row = {"setting": label, **kw}
        for name, (photos, refs) in sets.items():
            t0 = time.time()
            caps = [model.vocab.decode(h[0].tokens) for i in range(0, len(photos), 100)
                    for h in search_features(model.model.decoder, features[name][i:i + 100], model.vocab, options)]
            row[name] = scores(caps, refs)
            if name == "everyday":
                for h, idx in halves.items():
                    row[f"everyday_{h}"] = scores([caps[i] for i in idx], [refs[i] for i in idx])
                (args.cache / f"captions_{label}.json").write_text(json.dumps(dict(zip(map(str, photos), caps)), indent=0))
            row[name]["seconds"] = round(time.time() - t0, 1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
