"""The HTML explorer page: self-contained, data embedded exactly, decoder-agnostic."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import re
from html.parser import HTMLParser

import numpy as np
import pytest
import torch
from PIL import Image

from captions import make_caption
from captioner.errors import ConfigError, DataError
from captioner.inference import Caption
from captioner.viz.explorer import (CONCEPTS_LABEL, LABELS_LABEL, MAX_CONCEPTS, MAX_LABELS, opening_word, render_explorer,
                                    write_explorer)
from captioner.viz.heatmaps import UNIFORM_FLOOR, style_layer
from captioner.viz.overlays import BLUR_CELLS, colormap_lut


class _Collect(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        self._in_script = tag == "script"
        self.urls += [v for k, v in attrs if k in ("src", "href", "action", "data", "poster") and v is not None]

    def handle_data(self, data):
        if self._in_script:
            self.scripts.append(data)

    def handle_endtag(self, tag):
        self._in_script = False


def _record(words=("a", "dog", "runs"), g=3, all_attention=None, caption=None) -> Caption:
    rng = np.random.default_rng(1)
    att = rng.random((len(words), g, g)).astype(np.float32)
    return make_caption(words, att, (50, 0, 250, 200), all_attention, caption, image_size=(300, 200))


def _payload(page: str) -> dict:
    match = re.search(r'<script type="application/json" id="explorer-data">(.*?)</script>', page, re.S)
    assert match, "no embedded data"
    return json.loads(match.group(1))


def test_page_is_self_contained_and_embeds_the_image_and_weights(tmp_path):
    record = _record()
    image = Image.new("RGB", (300, 200), (10, 120, 200))
    path = write_explorer(tmp_path / "x.html", image, record, cmap="viridis", alpha=0.4)
    page = path.read_text(encoding="utf-8")
    parser = _Collect()
    parser.feed(page)
    assert parser.urls and all(u.startswith("data:") for u in parser.urls), parser.urls
    assert not re.search(r"https?://|//cdn|@import|url\(", page)
    assert "<canvas" in page and 'id="caption"' in page
    data = _payload(page)
    assert data["words"] == ["a", "dog", "runs"] and data["grid"] == [3, 3]
    assert data["box"] == [50, 0, 250, 200] and data["image_size"] == [300, 200]
    np.testing.assert_allclose(data["attention"], record.attention, atol=1e-5)
    assert data["lut"] == colormap_lut("viridis").reshape(-1).tolist()
    assert data["alpha"] == 0.4 and data["blur_cells"] == BLUR_CELLS and data["all_attention"] is None
    # the embedded picture decodes to the original image (JPEG, same size)
    src = next(u for u in parser.urls if u.startswith("data:image/jpeg;base64,"))
    embedded = Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1])))
    assert embedded.size == (300, 200)
    assert np.abs(np.asarray(embedded, dtype=int) - (10, 120, 200)).max() < 8


def test_large_images_are_downscaled_for_embedding():
    page = render_explorer(Image.new("RGB", (3000, 1500)), _record(), max_side=600)
    src = re.search(r'src="data:image/jpeg;base64,([^"]+)"', page).group(1)
    assert Image.open(io.BytesIO(base64.b64decode(src))).size == (600, 300)
    assert _payload(page)["image_size"] == [300, 200]  # weights still refer to the original geometry


def test_hostile_caption_text_cannot_break_out_of_the_page():
    evil = "</script><script>alert(1)</script> & <b>"
    page = render_explorer(Image.new("RGB", (30, 20)), _record(caption=evil))
    assert page.count("<script") == 2  # only the data block and the explorer code
    assert _payload(page)["caption"] == evil
    assert "&lt;/script&gt;" in page.split("<body>")[0]  # escaped in <title>


def test_layer_and_head_selectors_only_with_all_attention():
    all_att = np.random.default_rng(0).random((3, 2, 4, 3, 3)).astype(np.float32)
    page = render_explorer(Image.new("RGB", (30, 20)), _record(all_attention=all_att), layer=-1, head=None)
    data = _payload(page)
    assert (data["layers"], data["heads"], data["layer"], data["head"]) == (2, 4, 1, None)
    np.testing.assert_allclose(data["all_attention"], all_att, atol=1e-5)
    data = _payload(render_explorer(Image.new("RGB", (30, 20)), _record(all_attention=all_att), layer=0, head=3))
    assert (data["layer"], data["head"]) == (0, 3)
    with pytest.raises(ConfigError, match="layer 5"):
        render_explorer(Image.new("RGB", (30, 20)), _record(all_attention=all_att), layer=5)
    with pytest.raises(ConfigError, match="head 4"):
        render_explorer(Image.new("RGB", (30, 20)), _record(all_attention=all_att), head=4)


# ----------------------------------------------------------------------------- readable size, one colour scale


def test_small_images_are_upscaled_to_a_readable_size_and_large_ones_bounded():
    from captioner.viz.explorer import MIN_DISPLAY_SIDE, display_size

    def shown(size, **kw):
        record = make_caption(["a"], np.ones((1, 2, 2)) / 4, image_size=size)
        return _payload(render_explorer(Image.new("RGB", size), record, **kw))["display_size"]

    assert MIN_DISPLAY_SIDE >= 384
    assert shown((128, 128)) == [384, 384]  # a 128-px synthetic scene
    assert shown((128, 64)) == [384, 192]  # the aspect is kept
    assert shown((500, 400)) == [500, 400]  # in between: 1:1
    assert shown((3000, 1500)) == [960, 480] and shown((3000, 1500), max_side=600) == [600, 300]
    assert display_size((128, 128), min_side=512) == (512, 512)
    assert display_size((100, 50), min_side=800, max_side=400) == (400, 200)  # the bound wins
    with pytest.raises(ConfigError, match="min_side"):
        display_size((10, 10), min_side=0)
    with pytest.raises(DataError, match="0x10"):
        display_size((0, 10))


def test_the_explorer_opens_on_the_first_tag_word_or_noun_not_on_a():
    assert opening_word("a man in a black jacket rides a bike".split()) == 1
    assert opening_word("two young girls are playing".split()) == 2  # not a number, an adjective or "are"
    assert opening_word("a dog runs on the grass".split(), ["grass", "field"]) == 5  # a tag-word first
    assert opening_word("a dog runs".split(), ["cat"]) == 1  # no tag in the caption: the first noun
    assert opening_word("a picture of a group of people on a beach".split()) == 6  # not the framing nouns
    assert opening_word(["a", "the", "<unk>"]) == 0 and opening_word([]) == 0
    # a model trained on the synthetic scenes opens on the shape, not its colour (any of the scenes' colours)
    from captioner.data.shapes import COLORS, SIZES

    for colour in COLORS:
        for size in SIZES:
            assert opening_word(["a", size, colour, "circle", "to", "the", "left", "of", "a", "star"]) == 3
    record = make_caption(["a", "red", "circle", "below"], np.full((4, 3, 3), 1 / 9, np.float32))
    data = _payload(render_explorer(Image.new("RGB", (30, 20)), record))
    assert data["start"] == 2 and data["floor"] == pytest.approx(UNIFORM_FLOOR / 9)
    assert "scale" not in data  # each map is drawn on its own scale, in the page
    assert _payload(render_explorer(Image.new("RGB", (30, 20)), record, start=3))["start"] == 3
    tagged = _with_concepts(record, [("below", 0.8)], np.full((1, 3, 3), 1 / 9))
    assert _payload(render_explorer(Image.new("RGB", (30, 20)), tagged))["start"] == 3


# The explorer's own JavaScript, run in node with a minimal stand-in for the DOM: the canvas size it
# sets and the colour-map positions it writes for each word. (tests/test_browser.py does the same in
# Chromium when it is installed.)
_HARNESS = r"""
const fs = require("fs");
const page = fs.readFileSync(process.argv[2], "utf8");
const data = page.match(/<script type="application\/json" id="explorer-data">([\s\S]*?)<\/script>/)[1];
const code = page.match(/<script>([\s\S]*?)<\/script>/)[1];
const elements = {}, spans = [], shots = [], moved = { movementX: 2, movementY: 1 };
function element(tag) {
  const el = { tagName: tag.toUpperCase(), dataset: {}, hidden: true, value: "", handlers: {}, children: [],
    complete: true, naturalWidth: 1, style: {}, classList: { toggle() {}, contains() { return false; } },
    addEventListener(type, fn) { this.handlers[type] = fn; }, add(o) { this.children.push(o); },
    setAttribute() {}, focus() {}, getBoundingClientRect() { return { left: 0, right: 0, top: 0, bottom: 0 }; },
    appendChild(c) { if (c.tagName === "BUTTON") spans.push(c); },
    getContext() { return { drawImage(src) { if (src.image) el.last = src.image; }, fillRect() {},
      createImageData(w, h) { return { width: w, height: h, data: new Uint8ClampedArray(4 * w * h) }; },
      putImageData(img) { el.image = img; } }; } };
  return el;
}
global.window = { addEventListener() {} };
window.parent = window;
global.Option = function (text, value) { this.text = text; this.value = value; };
global.document = { body: { dataset: {} }, addEventListener() {}, createTextNode() { return {}; },
  createElement: element,
  getElementById(id) {
    if (!elements[id]) { elements[id] = element(id); if (id === "explorer-data") elements[id].textContent = data; }
    return elements[id];
  } };
