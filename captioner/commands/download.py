"""``captioner download flickr8k|coco``: fetch a dataset's archives and unzip them into the layout ``--data`` reads.

Downloads are resumable (``ROOT/downloads/<name>.part`` and HTTP Range: run the same command
again), checked (sizes and checksums where known) and extracted only into ``--root``; what is
already extracted is skipped. The datasets are described in :mod:`captioner.data.archives`.
"""

from __future__ import annotations

import argparse

NAME = "download"
HELP = "download a dataset (flickr8k or coco) into the layout --data reads: resumable, checked, extracted"
EXAMPLES = """
  captioner download flickr8k --root data/flickr8k                 # the two zips of the public mirror (~1 GB)
  captioner download flickr8k --root data/flickr8k --sha256 images=HEX --sha256 text=HEX
  captioner download coco --root data/coco --dry-run               # list what it would fetch and write
  captioner download coco --root data/coco --only annotations karpathy
"""
INTERRUPTED = "interrupted (run again to resume)"

FLICKR8K_KEYS = ("images", "text")
COCO_KEYS = ("train", "val", "annotations", "karpathy")


def _common(p: argparse.ArgumentParser, default_root: str, keys: tuple[str, ...]) -> None:
    """The options both datasets have: --root, --only, --mirror, --keep-archives, --dry-run, --no-progress."""
    p.add_argument("--root", default=default_root, help=f"dataset folder (default: {default_root})")
    p.add_argument("--only", nargs="+", metavar="NAME", choices=keys,
                   help="process only these archives: " + ", ".join(keys))
    p.add_argument("--mirror", metavar="URL", help="fetch every archive as URL/<archive name>")
    p.add_argument("--keep-archives", action="store_true", help="keep the zip files after extraction")
    p.add_argument("--dry-run", action="store_true", help="list what would be done, do nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (they are drawn only when stderr is a terminal)")
    p.add_argument("--force", action="store_true",
                   help="replace files under --root that captioner did not write (by default they are refused)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="dataset", metavar="DATASET", required=True, parser_class=type(parser))
    f8k = sub.add_parser("flickr8k", help="Flickr8k from the public mirror: photos and captions (about 1 GB)",
                         description="Flickr8k from the public mirror (github.com/jbrownlee/Datasets): "
                                     "Flickr8k_Dataset.zip and Flickr8k_text.zip, unzipped into "
                                     "ROOT/Flicker8k_Dataset/ and ROOT/Flickr8k_text/; each zip's SHA-256 is "
                                     "recorded in ROOT/Flickr8k.sha256, or checked with --sha256.")
    _common(f8k, "data/flickr8k", FLICKR8K_KEYS)
    f8k.add_argument("--sha256", action="append", metavar="KEY=HEX",
                     help="expected SHA-256 of an archive (images=..., text=...); repeat for both")
    coco = sub.add_parser("coco", help="COCO 2014 images, caption annotations and the Karpathy split (~20 GB)",
                          description="COCO 2014 (train2014, val2014, caption annotations) and the Karpathy "
                                      "split (dataset_coco.json); sizes and MD5s checked where known.")
    _common(coco, "data/coco", COCO_KEYS)
    coco.add_argument("--instances", action="store_true", help="also extract instances_{train,val}2014.json")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    if args.dataset == "flickr8k":
        from captioner.data.archives import flickr8k as dataset

        archives = dataset.select_archives(args.only, args.mirror, dataset.parse_sha256(args.sha256))
    else:
        from captioner.data.archives import coco as dataset

        archives = dataset.select_archives(args.only, args.mirror, args.instances)
    actions = dataset.prepare(Path(args.root), archives, dry_run=args.dry_run, keep_archives=args.keep_archives,
                              progress=False if args.no_progress else None, force=args.force)
    print(("would do:\n  " if args.dry_run else "done:\n  ") + "\n  ".join(actions))
    return 0
