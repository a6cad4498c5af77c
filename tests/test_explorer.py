"""The HTML explorer page: self-contained, data embedded exactly, decoder-agnostic."""

from __future__ import annotations

import base64
import io
import json
import re
from html.parser import HTMLParser

import numpy as np
import pytest
from PIL import Image

from captioner.errors import ConfigError
from captioner.explorer import render_explorer, write_explorer
from captioner.visualize import BLUR_CELLS, AttentionRecord, colormap_lut


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


def _record(words=("a", "dog", "runs"), g=3, all_attention=None, caption=None) -> AttentionRecord:
    rng = np.random.default_rng(1)
    att = rng.random((len(words), g, g)).astype(np.float32)
    return AttentionRecord(caption or " ".join(words), list(words), att, (300, 200), (50, 0, 250, 200), all_attention)


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
