"""``captioner evaluate``: score a checkpoint on a split (BLEU, CIDEr-D, attention statistics).

The table shows the built-in scores, then the coco-caption scores (PTB tokenisation, the papers'
scoring) when pycocoevalcap and Java are present, else one line saying why they are missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from captioner.commands.options import add_decoding_arguments, decoding_overrides, encoder_precision, int_range
from captioner.config.schema import MAX_WORKERS

NAME = "evaluate"
HELP = "score a checkpoint on a dataset split; writes metrics_<split>.json and a COCO results file"
EXAMPLES = """
  captioner evaluate runs/sat/best.safetensors --data data/shapes --split test --beam 3
  captioner evaluate runs/coco_sat_soft/best.safetensors --data data/coco --split test --beam 3   # Karpathy test
  captioner evaluate runs/tf/best.safetensors --data data/shapes --max-images 100 --json
  captioner evaluate runs/sat/best.safetensors runs/tf/best.safetensors --data data/shapes --out runs/ensemble
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CHECKPOINT", nargs="+",
                        help="checkpoint written by training: a .safetensors file, a run folder, an https:// "
                        "URL (#sha256=HEX checks it) or hf://ORG/REPO[/FILE]; a remote one needs --out. Several: "
                        "an ensemble (the mean of their word probabilities; one vocabulary, image size and grid; "
                        "needs --out)")
    parser.add_argument("--data", required=True, metavar="PATH", help="dataset folder, COCO captions JSON or Karpathy split JSON")
    parser.add_argument("--images", default=None, metavar="DIR", help="image folder when it is not where the layout puts it")
    parser.add_argument("--split", default="test", metavar="NAME", help="split to score (default: test)")
    add_decoding_arguments(parser)
    parser.add_argument("--batch-size", type=int_range(1, 4096), default=32, metavar="N", help="images per decoding batch (default: 32)")
    parser.add_argument("--out", default=None, metavar="DIR", help="output folder (default: the checkpoint's folder)")
    parser.add_argument("--max-images", type=int_range(1, 10**9), default=None, metavar="N", help="score only the first N images")
    parser.add_argument("--skip-missing", action="store_true", help="skip missing or unreadable images")
    parser.add_argument("--files-outside", action="store_true",
                        help="score images the caption file names outside its image folder ('..', absolute paths; "
                             "refused by default)")
    parser.add_argument("--workers", type=int_range(0, MAX_WORKERS), default=0, metavar="N", help="DataLoader workers for image decoding")
    parser.add_argument("--device", default="auto", metavar="NAME", help="cpu, cuda, cuda:1 or auto (default)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--no-meteor", action="store_true", help="skip METEOR (saves starting Java)")
    parser.add_argument("--no-coco-caption", action="store_true",
                        help="skip the coco-caption scores (PTB tokenisation; saves starting Java)")
    parser.add_argument("--no-reference-attention", action="store_true",
                        help="on a dataset with boxes, skip scoring attention along the reference captions "
                        "(saves encoding the images a second time)")
    parser.add_argument("--json", action="store_true", help="print the metrics as JSON instead of a table")
    parser.add_argument("--force", action="store_true",
                        help="replace an earlier evaluation of the same split in the output folder")


def _num(value: object, digits: int = 4) -> str:
    return "unavailable" if value is None else f"{value:.{digits}f}"


def _correctness_lines(title: str, pointing: str, corr: dict[str, Any]) -> list[str]:
    """Mass in the box against uniform, the ratio with its 95% interval, and pointing accuracy."""
    ratio, spread = corr.get("ratio"), corr.get("ratio_interval")
    first = (f"  {title}: {_num(corr.get('attention_correctness'))} (uniform baseline "
             f"{_num(corr.get('uniform_baseline'))}, {corr['words_scored']} words)"
             + (f": {ratio:.2f}x uniform" if ratio is not None else "")
             + (f", 95% interval {spread[0]:.2f}x-{spread[1]:.2f}x over the {corr.get('images_scored')} images"
                if spread else ""))
    spread = corr.get("pointing_interval")
    return [first, f"  {pointing}: {_num(corr.get('pointing_accuracy'))}"
            + (f" (95% interval {spread[0]:.2f}-{spread[1]:.2f})" if spread else "")]


def _chair_lines(chair: dict[str, Any]) -> list[str]:
    """CHAIR-s, CHAIR-i and object coverage, and what they were counted over."""
    if not chair:
        return []

    def share(key: str) -> str:
        return "n/a" if chair.get(key) is None else f"{100 * chair[key]:.1f}%"

    return [f"object hallucination (CHAIR, COCO's 80 categories; objects present from the {chair['objects']}):",
            f"  CHAIR-s {share('CHAIR-s')} (captions naming an absent object), CHAIR-i {share('CHAIR-i')} "
            f"({chair['hallucinated']} of {chair['mentions']} object mentions absent), "
            f"object coverage {share('coverage')} (of the objects the references name)"]