function shot() {
  const img = elements.view.last;
  shots.push({ info: elements.info.textContent, summary: elements.summary.textContent, width: img.width, height: img.height,
               rgba: Buffer.from(img.data).toString("base64"), big: elements["shown-word"].textContent,
               shown: document.body.dataset.shown, pinned: document.body.dataset.word,
               legend: elements["legend-top"].textContent, missing: elements.missing.hidden ? null : elements.missing.textContent });
}
eval(code);
for (const args of JSON.parse(process.argv[3])) {
  if (args.style !== undefined) { elements.style.value = args.style; elements.style.handlers.change(); }
  if (args.head !== undefined) { elements.head.value = args.head; elements.head.handlers.input(); }
  if (args.show !== undefined) window.captionerShowWord(args.show[0], args.show[1], args.show[2]);
  else if (args.tag !== undefined) elements["tag-" + args.tag].handlers[args.event || "click"](moved);
  else if (args.label !== undefined) elements["label-" + args.label].handlers[args.event || "click"](moved);
  else spans[args.word].handlers[args.event || "click"](moved);
  shot();
}
console.log(JSON.stringify({ canvas: [elements.view.width, elements.view.height], shots: shots,
                             info: elements.info.textContent, ready: document.body.dataset.ready }));
"""


def _run_in_node(tmp_path, page: str, steps: list[dict]) -> dict:
    import shutil
    import subprocess

    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        pytest.skip("node is not installed")
    (tmp_path / "page.html").write_text(page, encoding="utf-8")
    (tmp_path / "harness.js").write_text(_HARNESS, encoding="utf-8")
    done = subprocess.run([node, str(tmp_path / "harness.js"), str(tmp_path / "page.html"), json.dumps(steps)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _scale_positions(shot: dict, style: str = "heat", cmap: str = "viridis", strength: float = 0.75) -> np.ndarray:
    """Position on the scale (0..255) of each pixel of the layer the script drew over the photo: from its
    opacity in the light style (black, opaque where the word did not look), in the heat style the level whose
    colour and opacity in Python's ``style_layer`` the pixel is (so the script draws what Python draws)."""
    rgba = np.frombuffer(base64.b64decode(shot["rgba"]), dtype=np.uint8).reshape(shot["height"], shot["width"], 4)
    if style == "light":
        assert (rgba[..., :3] == 0).all(), "the light style darkens; it adds no colour"
        return 255 - rgba[..., 3].astype(np.float64) / strength
    colours, opacity = style_layer(np.arange(256) / 255, "heat", cmap, strength)
    table = np.concatenate([colours, 255 * opacity[:, None]], axis=1)  # (256, 4) what each level draws
    flat = rgba.reshape(-1, 4).astype(np.float64)
    levels = np.empty(len(flat), dtype=np.int64)
    for s in range(0, len(flat), 4096):
        dist = np.abs(flat[s:s + 4096, None, :] - table[None]).max(-1)  # (n, 256)
        levels[s:s + 4096] = dist.argmin(-1)
        assert dist.min(-1).max() <= 2, "a pixel that is not a level of the heat style"
    assert (np.abs(table[levels, 3] - flat[:, 3]) <= 1).all()  # transparent at the low end, darker than the photo
    return levels.reshape(rgba.shape[:2]).astype(np.float64)


