"""Attention overlays: the PNG grid, the GIF and the files written for one captioned image.

Shape legend: L words of a caption, g grid size, (H, W) original image height/width in pixels.

The maps lie on the ORIGINAL image (crop box undone, never squashed), drawn by
:mod:`captioner.viz.heatmaps` in one of its ``STYLES``, each on its own scale. Writers: a PNG grid
(the image with its caption, then one panel per word titled with the word and how it looked), an
animated GIF, the raw attention as JSON, and the HTML explorer.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from captioner.data.images import as_array
from captioner.errors import ConfigError, DataError
from captioner.files import Outputs, safe_name, write_output
from captioner.inference import Caption
from captioner.viz.attention_json import on_image, read_attention_json, write_attention_json
from captioner.viz.explorer import write_explorer
from captioner.viz.heatmaps import (
    BLUR_CELLS,
    DEFAULT_ALPHA,
    DEFAULT_CMAP,
    DEFAULT_STYLE,
    DIM,
    STYLES,
    attention_to_image_map,
    check_style,
    color_scale,
    colormap_lut,
    legend_top,
    overlay_heatmap,
    stats_label,
    style_layer,
    word_scale,
)

__all__ = [
    "BLUR_CELLS", "DEFAULT_ALPHA", "DEFAULT_CMAP", "DEFAULT_STYLE", "DIM", "GIF_BAND", "STYLES", "GridLayout", "as_array",
    "attention_to_image_map", "check_style", "color_scale", "colormap_lut", "grid_layout", "on_image", "overlay_heatmap", "overlay_paths",
    "read_attention_json", "render_gif_frames", "render_grid", "render_labels", "render_panels", "render_tags", "word_overlays", "word_scale", "word_titles", "write_attention_json",
    "write_overlays",
]

log = logging.getLogger(__name__)

BACKGROUND = (255, 255, 255)
TEXT = (20, 20, 20)
FIGURES = (90, 90, 90)  # colour of the figures line under a word
GIF_BAND = 50  # height of the band under each GIF frame (the word, then its figures)


def word_overlays(image: Image.Image, attention: np.ndarray, box: Sequence[float] | None, max_side: int,
                  cmap: str = DEFAULT_CMAP, alpha: float = DEFAULT_ALPHA, scale: tuple[float, float] | None = None,
                  style: str = DEFAULT_STYLE) -> tuple[Image.Image, list[Image.Image]]:
    """The image scaled to fit ``max_side`` and one overlay per word of (L, g, g) ``attention`` at that size.

    ``scale``: (vmin, vmax) for every word; None: each word on its own scale.
    """
    attention = as_array(attention)
    tops = word_scale(attention) if len(attention) else np.zeros(0)
    vranges = [scale if scale is not None else (0.0, float(top)) for top in tops]
    scale_px = max_side / max(image.size)
    size = (max(1, round(image.width * scale_px)), max(1, round(image.height * scale_px)))
    small = image.convert("RGB").resize(size, Image.Resampling.BICUBIC)
    sx, sy = size[0] / image.width, size[1] / image.height
    sbox = None if box is None else (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
    overlays = [
        overlay_heatmap(small, attention_to_image_map(a, size[0], size[1], sbox), cmap, alpha, sbox, vrange, style)
        for a, vrange in zip(attention, vranges)
    ]
    return small, overlays


# ----------------------------------------------------------------------------- drawing
@lru_cache(maxsize=8)
def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, OSError):  # Pillow without FreeType: fixed bitmap font
        return ImageFont.load_default()


def _fit_lines(text: str, font: ImageFont.ImageFont, width: int, max_lines: int) -> list[str]:
    """Greedy word wrap to ``width`` pixels; the last line gets an ellipsis when text is cut."""
    lines: list[str] = []
    for word in text.split() or [""]:
        if lines and font.getlength(lines[-1] + " " + word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        lines[-1] += " \u2026"
    for i, line in enumerate(lines):  # a single very long word is cut too
        while font.getlength(line) > width and len(line) > 1:
            line = line[:-2] + "\u2026"
        lines[i] = line
    return lines


def _draw_centered(draw: ImageDraw.ImageDraw, lines: list[tuple[str, int, tuple[int, int, int]]],
                   box: tuple[int, int, int, int]) -> None:
    """Draw ``(text, font size, colour)`` lines centred in ``box``, one under the other."""
    y = box[1] + (box[3] - box[1] - sum(size + 3 for _, size, _ in lines)) // 2
    for text, size, colour in lines:
        font = _font(size)
        draw.text((box[0] + (box[2] - box[0] - font.getlength(text)) / 2, y), text, fill=colour, font=font)
        y += size + 3


def word_titles(words: Sequence[str], attention: np.ndarray) -> list[tuple[str, str]]:
    """``(word, figures)`` for each word's panel, e.g. ``("dog", "one place · top region 34%")``."""
    return [(word, stats_label(a)) for word, a in zip(words, as_array(attention))]


