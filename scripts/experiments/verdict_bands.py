"""Fit the bands of ``captioner serve``'s verdict: how often a caption is right at a per-word log-probability.

Captions the dev photos of Flickr8k (``../shared/data/flickr8k``, split ``dev``) and the everyday dev
photos (``../shared/data/coco2014-val168``, split ``val2014``) with a model (the shipped one by default),
plainly and with the page's "everyday photos" (``captioner.share.server.EVERYDAY``), and scores each
caption by the model's own log-probability per word (a teacher-forced pass over the chosen words,
:func:`captioner.inference.teacher_forced_log_probs`; never the fused search score). A caption counts as
**right** when it names only objects that are there (no CHAIR hallucination against its five
references, Rohrbach et al. 2018) and scores well (its CIDEr-D against them at least ``--good-cider``,
about the shipped model's average on Flickr8k dev). The bands are fitted on all four runs together:

* the upper cut: the lowest per-word log-probability at or above which captions are right at least
  ``--high`` of the time (and at least ``--min-share`` of the captions);
* the lower cut: the highest (not above the upper) below which they are right at most ``--low`` of the
  time (same share).

Prints each run's rate of right captions per band and the fitted cuts (docs/share_and_show.md holds the
table; ``captioner.share.server.VERDICTS`` the cuts), and writes every caption's record to ``--out``.

    python scripts/experiments/verdict_bands.py [--model flickr8k] [--limit 0] [--out runs/verdict/records.json]
    python scripts/experiments/verdict_bands.py --records runs/verdict/records.json   # refit, no captioning
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import captioner
from captioner.data.coco import load_caption_set
from captioner.evaluation.chair import chair_scores
from captioner.evaluation.metrics import cider_d_scores
from captioner.inference import caption_features, teacher_forced_log_probs
from captioner.share.server import EVERYDAY, VERDICTS

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
SETS = (("flickr8k dev", "flickr8k", "dev"), ("everyday dev", "coco2014-val168", "val2014"))
GRID = np.round(np.arange(-3.0, 0.001, 0.05), 2)  # candidate cuts, per-word log-probability


def caption_set_records(engine, root: Path, split: str, everyday: bool, limit: int, batch: int = 32) -> list[dict]:
    """Every photo's best caption (beam 3) with the model's own log-probability, CHAIR and CIDEr-D."""
    cs = load_caption_set(root, split)
    images = cs.images[:limit] if limit else cs.images
    paths = [rec.path for rec in images]
    options = EVERYDAY if everyday else None
    captions, own = [], []
    for start in range(0, len(paths), batch):
        features, grid = engine.encode(paths[start:start + batch])  # (B, N, D)
        found = caption_features(engine.model, features, engine.vocab, options, grid=grid)
        captions += found
        for i, c in enumerate(found):  # one row of features per caption
            own += teacher_forced_log_probs(engine.model, features[i:i + 1], [c.tokens], engine.vocab.bos_id,
                                            engine.vocab.eos_id, [c.finished])
    references = [cs.references(rec.image_id) for rec in images]
    texts = [c.text for c in captions]
    chair = chair_scores(texts, references).per_image
    cider = cider_d_scores(texts, references)
    return [{"image": rec.file_name, "caption": c.text, "words": len(c.words), "log_prob": lp,
             "per_word": lp / max(1, len(c.words)), "score": c.score, "absent": ch["absent"], "cider": ci}
            for rec, c, lp, ch, ci in zip(images, captions, own, chair, cider)]


def right(record: dict, good_cider: float) -> bool:
    return not record["absent"] and record["cider"] >= good_cider


def fit(records: list[dict], good_cider: float, high: float, low: float, min_share: float) -> tuple[float, float]:
    """(upper cut, lower cut) of the per-word log-probability, as the module's docstring says."""
    x = np.array([r["per_word"] for r in records])
    y = np.array([right(r, good_cider) for r in records])
    need = min_share * len(x)
    upper = [c for c in GRID if (x >= c).sum() >= need and y[x >= c].mean() >= high]
    top = min(upper) if upper else float(GRID[-1])
    lower = [c for c in GRID if c <= top and (x < c).sum() >= need and y[x < c].mean() <= low]
    return top, (max(lower) if lower else float(GRID[0]))


def table(runs: dict[str, list[dict]], cuts: tuple[float, float], good_cider: float) -> str:
    upper, lower = cuts
    bands = ((f"likely right (>= {upper:.2f})", lambda v: v >= upper),
             (f"unsure ({lower:.2f} to {upper:.2f})", lambda v: lower <= v < upper),
             (f"probably wrong (< {lower:.2f})", lambda v: v < lower))
    lines = ["| run | " + " | ".join(name for name, _ in bands) + " | all |", "| --- " * 5 + "|"]
    for run, records in runs.items():
        cells = []
        for _, inside in (*bands, ("all", lambda v: True)):
            chosen = [r for r in records if inside(r["per_word"])]
            rate = np.mean([right(r, good_cider) for r in chosen]) if chosen else float("nan")
            cells.append(f"{100 * rate:.0f}% right of {len(chosen)}" if chosen else "none")
        lines.append(f"| {run} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="flickr8k")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--limit", type=int, default=0, help="only the first N photos of each set (0: all)")
    parser.add_argument("--records", type=Path, help="refit from records written before (no captioning)")
    parser.add_argument("--out", type=Path, default=Path("runs/verdict/records.json"))
    parser.add_argument("--good-cider", type=float, default=0.5, help="CIDEr-D (coco-caption scale) that scores well")
    parser.add_argument("--high", type=float, default=0.6, help="share right at or above the upper cut")
    parser.add_argument("--low", type=float, default=0.25, help="share right at most below the lower cut")
    parser.add_argument("--min-share", type=float, default=0.1, help="least share of captions in an outer band")
    args = parser.parse_args(argv)
    if args.records:
        runs = json.loads(args.records.read_text())
    else:
        if not (args.data / "flickr8k").is_dir():
            print(f"{args.data}: no flickr8k/ here (see ../shared/data/README.md)", file=sys.stderr)
            return 1
        engine = captioner.load(args.model, device="cpu")
        runs = {}
        for name, folder, split in SETS:
            for everyday in (False, True):
                start = time.perf_counter()
                run = f"{name}, {'everyday photos' if everyday else 'plain'}"
                runs[run] = caption_set_records(engine, args.data / folder, split, everyday, args.limit)
                print(f"{run}: {len(runs[run])} captions in {time.perf_counter() - start:.0f} s", file=sys.stderr)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(runs))
    everything = [r for records in runs.values() for r in records]
    cuts = fit(everything, args.good_cider, args.high, args.low, args.min_share)
    print(f"fitted cuts: likely right >= {cuts[0]:.2f}, probably wrong < {cuts[1]:.2f} "
          f"(package: {VERDICTS[0][0]:.2f}, {VERDICTS[1][0]:.2f})")
    print(table({**runs, "all four": everything}, cuts, args.good_cider))
    return 0


if __name__ == "__main__":
    sys.exit(main())
