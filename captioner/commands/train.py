"""``captioner train``: train a captioner from a preset and/or config file, with overrides."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from captioner.commands.options import float_range, int_range
from captioner.config.schema import list_presets

NAME = "train"
HELP = "train a caption model (checkpoints, metrics.csv and resume state go to the run folder)"
EXAMPLES = """
  captioner train --preset sat_soft_lite --data data/shapes --out runs/sat
  captioner train --preset transformer_tiny --data data/shapes --epochs 3 --set decoder.num_layers=1
  captioner train --config my_run.yaml --set train.lr=1e-3 --set decoder.hidden_dim=256
  captioner train --out runs/sat --resume                  # continue where it stopped (config from the run)
  captioner train --preset sat_soft_lite --data data/shapes --out runs/sat --overwrite  # old run -> runs/sat.old-<time>
  captioner train --preset sat_soft --data data/coco --out runs/sat_ft \
      --init runs/sat/best.safetensors --set encoder.fine_tune=true --set train.seed=1  # stage 2
  captioner train --preset sat_hard_lite --data data/shapes --time-budget 600 --no-progress
  captioner train --preset sat_soft_flickr8k --data data/flickr8k --out runs/flickr8k/sat_soft  # docs/flickr8k.md
  captioner train --init flickr8k --data my_photos --epochs 3       # adapt the shipped model to your captions
  captioner train --preset flickr8k_labels --init runs/shipped/release/flickr8k_stage3.safetensors \
      --data data/flickr8k --out runs/labels --set train.labels.teacher=runs/teacher/captions_train_results.json \
      --set train.labels.text=captions_val2017_text_only.json  # the shipped model's label stage (docs/training.md)
  torchrun --nproc_per_node=4 -m captioner train --preset sat_soft --data data/coco --out runs/coco_sat
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``captioner train``."""
    cfg = parser.add_argument_group("configuration (later wins: preset, --config, --set, flags)")
    cfg.add_argument("--preset", metavar="NAME", help=f"named preset: {', '.join(list_presets())}")
    cfg.add_argument("--config", metavar="FILE", help="JSON or YAML config file (nested model/data/train keys)")
    cfg.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override one config value, e.g. train.lr=1e-3 or decoder.hidden_dim=256 (repeatable)")
    run = parser.add_argument_group("common settings")
    run.add_argument("--data", metavar="DIR", help="dataset folder or annotation file (data.root)")
    run.add_argument("--out", metavar="DIR", help="run folder (default runs/<preset>)")
    run.add_argument("--epochs", type=int_range(1, 100_000), help="train.epochs")
    run.add_argument("--batch-size", type=int_range(1, 1 << 20), help="train.batch_size (global batch, split over torchrun processes)")
    run.add_argument("--lr", type=float_range(0, 10, low_open=True), help="train.lr (decoder learning rate)")
    run.add_argument("--time-budget", type=float_range(0, 10**9, low_open=True), metavar="SECONDS",
                     help="stop after this many seconds, validating and saving first (train.time_budget)")
    run.add_argument("--device", help="train.device: auto, cpu, cuda, cuda:1")
    run.add_argument("--skip-missing", action="store_true", help="skip missing/unreadable images (data.skip_missing)")
    run.add_argument("--resume", action="store_true",
                     help="continue the run in --out from train_state.pt (its config.json is the base config)")
    run.add_argument("--overwrite", action="store_true",
                     help="--out holds an earlier run: move it aside to DIR.old-<time> (never deleted) and start a "
                          "new one; without --resume or --overwrite such a folder is refused")
    run.add_argument("--init", metavar="CKPT",
                     help="start a new run from this checkpoint's weights and vocabulary, with a fresh optimizer "
                          "(train.init): a file, run folder or shipped model name (alone, a name also gives the "
                          "model's architecture and training settings); the architecture must match, "
                          "encoder.fine_tune may change; words of --data the vocabulary lacks are added")
    run.add_argument("--no-progress", action="store_true", help="no progress bars")


def resolve(args: argparse.Namespace):  # -> tuple[Config, Path]
    """The ``Config`` and run folder that ``args`` describe.

    With ``--resume`` and neither ``--preset`` nor ``--config``, the run folder's ``config.json``
    is the base, so ``captioner train --out runs/x --resume`` needs nothing else.
    """
    from captioner.config import resolve_config
    from captioner.errors import ConfigError
    from captioner.pretrained import is_model_name

    if args.init and args.resume:
        raise ConfigError("--init starts a new run from a checkpoint and --resume continues the run in --out "
                          "(whose weights are in its train_state.pt): pass one of them")
    out = Path(args.out) if args.out else Path("runs") / (args.preset or "train")
    config_file = args.config
    if args.resume and not args.preset and not args.config:
        if not (out / "config.json").exists():
            raise ConfigError(f"--resume: {out / 'config.json'} not found; pass --out with the run folder")
        config_file = out / "config.json"
    preset, model = args.preset, None
    if args.init and not args.preset and not args.config and is_model_name(args.init):
        # --init NAME alone: the shipped model's architecture, and the settings it was trained with
        from captioner.checkpoint.store import read_checkpoint_metadata
        from captioner.pretrained import MODELS, pretrained_path

        preset = MODELS[args.init].preset
        model = read_checkpoint_metadata(pretrained_path(args.init))["config"]
        if not args.out:
            out = Path("runs") / f"{args.init}_finetuned"
    cfg = resolve_config(preset, config_file, list(args.overrides), model=model)
    if args.init and cfg.train.stage == "labels" and model is None:
        # the label stage continues its --init model: that model's architecture, reading its encoder's labels
        from captioner.checkpoint.store import read_checkpoint_metadata
        from captioner.inference import checkpoint_path

        from captioner.errors import CheckpointError

        try:
            model = read_checkpoint_metadata(checkpoint_path(args.init))["config"]
        except CheckpointError as exc:
            raise CheckpointError(f"--init {exc}") from None
        model["encoder"] = {**model["encoder"], "labels": True}
        cfg = resolve_config(preset, config_file, list(args.overrides), model=model)
    flags = {
        "data.root": args.data,
        "train.epochs": args.epochs,
        "train.batch_size": args.batch_size,
        "train.lr": args.lr,
        "train.time_budget": args.time_budget,
        "train.device": args.device,
        "data.skip_missing": True if args.skip_missing else None,
        "train.init": args.init,
    }
    flags = {k: v for k, v in flags.items() if v is not None}
    return (cfg.override(**flags) if flags else cfg), out


def run(args: argparse.Namespace) -> int:
    """Train and print a one-line summary (rank 0 only under torchrun)."""
    from captioner.errors import ConfigError
    from captioner.training.label_stage import train_labels
    from captioner.training.loop import train

    cfg, out = resolve(args)
    if cfg.train.stage == "labels":
        if args.resume:
            raise ConfigError("train.stage=labels is not resumed: run it again with --overwrite")
        result = train_labels(cfg, out, progress=not args.no_progress, overwrite=args.overwrite)
    else:
        result = train(cfg, out, resume=args.resume, progress=not args.no_progress, overwrite=args.overwrite)
    if int(os.environ.get("RANK", "0")) == 0:
        chosen = "" if result.select_metric == "BLEU-4" else f", {result.select_metric} {result.best_score:.4f}"
        print(f"best val BLEU-4 {result.best_bleu4:.4f} (0-1 scale){chosen}, selected on {result.select_metric} "
              f"at epoch {result.best_epoch}: {result.best_checkpoint}; latest: {result.latest_checkpoint}; "
              f"{result.seconds:.0f} s")
    return 0