def test_the_explorer_script_upscales_the_canvas_and_draws_each_map_on_its_own_scale(tmp_path):
    g = 4
    peaked = np.zeros((g, g), dtype=np.float32)
    peaked[0, 0] = 1.0
    spread = 1 + 0.05 * np.random.default_rng(0).uniform(-1, 1, (g, g))
    att = np.stack([peaked, spread / spread.sum()]).astype(np.float32)
    record = make_caption(["dog", "the"], att)
    out = _run_in_node(tmp_path, render_explorer(Image.new("RGB", (128, 128)), record), [{"word": 0}, {"word": 1}])
    assert out["canvas"] == [384, 384]
    dog, the = (_scale_positions(s) for s in out["shots"])
    assert dog.max() >= 249 and dog.min() <= 40  # the strongest region at the top
    # pointing nowhere (each region within 5% of uniform): flat at mid-scale (the floor), not stretched
    assert the.max() - the.min() <= 12 and abs(the.mean() - 255 / UNIFORM_FLOOR) <= 12
    # the legend names its top with the figure the sentence gives
    assert out["shots"][0]["legend"] == "strongest region, 100%"
    share = re.search(r"holds ([0-9.]+)% of its attention", out["shots"][1]["summary"]).group(1)
    assert out["shots"][1]["legend"] == f"strongest region, {share}%" and share.startswith("6.")
    assert "peak 100% at row 1, column 1 \u00b7 H 0.0/2.8 nats" in out["shots"][0]["info"]
    assert "peak 6." in out["shots"][1]["info"] and "H 2.8/2.8" in out["shots"][1]["info"]
    assert out["shots"][0]["summary"] == ("Word 1 of 2 looked mostly at one place; its strongest region holds 100% "
                                          "of its attention.")
    assert "looked all over the picture" in out["shots"][1]["summary"]


