"""Overlay maths and the PNG/GIF/JSON writers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from captioner.config import EncoderConfig
from captioner.data.images import crop_box
from captioner.errors import ConfigError, DataError
from captions import make_caption as caption
from captioner.viz.attention_json import caption_to_dict
from captioner.viz.heatmaps import (DEFAULT_STYLE, HEAT_DIM, UNIFORM_FLOOR, attention_stats, legend_top, map_peaks,
                                    spread_words, word_scale)
from captioner.viz.overlays import (BACKGROUND, DIM, GIF_BAND, attention_to_image_map, color_scale, colormap_lut,
                                    grid_layout, on_image, overlay_heatmap, read_attention_json, render_gif_frames,
                                    render_grid, word_titles, write_overlays)


def corner_attention(g: int = 4, row: int = 0, col: int = 0) -> np.ndarray:
    att = np.zeros((g, g), dtype=np.float32)
    att[row, col] = 1.0
    return att


def photo(width: int = 200, height: int = 100) -> Image.Image:
    """A textured test image (a gradient, so dimming and blending are measurable)."""
    x = np.linspace(60, 200, width, dtype=np.float32)[None, :, None]
    y = np.linspace(0, 40, height, dtype=np.float32)[:, None, None]
    return Image.fromarray(np.broadcast_to(x + y, (height, width, 3)).astype(np.uint8))


@pytest.mark.parametrize("resize", ["stretch", "center_crop"])
def test_top_left_attention_peaks_in_top_left_of_original_image(resize):
    box = crop_box(200, 100, EncoderConfig(name="tiny", resize=resize))
    m = attention_to_image_map(corner_attention(), 200, 100, box)
    assert m.shape == (100, 200)  # (H, W) of the ORIGINAL image, not the encoder's square
    y, x = np.unravel_index(np.argmax(m), m.shape)
    left, top, right, bottom = box
    assert top <= y < top + (bottom - top) / 4 and left <= x < left + (right - left) / 4
    if resize == "center_crop":
        assert box == (50, 0, 150, 100)
        assert m[:, :50].max() == 0 and m[:, 150:].max() == 0  # nothing outside the crop box
    else:  # stretch: a cell is 50 x 25 pixels, the hot blob is twice as wide as it is tall
        half = m > m.max() / 2
        assert np.ptp(np.nonzero(half)[1]) > 1.5 * np.ptp(np.nonzero(half)[0])


def test_mass_preserving_map_is_a_distribution_over_pixels():
    rng = np.random.default_rng(0)
    att = rng.random((5, 5))
    att /= att.sum()
    smooth = attention_to_image_map(att, 160, 90, (35, 0, 125, 90), preserve_mass=True)
    assert smooth.sum() == pytest.approx(1.0, abs=1e-5) and smooth.min() >= 0
    blocks = attention_to_image_map(att, 100, 100, None, smooth=False, preserve_mass=True)
    # without smoothing every 20 x 20 cell holds exactly its weight
    cell_mass = blocks.reshape(5, 20, 5, 20).sum(axis=(1, 3))
    np.testing.assert_allclose(cell_mass, att, atol=1e-6)


def test_uniform_attention_gives_a_flat_map_up_to_the_edges():
    m = attention_to_image_map(np.full((7, 7), 1 / 49), 90, 60, None)
    np.testing.assert_allclose(m, 1 / 49, rtol=1e-5)


def test_bad_attention_shapes_and_boxes_are_rejected():
    with pytest.raises(DataError, match="square"):
        attention_to_image_map(np.zeros((3, 4)), 10, 10)
    with pytest.raises(DataError, match="box"):
        attention_to_image_map(np.zeros((3, 3)), 10, 10, (0, 0, 20, 10))


def test_light_keeps_the_photos_colours_where_the_word_looked_and_darkens_the_rest():
    image = Image.new("RGB", (200, 100), (250, 210, 20))  # a yellow picture: it must stay yellow
    box = (50, 0, 150, 100)
    heat = attention_to_image_map(corner_attention(), 200, 100, box)
    plain = np.asarray(image, dtype=np.float32)
    out = np.asarray(overlay_heatmap(image, heat, alpha=0.75, box=box, style="light"), dtype=np.float32)
    np.testing.assert_allclose(out[:, :50], DIM * plain[:, :50], atol=1.0)
    np.testing.assert_allclose(out[:, 150:], DIM * plain[:, 150:], atol=1.0)
    looked, elsewhere = out[3, 53], out[95, 145]  # the peak cell's corner | a cell the word never looked at
    np.testing.assert_allclose(looked, plain[3, 53], atol=12)  # the photo itself, not a tint
    np.testing.assert_allclose(elsewhere, 0.25 * plain[95, 145], atol=1.5)  # darkened by alpha, same hue
    assert np.allclose(elsewhere / elsewhere.sum(), plain[0, 0] / plain[0, 0].sum(), atol=0.02)
    for style in ("light", "heat"):  # strength 0 draws nothing in either style
        invisible = np.asarray(overlay_heatmap(image, heat, alpha=0.0, box=box, style=style), dtype=np.float32)
        np.testing.assert_allclose(invisible[:, 50:150], plain[:, 50:150], atol=1.0)
    with pytest.raises(ConfigError, match="nope"):
        overlay_heatmap(image, heat, "nope", style="heat")
    with pytest.raises(ConfigError, match="alpha"):
        overlay_heatmap(image, heat, alpha=1.5)
    with pytest.raises(ConfigError, match="light, heat"):
        overlay_heatmap(image, heat, style="jet")


def test_heat_is_transparent_at_its_low_end_and_the_colour_map_at_its_top():
    image = photo()
    heat = attention_to_image_map(corner_attention(), 200, 100)
    plain = np.asarray(image, dtype=np.float32)
    out = np.asarray(overlay_heatmap(image, heat, "viridis", 1.0, style="heat"), dtype=np.float32)
    # weight 0: no colour, the photo shows through, darkened by HEAT_DIM (same hue, not a tint)
    np.testing.assert_allclose(out[95, 195], (1 - HEAT_DIM) * plain[95, 195], atol=1.0)
    top = np.unravel_index(np.argmax(heat), heat.shape)
    np.testing.assert_allclose(out[top], colormap_lut("viridis")[255], atol=1.0)  # the peak: the map's top colour
    assert np.asarray(overlay_heatmap(image, heat), dtype=np.float32)[top].tolist() == \
        pytest.approx(np.asarray(overlay_heatmap(image, heat, style=DEFAULT_STYLE), dtype=np.float32)[top].tolist())
    assert DEFAULT_STYLE == "heat"


# ----------------------------------------------------------------------------- one colour scale per caption


def near_uniform(g: int = 4, wobble: float = 0.05, seed: int = 0) -> np.ndarray:
    """Attention spread over every region, each weight within about +-5% of 1/(g*g)."""
    att = 1 + wobble * np.random.default_rng(seed).uniform(-1, 1, (g, g))
    return (att / att.sum()).astype(np.float32)


def light_level(pixels: np.ndarray, grey: float = 128.0) -> np.ndarray:
    """Position on the scale (0..255) of each pixel of a grey picture drawn in the light style at alpha = 1."""
    return np.asarray(pixels, dtype=np.float64)[..., 0] / grey * 255


def test_color_scale_is_the_captions_highest_upsampled_value_with_a_uniform_floor():
    peaked, flat = corner_attention(4, 1, 2), np.full((4, 4), 1 / 16, dtype=np.float32)
    peak = float(map_peaks(peaked))
    # the peak after upsampling does not depend on the picture's size or aspect
    assert attention_to_image_map(peaked, 300, 120).max() == pytest.approx(peak, rel=0.03)
    assert 0.3 < peak < 1.0  # the blur lowers a one-hot cell's peak
    assert color_scale(np.stack([peaked, flat])) == (0.0, pytest.approx(peak))
    assert color_scale(np.stack([flat, flat])) == (0.0, pytest.approx(UNIFORM_FLOOR / 16))
    assert color_scale(np.zeros((0, 4, 4))) == (0.0, 1.0)
    with pytest.raises(DataError):
        color_scale(np.zeros((2, 3, 4)))


def spread_peak(share: float = 0.42, g: int = 4, row: int = 2, col: int = 1) -> np.ndarray:
    """A spread-out map whose strongest region holds ``share`` of it, the rest even over the other regions."""
    att = np.full((g, g), (1 - share) / (g * g - 1), dtype=np.float32)
    att[row, col] = share
    return att


def test_word_scale_is_each_maps_own_upsampled_peak_with_a_uniform_floor():
    peaked, flat = corner_attention(4, 1, 2), np.full((4, 4), 1 / 16, dtype=np.float32)
    tops = word_scale(np.stack([peaked, flat, spread_peak()]))
    assert tops[0] == pytest.approx(float(map_peaks(peaked)))
    assert tops[1] == pytest.approx(UNIFORM_FLOOR / 16)  # pointing nowhere: not blown up to the top
    assert tops[2] == pytest.approx(float(map_peaks(spread_peak()))) and tops[2] < tops[0]


@pytest.mark.parametrize("style", ["light", "heat"])
def test_a_spread_out_words_strongest_region_reaches_the_top_next_to_a_word_that_points(style):
    """Each word on its own scale: a map with 42% in one region and the rest spread is drawn with that region
    at the top of the scale even beside a word that points with all its attention."""
    image = Image.new("RGB", (128, 128), (128, 128, 128))
    words, att = ["dog", "man"], np.stack([corner_attention(4, 0, 0), spread_peak(0.42, 4, 2, 1)])
    layout = grid_layout(2, image.size)
    grid = np.asarray(render_grid(image, caption(words, att, text="the dog"), alpha=1.0, style=style))
    panels = []
    for i in (1, 2):
        left, top, right, bottom = layout.image_box(i)
        panels.append(grid[top:bottom, left:right].astype(np.float64))
    dog, man = panels
    side = man.shape[0]
    cell = slice(side // 4 * 2 + 8, side // 4 * 3 - 8), slice(side // 4 + 8, side // 2 - 8)  # row 2, column 1
    peak, rest = man[cell], man[: side // 4, side // 2:]  # the strongest region | a corner it hardly looked at
    centre = man[side * 5 // 8, side * 3 // 8]  # the middle of the strongest region
    assert np.abs(centre - dog[2, 2]).max() < 30  # drawn as the pointing word's peak (the top of the scale)
    assert np.abs(peak.mean((0, 1)) - rest.mean((0, 1))).sum() > 120  # and far from the rest
    frames = [np.asarray(f)[:-GIF_BAND].astype(np.float64)
              for f in render_gif_frames(image, caption(words, att), alpha=1.0, max_side=128, style=style)]
    gif_peak, gif_rest = frames[1][72:88, 40:56].mean((0, 1)), frames[1][:28, 72:].mean((0, 1))
    assert np.abs(gif_peak - gif_rest).sum() > 120  # the GIF draws it the same


def test_the_peak_is_distinct_on_a_dark_photo_in_the_default_style():
    """A dark photo (brightness about 20 of 255): the heat style still sets the strongest region apart."""
    rng = np.random.default_rng(1)
    image = Image.fromarray(rng.integers(5, 35, (120, 120, 3)).astype(np.uint8))
    att = spread_peak(0.42, 4, 1, 2)
    out = np.asarray(overlay_heatmap(image, attention_to_image_map(att, 120, 120)), dtype=np.float64).mean(-1)
    inside, outside = out[38:52, 68:82], np.concatenate([out[:20].ravel(), out[100:].ravel()])
    assert inside.mean() > 4 * outside.mean() and inside.mean() - outside.mean() > 80
    assert legend_top(0.42) == "strongest region, 42%" and legend_top(0.042) == "strongest region, 4.2%"


def test_a_caption_that_never_points_is_drawn_at_mid_scale_not_hot():
    image = Image.new("RGB", (64, 64), (128, 128, 128))
    att = np.stack([np.full((4, 4), 1 / 16), np.full((4, 4), 1 / 16)])
    frames = render_gif_frames(image, caption(["a", "b"], att), alpha=1.0, max_side=64, style="light")
    index = light_level(np.asarray(frames[0])[:-GIF_BAND])
    assert np.ptp(index) <= 2.5 and abs(index.mean() - 255 / UNIFORM_FLOOR) <= 3


def test_each_panel_is_titled_with_the_words_peak_share_and_entropy():
    att = np.stack([corner_attention(4, 0, 0), np.full((4, 4), 1 / 16), 0.5 * corner_attention(4, 0, 0)
                    + 0.5 * corner_attention(4, 3, 3)])
    assert word_titles(["dog", "the", "two"], att) == [
        ("dog", "one place \u00b7 top region 100%"), ("the", "all over \u00b7 top region 6.2%"),
        ("two", "one place \u00b7 top region 50%")]
    assert spread_words(2.0, 2.8) == "a few places" and spread_words(0.0, 0.0) == "one place"
    assert attention_stats(att[2]) == (pytest.approx(0.5), pytest.approx(np.log(2)), pytest.approx(np.log(16)))
    assert attention_stats(np.zeros((4, 4))) == (0.0, 0.0, pytest.approx(np.log(16)))
    # the figures are drawn: two panels titled with the same word differ only in the second line
    image = Image.new("RGB", (128, 128), (128, 128, 128))
    layout = grid_layout(2, image.size)
    grid = np.asarray(render_grid(image, caption(["a", "a"], att[:2])))
    titles = []
    for i in (1, 2):
        left, top, right, bottom = layout.title_box(i)
        titles.append(grid[top:bottom, left:right].astype(int))
    half = layout.title_height // 2
    assert (titles[0][:half] == titles[1][:half]).all()  # the word
    assert (titles[0][half:] != titles[1][half:]).any()  # the figures
    assert (titles[0][half:] != 255).any()  # ink under the word


def test_a_coarse_grid_on_a_small_picture_is_blurred_without_crashing():
    """The blur kernel (sigma 0.35 cells) is longer than a 10-px side when g = 2."""
    np.testing.assert_allclose(attention_to_image_map(np.full((2, 2), 0.25), 10, 10), 0.25, rtol=1e-5)
    m = attention_to_image_map(corner_attention(2, 1, 0), 10, 10)
    assert m[7:, :3].mean() > 2 * m[:3, 7:].mean()  # still hottest in the bottom-left cell
    assert color_scale(np.full((3, 1, 1), 1.0)) == (0.0, pytest.approx(2.0))  # g = 1: the floor, 2 x uniform


@pytest.mark.parametrize("style", ["light", "heat"])
def test_the_png_grid_carries_a_legend_of_its_style(style):
    image = Image.new("RGB", (64, 64), (128, 128, 128))
    layout = grid_layout(1, image.size)
    grid = np.asarray(render_grid(image, caption(["dot"], corner_attention()[None]), style=style)).astype(int)
    left, top, right, bottom = layout.legend_box()
    assert bottom == grid.shape[0] and bottom - top == layout.legend_height
    band = grid[top:bottom, left:right]
    row = band[(bottom - top) // 2]
    drawn = np.flatnonzero((row != BACKGROUND).any(-1))
    assert drawn.size > 100, "no legend drawn"
    ramp = row[drawn[0] + 45: drawn[0] + 255]  # inside the bar (220 px after the word "none"), clear of the words
    if style == "light":  # dark where the word did not look, the picture itself (grey 217) where it did
        assert ramp[:5].mean() < 80 and abs(ramp[-30:].mean() - 217) < 30
    else:  # transparent (grey) at the low end, the colour map at the top
        assert ramp[:3].std(axis=-1).mean() < 3 and ramp[-30:].std(axis=-1).mean() > 20


# ----------------------------------------------------------------------------- the photo's concepts in attention.json


def test_attention_json_round_trips_concepts_and_their_maps_and_reads_files_without_them(tmp_path):
    import dataclasses
    import json

    rng = np.random.default_rng(0)
    maps = rng.random((2, 4, 4)).astype(np.float32)
    maps /= maps.sum((1, 2), keepdims=True)
    plain = caption(["a", "dog"], np.stack([corner_attention(), corner_attention(4, 3, 3)]), image_size=(200, 100))
    tagged = dataclasses.replace(plain, concepts=[("dog", 0.9134567), ("grass", 0.25)],
                                 concept_maps=torch.from_numpy(maps))
    paths = write_overlays(photo(), tagged, tmp_path / "tagged")
    back = read_attention_json(paths["json"])
    assert back.concepts == [("dog", 0.913457), ("grass", 0.25)]
    np.testing.assert_allclose(back.concept_maps.numpy(), maps, atol=1e-6)
    assert back.concept_maps.dtype == torch.float32 and back.words == ["a", "dog"]
    assert 'id="tag-1"' in paths["html"].read_text(encoding="utf-8")  # the explorer written beside it has the chips
    with Image.open(paths["tags"]) as tags:  # and a PNG of the tags, as the grid of the words
        assert paths["tags"].name == "attention_tags.png" and tags.size == grid_layout(2, (200, 100)).canvas_size
    assert set(write_overlays(photo(), plain, tmp_path / "plain")) == {"png", "gif", "json", "html"}
    # a file without concepts (a model without them, or one written before they existed) still reads
    old = caption_to_dict(plain)
    assert "concepts" not in old and "concept_maps" not in old
    (tmp_path / "old.json").write_text(json.dumps(old))
    record = read_attention_json(tmp_path / "old.json")
    assert record.concepts is None and record.concept_maps is None and record.words == ["a", "dog"]
    # maps that do not match the concepts are refused in one line
    with pytest.raises(DataError, match="concept_maps must be"):
        on_image(dataclasses.replace(tagged, concept_maps=torch.from_numpy(maps[:1])))
    with pytest.raises(DataError, match="concepts but no concept maps"):
        on_image(dataclasses.replace(tagged, concept_maps=None))
    broken = {**caption_to_dict(tagged), "concept_maps": [[1.0]]}
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    with pytest.raises(DataError, match="broken.json: malformed attention record"):
        read_attention_json(tmp_path / "broken.json")


def test_peak_cell_and_map_overlap_known_answers():
    from captioner.viz.heatmaps import map_overlap, peak_cell

    a, b = corner_attention(4, 1, 2), corner_attention(4, 3, 0)
    assert peak_cell(2 * a) == (1, 2, 1.0)
    assert peak_cell(np.full((4, 4), 1 / 16)) == (0, 0, pytest.approx(1 / 16))
    assert map_overlap(a, 3 * a) == pytest.approx(1.0) and map_overlap(a, b) == 0.0
    assert map_overlap(0.5 * a + 0.5 * b, a) == pytest.approx(0.5)
    assert map_overlap(np.zeros((4, 4)), a) == 0.0
    with pytest.raises(DataError):
        map_overlap(a, np.zeros((3, 3)))
    with pytest.raises(DataError):
        peak_cell(np.zeros((2, 3)))


def test_render_panels_draws_chosen_maps_with_large_titles_and_the_caption_under_them():
    from captioner.viz.overlays import render_panels

    image = Image.new("RGB", (128, 128), (128, 128, 128))
    maps = np.stack([corner_attention(4, 0, 0), corner_attention(4, 3, 3)])
    out = render_panels(image, maps, [("dog", "one place"), ("ball", "one place")], "a dog and a ball", alpha=1.0,
                        style="light",
                        panel_side=100, columns=3, sizes=(30, 15, 20), text_below=True, photo_title="the photo")
    layout = grid_layout(2, image.size, 100, 3, title_height=57)
    assert out.size[0] == layout.canvas_size[0] and out.size[1] > layout.canvas_size[1]  # + the caption band
    pixels = np.asarray(out)
    lit = []
    for i in (1, 2):
        left, top, right, bottom = layout.image_box(i)
        lit.append(light_level(pixels[top:bottom, left:right]))
    assert lit[0][:20, :20].mean() > 200 and lit[0][-20:, -20:].mean() < 60  # each panel its own map
    assert lit[1][-20:, -20:].mean() > 200 and lit[1][:20, :20].mean() < 60
    band = pixels[layout.canvas_size[1] - layout.legend_height: out.size[1] - layout.legend_height]
    assert (band < 100).all(-1).sum() > 100, "no caption drawn under the panels"
    with pytest.raises(DataError, match="2 maps need as many titles"):
        render_panels(image, maps, [("dog", "")], "a dog")


def test_attention_json_round_trips_labels_and_overlays_draw_them(tmp_path):
    import dataclasses

    rng = np.random.default_rng(1)
    maps = rng.random((2, 4, 4)).astype(np.float32)
    maps /= maps.sum((1, 2), keepdims=True)
    plain = caption(["a", "bear"], np.stack([corner_attention(), corner_attention(4, 3, 3)]), image_size=(200, 100))
    labelled = dataclasses.replace(plain, labels=[("bear", 0.9968123, torch.from_numpy(maps[0])),
                                                  ("dog", 0.0003, torch.from_numpy(maps[1]))])
    paths = write_overlays(photo(), labelled, tmp_path / "labelled")
    back = read_attention_json(paths["json"])
    assert [(w, p) for w, p, _ in back.labels] == [("bear", 0.996812), ("dog", 0.0003)]
    np.testing.assert_allclose(np.stack([m.numpy() for _, _, m in back.labels]), maps, atol=1e-6)
    with Image.open(paths["labels"]) as drawn:  # a PNG of the labels, laid out as the grid of the words
        assert paths["labels"].name == "attention_labels.png" and drawn.size == grid_layout(2, (200, 100)).canvas_size
    assert "labels" not in caption_to_dict(plain) and read_attention_json(
        write_overlays(photo(), plain, tmp_path / "plain")["json"]).labels is None
    with pytest.raises(DataError, match=r"the map of label 'dog' must be \(g, g\) = \(4, 4\), got \(2, 8\)"):
        on_image(dataclasses.replace(labelled, labels=[("dog", 0.1, torch.zeros(2, 8))]))
    with pytest.raises(DataError, match=r"labels must be \(word, probability, map\) triples"):
        on_image(dataclasses.replace(labelled, labels=[("dog", 0.1)]))


@pytest.mark.parametrize("photo", ["tennis.jpg", "family_table.jpg"])
def test_the_light_style_lights_the_peak_of_a_dark_photo_and_only_darkens_a_bright_one(photo):
    """A photo at 15% brightness: in the light style the peak region is at least 3x the picture's mean
    brightness (it was darkened with the rest); a photo bright enough is only darkened, never brightened."""
    from captioner.pretrained import PHOTOS
    from captioner.viz.heatmaps import LIT_MAX_GAIN, light_gain

    bright = Image.open(PHOTOS / photo).convert("RGB")
    bright.thumbnail((320, 320))
    dark = Image.fromarray((np.asarray(bright, dtype=np.float64) * 0.15).round().astype(np.uint8))
    assert np.asarray(dark).mean() < 25
    att = spread_peak(0.42, 4, 1, 2)  # the strongest region: row 1, column 2 of 4
    w, h = dark.size
    heat = attention_to_image_map(att, w, h)
    peak = (slice(h // 4 + h // 16, h // 2 - h // 16), slice(w // 2 + w // 16, 3 * w // 4 - w // 16))
    lit = np.asarray(overlay_heatmap(dark, heat, style="light"), dtype=np.float64).mean(-1)
    assert lit[peak].mean() >= 3 * lit.mean(), (lit[peak].mean(), lit.mean())
    assert lit[peak].mean() > 2 * np.asarray(dark, dtype=np.float64).mean(-1)[peak].mean()  # lit up, not only kept
    bright = Image.fromarray(np.minimum(255, np.asarray(bright, dtype=np.float64) * 1.5).round().astype(np.uint8))
    assert 1 < light_gain(dark) <= LIT_MAX_GAIN and light_gain(bright) == 1.0
    kept = np.asarray(overlay_heatmap(bright, heat, style="light"), dtype=np.int16)
    assert (kept <= np.asarray(bright, dtype=np.int16) + 1).all()  # a bright photo: darkened where it did not look
