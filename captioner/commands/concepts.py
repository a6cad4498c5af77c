"""``captioner concepts``: learn concept detectors from a dataset's captions over its feature cache."""

from __future__ import annotations

import argparse

from captioner.commands.options import int_range

MAX_CONCEPTS, MAX_EPOCHS, MAX_HIDDEN, MAX_FOLDS = 100_000, 10_000, 65_536, 100  # as captioner.training.detectors
OFFLINE_PRESET = "sat_soft_lite"  # EfficientNet-Lite0: its ImageNet weights are installed with the package

NAME = "concepts"
HELP = ("learn concept detectors (which caption words each region shows) from the training captions, over the "
        "frozen encoder's feature cache; a decoder can read them (model.concepts) and be guided by their maps "
        "(train.concept_guide)")
EXAMPLES = """
  captioner concepts --preset sat_soft_flickr8k --data data/flickr8k --out runs/flickr8k/concepts.safetensors
  captioner concepts --preset sat_soft_flickr8k --data data/flickr8k --out c.safetensors --concepts 1000 --epochs 10
  captioner concepts ... --boxes data/coco2017-mini    # also: do COCO words' maps peak in their boxes?
  captioner concepts ... --folds 3    # also 3 fold heads: a decoder trains on concepts of heads that never saw the photo
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", metavar="NAME",
                        help="the preset whose encoder and data settings to use (default: the default config, "
                             f"whose ResNet-101 encoder downloads its ImageNet weights; --preset {OFFLINE_PRESET} "
                             "needs no download)")
    parser.add_argument("--config", metavar="FILE", help="JSON or YAML config file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config value (repeatable)")
    parser.add_argument("--data", metavar="DIR", help="dataset folder (data.root)")
    parser.add_argument("--out", metavar="FILE", required=True, help="the concepts file to write (.safetensors)")
    parser.add_argument("--force", action="store_true", help="replace --out when it exists")
    parser.add_argument("--concepts", type=int_range(1, MAX_CONCEPTS), default=1000, metavar="K",
                        help=f"how many concept words: the most frequent content words, 1 to {MAX_CONCEPTS} "
                             "(default 1000)")
    parser.add_argument("--epochs", type=int_range(1, MAX_EPOCHS), default=8,
                        help=f"passes over the training images, 1 to {MAX_EPOCHS} (default 8)")
    parser.add_argument("--hidden", type=int_range(0, MAX_HIDDEN), default=512,
                        help=f"hidden width of the head, 0 (linear) to {MAX_HIDDEN} (default 512)")
    parser.add_argument("--pooling", choices=("lse", "noisy_or"), default="lse",
                        help="how region scores make an image score (default lse, a soft maximum)")
    parser.add_argument("--boxes", metavar="DIR",
                        help="a COCO folder with instances_<split>.json (e.g. data/coco2017-mini): report "
                             "how often a COCO word's map peaks inside its object's box")
    parser.add_argument("--boxes-split", default="train2017", metavar="SPLIT", help="the split of --boxes")
    parser.add_argument("--folds", type=int_range(0, MAX_FOLDS), default=0, metavar="F",
                        help="also train F >= 2 fold heads, each without one fold of the training photos: a decoder "
                             "reading these concepts trains on each photo's concepts from the head that never saw "
                             "it (train.concept_cross_fit); F + 1 times the training (default 0: none)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def say_what_downloads(cfg, preset: str | None) -> None:  # noqa: ANN001 - a Config
    """Without ``--preset``: name the weights the default encoder downloads, or, offline with nothing
    cached, refuse in one line that names them and the preset to use instead."""
    import logging

    from captioner.checkpoint.remote import OFFLINE_ENV, offline
    from captioner.errors import ConfigError
    from captioner.models.encoder import weights_source
    from captioner.models.registry import Download, encoder_entry

    enc = cfg.model.encoder
    if preset or not enc.pretrained:
        return
    source = weights_source(enc, encoder_entry(enc.name))
    if not isinstance(source, Download) or (source.cached is not None and source.cached.is_file()):
        return
    where = f" from {source.url}" if source.url else ""
    if offline():
        raise ConfigError(f"no --preset: the default encoder needs {source.label}{where}, which is not downloaded and "
                          f"offline mode is on ({OFFLINE_ENV}); use --preset {OFFLINE_PRESET} (weights installed "
                          "with the package) or --set encoder.weights=FILE")
    logging.getLogger("captioner.training.concepts").warning(
        "no --preset: the default encoder downloads %s%s%s; --preset %s needs no download", source.label, where,
        f" into {source.cached.parent}" if source.cached is not None else "", OFFLINE_PRESET)


SCORE_BATCH = 256  # images whose region scores the head computes at once (captioner.training.concepts)


def head_bytes(dim: int, regions: int, hidden: int, concepts: int) -> int:
    """Bytes that training a concept head needs: its float32 weights five times (weights, gradients, Adam's
    two moments, the best epoch's copy) and the region scores of :data:`SCORE_BATCH` images (with their
    hidden layer; three copies for the forward, the pooling and the backward)."""
    params = dim * hidden + hidden + hidden * concepts + concepts if hidden else dim * concepts + concepts
    return 4 * (5 * params + 3 * SCORE_BATCH * regions * (hidden + concepts))


def run(args: argparse.Namespace) -> int:
    from captioner.config import resolve_config
    from captioner.training.concepts import check_output_file, learn_concepts
    from captioner.device import check_memory
    from captioner.models.registry import encoder_entry

    cfg = resolve_config(args.preset, args.config, list(args.overrides))
    if args.data:
        cfg = cfg.override(**{"data.root": args.data})
    enc = cfg.model.encoder
    dim = encoder_entry(enc.name).feature_dim(enc)
    check_memory(head_bytes(dim, enc.grid ** 2, args.hidden, args.concepts),
                 f"a concept head with --hidden {args.hidden} and --concepts {args.concepts} over {dim}-wide regions",
                 "lower --hidden or --concepts")
    check_output_file(args.out, args.force, "--out")  # before anything is downloaded or trained
    say_what_downloads(cfg, args.preset or args.config)
    print(learn_concepts(cfg, args.out, k=args.concepts, epochs=args.epochs, hidden=args.hidden,
                         pooling=args.pooling, boxes=args.boxes, boxes_split=args.boxes_split,
                         progress=not args.no_progress, folds=args.folds, overwrite=args.force))
    return 0
