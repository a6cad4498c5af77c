#!/usr/bin/env python
"""The training script: ``python scripts/train.py ARGS`` is ``captioner train ARGS``.

    python scripts/train.py --preset sat_soft_lite --data data/shapes --out runs/sat
    torchrun --nproc_per_node=2 scripts/train.py --preset sat_soft --data data/coco --out runs/coco
    python scripts/train.py --preset sat_soft --data data/coco --out runs/coco_ft \
        --init runs/coco/best.safetensors --set encoder.fine_tune=true --set train.seed=1

See ``captioner train --help`` (the same parser) and docs/training.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from captioner.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