def test_the_explorer_script_uses_the_scale_of_the_selected_head(tmp_path):
    g = 3
    all_att = np.zeros((2, 1, 2, g, g), dtype=np.float32)
    all_att[:, 0, 0] = 1 / g**2  # head 1: uniform for every word -> mid-scale, flat
    all_att[:, 0, 1, 1, 1] = 1.0  # head 2: every word points at the centre
    record = make_caption(["a", "b"], all_att[:, -1].mean(1), all_attention=all_att)
    page = render_explorer(Image.new("RGB", (200, 100)), record)
    out = _run_in_node(tmp_path, page, [{"word": 0, "head": "0", "style": "heat"}, {"word": 1, "head": "1"}])
    assert "row 2, column 2" in out["shots"][1]["info"]  # the head chosen is drawn
    assert out["canvas"] == [384, 192]
    uniform, pointing = (_scale_positions(s, "heat") for s in out["shots"])
    assert np.ptp(uniform) <= 1 and abs(uniform.mean() - 127.5) <= 2
    assert pointing.max() >= 250


def test_the_explorer_script_draws_an_empty_caption(tmp_path):
    out = _run_in_node(tmp_path, render_explorer(Image.new("RGB", (64, 64)), make_caption([], np.zeros((0, 3, 3)))), [])
    assert out["ready"] == "1" and out["info"] == "empty caption"


