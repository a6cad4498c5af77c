"""How well the encoder's ImageNet head names the objects of everyday photos, and what it costs.

On a COCO-format set (default ``../shared/data/coco2014-val168``; the objects present in a photo are
the COCO categories its reference captions name, :func:`captioner.evaluation.chair.named_objects`)
the head of the shipped model's encoder is read two ways:

* (a) on the shipped encoder's own region features (its top stage fine-tuned on Flickr8k);
* (b) on the features of the original ImageNet top stage (the wheel's ``blocks.6``, ``conv_head``,
  ``bn2``) run on the shipped trunk's stride-16 map, which the fine-tuning left as it was.

Reported for each: precision of the top word when its probability is over ``--confident`` and it
names a COCO category (right = a category present), the same over every confident top word judged
by the references' text, recall of the non-person objects present within the top-5 words, and the
time per photo of the head (and, for (b), of the extra top stage). With ``--boxes`` (a COCO set with
an instances file, e.g. ``../shared/data/coco2017-mini``) also where (a)'s maps put their mass: the
share inside the boxes of the word's category against the uniform share, over the top-5 words
with p >= 0.1 that name a boxed category.

    python scripts/experiments/label_quality.py [--data DIR --split val2014 --boxes DIR --json]
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
import torch.nn.functional as F

import captioner
from captioner.models.labels import label_head
from captioner.data.coco import load_caption_set
from captioner.data.images import crop_box, load_image
from captioner.models.encoder import efficientnet_lite_state_dict
from captioner.data.coco import load_instances
from captioner.evaluation.attention_metrics import box_coverage
from captioner.evaluation.chair import named_objects
from captioner.text import tokenize


def trunk_parts(trunk: torch.nn.Module, original: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(bottom: stem + all block stages but the last, top: last stage + conv_head + bn2 + ReLU6)."""
    last = len(trunk.blocks) - 1
    top_trunk = trunk
    if original:
        top_trunk = copy.deepcopy(trunk)
        top_trunk.load_state_dict({k: v for k, v in efficientnet_lite_state_dict("efficientnet_lite0").items()
                                   if not k.startswith("classifier.")})
    bottom = torch.nn.Sequential(trunk.conv_stem, trunk.bn1, torch.nn.ReLU6(), *trunk.blocks[:last])
    top = torch.nn.Sequential(top_trunk.blocks[last], top_trunk.conv_head, top_trunk.bn2, torch.nn.ReLU6())
    return bottom.eval(), top.eval()


def maps_in_boxes(model, head, root: str, split: str) -> dict:
    """Mass of the top words' maps inside their category's boxes, against the uniform share."""
    cs, instances = load_caption_set(root, split), load_instances(root, split)
    inside, uniform = [], []
    for rec in cs.images:
        image = load_image(rec.path)
        features, grid = model.encode(image)
        view = crop_box(image.width, image.height, model.config.encoder)
        for word, p, grid_map in head.top(features, grid, k=5, min_prob=0.1)[0]:
            cats = named_objects(word)
            boxes = [b.bbox for b in instances.get(rec.image_id, []) if cats and b.category == cats[0]]
            if boxes:
                cover = box_coverage(boxes, view, grid[0])
                inside.append(float((grid_map.flatten().numpy() * cover).sum()))
                uniform.append(float(cover.mean()))
    return {"labels_scored": len(inside), "mass_in_boxes": round(sum(inside) / max(len(inside), 1), 3),
            "uniform": round(sum(uniform) / max(len(uniform), 1), 3),
            "ratio": round(sum(inside) / max(sum(uniform), 1e-9), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="../shared/data/coco2014-val168")
    parser.add_argument("--split", default="val2014")
    parser.add_argument("--confident", type=float, default=0.3)
    parser.add_argument("--boxes", default=None, help="a COCO set with boxes: where the maps put their mass")
    parser.add_argument("--boxes-split", default="train2017")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = captioner.load("flickr8k", device="cpu")
    cs = load_caption_set(args.data, args.split)
    head = label_head(model.config.encoder)
    g = model.config.encoder.grid
    pixels = torch.stack([model.transform(load_image(r.path)) for r in cs.images])
    trunk = model.model.encoder.trunk
    bottom, shipped_top = trunk_parts(trunk, original=False)
    _, original_top = trunk_parts(trunk, original=True)
    out = {}
    with torch.no_grad():
        mid = torch.cat([bottom(pixels[i:i + 32]) for i in range(0, len(pixels), 32)])  # (B, 112/192, 14, 14)
        for name, top in (("a_shipped", shipped_top), ("b_original", original_top)):
            start = time.perf_counter()
            fmap = torch.cat([top(mid[i:i + 32]) for i in range(0, len(mid), 32)])  # (B, 1280, 7, 7)
            top_s = (time.perf_counter() - start) / len(cs.images)
            feats = F.adaptive_avg_pool2d(fmap, g).flatten(2).transpose(1, 2)  # (B, N, 1280)
            start = time.perf_counter()
            labels = head.top(feats, (g, g), k=5)
            head_s = (time.perf_counter() - start) / len(cs.images)
            conf = right = judged = text_right = recall_hit = recall_all = 0
            examples = []
            for rec, found in zip(cs.images, labels):
                refs = cs.references(rec.image_id)
                present = {c for text in refs for c in named_objects(text)}
                ref_words = {w for text in refs for w in tokenize(text)}
                top_word, p = found[0][0], found[0][1]
                if p > args.confident:
                    conf += 1
                    text_right += all(w in ref_words for w in top_word.split()) or bool(
                        set(named_objects(top_word)) & present)
                    cats = named_objects(top_word)
                    if cats:
                        judged += 1
                        right += cats[0] in present
                        if cats[0] not in present and len(examples) < 8:
                            examples.append(f"{rec.file_name}: {top_word} {p:.2f} vs {sorted(present)}")
                top5 = {c for word, _, _ in found for c in named_objects(word)}
                objects = present - {"person"}
                recall_all += len(objects)
                recall_hit += len(objects & top5)
            out[name] = {"confident_top_words": conf, "confident_coco_top_words": judged, "right": right,
                         "precision": round(right / max(judged, 1), 3),
                         "confident_top_word_in_references": round(text_right / max(conf, 1), 3),
                         "non_person_objects": recall_all, "in_top5": recall_hit,
                         "recall_top5": round(recall_hit / max(recall_all, 1), 3),
                         "top_stage_ms_per_photo": round(1000 * top_s, 2),
                         "head_ms_per_photo": round(1000 * head_s, 3), "wrong_examples": examples}
    if args.boxes:
        out["a_maps_in_boxes"] = maps_in_boxes(model, head, args.boxes, args.boxes_split)
    print(json.dumps(out, indent=2) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
