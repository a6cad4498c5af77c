"""``captioner export``: a run folder as a folder ready to upload to the Hugging Face Hub.

Writes the checkpoint (``model.safetensors``), its SHA-256, a ``README.md`` model card (the Hub's
YAML metadata block, the run's evaluation table, the data's licence) and an example overlay
(:mod:`captioner.share.model_card`). Uploading is the Hub's own command: ``hf upload ORG/NAME DIR``
(``huggingface-cli upload`` in older releases of huggingface_hub).
"""

from __future__ import annotations

import argparse

from captioner.commands.options import MAX_BEAM, int_range

NAME = "export"
HELP = "write a run's checkpoint, SHA-256, model card (README.md) and an example overlay, ready for the Hub"
EXAMPLES = """
  captioner export runs/sat --out export/sat                       # then: hf upload ORG/NAME export/sat
  captioner export runs/flickr8k/sat_soft --out export/f8k --repo-id me/captioner-f8k-sat --image dog.jpg
  captioner export runs/sat/best.safetensors --out export/sat --dataset shapes --force
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (its best.safetensors), a checkpoint file or a shipped model's name")
    parser.add_argument("--out", required=True, metavar="DIR", help="folder to write (created)")
    parser.add_argument("--repo-id", default=None, metavar="ORG/NAME",
                        help="the Hub id the model card's examples use (default: YOUR-NAME/<run folder name>)")
    parser.add_argument("--image", default=None, metavar="IMAGE",
                        help="picture for the example overlay (default: a synthetic scene)")
    parser.add_argument("--dataset", default=None, choices=("flickr8k", "coco", "shapes"),
                        help="training data named in the card (default: guessed from the run's data path)")
    parser.add_argument("--beam", type=int_range(1, MAX_BEAM), default=3, help="beam size for the example's caption (default: 3)")
    parser.add_argument("--force", action="store_true", help="replace files already in --out")


def run(args: argparse.Namespace) -> int:
    from captioner.data.images import load_image
    from captioner.errors import ConfigError
    from captioner.share.model_card import check_repo_id, export_run

    if args.repo_id is not None:
        check_repo_id(args.repo_id)
    if args.beam < 1:
        raise ConfigError(f"--beam must be >= 1, got {args.beam}")
    from captioner.pretrained import is_model_name, pretrained_path

    image = load_image(args.image) if args.image else None
    run_dir = pretrained_path(args.run_dir) if is_model_name(args.run_dir) else args.run_dir  # a shipped model
    paths = export_run(run_dir, args.out, repo_id=args.repo_id, image=image, dataset=args.dataset,
                       overwrite=args.force, beam=args.beam)
    for path in paths.values():
        print(f"wrote {path}")
    digest = paths["sha256"].read_text(encoding="utf-8").split()[0]
    print(f"SHA-256 {digest}\nupload: hf upload {args.repo_id or 'ORG/NAME'} {args.out}")
    return 0
