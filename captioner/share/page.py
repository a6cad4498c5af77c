"""The ``captioner serve`` page: one HTML document, inline CSS and JS, nothing fetched from elsewhere.

Drop, choose or click a photo; the page posts it to ``/api/caption`` and shows the caption, its
score, the n-best list, downloads and, in an iframe, the explorer page the server rendered for it
(:mod:`captioner.viz.explorer`). With several models, "all models" shows them side by side, their
maps level and the same word lit in each. docs/share_and_show.md describes it. The document sets
``data-state`` on ``<body>`` (``idle``, ``busy``, ``done``, ``error``), ``data-answers`` and
``data-ms`` (the last upload-to-map time): what the browser tests wait on and measure.
"""

from __future__ import annotations

import html
import json

from captioner.files import package_texts, size_text

__all__ = ["PAGE_CSS", "PAGE_HTML", "PAGE_JS", "render_page"]


def render_page(models: list[dict], examples: list[dict], max_beam: int, max_bytes: int,
                verdicts: list[dict] = (), upload_side: int = 0) -> str:
    """The page as one HTML string.

    ``models``: ``[{"name", "decoder", "encoder", "about", "card", "everyday", ...}]``, the first selected;
    ``examples``: ``{"name", "file"}`` each; ``max_bytes``: largest upload (checked before sending);
    ``verdicts``: ``{"name", "note"}`` each, what a caption's verdict means; ``upload_side``: the long side
    a larger photo is shrunk to in the browser before it is sent (0: sent as it is).
    """
    config = {"models": models, "examples": examples, "max_beam": max_beam, "max_bytes": max_bytes,
              "max_text": size_text(max_bytes), "verdicts": list(verdicts), "upload_side": upload_side}
    payload = json.dumps(config, separators=(",", ":")).replace("<", "\\u003c")  # safe inside <script>
    names = html.escape(", ".join(m["name"] for m in models))
    about = "".join(
        f'<li><strong>{html.escape(m["name"])}</strong>: {html.escape(m.get("about", ""))}'
        + (f' <a href="/cards/{i}" target="_blank" rel="noopener">model card</a>' if m.get("card") else "")
        + "</li>" for i, m in enumerate(models))
    return PAGE_HTML.format(names=names, css=PAGE_CSS, about=about, payload=payload, js=PAGE_JS)


# The page's template, stylesheet and script, filled in by render_page and shipped as package data.
# The script captions the last photo again whenever a setting changes; with "all models" it shows one column
# per model, the same word in each. The page never scrolls by itself: nothing jumps while a photo is busy.
PAGE_HTML, PAGE_CSS, PAGE_JS = package_texts(__package__, "page", ("html", "css", "js"))