# ----------------------------------------------------------------------------- the photo's tags (concept detectors)


def _with_concepts(record: Caption, concepts, maps) -> Caption:
    return dataclasses.replace(record, concepts=list(concepts), concept_maps=torch.as_tensor(np.asarray(maps, np.float32)))


def _chips(page: str) -> list[tuple[str, str, str]]:
    """(id, word, probability) of each concept chip in the page."""
    return re.findall(r'<button type="button" class="chip" id="(tag-\d+)"[^>]*>([^<]*) <span class="prob">([^<]*)</span>',
                      page)


def test_concept_chips_list_the_photos_tags_under_the_caption_and_only_for_a_model_with_concepts():
    rng = np.random.default_rng(2)
    words = [f"w{k}" for k in range(12)] + ["<b>&co"]
    maps = rng.random((13, 3, 3))
    maps /= maps.sum((1, 2), keepdims=True)
    record = _with_concepts(_record(), [(w, 0.95 - 0.05 * k) for k, w in enumerate(words)], maps)
    page = render_explorer(Image.new("RGB", (30, 20)), record)
    chips = _chips(page)
    assert len(chips) == MAX_CONCEPTS == 10  # at most ten, most probable first
    assert chips[:2] == [("tag-0", "w0", "0.95"), ("tag-1", "w1", "0.90")]
    assert CONCEPTS_LABEL in page and page.index('id="caption"') < page.index('id="concepts"') < page.index("<canvas")
    data = _payload(page)
    assert [c["word"] for c in data["concepts"]] == words[:10]
    np.testing.assert_allclose(data["concept_maps"], maps[:10], atol=1e-5)
    few = render_explorer(Image.new("RGB", (30, 20)), _with_concepts(_record(), [(words[-1], 0.5)], maps[:1]))
    assert _chips(few) == [("tag-0", "&lt;b&gt;&amp;co", "0.50")]  # escaped
    for plain in (_record(), _with_concepts(_record(), [], np.zeros((0, 3, 3)))):  # no concepts: no row
        page = render_explorer(Image.new("RGB", (30, 20)), plain)
        assert _chips(page) == [] and 'id="concepts"' not in page and CONCEPTS_LABEL not in page
        assert _payload(page)["concepts"] is None


def test_the_explorer_script_draws_a_tags_map_as_it_draws_a_words(tmp_path):
    g = 4
    top_left, bottom_right = np.zeros((g, g), np.float32), np.zeros((g, g), np.float32)
    top_left[0, 0] = bottom_right[g - 1, g - 1] = 1.0
    record = _with_concepts(make_caption(["a", "dog"], np.stack([top_left, top_left])),
                            [("dog", 0.913), ("grass", 0.2)], np.stack([bottom_right, top_left]))
    page = render_explorer(Image.new("RGB", (128, 128)), record, style="light")
    steps = [{"word": 1}, {"tag": 0, "event": "mousemove"}, {"tag": 0, "event": "mouseleave"}, {"tag": 0},
             {"tag": 1, "event": "focus"}, {"word": 0, "style": "heat"}, {"tag": 0}]
    out = _run_in_node(tmp_path, page, steps)
    word, hovered, left, pinned, focused, heat_word, heat_tag = out["shots"]
    w, t = _scale_positions(word, "light"), _scale_positions(hovered, "light")
    assert w[:40, :40].mean() > 200 and w[-40:, -40:].mean() < 60  # the word looked top left
    assert t[-40:, -40:].mean() > 200 and t[:40, :40].mean() < 60  # the tag lies bottom right
    assert hovered["big"] == "tag: dog 0.91" and hovered["shown"] == "tag-0" and hovered["pinned"] == "1"
    assert hovered["summary"].startswith("The tag \u201cdog\u201d (probability 0.91) lies mostly in one place")
    assert hovered["info"].startswith("tag 1/2 \u201cdog\u201d: peak 100% at row 4, column 4")
    assert left["big"] == "\u201cdog\u201d" and left["shown"] == "1"  # hover left: back to the pinned word
    assert pinned["pinned"] == "tag-0" and pinned["big"] == "tag: dog 0.91"
    assert focused["shown"] == "tag-1" and focused["pinned"] == "tag-0" and focused["big"] == "tag: grass 0.20"
    assert _scale_positions(heat_tag, "heat")[-40:, -40:].mean() > 200  # the heat style holds for tags
    assert heat_word["big"] == "\u201ca\u201d"