@dataclass(frozen=True)
class GridLayout:
    """Geometry of the PNG grid: panel 0 is the image with the caption, panel i+1 is word i.

    ``image_size``: (w, h) of each picture (the original's aspect); ``title_height``, ``legend_height``
    and ``text_height`` (a caption band under the panels; 0: none) are band heights; ``pad`` a margin.
    """

    panels: int
    columns: int
    rows: int
    image_size: tuple[int, int]
    title_height: int = 40
    legend_height: int = 30
    pad: int = 6
    text_height: int = 0

    @property
    def cell_size(self) -> tuple[int, int]:
        return self.image_size[0] + 2 * self.pad, self.title_height + self.image_size[1] + 2 * self.pad

    @property
    def canvas_size(self) -> tuple[int, int]:
        cw, ch = self.cell_size
        return self.columns * cw, self.rows * ch + self.text_height + self.legend_height

    def legend_box(self) -> tuple[int, int, int, int]:
        """(left, top, right, bottom) of the legend band, under the last row."""
        width, height = self.canvas_size
        return self.pad, height - self.legend_height, width - self.pad, height

    def text_box(self) -> tuple[int, int, int, int]:
        """(left, top, right, bottom) of the caption band under the panels (empty when ``text_height`` is 0)."""
        width, height = self.canvas_size
        top = height - self.legend_height - self.text_height
        return 2 * self.pad, top, width - 2 * self.pad, top + self.text_height

    def image_box(self, index: int) -> tuple[int, int, int, int]:
        """(left, top, right, bottom) of panel ``index``'s picture on the canvas."""
        cw, ch = self.cell_size
        left = (index % self.columns) * cw + self.pad
        top = (index // self.columns) * ch + self.pad + self.title_height
        return left, top, left + self.image_size[0], top + self.image_size[1]

    def title_box(self, index: int) -> tuple[int, int, int, int]:
        left, top, right, _ = self.image_box(index)
        return left, top - self.title_height, right, top


def grid_layout(num_words: int, image_size: tuple[int, int], panel_side: int = 224, columns: int = 5,
                title_height: int = 40, text_height: int = 0) -> GridLayout:
    """Layout for ``num_words`` word panels plus the image panel; pictures keep the image's aspect."""
    scale = panel_side / max(image_size)
    size = (max(1, round(image_size[0] * scale)), max(1, round(image_size[1] * scale)))
    panels = num_words + 1
    cols = max(1, min(columns, panels))
    return GridLayout(panels=panels, columns=cols, rows=-(-panels // cols), image_size=size,
                      title_height=title_height, text_height=text_height)


def _draw_legend(canvas: Image.Image, box: tuple[int, int, int, int], style: str, cmap: str, alpha: float) -> None:
    """"none [the scale drawn over a light grey] strongest region" in ``box``, as the explorer's legend: each
    panel's map runs from no attention to its own strongest region (the share written over the panel)."""
    draw = ImageDraw.Draw(canvas)
    font = _font(12)
    left, top, right, bottom = box
    words = ("none", legend_top() + " of each map")
    bar_left = left + int(font.getlength(words[0])) + 8
    bar_right = min(right - int(font.getlength(words[1])) - 8, bar_left + 220)
    if bar_right <= bar_left + 8:
        return
    colours, opacity = style_layer(np.linspace(0.0, 1.0, bar_right - bar_left), style, cmap, alpha)
    grey = np.full(colours.shape, 217.0, dtype=np.float32)
    ramp = ((1.0 - opacity[:, None]) * grey + opacity[:, None] * colours).round().astype(np.uint8)
    bar_top, bar_bottom = top + (bottom - top) // 2 - 6, top + (bottom - top) // 2 + 6
    canvas.paste(Image.fromarray(np.repeat(ramp[None], bar_bottom - bar_top, axis=0)), (bar_left, bar_top))
    draw.rectangle((bar_left - 1, bar_top - 1, bar_right, bar_bottom), outline=(170, 170, 170))
    middle = (top + bottom) // 2 - 7
    draw.text((left, middle), words[0], fill=FIGURES, font=font)
    draw.text((bar_right + 8, middle), words[1], fill=FIGURES, font=font)


def render_panels(image: Image.Image, maps: np.ndarray, titles: Sequence[tuple[str, str]], text: str,
                  box: Sequence[float] | None = None, cmap: str = DEFAULT_CMAP, alpha: float = DEFAULT_ALPHA,
                  style: str = DEFAULT_STYLE, scale: tuple[float, float] | None = None, panel_side: int = 224,
                  columns: int = 5, sizes: tuple[int, int, int] = (16, 12, 13), text_below: bool = False,
                  photo_title: str = "") -> Image.Image:
    """The picture, then one panel per (P, g, g) map, each titled with a large line over a small one, and a legend.

    Args:
        titles: ``(large, small)`` lines over each map (:func:`word_titles`).
        text: the caption, over the picture, or with ``text_below`` in a band under the panels.
        scale: (vmin, vmax) of every panel; None: each map's own.
        panel_side, columns, sizes: picture side, panels per row, font sizes (large, small, caption).
        photo_title: the picture's title when the caption is below it.
    """
    maps = as_array(maps)
    if len(titles) != len(maps):
        raise DataError(f"{len(maps)} maps need as many titles, got {len(titles)}")
    big, small_size, text_size = sizes
    title_height = max(40, big + small_size + 12)
    layout = grid_layout(len(maps), image.size, panel_side, columns, title_height)
    if text_below:  # a band as high as the caption's lines (at most three) across the whole width
        left, _, right, _ = layout.text_box()
        text_lines = _fit_lines(text, _font(text_size), right - left, 3)
        layout = dataclasses.replace(layout, text_height=len(text_lines) * (text_size + 3) + 14)
    small, overlays = word_overlays(image, maps, box, max(layout.image_size), cmap, alpha, scale, style)
    canvas = Image.new("RGB", layout.canvas_size, BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    width = layout.image_size[0]
    canvas.paste(small.resize(layout.image_size), layout.image_box(0)[:2])
    if text_below:
        _draw_centered(draw, [(line, text_size, TEXT) for line in text_lines], layout.text_box())
        _draw_centered(draw, [(_fit_lines(photo_title, _font(small_size), width, 1)[0], small_size, FIGURES)],
                       layout.title_box(0))
    else:
        _draw_centered(draw, [(line, text_size, TEXT) for line in _fit_lines(text, _font(text_size), width, 2)],
                       layout.title_box(0))
    for i, (picture, (word, figures)) in enumerate(zip(overlays, titles), start=1):
        canvas.paste(picture.resize(layout.image_size), layout.image_box(i)[:2])
        lines = [(_fit_lines(word, _font(big), width, 1)[0], big, TEXT),
                 (_fit_lines(figures, _font(small_size), width, 1)[0], small_size, FIGURES)]
        _draw_centered(draw, lines, layout.title_box(i))
    _draw_legend(canvas, layout.legend_box(), style, cmap, alpha)
    return canvas


def render_grid(image: Image.Image, caption: Caption, cmap: str = DEFAULT_CMAP, alpha: float = DEFAULT_ALPHA,
                panel_side: int = 224, columns: int = 5, style: str = DEFAULT_STYLE) -> Image.Image:
    """The PNG grid: the image titled with the caption, then one overlay per word titled with its figures."""
    caption = on_image(caption, image)
    attention = caption.attention.numpy()
    return render_panels(image, attention, word_titles(caption.words, attention), caption.text, caption.box, cmap,
                         alpha, style, panel_side=panel_side, columns=columns)


def render_tags(image: Image.Image, caption: Caption, cmap: str = DEFAULT_CMAP, alpha: float = DEFAULT_ALPHA,
                panel_side: int = 224, columns: int = 5, style: str = DEFAULT_STYLE) -> Image.Image | None:
    """The photo's concept tags as :func:`render_grid` draws words; None for a caption without concepts."""
    caption = on_image(caption, image)
    if not caption.concepts:
        return None
    return _render_named_maps(image, caption, "tag", caption.concepts, caption.concept_maps.numpy(), cmap, alpha,
                              panel_side, columns, style)


def render_labels(image: Image.Image, caption: Caption, cmap: str = DEFAULT_CMAP, alpha: float = DEFAULT_ALPHA,
                  panel_side: int = 224, columns: int = 5, style: str = DEFAULT_STYLE) -> Image.Image | None:
    """The words the encoder's ImageNet head sees (``Caption.labels``) as :func:`render_tags` draws tags,
    each panel titled ``label: bear 0.99``; None for a caption without labels."""
    caption = on_image(caption, image)
    if not caption.labels:
        return None
    maps = np.stack([m.numpy() for _, _, m in caption.labels])  # (K, g, g)
    return _render_named_maps(image, caption, "label", [(w, p) for w, p, _ in caption.labels], maps, cmap, alpha,
                              panel_side, columns, style)


def _render_named_maps(image: Image.Image, caption: Caption, kind: str, named: list[tuple[str, float]],
                       maps: np.ndarray, cmap: str, alpha: float, panel_side: int, columns: int,
                       style: str) -> Image.Image:
    """The image titled with the caption, then one panel per ``(word, probability)`` of ``named`` titled
    ``<kind>: word 0.91`` with its map (K, g, g) and figures, each on its own scale."""
    titles = [(f"{kind}: {word} {prob:.2f}", stats_label(m)) for (word, prob), m in zip(named, maps)]
    return render_panels(image, maps, titles, caption.text, caption.box, cmap, alpha, style, panel_side=panel_side,
                         columns=columns)


def render_gif_frames(image: Image.Image, caption: Caption, cmap: str = DEFAULT_CMAP, alpha: float = DEFAULT_ALPHA,
                      max_side: int = 360, style: str = DEFAULT_STYLE) -> list[Image.Image]:
    """One frame per word: the overlay (on the word's own scale) with "i/L word" and the
    word's figures in a band of ``GIF_BAND`` pixels below (the image alone for L = 0)."""
    caption = on_image(caption, image)
    words, attention, box = caption.words, caption.attention.numpy(), caption.box
    small, overlays = word_overlays(image, attention, box, max_side, cmap, alpha, style=style)
    frames = []
    # the counter comes first so that truncation never cuts it: PIL merges identical GIF frames
    labels = [(f"{i + 1}/{len(words)}  {w}", figures) for i, (w, figures) in enumerate(word_titles(words, attention))]
    for picture, (label, figures) in zip(overlays or [small], labels or [("(empty caption)", "")]):
        frame = Image.new("RGB", (picture.width, picture.height + GIF_BAND), BACKGROUND)
        frame.paste(picture, (0, 0))
        lines = [(_fit_lines(label, _font(18), picture.width - 4, 1)[0], 18, TEXT)]
        if figures:
            lines.append((_fit_lines(figures, _font(14), picture.width - 4, 1)[0], 14, FIGURES))
        _draw_centered(ImageDraw.Draw(frame), lines, (0, picture.height, picture.width, picture.height + GIF_BAND))
        frames.append(frame)
    return frames


# ----------------------------------------------------------------------------- all outputs
def check_stem(stem: str, option: str = "stem") -> None:
    """Refuse a file name stem that would leave its folder (``../x``, ``a/b``, ``..``) or is empty."""
    if not isinstance(stem, str) or not stem or safe_name(stem, fallback="") != stem:
        raise ConfigError(f"{option} {stem!r} must be a plain file name (no folder separators or control "
                          "characters, not '.' or '..')")


def overlay_paths(out_dir: str | Path, stem: str = "attention") -> dict[str, Path]:
    """The files :func:`write_overlays` may write: ``{"png", "gif", "json", "html", "tags", "labels"}`` -> path."""
    out = Path(out_dir)
    paths = {kind: out / f"{stem}.{kind}" for kind in ("png", "gif", "json", "html")}
    paths["tags"] = out / f"{stem}_tags.png"
    paths["labels"] = out / f"{stem}_labels.png"
    return paths


def write_overlays(image: Image.Image, caption: Caption, out_dir: str | Path, cmap: str = DEFAULT_CMAP,
                   alpha: float = DEFAULT_ALPHA, stem: str = "attention", layer: int = -1, head: int | None = None,
                   style: str = DEFAULT_STYLE, outputs: Outputs | None = None) -> dict[str, Path]:
    """Write the PNG grid, the GIF, the raw JSON and the HTML explorer of one captioned ORIGINAL image.

    Also ``<stem>_tags.png`` and ``<stem>_labels.png`` for a caption with concepts or labels. ``stem``
    is a plain file name (:func:`check_stem`); ``cmap``, ``alpha``, ``style`` as for ``overlay_heatmap``;
    ``layer``, ``head``: what the explorer shows first; ``outputs``: the command's output folder, whose
    manifest records each file as it is written. Each file is written atomically (``captioner.files``).
    Returns ``{"png", "gif", "json", "html", ...}`` paths.
    """
    colormap_lut(cmap)  # fail early on a bad name
    check_style(style)
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"alpha must be in [0, 1], got {alpha}")
    check_stem(stem)
    image = image.convert("RGB")
    record = on_image(dataclasses.replace(caption, image_size=image.size), image)  # the picture drawn on
    out = Path(out_dir)
    paths = overlay_paths(out, stem)
    tags_path, labels_path = paths.pop("tags"), paths.pop("labels")
    grid = render_grid(image, record, cmap, alpha, style=style)
    frames = [f.quantize(256, method=Image.Quantize.FASTOCTREE)  # ~20x faster than median cut
              for f in render_gif_frames(image, record, cmap, alpha, style=style)]
    tags = render_tags(image, record, cmap, alpha, style=style)
    if tags is not None:
        paths["tags"] = tags_path
    labels = render_labels(image, record, cmap, alpha, style=style)
    if labels is not None:
        paths["labels"] = labels_path
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_output(paths["png"], lambda f: grid.save(f, format="PNG"), outputs, DataError)
        write_output(paths["gif"], lambda f: frames[0].save(f, format="GIF", save_all=True, append_images=frames[1:],
                                                            duration=900, loop=0, disposal=1), outputs, DataError)
        write_attention_json(paths["json"], record, outputs)
        write_explorer(paths["html"], image, record, outputs, cmap=cmap, alpha=alpha, layer=layer, head=head,
                       style=style)
        for kind, picture in (("tags", tags), ("labels", labels)):
            if picture is not None:
                write_output(paths[kind], lambda f, picture=picture: picture.save(f, format="PNG"), outputs, DataError)
    except OSError as exc:
        raise DataError(f"{out}: cannot write overlays ({exc.strerror or exc})") from None
    log.debug("overlays for %r written to %s", record.text, out)
    return paths