def format_report(report: dict) -> str:
    """A readable table of the scores, the counts and the files written."""
    from captioner.evaluation.metrics import COCO_KEYS, LABEL, METRIC_KEYS, format_metrics

    checkpoint = report["checkpoint"]
    if isinstance(checkpoint, list):
        checkpoint = f"ensemble of {' + '.join(checkpoint)}"
    lines = [f"{checkpoint} on {report['data']} [{report['split']}]: {report['num_images']} images, "
             f"{report['num_references']} references, beam {report['beam_size']}"]
    lines.append("built-in scores (captioner's tokeniser):")
    lines += ["  " + line for line in format_metrics({k: report.get(k) for k in METRIC_KEYS}).splitlines()]
    coco = {k.split("/", 1)[1]: report.get(k) for k in COCO_KEYS}
    if coco["BLEU-4"] is not None:
        lines.append(f"{LABEL}:")
        lines += ["  " + line for line in format_metrics(coco).splitlines()[:-1]]
    elif report.get("coco_caption_note"):
        lines.append(report["coco_caption_note"])
    key = "coco/BLEU-4" if report.get("coco/BLEU-4") is not None else "BLEU-4"
    if report.get(key) is not None:
        which = "coco-caption BLEU-4" if key.startswith("coco/") else "BLEU-4"
        lines.append(f"  (papers print every score x100: {which} {report[key]:.4f} is "
                     f"{100 * report[key]:.1f} in a paper's table)")
    att = report.get("attention") or {}
    if att.get("attention_entropy") is not None:
        lines.append(f"  attention entropy: {_num(att['attention_entropy'], 3)} nats "
                     f"(uniform {_num(att.get('uniform_entropy'), 3)})")
    lines += _chair_lines(report.get("chair") or {})
    corr = report.get("attention_correctness") or {}
    if corr and not corr.get("words_scored"):
        names = {"shapes": "shape nouns", "coco": "COCO category names and synonyms",
                 "categories": "the instances file's category names"}.get(corr.get("vocabulary"), "object names")
        lines.append(f"  attention correctness: no object word was generated (matched against {names}), "
                     "nothing to score")
    elif corr:
        lines += _correctness_lines("attention correctness", "pointing accuracy", corr)
    forced = report.get("reference_attention_correctness") or {}
    if forced.get("words_scored"):
        lines += _correctness_lines(f"on the {forced.get('captions_scored')} reference captions, teacher-forced",
                                    "their pointing accuracy", forced)
    if corr.get("objects_correct") is not None:
        lines.append(f"  objects correct: {_num(corr['objects_correct'])} (captions naming every object right)")
    if corr.get("unseen_pairs"):
        lines.append(f"  objects correct, scenes with seen pairs only: {_num(corr['objects_correct_seen'])} "
                     f"({corr['scenes_seen']} scenes); with an unseen pair: {_num(corr['objects_correct_unseen'])} "
                     f"({corr['scenes_unseen']} scenes)")
        lines.append(f"  pairs named right: unseen {_num(corr['unseen_pairs_named'])} ({corr['objects_unseen']} objects; "
                     f"{', '.join(corr['unseen_pairs'])}), seen {_num(corr['seen_pairs_named'])}")
    if report.get("missing_images") or report.get("unreadable_images"):
        lines.append(f"skipped: {report.get('missing_images', 0)} missing, "
                     f"{len(report.get('unreadable_images') or [])} unreadable images")
    lines.append(f"wrote {report['paths']['metrics']}")
    lines.append(f"wrote {report['paths']['results']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from captioner.errors import ConfigError
    from captioner.evaluation.evaluate import EvaluateOptions, evaluate_checkpoint

    decoding = decoding_overrides(args)
    for flag in ("batch_size",):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.max_images is not None and args.max_images < 1:
        raise ConfigError(f"--max-images must be >= 1, got {args.max_images}")
    if not 0 <= args.workers <= MAX_WORKERS:
        raise ConfigError(f"--workers must be between 0 and {MAX_WORKERS}, got {args.workers}")
    settings = EvaluateOptions(
        batch_size=args.batch_size, out_dir=args.out, images_dir=args.images, max_images=args.max_images,
        skip_missing=args.skip_missing, files_outside=args.files_outside, device=args.device,
        precision=encoder_precision(args),
        progress=not args.no_progress,
        num_workers=args.workers, meteor=not args.no_meteor,
        coco_caption=not args.no_coco_caption, references_attention=not args.no_reference_attention,
        overwrite=args.force)
    report = evaluate_checkpoint(args.checkpoint, args.data, split=args.split, settings=settings, **decoding)
    report = {k: v for k, v in report.items() if k not in ("results", "caption_set")}
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_report(report))
    return 0
