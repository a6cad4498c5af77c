"""``captioner make-shapes``: write the synthetic shapes captioning dataset."""

from __future__ import annotations

import argparse

NAME = "make-shapes"
HELP = "generate the synthetic shapes dataset (COCO-format captions, boxes and PNG images)"
EXAMPLES = """
  captioner make-shapes                                   # 3000 images, 128 px, into data/shapes
  captioner make-shapes --out data/shapes --images 3000 --seed 0
  captioner make-shapes --out /tmp/shapes-small --images 300 --image-size 64 --seed 1
  captioner make-shapes --out data/shapes_unseen4 --unseen-pairs 4   # 4 colour-shape pairs only in test
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="data/shapes", help="output folder (default: %(default)s)")
    parser.add_argument("--images", type=_positive_int, default=3000,
                        help="number of images over train/val/test (80/10/10; default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed; same seed, same files (default: %(default)s)")
    parser.add_argument("--image-size", type=_positive_int, default=128,
                        help="image side in pixels (default: %(default)s)")
    parser.add_argument("--unseen-pairs", type=int, default=0, metavar="K",
                        help="compositional split: K colour-shape pairs never in train or val, only in test "
                             "(every other test scene has one; `captioner evaluate` then reports seen and unseen "
                             "apart; default: 0)")


def run(args: argparse.Namespace) -> int:
    from captioner.data.shapes import make_shapes

    stats = make_shapes(args.out, images=args.images, seed=args.seed, image_size=args.image_size,
                        unseen_pairs=args.unseen_pairs)
    splits = stats["splits"]
    print(f"wrote {stats['images']} images ({splits['train']} train, {splits['val']} val, {splits['test']} test), "
          f"{stats['captions']} captions and {stats['objects']} object boxes to {stats['out']} "
          f"in {stats['seconds']:.1f}s")
    if stats["unseen_pairs"]:
        print("held out of train and val: " + ", ".join(f"{c} {s}" for c, s in stats["unseen_pairs"]))
    return 0
