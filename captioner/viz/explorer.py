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
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{heading}: {html.escape(record.text)}</title>
<link rel="icon" href="data:,">
<style>{EXPLORER_CSS}</style>
</head>
<body>
<h1>{heading}</h1>
<p class="hint" id="hint">Each word with its map: hover, tap or Tab to the words, the arrow keys step.</p>
<div class="caption" id="caption" role="toolbar" aria-label="the caption's words, each with its map" aria-describedby="hint"></div>
{chips}<div class="controls">
  <button type="button" id="play" aria-pressed="false">&#9654; Play</button>
  <button type="button" id="bare" aria-pressed="false">Photo without the map</button>
  <label>style<select id="style"><option value="heat">heat map</option>
    <option value="light">attention as light</option></select></label>
  <span id="selectors" hidden>
    <label>layer<select id="layer"></select></label>
    <label>head<select id="head"></select></label>
  </span>
  <label class="strength">strength<input type="range" id="alpha" min="0" max="1" step="0.05"></label>
</div>
<div class="views">
  <figure>
    <p id="shown-word" aria-live="polite"></p>
    <div class="stage"><canvas id="view" role="img" aria-label="where the model looked for the chosen word"></canvas>
      <p id="missing" hidden></p></div>
    <div class="legend"><span>none</span><span class="bar" id="legend-bar"></span><span id="legend-top"></span></div>
    <p id="summary"></p>
    <details><summary>figures</summary><span id="info"></span></details>
  </figure>
  <img id="photo" alt="" hidden width="{size[0]}" height="{size[1]}" src="{_image_data_uri(image, max_side)}">
</div>
<p class="help">Hover, tap or Tab to a word to see where the model looked{tag_where}; Enter, Space or a click keeps it;
the arrow keys step through the words{tag_help}; Play shows them in turn.
Outside the region the encoder saw, the image is dimmed.</p>
<script type="application/json" id="explorer-data">{payload}</script>
<script>{EXPLORER_JS}</script>
</body>
</html>
"""


def write_explorer(path: str | Path, image: Image.Image, caption: Caption, **options: object) -> Path:
    """Write :func:`render_explorer`'s page to ``path`` (options as there)."""
    path = Path(path)
    path.write_text(render_explorer(image, caption, **options), encoding="utf-8")  # type: ignore[arg-type]
    return path


# --- the page's stylesheet and script (embedded inline by render_explorer) ---
# The script draws the chosen word's map as :mod:`captioner.viz.heatmaps` does in numpy.

EXPLORER_CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.2em auto; max-width: 1180px;
       padding: 0 1em; color: #1d1d1f; background: #fafafa; }
