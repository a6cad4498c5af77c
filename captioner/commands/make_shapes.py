"""``captioner make-shapes``: write the synthetic shapes captioning dataset."""

from __future__ import annotations

import argparse

from captioner.commands.options import int_range

MAX_IMAGES, MAX_IMAGE_SIZE, MAX_UNSEEN_PAIRS = 10_000_000, 4096, 18  # captioner.data.shapes' bounds (no import here)

NAME = "make-shapes"
HELP = "generate the synthetic shapes dataset (COCO-format captions, boxes and PNG images)"
EXAMPLES = """
  captioner make-shapes                                   # 3000 images, 128 px, into data/shapes
  captioner make-shapes --out data/shapes --images 3000 --seed 0
  captioner make-shapes --out /tmp/shapes-small --images 300 --image-size 64 --seed 1
  captioner make-shapes --out data/shapes_unseen4 --unseen-pairs 4   # 4 colour-shape pairs only in test
  captioner make-shapes --out data/shapes --images 300 --force       # replace the dataset already there
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="data/shapes", help="output folder (default: %(default)s)")
    parser.add_argument("--images", type=int_range(3, MAX_IMAGES), default=3000,
                        help=f"number of images over train/val/test (80/10/10), 3 to {MAX_IMAGES} "
                             "(default: %(default)s)")
    parser.add_argument("--seed", type=int_range(0, 2**63 - 1), default=0,
                        help="random seed; same seed, same files (default: %(default)s)")
    parser.add_argument("--image-size", type=int_range(32, MAX_IMAGE_SIZE), default=128,
                        help=f"image side in pixels, 32 to {MAX_IMAGE_SIZE} (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="replace a dataset already in --out")
    parser.add_argument("--unseen-pairs", type=int_range(0, MAX_UNSEEN_PAIRS), default=0, metavar="K",
                        help="compositional split: K colour-shape pairs never in train or val, only in test "
                             "(every other test scene has one; `captioner evaluate` then reports seen and unseen "
                             "apart; default: 0)")


def run(args: argparse.Namespace) -> int:
    from captioner.data.shapes import make_shapes

    stats = make_shapes(args.out, images=args.images, seed=args.seed, image_size=args.image_size,
                        unseen_pairs=args.unseen_pairs, overwrite=args.force)
    splits = stats["splits"]
    print(f"wrote {stats['images']} images ({splits['train']} train, {splits['val']} val, {splits['test']} test), "
          f"{stats['captions']} captions and {stats['objects']} object boxes to {stats['out']} "
          f"in {stats['seconds']:.1f}s")
    if stats["unseen_pairs"]:
        print("held out of train and val: " + ", ".join(f"{c} {s}" for c, s in stats["unseen_pairs"]))
    return 0
