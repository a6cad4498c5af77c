"""The HTML attention explorer: one self-contained file (inline CSS/JS, image as a data: URI).

The caption's words form a strip, each under its small map; hovering, focusing or tapping one
draws its attention large over the photo on a <canvas>, a click keeps it, the arrow keys step and
"Play" shows the words in turn. Maps are rendered client-side from the raw g x g weights embedded
as JSON, by the same rules as :mod:`captioner.viz.heatmaps` (placement on the crop box, blur,
styles, each map on its own scale), so any layer and head of a Transformer can be picked. The
page opens on the first tag-word or noun (:func:`opening_word`). A model's concepts and a
caption's labels add rows of chips shown the same way. Inside a page (``captioner serve``) it
talks to its parent with ``postMessage`` and offers ``captionerShowWord``, ``captionerSetStyle``,
``captionerSetStrength`` and ``captionerSnapshot``. docs/share_and_show.md describes it.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

from captioner.errors import ConfigError, DataError
from captioner.files import Outputs, package_texts, write_output
from captioner.inference import Caption
from captioner.viz.attention_json import on_image
from captioner.viz.heatmaps import (BLUR_CELLS, DEFAULT_ALPHA, DEFAULT_CMAP, DEFAULT_STYLE, DIM, HEAT_DIM, LIT_MAX_GAIN,
                                    LIT_TARGET, UNIFORM_FLOOR, check_style, colormap_lut)

MIN_DISPLAY_SIDE = 384  # the canvas's long side is at least this many pixels
MAX_CONCEPTS = 10  # concept chips shown at most
MAX_LABELS = 10  # label chips shown at most
CONCEPTS_LABEL = "Tags the model sees in this photo"
LABELS_LABEL = "Labels the encoder sees"
# words that never open the explorer: articles, numbers, prepositions, pronouns, verbs of being, colours,
# common adjectives and framing nouns (no part-of-speech tagger: a caption's first other word is its first
# noun nearly always)
NOT_NOUNS = frozenset("""
a an the this that these those some two three four five six seven eight nine ten one many several few lots of
in on at to into onto over under above below near next beside behind by with without from for through across
along around up down out off while and or but as its his her their there here who which
is are was were be being been has have had does do it they he she we i you them
red orange yellow green blue purple pink brown black white grey gray dark light bright colorful colourful cyan
magenta violet beige golden silver
small big large little tiny huge tall short long young old older smiling happy wet dry other different
left right top bottom middle front back another each very
picture image photo photograph view scene group pair bunch kind sort side
""".split())  # the last line: nouns that frame a caption ("a picture of", "a group of") rather than name a thing


def opening_word(words: list[str], tags: list[str] | None = None) -> int:
    """Index of the word an explorer opens on: the first of ``tags``, else the first noun-like word, else 0."""
    tagged = {t.lower() for t in tags or ()}
    for i, w in enumerate(words):
        if w.lower() in tagged:
            return i
    for i, w in enumerate(words):
        low = w.lower()
        if low.isalpha() and low not in NOT_NOUNS and not low.endswith(("ing", "ly")):
            return i
    return 0


def display_size(image_size: tuple[int, int], min_side: int = MIN_DISPLAY_SIDE, max_side: int = 960
                 ) -> tuple[int, int]:
    """Canvas size for an image: the long side clamped to [min_side, max_side] (``max_side`` wins), aspect kept."""
    if min_side < 1 or max_side < 1:
        raise ConfigError(f"display sides must be >= 1, got min_side={min_side}, max_side={max_side}")
    w, h = image_size
    if w < 1 or h < 1:
        raise DataError(f"image size must be positive, got {w}x{h}")
    s = min(max_side, max(min_side, w, h)) / max(w, h)
    return max(1, round(w * s)), max(1, round(h * s))


def _image_data_uri(image: Image.Image, max_side: int) -> str:
    image = image.convert("RGB")
    if max(image.size) > max_side:
        s = max_side / max(image.size)
        image = image.resize((max(1, round(image.width * s)), max(1, round(image.height * s))),
                             Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=88)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _chip_row(row: str, kind: str, heading: str, items: list[dict] | None) -> str:
    """A row of chips under the caption, ``kind-0``, ``kind-1``, ... (buttons the script brings to life: the
    photo's tags, ``concepts``, or its labels, ``labels``), or nothing."""
    if not items:
        return ""
    chips = "".join(
        f'<button type="button" class="chip" id="{kind}-{k}" aria-pressed="false" '
        f'title="{kind} {html.escape(c["word"])}: probability {c["prob"]:.2f}">{html.escape(c["word"])} '
        f'<span class="prob">{c["prob"]:.2f}</span></button>' for k, c in enumerate(items))
    return (f'<div class="chip-row" id="{row}"><span class="chip-row-label" id="{row}-label">{heading}'
            f'</span><span class="chips" role="group" aria-labelledby="{row}-label">{chips}</span></div>\n')


def render_explorer(image: Image.Image, caption: Caption, cmap: str = DEFAULT_CMAP, alpha: float = DEFAULT_ALPHA,
                    layer: int = -1, head: int | None = None, title: str | None = None, max_side: int = 960,
                    start: int | None = None, min_side: int = MIN_DISPLAY_SIDE, style: str = DEFAULT_STYLE) -> str:
    """The explorer page as one HTML string with no external resources.

    Args:
        image: the original RGB image (embedded as JPEG, at most ``max_side`` pixels).
        caption: with its (L, g, g) attention, optional all_attention, concepts and labels.
        cmap, alpha, style: the ``heat`` colour map, initial strength and first style.
        layer, head: selected first with ``all_attention`` (layer < 0 counts from the end; head None = mean).
        start: word selected first (None: :func:`opening_word`); ``min_side``: small images upscaled to it.
    """
    record = on_image(caption, image)
    if start is None:
        start = opening_word(record.words, [w for w, _ in (record.concepts or [])[:MAX_CONCEPTS]])
    data = {
        "caption": record.text, "words": record.words, "grid": list(record.grid),
        "image_size": list(record.image_size), "box": list(record.box),
        "attention": np.round(record.attention.numpy().astype(np.float64), 5).tolist(),
        "all_attention": None, "layers": 0, "heads": 0, "layer": 0, "head": None,
        "lut": colormap_lut(cmap).reshape(-1).tolist(), "alpha": float(alpha), "blur_cells": BLUR_CELLS,
        "dim": DIM, "heat_dim": HEAT_DIM, "display_size": list(display_size(record.image_size, min_side, max_side)),
        "floor": UNIFORM_FLOOR / (record.grid[0] * record.grid[1]),
        "start": max(0, min(start, len(record.words) - 1)), "style": check_style(style),
        "concepts": None, "concept_maps": None, "labels": None, "label_maps": None,
        "lit_target": LIT_TARGET, "lit_max": LIT_MAX_GAIN,
    }
    if record.concepts:
        maps = record.concept_maps[:MAX_CONCEPTS]
        data.update(concepts=[{"word": w, "prob": round(p, 4)} for w, p in record.concepts[:MAX_CONCEPTS]],
                    concept_maps=np.round(maps.numpy().astype(np.float64), 5).tolist())
    if record.labels:
        labels = record.labels[:MAX_LABELS]
        data.update(labels=[{"word": w, "prob": round(p, 4)} for w, p, _ in labels],
                    label_maps=[np.round(m.numpy().astype(np.float64), 5).tolist() for _, _, m in labels])
    if record.all_attention is not None:
        layers, heads = record.all_attention.shape[1:3]
        if not -layers <= layer < layers:
            raise ConfigError(f"layer {layer} out of range: the decoder has {layers} layers")
        if head is not None and not 0 <= head < heads:
            raise ConfigError(f"head {head} out of range: the decoder has {heads} heads")
        data.update(all_attention=np.round(record.all_attention.numpy().astype(np.float64), 5).tolist(),
                    layers=int(layers), heads=int(heads), layer=layer % layers, head=head)
    payload = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")  # safe inside <script>
    size = data["display_size"]
    heading = html.escape(title or "Attention explorer")
    chips = (_chip_row("concepts", "tag", CONCEPTS_LABEL, data["concepts"])
             + _chip_row("labels", "label", LABELS_LABEL, data["labels"]))
    kinds = " or a ".join(k for k, key in (("tag", "concepts"), ("label", "labels")) if data[key])
    tag_help = f" (from a {kinds}, through its row)" if kinds else ""
    tag_where = f", or to a {kinds} to see where the model finds it" if kinds else ""
    return EXPLORER_HTML.format(heading=heading, text=html.escape(record.text), css=EXPLORER_CSS, chips=chips,
                                width=size[0], height=size[1], image=_image_data_uri(image, max_side),
                                tag_where=tag_where, tag_help=tag_help, payload=payload, js=EXPLORER_JS)


def write_explorer(path: str | Path, image: Image.Image, caption: Caption, outputs: Outputs | None = None,
                   **options: object) -> Path:
    """Write :func:`render_explorer`'s page to ``path`` (options as there), atomically (recorded in ``outputs``)."""
    data = render_explorer(image, caption, **options).encode("utf-8")  # type: ignore[arg-type]
    return write_output(path, lambda f: f.write(data), outputs, DataError)


# The page's template, stylesheet and script, filled in by render_explorer and shipped as package data.
# The script draws the chosen word's map as :mod:`captioner.viz.heatmaps` does in numpy.
EXPLORER_HTML, EXPLORER_CSS, EXPLORER_JS = package_texts(__package__, "explorer", ("html", "css", "js"))
