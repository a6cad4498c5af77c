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
import re

from captioner.config import EVERYDAY_PHOTOS, flags_of
from captioner.files import package_texts, size_text

__all__ = ["PAGE_CSS", "PAGE_HTML", "PAGE_JS", "card_html", "render_card_page", "render_page"]


def render_page(models: list[dict], examples: list[dict], max_beam: int, max_bytes: int,
                verdicts: list[dict] = (), upload_side: int = 0) -> str:
    """The page as one HTML string.

    ``models``: ``[{"name", "decoder", "encoder", "about", "card", "everyday", ...}]``, the first selected;
    ``examples``: ``{"name", "file"}`` each; ``max_bytes``: largest upload (checked before sending);
    ``verdicts``: ``{"name", "note"}`` each, what a caption's verdict means; ``upload_side``: the long side
    a larger photo is shrunk to in the browser before it is sent (0: sent as it is).
    """
    config = {"models": models, "examples": examples, "max_beam": max_beam, "max_bytes": max_bytes,
              "max_text": size_text(max_bytes), "verdicts": list(verdicts), "upload_side": upload_side,
              "everyday_setting": flags_of(EVERYDAY_PHOTOS)}  # what "everyday photos" decodes with, as flags
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


CARD_CSS = ("body { font: 15px/1.5 system-ui, -apple-system, \"Segoe UI\", sans-serif; margin: 1em auto; max-width: 60em; "
            "padding: 0 1em; color: #1d1d1f; background: #fafafa; } a { color: #1f47b8; } "
            "h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; } "
            ".table { overflow-x: auto; } table { border-collapse: collapse; font-size: .9em; } "
            "th, td { border: 1px solid #c5cbd6; padding: .3em .5em; text-align: left; vertical-align: top; } "
            "th { background: #eef1f7; } code { font-size: .92em; background: #eef1f7; padding: 0 .2em; border-radius: 3px; } "
            "pre { background: #eef1f7; padding: .6em; overflow-x: auto; border-radius: 4px; } pre code { padding: 0; }")
_INLINE = re.compile(r"`([^`]+)`|\*\*(.+?)\*\*|!\[([^\]]*)\]\([^)]*\)|\[([^\]]+)\]\(([^)\s]+)\)")
_LIST = re.compile(r"^(\s*)(?:[-*]|(\d+)\.)\s+(.*)$")


def _inline(text: str) -> str:
    """One line of the card's Markdown as HTML: `code`, **bold**, [links](href) (http(s), anchors, relative
    files); an image's alt text alone; everything else escaped."""
    out, at = [], 0
    for m in _INLINE.finditer(text):
        out.append(html.escape(text[at:m.start()]))
        code, bold, alt, label, href = m.groups()
        if code is not None:
            out.append(f"<code>{html.escape(code)}</code>")
        elif bold is not None:
            out.append(f"<strong>{_inline(bold)}</strong>")
        elif alt is not None:
            out.append(html.escape(alt))
        elif re.match(r"^(https?://|#|[\w./-]+$)", href) and not href.startswith("//"):
            out.append(f'<a href="{html.escape(href)}">{_inline(label)}</a>')
        else:
            out.append(_inline(label))
        at = m.end()
    return "".join(out) + html.escape(text[at:])


def _anchor(title: str) -> str:
    return re.sub(r"[^a-z0-9 -]", "", title.lower().replace("`", "")).strip().replace(" ", "-")


def card_html(card: str) -> str:
    """A model card's Markdown as HTML: the subset cards are written in (YAML front matter, left out; ``#``
    headings with anchors; pipe tables; paragraphs; ``-`` and ``1.`` lists; fenced code). No dependency:
    the cards are the package's own or ``captioner export``'s."""
    lines = card.replace("\r\n", "\n").split("\n")
    if lines and lines[0].strip() == "---" and "---" in (s.strip() for s in lines[1:]):  # metadata for the Hub
        lines = lines[[s.strip() for s in lines].index("---", 1) + 1:]
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
        elif line.startswith("```"):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
            out.append("<pre><code>" + html.escape("\n".join(lines[i + 1:end])) + "</code></pre>")
            i = end + 1
        elif re.match(r"^#{1,6} ", line):
            level, title = len(line.split(" ", 1)[0]), line.split(" ", 1)[1].strip()
            out.append(f'<h{level} id="{_anchor(title)}">{_inline(title)}</h{level}>')
            i += 1
        elif line.lstrip().startswith("|"):
            rows = []
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                rows.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
                i += 1
            rows = [r for r in rows if not all(re.fullmatch(r":?-+:?", c) for c in r)]  # the separator row
            head, *body = rows
            keyed = not any(head)  # an empty header row: a table of names and values, each row's name its header
            cells = "" if keyed else "<thead><tr>" + "".join(f"<th>{_inline(c)}</th>" for c in head) + "</tr></thead>"
            out.append(f'<div class="table"><table>{cells}<tbody>' + "".join(
                "<tr>" + "".join(f'<th scope="row">{_inline(c)}</th>' if keyed and k == 0 else f"<td>{_inline(c)}</td>"
                                 for k, c in enumerate(r)) + "</tr>" for r in body) + "</tbody></table></div>")
        elif _LIST.match(line):
            ordered = _LIST.match(line).group(2) is not None
            items: list[str] = []
            while i < len(lines) and lines[i].strip():
                m = _LIST.match(lines[i])
                if m and not m.group(1):
                    items.append(m.group(3))
                elif items:
                    items[-1] += " " + lines[i].strip()  # a continuation line
                i += 1
            tag = "ol" if ordered else "ul"
            out.append(f"<{tag}>" + "".join(f"<li>{_inline(t)}</li>" for t in items) + f"</{tag}>")
        else:
            text = []
            while (i < len(lines) and lines[i].strip() and not lines[i].startswith(("#", "```", "|"))
                   and not _LIST.match(lines[i])):
                text.append(lines[i].strip())
                i += 1
            out.append(f"<p>{_inline(' '.join(text))}</p>")
    return "\n".join(out)


def render_card_page(name: str, card: str) -> str:
    """The model card page ``/cards/{i}``: ``card`` (Markdown) as HTML under a link back to the page."""
    title = html.escape(name)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{title}: model card</title>'
            f'<link rel="icon" href="data:,"><style>{CARD_CSS}</style></head><body><nav aria-label="back">'
            f'<a href="/">back to the page</a></nav><main>{card_html(card)}</main></body></html>')
