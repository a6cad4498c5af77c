"""Does attention follow the concept detectors? ``python scripts/experiments/concept_maps_on_references.py CKPT``.

CKPT: a checkpoint whose decoder reads concepts (``train.concepts``). On a COCO folder with boxes
(default ``../shared/data/coco2017-mini``), every reference caption is fed to the decoder (as
``captioner evaluate`` does for ``reference_attention_correctness``), and its words that are concepts
are scored twice against the boxes: with the decoder's attention at the step that predicts each, and
with the concept detectors' own map of that word in the photo (the target the concept guide pulls
attention towards). Prints both ratios with their 95% intervals and pointing accuracies: the gap
between them is how far the decoder falls short of the maps it was guided by.
"""

from __future__ import annotations

import argparse
import sys

import torch

from captioner.errors import CaptionerError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint whose decoder reads concepts")
    parser.add_argument("--data", default="../shared/data/coco2017-mini", help="COCO folder with instances")
    parser.add_argument("--split", default="train2017", help="split with boxes (default: train2017)")
    args = parser.parse_args(argv)
    import captioner
    from captioner.data.coco import load_caption_set, load_instances
    from captioner.data.dataset import image_loader
    from captioner.evaluation.attention_metrics import reference_correctness
    from captioner.evaluation.evaluate import ForcedCaption, reference_attention

    try:
        engine = captioner.load(args.checkpoint, device="cpu")
        decoder = engine.model.decoder
        if not getattr(decoder, "concepts", 0):
            raise CaptionerError(f"{args.checkpoint}: its decoder reads no concepts (train it with train.concepts)")
        cs = load_caption_set(args.data, args.split)
        instances = load_instances(args.data, args.split, None)
        if instances is None:
            raise CaptionerError(f"{args.data} [{args.split}]: no instances file, so no boxes to score against")
        concept_of = {engine.vocab.itos[i]: k for k, i in enumerate(decoder.concept_ids.tolist())}
        forced = reference_attention(engine, cs, progress=False)
        load = image_loader(cs, engine.transform)
        on_maps, on_attention = [], []
        with torch.no_grad():
            for i, refs in enumerate(forced):
                features, grid = engine.model.encode(load(i).unsqueeze(0))
                maps = decoder.concept_head.maps(features)[0].reshape(-1, int(grid[0]), int(grid[1]))  # (K, g, g)
                uniform = torch.full(maps.shape[1:], 1.0 / maps[0].numel())
                mine, theirs = [], []
                for ref in refs:  # words that are not concepts are hidden from the scorer
                    words = [w if w in concept_of else "<none>" for w in ref.words]
                    mine.append(ForcedCaption(words, torch.stack([maps[concept_of[w]] if w in concept_of else uniform
                                                                  for w in ref.words])))
                    theirs.append(ForcedCaption(words, ref.attention))
                on_maps.append(mine)
                on_attention.append(theirs)
        for name, captions in (("the decoder's attention", on_attention), ("the concept detectors' maps", on_maps)):
            r = reference_correctness(captions, cs, instances, engine.config.encoder)
            if not r["words_scored"]:
                print(f"{name}: no reference word is both a concept and a box's category")
                continue
            low, high = r["ratio_interval"] or (float("nan"), float("nan"))
            print(f"{name}: {r['ratio']:.2f}x uniform [95% {low:.2f}-{high:.2f}], pointing "
                  f"{r['pointing_accuracy']:.2f}, {r['words_scored']} words of {r['captions_scored']} captions")
    except CaptionerError as exc:
        print(f"concept_maps_on_references: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