h1 { font-size: 1.15em; margin: 0 0 .6em; font-weight: 600; }
/* the word strip: every word under its own small map; one Tab stop, the arrow keys step */
.hint { color: #444; font-size: .85em; margin: 0 0 .2em; }
.caption { display: flex; gap: .3em; margin: 0 0 .5em; padding: 2px 2px 4px; overflow-x: auto; }
.word { font: inherit; font-size: 1.05em; color: inherit; background: none; border: 2px solid transparent;
        padding: 2px 2px 0; border-radius: 6px; cursor: pointer; display: flex; flex-direction: column;
        align-items: center; flex: 0 0 auto; }
.word .mini { display: block; height: 44px; width: auto; border-radius: 3px; background: #ddd; }
.word:hover { background: #e3e8f4; }
.word.active { background: #1f47b8; color: #fff; border-color: #1f47b8; }
.word.pinned, .chip.pinned { text-decoration: underline; text-decoration-thickness: .12em; text-underline-offset: .2em; }
.chip-row { display: flex; flex-wrap: wrap; align-items: center; gap: .35em .45em; margin: -.2em 0 .8em; }
.chip-row-label { color: #444; font-size: .9em; margin-right: .2em; }
.chips { display: contents; }
.chip { font: inherit; font-size: .95em; color: #1d1d1f; background: #eef1f7; border: 1px solid #b8c0cf;
        border-radius: 999px; padding: .05em .7em; cursor: pointer; }
.chip .prob { color: #4a4a4a; font-size: .85em; margin-left: .1em; font-variant-numeric: tabular-nums; }
.chip:hover { background: #dde3f1; }
.chip.active { background: #1f47b8; border-color: #1f47b8; color: #fff; }
.chip.active .prob { color: #e4e9f7; }
.word:focus-visible, .chip:focus-visible, select:focus-visible, input:focus-visible, summary:focus-visible {
  outline: 3px solid #e0a800; outline-offset: 2px; }
.controls { display: flex; flex-wrap: wrap; gap: .5em 1.2em; align-items: center; margin-bottom: .5em; font-size: .92em; }
.controls button { font: inherit; padding: .15em .7em; border: 1px solid #8a94a6; border-radius: 6px; background: #fff;
                   color: #1d1d1f; cursor: pointer; }
.controls button[aria-pressed="true"] { background: #dfe6f7; border-color: #1f47b8; }
.controls button:focus-visible { outline: 3px solid #e0a800; outline-offset: 2px; }
.controls select, .controls input { margin-left: .35em; }
.views figure { margin: 0; min-width: 0; padding-top: var(--lead, 0px); }  /* --lead: a page levels its maps */
#shown-word { font-size: 1.5em; font-weight: 600; margin: 0 0 .15em; line-height: 1.2; overflow-wrap: anywhere; }
.stage { position: relative; width: fit-content; max-width: 100%; }
#summary { margin: .3em 0; }
#info { color: #555; font-variant-numeric: tabular-nums; }
/* the canvas is drawn at display_size and shrinks (never grows) on narrow screens, and to --map-max high (a page
   that holds the explorer sets it, so the map and its legend fit its window) */
#view { display: block; max-width: 100%; max-height: var(--map-max, none); width: auto; height: auto;
        border-radius: 4px; box-shadow: 0 1px 4px #0003; }
.legend { display: flex; align-items: center; gap: .5em; font-size: .85em; color: #444; margin: .4em 0; }
.legend .bar { flex: 0 1 220px; height: 12px; border-radius: 3px; border: 1px solid #bbb; }
.help { color: #555; font-size: .85em; }
body.embedded { margin: 0; padding: 0 4px; max-width: none; display: flex; flex-direction: column; }
body.embedded h1, body.embedded .help { display: none; }  /* inside a page: it gives the heading and the help */
body.embedded #shown-word { font-size: 1.2em; }
body.embedded .stage { width: auto; }
body.embedded #view { width: 100%; max-width: min(100%, calc(var(--map-max, 100vh) * var(--aspect, 1))); }
/* a word another column shows and this caption lacks: said over the map's top, which stays where it is */
#missing { position: absolute; left: 0; right: 0; top: 0; margin: 0; padding: .2em .6em; border-radius: 4px 4px 0 0;
           background: #fff4d6e8; color: #5c4300; font-size: .9em; }
@media (max-width: 600px) {  /* a narrow window: the map right under the words, the settings after it */
  body.embedded .controls { order: 1; }
  body.embedded .hint { display: none; }
}
@media (max-width: 420px) {  /* a phone's column: the map first, small print around it, the chips after it */
  body.embedded .chip-row { order: 1; margin: .4em 0 .2em; }
  .word { font-size: .9em; }
  .word .mini { height: 34px; }
  #shown-word { font-size: 1.1em; }
  .controls { gap: .4em .8em; font-size: .85em; margin-bottom: .4em; }
  .legend .bar { flex-basis: 80px; }
  body.compare .chip-row-label, body.compare .controls .strength { display: none; }
  body.compare #missing { font-size: .85em; }
}
[hidden] { display: none !important; }
"""

EXPLORER_JS = r"""
"use strict";
(function () {
  const D = JSON.parse(document.getElementById("explorer-data").textContent);
  const photo = document.getElementById("photo");
  const canvas = document.getElementById("view");
  const ctx = canvas.getContext("2d");
  const layerSel = document.getElementById("layer");
  const headSel = document.getElementById("head");
  const styleSel = document.getElementById("style");
  const alphaIn = document.getElementById("alpha");
  const info = document.getElementById("info");
  const g = D.grid[0];
  canvas.width = D.display_size[0];  // small images are upscaled, large ones bounded (Python decides)
  canvas.height = D.display_size[1];
  canvas.style.setProperty && canvas.style.setProperty("--aspect", String(canvas.width / canvas.height));
  const sx = canvas.width / D.image_size[0], sy = canvas.height / D.image_size[1];
  const box = [D.box[0] * sx, D.box[1] * sy, D.box[2] * sx, D.box[3] * sy];
  // what can be shown: the caption's words (0 .. L-1), then the photo's tags and labels, the chips (L .. L+C-1):
  // chips[j] is {kind, word, prob, map, k: its place in its row, first: the row's first chip, n: the row's length}
  const chips = [];
  [["tag", D.concepts, D.concept_maps], ["label", D.labels, D.label_maps]].forEach(function (row) {
    (row[1] || []).forEach(function (c, k) {
      chips.push({ kind: row[0], word: c.word, prob: c.prob, map: row[2][k], k: k, first: chips.length - k,
                   n: row[1].length });
    });
  });
  const L = D.words.length, C = chips.length, spans = [], buttons = [];
  let current = 0, shown = 0, over = -1;  // the pinned item | the item drawn now (hovered, focused or pinned); -1:
                                          // none | the item the pointer moved onto

  if (D.all_attention) {
    for (let l = 0; l < D.layers; l++) layerSel.add(new Option(String(l + 1), String(l)));
    headSel.add(new Option("mean", "mean"));
    for (let h = 0; h < D.heads; h++) headSel.add(new Option(String(h + 1), String(h)));
    layerSel.value = String(D.layer);
    headSel.value = D.head === null ? "mean" : String(D.head);
    document.getElementById("selectors").hidden = false;
  }
  alphaIn.value = String(D.alpha);
  styleSel.value = D.style;

  function isChip(i) { return i >= L; }
  function label(i) {  // what the item is called, large above the map and under a saved picture
    if (!isChip(i)) return "\u201c" + D.words[i] + "\u201d";
    const c = chips[i - L];
    return c.kind + ": " + c.word + " " + c.prob.toFixed(2);
  }

  function weights(i) {  // the g x g map shown for item i
    if (isChip(i)) return chips[i - L].map;
    if (!D.all_attention) return D.attention[i];
    const heads = D.all_attention[i][+layerSel.value];
    if (headSel.value !== "mean") return heads[+headSel.value];
    return heads[0].map(function (row, r) {
      return row.map(function (_, c) {
        let s = 0;
        for (let h = 0; h < heads.length; h++) s += heads[h][r][c];
        return s / heads.length;
      });
    });
  }


  function axis(n, cell) {  // bilinear taps (half-pixel centres, clamped) for n pixels
    const lo = new Int32Array(n), hi = new Int32Array(n), fr = new Float32Array(n);
    for (let p = 0; p < n; p++) {
      const u = Math.min(Math.max((p + 0.5) / cell - 0.5, 0), g - 1);
      lo[p] = Math.min(Math.floor(u), g - 1); hi[p] = Math.min(lo[p] + 1, g - 1); fr[p] = u - lo[p];
    }
    return { lo: lo, hi: hi, fr: fr };
  }

  function blur(a, w, h, sigma, horizontal) {  // separable Gaussian, kernel renormalised at edges
    if (sigma < 0.5) return a;
    const r = Math.max(1, Math.floor(3 * sigma)), k = [];
    for (let x = -r; x <= r; x++) k.push(Math.exp(-0.5 * (x / sigma) * (x / sigma)));
    const out = new Float32Array(a.length), n = horizontal ? w : h;
    for (let y = 0; y < h; y++) for (let x = 0; x < w; x++) {
      const p = horizontal ? x : y;
      let s = 0, ws = 0;
      for (let j = -r; j <= r; j++) {
        const q = p + j;
        if (q < 0 || q >= n) continue;
        s += k[j + r] * a[horizontal ? y * w + q : q * w + x]; ws += k[j + r];
      }
      out[y * w + x] = s / ws;
    }
    return out;
  }

  function layerCanvas(m, side, bx) {  // the style's RGBA layer at a working resolution (at most side px) of the
    bx = bx || box;                      // box (heatmaps.style_layer)
    const bw = bx[2] - bx[0], bh = bx[3] - bx[1];
    const f = Math.min(1, (side || 240) / Math.max(bw, bh));
    const w = Math.max(1, Math.round(bw * f)), h = Math.max(1, Math.round(bh * f));
    const ax = axis(w, w / g), ay = axis(h, h / g);
    let a = new Float32Array(w * h);
    for (let y = 0; y < h; y++) {
      const r0 = m[ay.lo[y]], r1 = m[ay.hi[y]], fy = ay.fr[y];
      for (let x = 0; x < w; x++) {
        const top = r0[ax.lo[x]] * (1 - ax.fr[x]) + r0[ax.hi[x]] * ax.fr[x];
        const bot = r1[ax.lo[x]] * (1 - ax.fr[x]) + r1[ax.hi[x]] * ax.fr[x];
        a[y * w + x] = top * (1 - fy) + bot * fy;
      }
    }
    a = blur(blur(a, w, h, D.blur_cells * w / g, true), w, h, D.blur_cells * h / g, false);
    let top = D.floor;  // the map's own scale: 0 to its peak (heatmaps.word_scale)
    for (let p = 0; p < a.length; p++) if (a[p] > top) top = a[p];
    const lo = 0, hi = top, strength = +alphaIn.value, light = styleSel.value === "light";
    const layer = document.createElement("canvas");
    layer.width = w; layer.height = h;
    const lctx = layer.getContext("2d"), img = lctx.createImageData(w, h);
    for (let p = 0; p < a.length; p++) {
      const v = hi - lo > 1e-12 ? Math.min(255, Math.max(0, Math.round(255 * (a[p] - lo) / (hi - lo)))) : 0;
      if (light) {  // black, opaque where the word did not look: the photo itself where it did
        img.data[4 * p + 3] = Math.round(255 * strength * (1 - v / 255));
      } else {  // the colour map, transparent at the low end, over black that darkens the rest a little
        const rgba = heat(v, strength);
        img.data[4 * p] = rgba[0]; img.data[4 * p + 1] = rgba[1]; img.data[4 * p + 2] = rgba[2];
        img.data[4 * p + 3] = Math.round(255 * rgba[3]);
      }
    }
    lctx.putImageData(img, 0, 0);
    if (light) layer.lit = litLayer(a, w, h, lo, hi, strength);
    return layer;
  }

  // "attention as light" on a dark photo: where the word looked, the photo is also lit up (its brightness raised
  // towards a mid grey), so the peak can be seen however dark the photo is; elsewhere it is only darkened
  let gain = null;
  function photoGain() {  // how much a photo this dark is brightened where the word looked (1: not at all)
    if (gain !== null) return gain;
    gain = 1;
    const probe = document.createElement("canvas");
    probe.width = probe.height = 32;
    const p = probe.getContext("2d");
    if (!p || !p.getImageData) return gain;
    try {
      p.drawImage(photo, 0, 0, 32, 32);
      const px = p.getImageData(0, 0, 32, 32).data;
      let sum = 0;
      for (let k = 0; k < px.length; k += 4) sum += 0.299 * px[k] + 0.587 * px[k + 1] + 0.114 * px[k + 2];
      gain = Math.min(D.lit_max, Math.max(1, D.lit_target * 255 / Math.max(1, sum / (px.length / 4))));  // light_gain
    } catch (e) { gain = 1; }
    return gain;
  }
  function litLayer(a, w, h, lo, hi, strength) {  // the lit photo's mask: opaque where the word looked most
    if (photoGain() < 1.05) return null;  // as heatmaps.overlay_heatmap: not for a photo that is bright enough
    const mask = document.createElement("canvas");
    mask.width = w; mask.height = h;
    const mctx = mask.getContext("2d"), img = mctx.createImageData(w, h);
    for (let p = 0; p < a.length; p++) {
      const v = hi - lo > 1e-12 ? Math.min(1, Math.max(0, (a[p] - lo) / (hi - lo))) : 0;
      img.data[4 * p + 3] = Math.round(255 * strength * v * v);
    }
    mctx.putImageData(img, 0, 0);
    return mask;
  }
  function drawLit(target, mask, bx) {  // the photo brightened by photoGain, through the mask, over the box
    const lit = document.createElement("canvas");
    lit.width = target.canvas.width; lit.height = target.canvas.height;
    const l = lit.getContext("2d");
    l.filter = "brightness(" + photoGain().toFixed(2) + ")";
    l.drawImage(photo, 0, 0, lit.width, lit.height);
    l.filter = "none";
    l.globalCompositeOperation = "destination-in";
    l.imageSmoothingEnabled = true;
    l.drawImage(mask, bx[0], bx[1], bx[2] - bx[0], bx[3] - bx[1]);
    l.globalCompositeOperation = "source-over";
    target.drawImage(lit, 0, 0);
  }

  function heat(v, strength) {  // heatmaps.style_layer "heat" at level v (0..255): [r, g, b, opacity 0..1]
    const paint = strength * (v / 255) * (v / 255), dark = D.heat_dim * strength * (1 - v / 255);
    const o = 1 - (1 - paint) * (1 - dark), k = o > 0 ? paint / o : 0;
    return [Math.round(D.lut[3 * v] * k), Math.round(D.lut[3 * v + 1] * k), Math.round(D.lut[3 * v + 2] * k), o];
  }

  function legend(pct) {  // what the two ends of the scale look like; the top is the map's strongest region
    const bar = document.getElementById("legend-bar"), strength = +alphaIn.value, stops = [];
    for (let k = 0; k <= 8; k++) {
      const v = Math.round(255 * k / 8), rgba = styleSel.value === "light" ? [0, 0, 0, strength * (1 - v / 255)]
        : heat(v, strength);
      stops.push("rgba(" + rgba[0] + "," + rgba[1] + "," + rgba[2] + "," + rgba[3].toFixed(3) + ")");
    }
    bar.style.background = "linear-gradient(to right, " + stops.join(", ") + "), #d9d9d9";
    document.getElementById("legend-top").textContent = pct === null ? "strongest region"
      : "strongest region, " + pct + "%";
  }

  function describe(i, m) {  // plain words first; the figures behind them on demand
    let best = 0, br = 0, bc = 0, total = 0, entropy = 0;
    m.forEach(function (row, r) {
      row.forEach(function (v, c) { total += v; if (v > best) { best = v; br = r; bc = c; } });
    });
    if (total > 0) m.forEach(function (row) { row.forEach(function (v) {
      if (v > 0) entropy -= (v / total) * Math.log(v / total);
    }); });
    const share = total > 0 ? best / total : 0, spread = entropy / Math.log(g * g);
    const pct = (100 * share).toFixed(share >= 0.1 ? 0 : 1);
    legend(pct);
    const figures = ": peak " + pct + "% at row " + (br + 1) + ", column " + (bc + 1) +
      " \u00b7 H " + entropy.toFixed(1) + "/" + Math.log(g * g).toFixed(1) + " nats";
    document.getElementById("shown-word").textContent = label(i);
    if (isChip(i)) {
      const t = chips[i - L], where = spread < 0.5 ? "lies mostly in one place" : spread < 0.85
        ? "lies in a few places" : "is spread all over the picture";
      document.getElementById("summary").textContent = "The " + t.kind + " \u201c" + t.word + "\u201d (probability " +
        t.prob.toFixed(2) + ") " + where + "; its strongest region holds " + pct + "% of its map.";
      info.textContent = t.kind + " " + (t.k + 1) + "/" + t.n + " \u201c" + t.word + "\u201d" + figures;
      return;
    }
    const how = spread < 0.5 ? "looked mostly at one place" : spread < 0.85 ? "looked at a few places"
      : "looked all over the picture";
    document.getElementById("summary").textContent = "Word " + (i + 1) + " of " + L + " " + how +
      "; its strongest region holds " + pct + "% of its attention.";
    info.textContent = "word " + (i + 1) + "/" + L + " \u201c" + D.words[i] + "\u201d" + figures;
  }

  function paint(target, w, h, bx, m, side) {  // the photo, dimmed outside the box, and map m's layer over it
    target.globalAlpha = 1;
    target.drawImage(photo, 0, 0, w, h);
    target.fillStyle = "rgba(0,0,0," + (1 - D.dim) + ")";  // dim what the encoder did not see
    target.fillRect(0, 0, w, bx[1]);
    target.fillRect(0, bx[3], w, h - bx[3]);
    target.fillRect(0, bx[1], bx[0], bx[3] - bx[1]);
    target.fillRect(bx[2], bx[1], w - bx[2], bx[3] - bx[1]);
    if (!m) return;
    target.imageSmoothingEnabled = true;
    target.imageSmoothingQuality = "high";
    const layer = layerCanvas(m, side, bx);
    target.drawImage(layer, bx[0], bx[1], bx[2] - bx[0], bx[3] - bx[1]);
    if (layer.lit) drawLit(target, layer.lit, bx);
  }

  const bare = document.getElementById("bare");
  let bareOn = false;  // the photo without the map
  function draw(i) {
    const none = i < 0 || i >= L + C;
    paint(ctx, canvas.width, canvas.height, box, none || bareOn ? null : weights(i));
    if (none) { legend(null); info.textContent = "empty caption"; return; }
    describe(i, weights(i));
  }

  function drawMinis() {  // the strip: each word's map, small, in the style and strength chosen
    spans.forEach(function (s, i) {
      const mini = s.firstChild;
      if (!mini || !mini.getContext) return;
      const c = mini.getContext("2d"), f = mini.width / canvas.width;
      paint(c, mini.width, mini.height, [box[0] * f, box[1] * f, box[2] * f, box[3] * f], weights(i), 48);
    });
  }

  function id(i) { return isChip(i) ? chips[i - L].kind + "-" + chips[i - L].k : String(i); }  // "3", "tag-0", "label-1"

  const missing = document.getElementById("missing");
  function show(i, quiet, note) {  // draw item i and mark it: hovered, focused and pinned items look the same
    shown = i;
    missing.textContent = note || ""; missing.hidden = !note;
    buttons.forEach(function (s, k) { s.classList.toggle("active", k === i); });
    document.body.dataset.shown = i < 0 ? "" : id(i);
    draw(i);
    if (!quiet && i >= 0 && window.parent !== window) {
      window.parent.postMessage({ captioner: "word", kind: isChip(i) ? chips[i - L].kind : "word",
                                  word: isChip(i) ? chips[i - L].word : D.words[i], map: weights(i) }, "*");
    }
  }

  function select(i, quiet) {  // pin item i (click, tap, Enter, Space, arrows)
    current = i;
    buttons.forEach(function (s, k) {
      s.classList.toggle("pinned", k === current); s.setAttribute("aria-pressed", String(k === current));
    });
    if (i < L) spans.forEach(function (s, k) { s.tabIndex = k === i ? 0 : -1; });  // the strip: one Tab stop
    document.body.dataset.word = id(current);
    show(current, quiet);
  }

  function bind(s, i) {  // hover, focus, tap and keys: the same for a word and a tag
    s.addEventListener("click", function () { select(i); });
    s.addEventListener("mousemove", function () {  // a pointer that moves onto it: a caption loaded under a
      if (over !== i) { over = i; show(i); }       // still pointer gets only mouseover/mouseenter, keeps its word
    });
    s.addEventListener("mouseleave", function () { over = -1; show(current); });
    s.addEventListener("focus", function () { show(i); });
    s.addEventListener("blur", function () { show(current); });
    buttons.push(s);
  }

  const cap = document.getElementById("caption");
  const miniH = 88, miniW = Math.max(1, Math.round(miniH * canvas.width / canvas.height));
  D.words.forEach(function (word, i) {
    const s = document.createElement("button"), mini = document.createElement("canvas");
    const text = document.createElement("span");
    s.type = "button"; s.className = "word"; s.id = "word-" + i; s.tabIndex = -1;
    mini.className = "mini"; mini.width = miniW; mini.height = miniH;
    mini.setAttribute("aria-hidden", "true");
    text.textContent = word;
    s.appendChild(mini); s.appendChild(text);
    bind(s, i);
    cap.appendChild(s);
    spans.push(s);
  });
  chips.forEach(function (c, j) { bind(document.getElementById(c.kind + "-" + c.k), L + j); });  // in the page
  document.addEventListener("keydown", function (e) {
    if (e.target && (e.target.tagName === "SELECT" || e.target.tagName === "INPUT")) return;  // their own arrows
    const ends = e.key === "Home" || e.key === "End";
    const step = e.key === "ArrowRight" || e.key === "ArrowDown" ? 1 : e.key === "ArrowLeft" || e.key === "ArrowUp" ? -1 : 0;
    const list = e.target && e.target.classList;
    const onItem = list && (list.contains("word") || list.contains("chip"));
    if (!step && !(ends && onItem)) return;
    stop();
    const from = onItem ? shown : current;  // step through the words, or through a chip's row from a chip
    if (from < 0) return;
    const lo = isChip(from) ? L + chips[from - L].first : 0, n = isChip(from) ? chips[from - L].n : L;
    select(ends ? lo + (e.key === "Home" ? 0 : n - 1) : lo + ((from - lo + step) % n + n) % n);
    if (onItem) buttons[current].focus();
    e.preventDefault();
  });
  [layerSel, headSel, alphaIn].forEach(function (el) {
    el.addEventListener("input", function () { draw(shown); });
    el.addEventListener("change", function () { draw(shown); drawMinis(); });
  });
  alphaIn.addEventListener("change", function () {  // the page keeps the strength for the next answer
    if (window.parent !== window) window.parent.postMessage({ captioner: "strength", value: +alphaIn.value }, "*");
  });
  styleSel.addEventListener("change", function () {
    draw(shown); drawMinis();
    if (window.parent !== window) window.parent.postMessage({ captioner: "style", style: styleSel.value }, "*");
  });
  bare.addEventListener("click", function () {  // the photo as it is, without the map, and back
    bareOn = !bareOn;
    bare.setAttribute("aria-pressed", String(bareOn));
    draw(shown);
  });
  // Play: each word in turn, as the GIF shows them; any other choice stops it
  const play = document.getElementById("play");
  let timer = null;
  function stop() {
    if (timer === null) return;
    clearInterval(timer); timer = null;
    play.setAttribute("aria-pressed", "false"); play.textContent = "\u25b6 Play";
    document.body.dataset.playing = "";
  }
  play.addEventListener("click", function () {
    if (timer !== null) { stop(); return; }
    if (!L) return;
    let k = 0;
    play.setAttribute("aria-pressed", "true"); play.textContent = "\u275a\u275a Pause";
    document.body.dataset.playing = "1";
    select(0);
    timer = setInterval(function () {
      if (++k >= L) { stop(); return; }
      select(k);
    }, D.play_ms || 900);
  });
  cap.addEventListener("click", function () { stop(); });

  // for a page that holds several explorers: the same word in each, one style, a picture to save
  function overlap(a, b) {  // heatmaps.map_overlap: histogram intersection of two maps, each summing to 1
    let sa = 0, sb = 0, s = 0;
    a.forEach(function (row) { row.forEach(function (v) { sa += v; }); });
    b.forEach(function (row) { row.forEach(function (v) { sb += v; }); });
    if (!(sa > 0 && sb > 0)) return 0;
    a.forEach(function (row, r) { row.forEach(function (v, c) { s += Math.min(v / sa, b[r][c] / sb); }); });
    return s;
  }
  function find(kind, word) {  // the item of that kind and name (a word of the caption, a tag, a label), or -1
    if (kind === "word") return D.words.indexOf(word);
    for (let j = 0; j < C; j++) if (chips[j].kind === kind && chips[j].word === word) return L + j;
    return -1;
  }
  window.captionerShowWord = function (word, kind, map) {  // kind "tag" or "label": a chip of the photo, else a word
    kind = kind === "tag" || kind === "label" ? kind : "word";
    if (find(kind, word) >= 0) { show(find(kind, word), true); return; }
    const where = kind === "word" ? "in this caption" : "among this photo's " + kind + "s";
    const others = { word: ["tag", "label"], tag: ["word", "label"], label: ["word", "tag"] }[kind];
    for (let o = 0; o < others.length; o++) if (find(others[o], word) >= 0) {  // the same name, of another kind
      show(find(others[o], word), true, "No \u201c" + word + "\u201d " + where + ": its " + others[o] + " instead.");
      return;
    }
    let best = -1, most = -1;  // else the caption's word whose map is most like the one shown beside
    if (map && map.length === g) for (let j = 0; j < L; j++) {
      const o = overlap(weights(j), map);
      if (o > most) { most = o; best = j; }
    }
    if (best < 0) { show(current, true, "No \u201c" + word + "\u201d " + where + "."); return; }
    show(best, true, "No \u201c" + word + "\u201d " + where +
      ": its nearest word, the one that looked most alike (" + (100 * most).toFixed(0) + "% overlap).");
  };
  window.captionerSetStyle = function (style) {
    if (styleSel.value !== style) { styleSel.value = style; draw(shown); drawMinis(); }
  };
  window.captionerSetStrength = function (value) {
    if (+alphaIn.value !== +value) { alphaIn.value = String(value); draw(shown); drawMinis(); }
  };
  window.captionerSnapshot = function () {  // the map with the caption and the word under it
    const band = 56, out = document.createElement("canvas");
    out.width = canvas.width; out.height = canvas.height + band;
    const o = out.getContext("2d");
    o.fillStyle = "#fff"; o.fillRect(0, 0, out.width, out.height);
    o.drawImage(canvas, 0, 0);
    o.fillStyle = "#111"; o.font = "600 20px system-ui, sans-serif";
    o.fillText(shown >= 0 && shown < L + C ? label(shown) : "(empty caption)", 8, canvas.height + 22, out.width - 16);
    o.font = "15px system-ui, sans-serif"; o.fillStyle = "#333";
    o.fillText(D.caption, 8, canvas.height + 44, out.width - 16);
    return out.toDataURL("image/png");
  };
  if (window.parent !== window) {
    document.body.classList.add("embedded");
    ["dragenter", "dragover"].forEach(function (t) {  // a photo dropped here is the page's to caption
      document.addEventListener(t, function (e) { e.preventDefault(); });
    });
    document.addEventListener("drop", function (e) {
      e.preventDefault();
      const files = e.dataTransfer && e.dataTransfer.files;
      if (files && files.length) window.parent.postMessage({ captioner: "drop", file: files[0] }, "*");
    });
  }
  function start() {
    if (L) select(D.start, true); else { current = -1; show(-1, true); }  // an empty caption: the photo, and a line saying so
    drawMinis();
    document.body.dataset.ready = "1";
  }
  if (photo.complete && photo.naturalWidth) start(); else photo.addEventListener("load", start);
})();
"""
