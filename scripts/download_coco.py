#!/usr/bin/env python
"""Kept for old instructions: the same as ``captioner download coco ARGS``, which holds the code
(:mod:`captioner.data.archives`).

    python scripts/download_coco.py --root data/coco --dry-run
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from captioner.cli import main as captioner_main  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return captioner_main(["download", "coco", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
