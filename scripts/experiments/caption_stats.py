"""How varied and how repetitive a set of captions is: ``python scripts/experiments/caption_stats.py RESULTS.json ...``.

RESULTS: a COCO results file (``[{"image_id": ..., "caption": ...}]``) as ``captioner evaluate`` writes
(``captions_<split>_results.json``). Prints, per file: captions, mean words, distinct words, and the
share of captions that repeat a trigram or a content word (a word outside ``captioner.text.STOP_WORDS``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from captioner.text import STOP_WORDS, tokenize


def stats(captions: list[str]) -> dict[str, float]:
    """The figures for one set of captions."""
    words = [tokenize(c) for c in captions]
    trigram = sum(len(set(zip(w, w[1:], w[2:]))) < max(len(w) - 2, 0) for w in words)
    content = sum(len({x for x in w if x not in STOP_WORDS}) < len([x for x in w if x not in STOP_WORDS])
                  for w in words)
    n = max(len(words), 1)
    return {"captions": len(words), "mean_words": sum(map(len, words)) / n,
            "distinct_words": len({x for w in words for x in w}),
            "repeat_trigram": trigram / n, "repeat_content_word": content / n}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="COCO results JSON files")
    args = parser.parse_args(argv)
    for path in args.results:
        try:
            rows = json.loads(path.read_text())
            captions = [str(r["caption"]) for r in rows]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"caption_stats: error: {path}: {exc}", file=sys.stderr)
            return 1
        s = stats(captions)
        print(f"{path}: {s['captions']} captions, {s['mean_words']:.1f} words on average, {s['distinct_words']} "
              f"distinct words, {100 * s['repeat_trigram']:.1f}% repeat a trigram, "
              f"{100 * s['repeat_content_word']:.1f}% repeat a content word")
    return 0


if __name__ == "__main__":
    sys.exit(main())
