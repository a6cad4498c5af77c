#!/usr/bin/env python
"""Calibrate the int8 encoder of a model once: the range of every activation of its EfficientNet-Lite
trunk, measured on a few hundred training photos, written as a small JSON file shipped beside the model
(``captioner.load(name, precision="int8")`` reads it; nothing is calibrated at a user's call).

    python scripts/calibrate_int8.py                       # the shipped model, 256 Flickr8k train photos
    python scripts/calibrate_int8.py --photos 512 --out /tmp/flickr8k.int8.json

Photos: the Flickr8k train split of ``--data`` (default ../shared/data/flickr8k), shuffled with seed 0,
the first ``--photos``. Writes ``--out`` (default captioner/weights/<model>.int8.json); the registry entry
(captioner/pretrained.py) pins its SHA-256, printed at the end.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import captioner  # noqa: E402
from captioner.data.images import load_image  # noqa: E402
from captioner.files import file_sha256  # noqa: E402
from captioner.models.quantize import calibrate, write_calibration  # noqa: E402
from captioner.pretrained import WEIGHTS  # noqa: E402

BATCH = 32


def train_photos(data: Path, count: int, seed: int = 0) -> list[Path]:
    """``count`` photos of the train split of ``data`` (splits.tsv, images/), shuffled with ``seed``."""
    rows = [line.split("\t") for line in (data / "splits.tsv").read_text(encoding="utf-8").splitlines()]
    names = sorted(row[0] for row in rows if len(row) == 2 and row[1].strip() == "train")
    random.Random(seed).shuffle(names)
    return [data / "images" / name for name in names[:count]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="flickr8k", help="a shipped model's name (default: flickr8k)")
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "flickr8k")
    parser.add_argument("--photos", type=int, default=256, help="calibration photos (default: 256)")
    parser.add_argument("--out", type=Path, default=None, help="default: captioner/weights/<model>.int8.json")
    args = parser.parse_args(argv)
    paths = train_photos(args.data, args.photos)
    if not paths:
        print(f"{args.data}: no train photos (splits.tsv, images/)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    model = captioner.load(args.model, device="cpu", precision="float32")

    def batches():
        for start in range(0, len(paths), BATCH):
            yield torch.stack([model.transform(load_image(p)) for p in paths[start:start + BATCH]])

    t0 = time.perf_counter()
    measured = calibrate(model.model.encoder.trunk, batches())
    out = args.out or WEIGHTS / f"{args.model}.int8.json"
    write_calibration(out, measured, {"model": args.model, "photos": len(paths),
                                    "data": f"{args.data.name} train split, shuffled with seed 0"})
    seconds = time.perf_counter() - t0
    print(f"wrote {out}: {len(measured.ranges)} activations from {len(paths)} photos in {seconds:.0f} s; "
          f"sha256 {file_sha256(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
