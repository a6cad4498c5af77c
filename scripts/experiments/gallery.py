"""Photos whose caption names two things that the model looked for in two places, drawn for the README.

    python scripts/experiments/gallery.py CKPT DATA --split dev --out docs/images/gallery --count 4 \
        [--max-len 16] [--no-repeat-ngram 3 --no-repeat-words]

Captions the split's photos in batches through the public API (``captioner.load(CKPT).caption(...,
attention=True)``). The nouns of a caption are chosen without a part-of-speech tagger: the words that
are concept words of the model when it has concept detectors (``model.concepts``), else the words
of a built-in list of common Flickr8k nouns (``--nouns`` gives another list), never a stop word,
colour, number, common adjective, ``-ing`` form or common verb; a noun counts only where the model
looked somewhere in particular for it (its map is not spread "all over", ``heatmaps.spread_words``).
A photo whose caption names at least two distinct such nouns is kept (up to ``--max-nouns`` of them,
in caption order, each with the map of its first mention), and scored by how far apart its nouns' maps lie: over the pairs of nouns, the
mean of (distance between the peak cells / the grid's diagonal) and (1 - the maps' histogram
intersection), averaged. The best ``--count`` are picked, with distinct first nouns where possible.

Writes to ``--out``, for each photo, ``NN_<image stem>.jpg`` (JPEG quality 88): the photo, then one
panel per noun (the noun in large type over its map, in the package's ``light`` style, each on its
own scale: the noun's strongest place is drawn as the photo itself) and the caption under them, drawn by ``captioner.viz.overlays.render_panels``;
and ``gallery.json``: per photo the file, the caption, the nouns with their peak cell (row, col, from
the top left, 0-based) and peak share, and the pairwise map overlap. Prints one line per photo.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

COMMON_NOUNS = frozenset("""
dog dogs puppy man men woman women boy boys girl girls child children kid kids baby person people player
players team crowd ball frisbee stick toy water grass snow sand dirt mud bike bicycle motorcycle car truck
bus boat horse cow sheep bird cat shirt jacket hat helmet dress swimsuit uniform costume street road
sidewalk beach ocean lake river pool wave waves rock rocks wall field park tree trees building fence mountain
hill hills sky bench stairs table chair camera skateboard ramp surfboard rope net goal hoop tent trail
""".split())

NOT_NOUNS = frozenset("""
black white brown red blue green yellow orange pink purple grey gray tan dark light colorful
one two three four five six several many some other another each
big large small little young old tall long short wet dry snowy grassy sandy rocky muddy open front top
runs jumps plays sits stands walks rides climbs looks holds swims lies catches carries wears waits
throws eats smiles poses is are
""".split())

ING_NOUNS = frozenset("building clothing railing swing ring wing string ceiling painting".split())


def noun_words(model) -> tuple[frozenset[str], str]:
    """The words that count as nouns, and where they come from (the model's concepts or the built-in list)."""
    from captioner.text import STOP_WORDS

    extension = model.model.decoder.extension
    if getattr(extension, "concepts", 0) and getattr(extension, "concept_ids", None) is not None:
        words = {model.vocab.itos[int(i)] for i in extension.concept_ids.tolist()}
        source = "concept words of the model"
    else:
        words, source = set(COMMON_NOUNS), "built-in list of common nouns"
    keep = {w for w in words if w not in STOP_WORDS and w not in NOT_NOUNS and w.isalpha()
            and (not w.endswith("ing") or w in ING_NOUNS)}
    return frozenset(keep), source


def separation(peaks: list[tuple[int, int]], maps, g: int) -> tuple[float, list[dict]]:
    """The photo's score (0..1, higher = the nouns' maps further apart) and each pair's figures."""
    from captioner.viz.heatmaps import map_overlap

    diagonal = math.hypot(g - 1, g - 1) or 1.0
    pairs, scores = [], []
    for a, b in itertools.combinations(range(len(peaks)), 2):
        distance = math.hypot(peaks[a][0] - peaks[b][0], peaks[a][1] - peaks[b][1])
        overlap = map_overlap(maps[a], maps[b])
        scores.append(0.5 * distance / diagonal + 0.5 * (1.0 - overlap))
        pairs.append({"pair": [a, b], "overlap": round(overlap, 4), "peak_distance": round(distance, 3)})
    return sum(scores) / len(scores), pairs


def describe(caption, nouns: frozenset[str], max_nouns: int) -> dict | None:
    """The photo's nouns, their peaks, pairs and score; None when its caption names fewer than two."""
    from captioner.viz.heatmaps import attention_stats, peak_cell, spread_words

    first: dict[str, int] = {}
    for i, w in enumerate(caption.words):
        if w in nouns and w not in first and spread_words(*attention_stats(caption.attention[i])[1:]) != "all over":
            first[w] = i  # its first mention, when the model looked somewhere in particular for it
    if len(first) < 2:
        return None
    chosen = list(first.items())[:max_nouns]
    maps = [caption.attention[i].numpy() for _, i in chosen]
    found = []
    for (word, index), m in zip(chosen, maps):
        row, col, share = peak_cell(m)
        found.append({"word": word, "index": index, "peak": [row, col], "peak_share": round(share, 4)})
    score, pairs = separation([tuple(n["peak"]) for n in found], maps, caption.attention.shape[-1])
    for p in pairs:
        p["pair"] = [found[k]["word"] for k in p["pair"]]
    return {"caption": caption.text, "nouns": found, "pairs": pairs, "score": round(score, 4)}


def singular(word: str) -> str:
    """``dogs`` -> ``dog`` (not ``grass``): so that ``dog`` and ``dogs`` are one first noun."""
    return word[:-1] if word.endswith("s") and not word.endswith("ss") else word


def pick(kept: list[tuple[dict, object]], count: int) -> list[tuple[dict, object]]:
    """The best ``count`` by score, with distinct first nouns (``dog`` = ``dogs``) where there are enough,
    in score order."""
    ranked = sorted(kept, key=lambda item: -item[0]["score"])
    chosen, firsts = [], set()
    for k, item in enumerate(ranked):
        first = singular(item[0]["nouns"][0]["word"])
        if len(chosen) < count and first not in firsts:
            chosen.append(k)
            firsts.add(first)
    chosen += [k for k in range(len(ranked)) if k not in chosen][: count - len(chosen)]  # too few distinct: the next best
    return [ranked[k] for k in sorted(chosen)]


def draw(path: Path, record, caption, entry: dict, panel_side: int) -> None:
    """The photo, one panel per noun (the noun large over its map), the caption under them, as JPEG."""
    from PIL import Image

    from captioner.viz.attention_json import on_image
    from captioner.viz.heatmaps import stats_label
    from captioner.viz.overlays import render_panels

    with Image.open(record.path) as img:
        image = img.convert("RGB")
    placed = on_image(caption, image)
    maps = placed.attention.numpy()[[n["index"] for n in entry["nouns"]]]
    titles = [(n["word"], stats_label(m)) for n, m in zip(entry["nouns"], maps)]
    # each noun on its own scale (render_panels' default): its strongest place at the top, on any photo
    picture = render_panels(image, maps, titles, caption.text, placed.box,
                            panel_side=panel_side, columns=len(maps) + 1, sizes=(30, 15, 20), text_below=True,
                            photo_title="the photo")
    picture.save(path, format="JPEG", quality=88)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint, run folder, URL or hf:// id (captioner.load)")
    parser.add_argument("data", type=Path, help="the dataset (any layout --data reads)")
    parser.add_argument("--split", default="dev", help="the split whose photos are captioned (default: dev)")
    parser.add_argument("--out", type=Path, default=Path("docs/images/gallery"), help="folder for the JPEGs and gallery.json")
    parser.add_argument("--count", type=int, default=4, help="photos to draw (default 4)")
    parser.add_argument("--images", type=int, default=0, help="caption only the split's first N photos (0: all)")
    parser.add_argument("--beam", type=int, default=3, help="beam width (default 3)")
    parser.add_argument("--max-len", type=int, default=16, help="longest caption in words (default 16)")
    parser.add_argument("--no-repeat-ngram", type=int, default=0, help="never repeat an n-gram of this size (0: off)")
    parser.add_argument("--no-repeat-words", action="store_true", help="never repeat a content word")
    parser.add_argument("--nouns", default="", help="comma-separated words to use as nouns instead")
    parser.add_argument("--max-nouns", type=int, default=3, help="noun panels per photo at most (default 3)")
    parser.add_argument("--panel-side", type=int, default=320, help="long side of each panel in pixels (default 320)")
    parser.add_argument("--batch-size", type=int, default=16, help="photos captioned together (default 16)")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or auto")
    args = parser.parse_args(argv)
    if args.count < 1 or args.max_nouns < 2 or args.images < 0:
        parser.error("--count must be >= 1, --max-nouns >= 2 and --images >= 0")

    import captioner
    from captioner.data.coco import load_caption_set
    from captioner.errors import CaptionerError

    try:
        model = captioner.load(args.checkpoint, device=args.device)
        photos = load_caption_set(args.data, args.split).images
        photos = photos[: args.images] if args.images else photos
        if args.nouns:
            nouns, source = frozenset(w.strip() for w in args.nouns.split(",") if w.strip()), "--nouns"
        else:
            nouns, source = noun_words(model)
        kept = []
        for start in range(0, len(photos), 64):
            chunk = photos[start:start + 64]
            captions = model.caption([p.path for p in chunk], attention=True, batch_size=args.batch_size,
                                     beam=args.beam, max_len=args.max_len, no_repeat_ngram=args.no_repeat_ngram,
                                     no_repeat_words=args.no_repeat_words)
            for record, caption in zip(chunk, captions):
                entry = describe(caption, nouns, args.max_nouns)
                if entry is not None:
                    kept.append((dict(entry, image=record.file_name), (record, caption)))
            print(f"captioned {start + len(chunk)}/{len(photos)} photos, {len(kept)} name two nouns",
                  file=sys.stderr, flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        chosen = pick(kept, args.count)
        for rank, (entry, (record, caption)) in enumerate(chosen, start=1):
            file = f"{rank:02d}_{Path(record.file_name).stem}.jpg"
            entry.update({"file": file, **{k: entry.pop(k) for k in ("image", "caption", "nouns", "pairs", "score")}})
            draw(args.out / file, record, caption, entry, args.panel_side)
            nouns_line = " | ".join(f"{n['word']} at ({n['peak'][0]},{n['peak'][1]}) {100 * n['peak_share']:.0f}%"
                                    for n in entry["nouns"])
            pairs_line = ", ".join(f"{p['pair'][0]}-{p['pair'][1]} {p['overlap']:.2f}" for p in entry["pairs"])
            print(f"{entry['file']}: \"{entry['caption']}\"  {nouns_line}  overlap {pairs_line}  score {entry['score']:.2f}")
    except CaptionerError as exc:
        print(f"gallery: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"gallery: error: {exc.filename or args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    summary = {"checkpoint": str(args.checkpoint), "data": str(args.data), "split": args.split,
               "photos_captioned": len(photos), "photos_naming_two_nouns": len(kept), "nouns_from": source,
               "photos": [entry for entry, _ in chosen]}
    (args.out / "gallery.json").write_text(json.dumps(summary, indent=1) + "\n")
    if not chosen:
        print(f"no caption of the {len(photos)} photos names two nouns ({source})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