def test_a_word_missing_from_the_caption_is_said_so_and_its_tag_or_nearest_word_shown(tmp_path):
    """What a column of models side by side does with a word another column shows (``captionerShowWord``)."""
    g = 4
    corners = np.zeros((3, g, g), np.float32)
    corners[0, 0, 0] = corners[1, g - 1, g - 1] = corners[2, 0, g - 1] = 1.0  # top left, bottom right, top right
    record = _with_concepts(make_caption(["a", "ball", "field"], corners), [("dog", 0.8)], corners[2:])
    page = render_explorer(Image.new("RGB", (128, 128)), record)
    near_bottom_right = np.zeros((g, g))
    near_bottom_right[g - 1, g - 1], near_bottom_right[0, 0] = 0.7, 0.3
    finer = np.kron(near_bottom_right, np.ones((2, 2))) / 4  # the same map from a model of an 8 x 8 grid
    out = _run_in_node(tmp_path, page, [{"show": ["ball", "word", None]},
                                        {"show": ["cat", "word", near_bottom_right.tolist()]},
                                        {"show": ["dog", "word", near_bottom_right.tolist()]},
                                        {"show": ["cat", "word", finer.tolist()]}])
    same, nearest, tag, across = out["shots"]
    assert {k: across[k] for k in ("shown", "missing")} == {k: nearest[k] for k in ("shown", "missing")}
    assert same["shown"] == "1" and same["missing"] is None  # in the caption: shown, nothing to say
    assert nearest["shown"] == "1" and nearest["big"] == "\u201cball\u201d"  # the map most like the one sent
    assert nearest["missing"].startswith("No \u201ccat\u201d in this caption: its nearest word")
    assert "70% overlap" in nearest["missing"]
    assert tag["shown"] == "tag-0" and tag["big"] == "tag: dog 0.80"  # the photo's tag of that name
    assert tag["missing"] == "No \u201cdog\u201d in this caption: its tag instead."
    assert tag["pinned"] == same["pinned"]  # shown, not pinned: the column's own choice stays


# ----------------------------------------------------------------------------- the labels the encoder sees


def _with_labels(record: Caption, labels, maps) -> Caption:
    return dataclasses.replace(record, labels=[(w, p, torch.as_tensor(np.asarray(m, np.float32)))
                                               for (w, p), m in zip(labels, maps)])


