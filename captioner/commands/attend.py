"""``captioner attend``: caption one image and write where each word looked.

Writes ``attention.png`` (the image with its caption, then one panel per word), ``attention.gif``,
``attention.json`` and ``attention.html`` (the explorer; every layer and head for a Transformer) to
``--out``. With no image it captions the package's example photos, each into its own folder.
"""

from __future__ import annotations

import argparse
import dataclasses

from captioner.commands.caption import add_common_arguments, add_force_argument, add_style_arguments, checkpoints
from captioner.commands.options import decoding_overrides, encoder_precision, int_range

NAME = "attend"
HELP = "caption one image and write its attention overlays: PNG grid, GIF, JSON and an HTML explorer"
EXAMPLES = """
  captioner attend                                   # the shipped model on the example photos -> overlays/
  captioner attend photo.jpg --out overlays/         # the shipped model on your photo
  captioner attend photo.jpg --checkpoint runs/sat/best.safetensors --out overlays/
  captioner attend photo.jpg -c best.safetensors --out overlays/ --style heat --cmap magma --beam 5
  captioner attend photo.jpg -c runs/tf/best.safetensors --out overlays/ --layer 1 --head 3   # Transformer
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("image", metavar="IMAGE", nargs="?", default=None,
                        help="image file (default: the example photos shipped with the package)")
    add_common_arguments(parser)
    parser.add_argument("--out", default="overlays", metavar="DIR", help="output folder (created; default: overlays)")
    add_force_argument(parser, "--out")
    add_style_arguments(parser)
    parser.add_argument("--layer", type=int_range(1, 1000), default=None,
                        help="Transformer: decoder layer shown in the PNG/GIF, 1-based (default: the last)")
    parser.add_argument("--head", type=int_range(1, 1000), default=None,
                        help="Transformer: attention head shown, 1-based (default: the mean of all heads)")
    parser.add_argument("--stem", default="attention",
                        help="output file name stem, a plain name without folders (default: attention)")


def select_view(all_attention, layer: int | None, head: int | None):
    """The (L, g, g) maps of one layer (1-based; None = last) and head (1-based; None = mean of heads)."""
    from captioner.errors import ConfigError

    layers, heads = all_attention.shape[1:3]
    li = layers - 1 if layer is None else layer - 1
    if not 0 <= li < layers:
        raise ConfigError(f"--layer {layer} out of range: the decoder has {layers} layers (1..{layers})")
    per_head = all_attention[:, li]  # (L, heads, g, g)
    if head is None:
        return per_head.mean(axis=1)
    if not 1 <= head <= heads:
        raise ConfigError(f"--head {head} out of range: the decoder has {heads} heads (1..{heads})")
    return per_head[:, head - 1]


def run(args: argparse.Namespace) -> int:
    decoding = decoding_overrides(args)
    from captioner.device import resolve_device
    from captioner.errors import ConfigError
    from captioner.inference import load
    from captioner.viz.overlays import check_stem, colormap_lut

    colormap_lut(args.cmap)  # bad names and values fail before any work
    check_stem(args.stem, "--stem")  # the files must stay inside --out
    from captioner.files import writable_folder

    writable_folder(args.out, ConfigError)  # before the model loads
    if not 0.0 <= args.alpha <= 1.0:
        raise ConfigError(f"--alpha must be in [0, 1], got {args.alpha}")
    from pathlib import Path

    from captioner.files import Outputs
    from captioner.pretrained import PHOTOS, example_photos
    from captioner.viz.overlays import overlay_paths

    # each example photo into its own folder: overlays/skateboarder/attention.png ...
    jobs = [(args.image, Path(args.out))] if args.image is not None else \
        [(photo, Path(args.out) / photo.stem) for photo in example_photos()]
    outputs = Outputs(Path(args.out), force=args.force, option="--out")
    outputs.check([p for _, out in jobs for p in overlay_paths(out, args.stem).values()])  # before any work
    from captioner.data.images import load_image

    jobs = [(load_image(path), path, out) for path, out in jobs]  # the photos, read before any model loads
    model = load(checkpoints(args), device=resolve_device(args.device, option="--device"), refresh=args.refresh,
                 precision=encoder_precision(args))
    for image, path, out in jobs:  # each file is recorded in the manifest as it is written
        _attend(model, args, image, path, out, decoding, outputs)
    if args.image is None:
        print(f"credits of the example photos: {PHOTOS / 'CREDITS.md'}")
    return 0


def _attend(model, args: argparse.Namespace, image, path, out, decoding: dict, outputs) -> list:
    """Caption ``image`` (read from ``path``) and write its overlays, GIF, JSON and explorer to ``out`` (recorded
    in ``outputs``); the files written.

    An empty caption is an error (``EmptyCaptionError``, from the model): nothing is drawn for it."""
    from captioner.errors import ConfigError
    from captioner.inference import decode_options, empty_caption
    from captioner.viz.overlays import write_overlays

    result = model.caption(image, all_heads=True, labels=args.labels, allow_empty=True, **decoding)[0]
    if not result.words:  # nothing to draw: an error naming the file
        raise empty_caption(str(path), decode_options(None, **decoding))
    all_att = result.all_attention.numpy() if result.all_attention is not None else None  # (L, layers, heads, g, g)
    attention = result.attention.numpy()  # (L, g, g): the decoder's overlay view
    if args.layer is not None or args.head is not None:
        if all_att is None:
            raise ConfigError("--layer/--head need per-layer attention; this checkpoint's decoder has one "
                              "attention map per word")
        attention = select_view(all_att, args.layer, args.head)
    paths = write_overlays(
        image, dataclasses.replace(result, attention=attention), out, cmap=args.cmap, alpha=args.alpha,
        style=args.style, stem=args.stem, layer=-1 if args.layer is None else args.layer - 1,
        head=None if args.head is None else args.head - 1, outputs=outputs,
    )
    print(f"{path}\t{result.text}")
    for written in paths.values():  # png, gif, json, html (and the tags' and labels' png when there are some)
        print(f"wrote {written}")
    return list(paths.values())
