"""``captioner distill``: the two steps of knowledge distillation (:mod:`captioner.training.distill`).

``captions`` writes a dataset whose training photos carry a teacher's captions (sequence level);
``words`` writes a teacher's top-k next words along every training caption (word level), the file
``train.word_distill`` names. Each prints its summary as one JSON line; the student is then trained
with ``captioner train`` on the new dataset.
"""

from __future__ import annotations

import argparse
import json

from captioner.commands.options import int_range

MAX_TOP_K = 1000  # as captioner.training.distill.MAX_TOP_K (a test keeps them equal)

NAME = "distill"
HELP = ("knowledge distillation: a dataset with a teacher's captions for the training photos (captions), or a "
        "teacher's top-k next words along the training captions (words)")
EXAMPLES = """
  captioner evaluate teacher_a teacher_b --data data/flickr8k --split train --out runs/teacher
  captioner distill captions data/flickr8k runs/teacher/captions_train_results.json --out runs/distilled --teacher-only
  captioner distill words teacher_a/best.safetensors teacher_b/best.safetensors --data runs/distilled/flickr8k \\
      --out runs/words.safetensors --top-k 8 --device auto
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    steps = parser.add_subparsers(dest="step", metavar="STEP", required=True)
    captions = steps.add_parser("captions", help="a dataset folder: the human captions plus the teacher's",
                                description="Write OUT/<name of DATA>/: DATA's captions, the teacher's caption of "
                                            "each training photo added (or, with --teacher-only, in their place); "
                                            "the images are linked, not copied.")
    captions.add_argument("data", metavar="DATA", help="dataset folder (captions_coco_format.json, splits.tsv, images/)")
    captions.add_argument("results", metavar="RESULTS",
                          help="the teacher's COCO results file for the split (captioner evaluate --split train)")
    captions.add_argument("--out", required=True, metavar="DIR", help="parent folder of the new dataset (created)")
    captions.add_argument("--split", default="train", metavar="NAME", help="the split given the teacher's captions")
    captions.add_argument("--teacher-only", action="store_true",
                          help="the split's photos keep only the teacher's caption (sequence-level distillation proper)")
    words = steps.add_parser("words", help="a safetensors file: the teacher's top-k next words along every caption",
                             description="Feed every caption of the split to the teacher (several checkpoints: "
                                         "their ensemble) and keep its top-k next words at each step.")
    words.add_argument("teacher", nargs="+", metavar="CHECKPOINT", help="the teacher: one checkpoint, or several")
    words.add_argument("--data", required=True, metavar="DIR", help="dataset folder (the student's)")
    words.add_argument("--out", required=True, metavar="FILE", help="the file to write (.safetensors)")
    words.add_argument("--split", default="train", metavar="NAME", help="whose captions (default: train)")
    words.add_argument("--top-k", type=int_range(1, MAX_TOP_K), default=8, metavar="K",
                       help=f"next words kept per step, 1 to {MAX_TOP_K} (default 8)")
    words.add_argument("--batch-size", type=int_range(1, 4096), default=32, help="images encoded at a time")
    words.add_argument("--device", default="auto", metavar="NAME", help="cpu, cuda, cuda:1 or auto (default)")
    words.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from captioner.device import resolve_device
    from captioner.training.distill import teacher_dataset, write_word_targets

    if args.step == "captions":
        summary = teacher_dataset(args.data, args.results, args.out, split=args.split,
                                  keep_human=not args.teacher_only)
    else:
        teacher = args.teacher if len(args.teacher) > 1 else args.teacher[0]  # loaded once --data is read
        summary = write_word_targets(teacher, args.data, args.out, split=args.split, top_k=args.top_k,
                                     batch_size=args.batch_size, progress=False if args.no_progress else None,
                                     device=str(resolve_device(args.device, option="--device")))
    print(json.dumps(summary))
    return 0