def test_label_chips_list_the_labels_the_encoder_sees_in_their_own_row():
    rng = np.random.default_rng(3)
    maps = rng.random((12, 3, 3))
    maps /= maps.sum((1, 2), keepdims=True)
    names = [f"l{k}" for k in range(11)] + ["<i>"]
    record = _with_labels(_record(), [(w, 0.9 - 0.05 * k) for k, w in enumerate(names)], maps)
    page = render_explorer(Image.new("RGB", (30, 20)), record)
    chips = re.findall(r'<button type="button" class="chip" id="(label-\d+)"[^>]*>([^<]*) <span class="prob">([^<]*)</span>',
                       page)
    assert len(chips) == MAX_LABELS == 10 and chips[:2] == [("label-0", "l0", "0.90"), ("label-1", "l1", "0.85")]
    assert LABELS_LABEL in page and 'aria-labelledby="labels-label"' in page
    assert page.index('id="caption"') < page.index('id="labels"') < page.index("<canvas")
    assert 'id="concepts"' not in page and _chips(page) == []  # no concepts: no row of tags
    data = _payload(page)
    assert [c["word"] for c in data["labels"]] == names[:10] and data["labels"][1]["prob"] == 0.85
    np.testing.assert_allclose(data["label_maps"], maps[:10], atol=1e-5)
    both = _with_concepts(_with_labels(_record(), [("dog", 0.7)], maps[:1]), [("grass", 0.4)], maps[1:2])
    page = render_explorer(Image.new("RGB", (30, 20)), both)  # tags, then labels
    assert page.index('id="concepts"') < page.index('id="labels"') and "to a tag or a label" in page
    plain = render_explorer(Image.new("RGB", (30, 20)), _record())
    assert 'id="labels"' not in plain and LABELS_LABEL not in plain and _payload(plain)["labels"] is None


def test_the_explorer_script_draws_a_labels_map_and_steps_between_words_tags_and_labels(tmp_path):
    g = 4
    corners = np.zeros((3, g, g), np.float32)
    corners[0, 0, 0] = corners[1, g - 1, g - 1] = corners[2, 0, g - 1] = 1.0  # top left, bottom right, top right
    record = _with_labels(make_caption(["a", "dog"], corners[[0, 0]]), [("dog", 0.913), ("ball", 0.05)],
                          corners[[1, 2]])
    page = render_explorer(Image.new("RGB", (128, 128)), _with_concepts(record, [("grass", 0.3)], corners[2:]),
                           style="light")
    steps = [{"word": 1}, {"label": 0, "event": "mousemove"}, {"label": 0, "event": "mouseleave"},
             {"label": 1, "event": "focus"}, {"label": 1}, {"show": ["ball", "word", None]},
             {"show": ["grass", "label", None]}, {"show": ["dog", "label", None]}, {"show": ["cat", "label", None]}]
    out = _run_in_node(tmp_path, page, steps)
    word, hovered, left, focused, pinned, ball, grass, dog, cat = out["shots"]
    w, t = _scale_positions(word, "light"), _scale_positions(hovered, "light")
    assert w[:40, :40].mean() > 200 and w[-40:, -40:].mean() < 60  # the word looked top left
    assert t[-40:, -40:].mean() > 200 and t[:40, :40].mean() < 60  # the label "dog" lies bottom right
    assert hovered["big"] == "label: dog 0.91" and hovered["shown"] == "label-0" and hovered["pinned"] == "1"
    assert hovered["summary"].startswith("The label \u201cdog\u201d (probability 0.91) lies mostly in one place")
    assert hovered["info"].startswith("label 1/2 \u201cdog\u201d: peak 100% at row 4, column 4")
    assert left["shown"] == "1" and focused["shown"] == "label-1" and focused["big"] == "label: ball 0.05"
    assert pinned["pinned"] == "label-1" and _scale_positions(pinned, "light")[:40, -40:].mean() > 200
    # what another column shows: a word this caption lacks but a label has, a label this photo lacks
    assert ball["shown"] == "label-1" and ball["missing"] == "No \u201cball\u201d in this caption: its label instead."
    assert grass["shown"] == "tag-0" and grass["missing"] == "No \u201cgrass\u201d among this photo's labels: its tag instead."
    assert dog["shown"] == "label-0" and dog["missing"] is None  # its own label of that name
    assert cat["missing"] == "No \u201ccat\u201d among this photo's labels." and cat["shown"] == "label-1"
