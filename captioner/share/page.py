"""The ``captioner serve`` page: one HTML document, inline CSS and JS, nothing fetched from elsewhere.

Drop a photo on the page, choose one, or click an example; the page posts it to ``/api/caption``
and shows, under the photo's name and thumbnail, the captions (best first, each with its labelled
score; click one to see its attention) and, in an iframe, the explorer page the server rendered for
it (:mod:`captioner.viz.explorer`: hover, focus or tap a word; attention as light or a heat map;
layer and head selectors for a Transformer). Changing the model, the beam or the number of
captions, or pressing "Run again", captions the same photo again. With several models, "all
models" (the default) shows them side by side, the same word lit in each. Buttons download the
map on show with the caption and the word under it (PNG) and the attention record (JSON). An
error is shown in one line and clears the old result; a new photo marks it as the previous one's
until its own answer arrives. A file larger than the server's limit is refused before it is sent.
The script and stylesheet are in :mod:`captioner.share.page_script`.

The document sets ``data-state`` on ``<body>`` (``idle``, ``busy``, ``done``, ``error``), counts
answers in ``data-answers`` and the last upload-to-map time in ``data-ms``: what the browser tests
wait on and measure.
"""

from __future__ import annotations

import html
import json

from captioner.files import size_text
from captioner.share.page_script import PAGE_CSS, PAGE_JS

__all__ = ["render_page"]


def render_page(models: list[dict], examples: list[str], max_beam: int, max_bytes: int) -> str:
    """The page as one HTML string.

    Args:
        models: ``[{"name", "decoder", "encoder", ...}]``, the first selected.
        examples: the examples' names (``/examples/<index>`` serves each).
        max_beam: largest beam offered.
        max_bytes: largest upload (checked in the page before sending, and by the server).
    """
    config = {"models": models, "examples": examples, "max_beam": max_beam, "max_bytes": max_bytes,
              "max_text": size_text(max_bytes)}
    payload = json.dumps(config, separators=(",", ":")).replace("<", "\\u003c")  # safe inside <script>
    names = html.escape(", ".join(m["name"] for m in models))
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>captioner: {names}</title>
<link rel="icon" href="data:,">
<style>{PAGE_CSS}</style>
</head>
<body data-state="loading" data-answers="0">
<main>
<h1>Where does each word look? <small>captioner serve</small></h1>
<div class="bar">
  <div id="drop"><label for="file">Drop a photo here, or choose one:</label> <input type="file" id="file" accept="image/*"></div>
  <div id="examples"><span>or an example:</span></div>
</div>
<div class="bar">
  <div id="current" hidden><img id="thumb" alt=""><span id="file-name"></span></div>
  <label id="model-label">model<select id="model"></select></label>
  <label>beam<select id="beam"></select></label>
  <label>captions<select id="nbest-count"></select></label>
  <button type="button" id="again" disabled>Run again</button>
</div>
<p id="error" role="alert" hidden></p>
<p id="status" aria-live="polite"></p>
<section id="result" hidden aria-label="result">
  <p id="stale-note" hidden></p>
  <div id="result-head" class="bar"><img id="result-thumb" alt="" width="40" height="40">
    <span>Result for <strong id="result-file"></strong></span></div>
  <div id="columns"></div>
</section>
</main>
<script type="application/json" id="serve-config">{payload}</script>
<script>{PAGE_JS}</script>
</body>
</html>
"""
