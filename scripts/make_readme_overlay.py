#!/usr/bin/env python
"""Regenerate the README's example overlay (docs/images/overlay_example.png) from a checkpoint.

    python scripts/make_readme_overlay.py --checkpoint runs/demo/sat_soft/best.safetensors \\
        --image data/shapes/images/000123.png

Captions the image with beam search and writes the PNG grid (the image with its caption, then one
panel per word, in the default attention-as-light style or ``--style heat``) exactly as ``captioner attend`` does, sized for a README.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="trained checkpoint (.safetensors)")
    parser.add_argument("--image", required=True, help="image to caption")
    parser.add_argument("--out", default=str(REPO / "docs" / "images" / "overlay_example.png"), help="PNG to write")
    parser.add_argument("--beam", type=int, default=3, help="beam size (default: 3)")
    parser.add_argument("--max-len", type=int, default=12, help="longest caption in words (default: 12)")
    parser.add_argument("--columns", type=int, default=4, help="panels per row (default: 4)")
    parser.add_argument("--panel", type=int, default=200, help="longest side of a panel's picture (default: 200)")
    from captioner.commands.caption import add_style_arguments

    add_style_arguments(parser)
    args = parser.parse_args(argv)

    from captioner.data.images import load_image
    from captioner.errors import CaptionerError
    from captioner.inference import load
    from captioner.viz.overlays import render_grid

    try:
        model = load(args.checkpoint, device="cpu")
        image = load_image(args.image)
        result = model.caption(image, attention=True, beam=args.beam, max_len=args.max_len)[0]
        grid = render_grid(image, result, args.cmap, args.alpha, panel_side=args.panel, columns=args.columns,
                           style=args.style)
    except CaptionerError as exc:
        print(f"make_readme_overlay: error: {exc}", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    grid.save(out, optimize=True)
    print(f"{args.image}\t{result.text}\nwrote {out} ({grid.width}x{grid.height})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
