"""``captioner concepts``: learn concept detectors from a dataset's captions over its feature cache."""

from __future__ import annotations

import argparse

NAME = "concepts"
HELP = ("learn concept detectors (which caption words each region shows) from the training captions, over the "
        "frozen encoder's feature cache; a decoder can read them (decoder.concepts) and be guided by their maps "
        "(train.concept_guide)")
EXAMPLES = """
  captioner concepts --preset sat_soft_flickr8k --data ../shared/data/flickr8k --out runs/flickr8k/concepts.safetensors
  captioner concepts --preset sat_soft_flickr8k --data data/flickr8k --out c.safetensors --concepts 1000 --epochs 10
  captioner concepts ... --boxes ../shared/data/coco2017-mini    # also: do COCO words' maps peak in their boxes?
  captioner concepts ... --folds 3    # also 3 fold heads: a decoder trains on concepts of heads that never saw the photo
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", metavar="NAME", help="the preset whose encoder and data settings to use")
    parser.add_argument("--config", metavar="FILE", help="JSON or YAML config file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config value (repeatable)")
    parser.add_argument("--data", metavar="DIR", help="dataset folder (data.root)")
    parser.add_argument("--out", metavar="FILE", required=True, help="the concepts file to write (.safetensors)")
    parser.add_argument("--concepts", type=int, default=1000, metavar="K",
                        help="how many concept words: the most frequent content words (default 1000)")
    parser.add_argument("--epochs", type=int, default=8, help="passes over the training images (default 8)")
    parser.add_argument("--hidden", type=int, default=512, help="hidden width of the head (0: linear; default 512)")
    parser.add_argument("--pooling", choices=("lse", "noisy_or"), default="lse",
                        help="how region scores make an image score (default lse, a soft maximum)")
    parser.add_argument("--boxes", metavar="DIR",
                        help="a COCO folder with instances_<split>.json (e.g. ../shared/data/coco2017-mini): report "
                             "how often a COCO word's map peaks inside its object's box")
    parser.add_argument("--boxes-split", default="train2017", metavar="SPLIT", help="the split of --boxes")
    parser.add_argument("--folds", type=int, default=0, metavar="F",
                        help="also train F >= 2 fold heads, each without one fold of the training photos: a decoder "
                             "reading these concepts trains on each photo's concepts from the head that never saw "
                             "it (train.concept_cross_fit); F + 1 times the training (default 0: none)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from captioner.config import resolve_config
    from captioner.training.detectors import learn_concepts

    cfg = resolve_config(args.preset, args.config, list(args.overrides))
    if args.data:
        cfg = cfg.override(**{"data.root": args.data})
    print(learn_concepts(cfg, args.out, k=args.concepts, epochs=args.epochs, hidden=args.hidden,
                         pooling=args.pooling, boxes=args.boxes, boxes_split=args.boxes_split,
                         progress=not args.no_progress, folds=args.folds))
    return 0
