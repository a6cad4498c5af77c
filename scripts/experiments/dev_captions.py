"""Caption the Flickr8k dev photos with a model and write {image: caption} as JSON.

A check that a change to the code leaves the shipped model's captions as they were: run it before and
after, then compare the two files (``--compare``).

    python scripts/experiments/dev_captions.py out.json [--model flickr8k] [--precision bfloat16]
    python scripts/experiments/dev_captions.py --compare before.json after.json
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import torch

import captioner

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "flickr8k"


def dev_photos(root: Path) -> list[Path]:
    with open(root / "splits.tsv", newline="") as f:
        rows = [row for row in csv.reader(f, delimiter="\t") if len(row) == 2]
    return [root / "images" / name for name, split in rows if split == "dev"]


def compare(before: Path, after: Path) -> int:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    same = sum(1 for key in a if b.get(key) == a[key])
    print(f"{same} of {len(a)} identical ({len(b)} in {after.name})")
    return 0 if same == len(a) == len(b) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path)
    parser.add_argument("--model", default="flickr8k")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--beam", type=int, default=3)
    parser.add_argument("--precision", default="float32")
    parser.add_argument("--limit", type=int, default=0, help="only the first N photos (0: all)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if args.out is None:
        parser.error("give the output file")
    torch.manual_seed(0)
    photos = dev_photos(args.data)
    if args.limit:
        photos = photos[: args.limit]
    model = captioner.load(args.model, device="cpu")
    start = time.perf_counter()
    captions = model.caption(photos, beam=args.beam, precision=args.precision, batch_size=32)
    result = {photo.name: caption.text for photo, caption in zip(photos, captions)}
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"{len(result)} captions in {time.perf_counter() - start:.0f} s -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
