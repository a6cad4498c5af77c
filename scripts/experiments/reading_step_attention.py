"""Where does attention look at a word: the step predicting it or the step reading it? ``python
scripts/experiments/reading_step_attention.py CKPT [CKPT ...]``.

Every reference caption of a COCO folder with boxes (default ``../shared/data/coco2017-mini``) is fed
to each decoder (as ``captioner evaluate`` does for ``reference_attention_correctness``), and its words
that name a box's category are scored against the boxes twice: with the attention of the step that
predicts each word (what the overlays show) and with the attention of the step after it, whose input
is the word itself (``reference_attention(..., reading_step=True)``). Prints both ratios with their
95% intervals and pointing accuracies.
"""

from __future__ import annotations

import argparse
import sys

from captioner.errors import CaptionerError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+", metavar="CKPT", help="trained checkpoints")
    parser.add_argument("--data", default="../shared/data/coco2017-mini", help="COCO folder with instances")
    parser.add_argument("--split", default="train2017", help="split with boxes (default: train2017)")
    args = parser.parse_args(argv)
    import captioner
    from captioner.data.coco import load_caption_set, load_instances
    from captioner.evaluation.attention_metrics import reference_correctness
    from captioner.evaluation.evaluate import ratio_line, reference_attention

    try:
        cs = load_caption_set(args.data, args.split)
        instances = load_instances(args.data, args.split, None)
        if instances is None:
            raise CaptionerError(f"{args.data} [{args.split}]: no instances file, so no boxes to score against")
        for checkpoint in args.checkpoints:
            engine = captioner.load(checkpoint, device="cpu")
            for reading, name in ((False, "predicting"), (True, "reading")):
                forced = reference_attention(engine, cs, progress=False, reading_step=reading)
                r = reference_correctness(forced, cs, instances, engine.config.encoder)
                if not r["words_scored"]:
                    print(f"{checkpoint}: no reference word names a box's category")
                    break
                print(f"{checkpoint}, the step {name} each word: {ratio_line(r, with_captions=False)}")
    except CaptionerError as exc:
        print(f"reading_step_attention: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
