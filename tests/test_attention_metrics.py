"""Attention correctness on hand-made maps and boxes, word -> object mapping, object accuracy."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from captioner.config import EncoderConfig
from captioner.data.coco import ObjectBox
from captioner.errors import DataError
from captioner.evaluation.attention_metrics import (WordScore, WordScores, attention_correctness,
                                                    attention_correctness_for_results, attention_entropy_summary,
                                                    attention_mass, caption_object_accuracy, find_mentions, summarize)
from captioner.text import tokenize

SQUARE = (64, 64)
WHOLE = (0, 0, 64, 64)


def one_hot(g: int, row: int, col: int) -> np.ndarray:
    att = np.zeros((g, g))
    att[row, col] = 1.0
    return att


def test_all_mass_inside_box_scores_one() -> None:
    att = one_hot(4, 1, 2)  # cell covers x in [32, 48), y in [16, 32)
    assert attention_mass(att, [(32, 16, 16, 16)], SQUARE, WHOLE) == pytest.approx(1.0)
    assert attention_mass(att, [(20, 10, 40, 40)], SQUARE, WHOLE) == pytest.approx(1.0)


def test_uniform_attention_scores_the_box_area_share() -> None:
    uniform = np.full((4, 4), 1 / 16)
    assert attention_mass(uniform, [(0, 0, 32, 16)], SQUARE, WHOLE) == pytest.approx(0.125)
    assert attention_mass(uniform, [(10, 5, 20, 30)], SQUARE, WHOLE) == pytest.approx(600 / 4096, abs=1e-3)
    # a non-square image: the box's share of the whole image
    assert attention_mass(np.full((7, 7), 1 / 49), [(0, 0, 50, 20)], (200, 100), (0, 0, 200, 100)) == \
        pytest.approx(1000 / 20000, abs=2e-3)


def test_attention_in_the_wrong_cell_scores_zero() -> None:
    assert attention_mass(one_hot(4, 3, 3), [(0, 0, 16, 16)], SQUARE, WHOLE) == pytest.approx(0.0, abs=1e-9)
    # half the mass inside
    att = (one_hot(4, 0, 0) + one_hot(4, 3, 3)) / 2
    assert attention_mass(att, [(0, 0, 16, 16)], SQUARE, WHOLE) == pytest.approx(0.5)


def test_large_images_are_rasterised_downscaled_with_the_same_shares() -> None:
    att = one_hot(7, 2, 5)
    w, h = 1400, 700  # cells are 200 x 100 pixels
    assert attention_mass(att, [(1000, 200, 200, 100)], (w, h), (0, 0, w, h)) == pytest.approx(1.0, abs=0.02)
    assert attention_mass(att, [(1000, 200, 100, 100)], (w, h), (0, 0, w, h)) == pytest.approx(0.5, abs=0.02)


def test_center_crop_geometry_maps_cells_inside_the_crop() -> None:
    from captioner.data.images import crop_box

    w, h = 100, 50
    view = crop_box(w, h, EncoderConfig(name="tiny", resize="center_crop"))
    assert view == (25, 0, 75, 50)
    att = one_hot(2, 0, 0)  # the top-left quarter of the crop: x in [25, 50), y in [0, 25)
    assert attention_mass(att, [(25, 0, 25, 25)], (w, h), view) == pytest.approx(1.0)
    # the same map read with "stretch" geometry covers x in [0, 50): half of it in that box
    assert attention_mass(att, [(25, 0, 25, 25)], (w, h), (0, 0, w, h)) == pytest.approx(0.5)
    # the encoder never saw the left margin: uniform attention puts nothing there
    assert attention_mass(np.full((2, 2), 0.25), [(0, 0, 25, 50)], (w, h), view) == pytest.approx(0.0)


def test_word_scores_pointing_and_uniform_baseline() -> None:
    words = ["a", "dog", "on", "a", "bench"]
    att = np.stack([np.full((4, 4), 1 / 16), one_hot(4, 0, 0), np.full((4, 4), 1 / 16),
                    np.full((4, 4), 1 / 16), one_hot(4, 0, 0)])
    boxes = [ObjectBox("dog", (0, 0, 16, 16)), ObjectBox("bench", (32, 32, 32, 32))]
    s = attention_correctness(words, torch.tensor(att), boxes, SQUARE, WHOLE, vocabulary="coco")
    assert [(w.word, w.category) for w in s.scored] == [("dog", "dog"), ("bench", "bench")]
    dog, bench = s.scored
    assert (dog.mass, dog.hit, dog.uniform) == (pytest.approx(1.0), True, pytest.approx(1 / 16))
    assert (bench.mass, bench.hit, bench.uniform) == (pytest.approx(0.0), False, pytest.approx(0.25))
    summary = summarize([s])
    assert summary["attention_correctness"] == pytest.approx(0.5)
    assert summary["uniform_baseline"] == pytest.approx((1 / 16 + 0.25) / 2)
    assert summary["ratio"] == pytest.approx(0.5 / ((1 / 16 + 0.25) / 2))
    assert summary["pointing_accuracy"] == pytest.approx(0.5)
    assert (summary["words_scored"], summary["images_scored"], summary["objects_invented"]) == (2, 1, 0)
    assert summary["ratio_interval"] is None and summary["pointing_interval"] is None  # one image: no spread


def _image(masses: list[float], uniforms: list[float], hits: list[bool]) -> WordScores:
    return WordScores(scored=[WordScore(i, "dog", "dog", m, u, h)
                              for i, (m, u, h) in enumerate(zip(masses, uniforms, hits))], mentions=len(masses))


def test_intervals_resample_images_hold_the_estimate_and_narrow_with_more_images() -> None:
    rng = np.random.default_rng(1)
    def images(n: int) -> list[WordScores]:
        return [_image(list(rng.uniform(0.2, 0.8, 2)), [0.25, 0.25], list(rng.random(2) < 0.6)) for _ in range(n)]
    few, many = summarize(images(20)), summarize(images(500))
    for summary in (few, many):
        lo, hi = summary["ratio_interval"]
        assert lo < summary["ratio"] < hi
        lo, hi = summary["pointing_interval"]
        assert 0.0 <= lo < summary["pointing_accuracy"] < hi <= 1.0
    for key in ("ratio_interval", "pointing_interval"):  # 25 times the images: about 5 times narrower
        assert many[key][1] - many[key][0] < (few[key][1] - few[key][0]) / 2.5
    same = images(30)  # a seeded bootstrap: the same scores, the same interval
    assert summarize(same)["ratio_interval"] == summarize(same)["ratio_interval"]


def test_identical_images_give_an_interval_of_one_point() -> None:
    summary = summarize([_image([0.5, 0.3], [0.25, 0.25], [True, False]) for _ in range(5)])
    assert summary["ratio_interval"] == pytest.approx([1.6, 1.6])
    assert summary["pointing_interval"] == pytest.approx([0.5, 0.5])


def test_boxes_sharing_a_category_are_united_and_absent_objects_are_invented() -> None:
    words = ["two", "men", "and", "a", "cat"]
    att = np.zeros((5, 4, 4))
    att[1] = (one_hot(4, 0, 0) + one_hot(4, 3, 3)) / 2  # "men": half on each person
    boxes = [ObjectBox("person", (0, 0, 16, 16)), ObjectBox("person", (48, 48, 16, 16))]
    s = attention_correctness(words, att, boxes, SQUARE, WHOLE, vocabulary="coco")
    assert [w.word for w in s.scored] == ["men"]
    assert s.scored[0].mass == pytest.approx(1.0)
    assert s.scored[0].uniform == pytest.approx(2 / 16)
    assert s.invented == [(4, "cat", "cat")]
    assert summarize([s])["invented_rate"] == pytest.approx(0.5)


@pytest.mark.parametrize("caption, expected", [
    ("two men riding bikes", [("men", "person"), ("bikes", "bicycle")]),
    ("a hot dog next to a dog", [("hot dog", "hot dog"), ("dog", "dog")]),
    ("a hotdog and a teddy bear on a sofa", [("hotdog", "hot dog"), ("teddy bear", "teddy bear"), ("sofa", "couch")]),
    ("people with a cellphone on a motorbike", [("people", "person"), ("cellphone", "cell phone"),
                                                ("motorbike", "motorcycle")]),
    ("a jet above buses and a tv", [("jet", "airplane"), ("buses", "bus"), ("tv", "tv")]),
    ("an orange cat eating an orange", [("cat", "cat"), ("orange", "orange")]),
    ("doughnuts and knives by a laptop", [("doughnuts", "donut"), ("knives", "knife"), ("laptop", "laptop")]),
    ("a man wearing glasses", [("man", "person")]),
])
def test_coco_words_map_plurals_synonyms_and_phrases(caption: str, expected: list[tuple[str, str]]) -> None:
    words = caption.split()
    found = [(" ".join(words[m.noun_start:m.end]), m.category) for m in find_mentions(words, "coco")]
    assert found == expected


def test_hot_dog_scores_both_words_against_the_hot_dog_box() -> None:
    words = ["a", "hot", "dog"]
    att = np.stack([np.full((4, 4), 1 / 16), one_hot(4, 1, 1), one_hot(4, 1, 1)])
    boxes = [ObjectBox("hot dog", (16, 16, 16, 16)), ObjectBox("dog", (48, 48, 16, 16))]
    s = attention_correctness(words, att, boxes, SQUARE, WHOLE, vocabulary="coco")
    assert [(w.word, w.category, w.mass) for w in s.scored] == [("hot", "hot dog", 1.0), ("dog", "hot dog", 1.0)]


def shape_words() -> tuple[str, str, str, str, str]:
    from captioner.data.shapes import COLORS, SHAPES, SIZES

    return str(list(SIZES)[0]), str(list(COLORS)[0]), str(SHAPES[0]), str(list(COLORS)[1]), str(SHAPES[1])


def test_colour_and_size_words_belong_to_the_following_shape() -> None:
    size, red, circle, blue, square = shape_words()
    words = ["a", size, red, circle, "and", "a", blue, square]
    att = np.zeros((len(words), 4, 4))
    att[1:4] = one_hot(4, 0, 0)  # size, colour and noun of the first object look at it
    att[6] = one_hot(4, 0, 0)  # the second object's colour word looks at the wrong place
    att[7] = one_hot(4, 3, 3)
    boxes = [ObjectBox(circle, (0, 0, 16, 16), {"color": red, "size": size}),
             ObjectBox(square, (48, 48, 16, 16), {"color": blue, "size": size})]
    s = attention_correctness(words, att, boxes, SQUARE, WHOLE, vocabulary="shapes")
    assert [(w.word, w.category, round(w.mass, 6)) for w in s.scored] == [
        (size, circle, 1.0), (red, circle, 1.0), (circle, circle, 1.0), (blue, square, 0.0), (square, square, 1.0)]
    m = find_mentions(words, "shapes")
    assert [x.attributes for x in m] == [{"color": red, "size": size}, {"color": blue}]


def test_caption_object_accuracy() -> None:
    size, red, circle, blue, square = shape_words()
    boxes = [ObjectBox(circle, (0, 0, 9, 9), {"color": red}), ObjectBox(square, (20, 20, 9, 9), {"color": blue})]
    assert caption_object_accuracy(f"a {size} {red} {circle} and a {blue} {square}".split(), boxes)
    assert caption_object_accuracy(f"a {blue} {square} above a {red} {circle}".split(), boxes)
    assert not caption_object_accuracy(f"a {blue} {circle} and a {blue} {square}".split(), boxes)  # wrong colour
    assert not caption_object_accuracy(f"a {red} {circle}".split(), boxes)  # misses the square
    assert not caption_object_accuracy(f"a {circle} and a {blue} {square}".split(), boxes)  # no colour
    from captioner.data.shapes import SHAPES

    extra = f"a {red} {circle} and a {blue} {square} and a {red} {SHAPES[2]}".split()
    assert not caption_object_accuracy(extra, boxes)  # invents a third shape


def test_attention_entropy_summary() -> None:
    uniform = SimpleNamespace(words=["a", "b"], attention=torch.full((3, 4, 4), 1 / 16))  # extra <eos> row
    peaked = SimpleNamespace(words=["c"], attention=torch.tensor(one_hot(4, 2, 2))[None])
    out = attention_entropy_summary([uniform, peaked])
    assert out["uniform_entropy"] == pytest.approx(math.log(16))
    assert out["attention_entropy"] == pytest.approx(2 * math.log(16) / 3, abs=1e-6)


def test_bad_attention_shapes_raise_data_errors() -> None:
    with pytest.raises(DataError):
        attention_correctness(["a", "dog"], np.zeros((1, 4, 4)), [], SQUARE, WHOLE, vocabulary="coco")
    with pytest.raises(DataError):
        attention_correctness(["dog"], np.zeros((1, 5)), [], SQUARE, WHOLE, vocabulary="coco")
    with pytest.raises(DataError):
        find_mentions(["dog"], "pascal")


def test_results_on_synthetic_scenes_with_oracle_and_uniform_attention(tiny_shapes) -> None:
    from captioner.data.coco import load_caption_set, load_instances

    cs = load_caption_set(tiny_shapes, "test")
    instances = load_instances(tiny_shapes, "test")
    g = 16  # 4-pixel cells: the cell holding a box centre has its own centre inside the box
    enc = EncoderConfig(name="tiny", grid=g, image_size=64)
    oracle, uniform = [], []
    for rec in cs.images:
        words = tokenize(cs.captions[rec.image_id][0])
        boxes = instances[rec.image_id]
        att = np.full((len(words), g, g), 1 / g**2)
        for m in find_mentions(words, "shapes"):
            (x, y, w, h), = [b.bbox for b in boxes if b.category == m.category]
            cx, cy = (x + w / 2) / rec.width * g, (y + h / 2) / rec.height * g
            att[m.start:m.end] = one_hot(g, int(cy), int(cx))
        oracle.append(SimpleNamespace(words=words, attention=att))
        uniform.append(SimpleNamespace(words=words, attention=np.full((len(words), g, g), 1 / g**2)))
    good = attention_correctness_for_results(oracle, cs, instances, enc)
    base = attention_correctness_for_results(uniform, cs, instances, enc)
    assert good["objects_correct"] == 1.0  # reference captions name every object correctly
    assert good["words_scored"] > len(cs.images)
    assert good["pointing_accuracy"] == 1.0
    assert good["ratio"] > 2.0
    assert base["ratio"] == pytest.approx(1.0)
    assert base["attention_correctness"] == pytest.approx(good["uniform_baseline"])
    with pytest.raises(DataError):
        attention_correctness_for_results(oracle[:-1], cs, instances, enc)


# ----------------------------------------------------------------------------- a foreign COCO-format dataset

FOREIGN = ["circle", "box", "Traffic_Cone"]  # plain words, one a shape, none a COCO category


@pytest.mark.parametrize("caption, expected", [
    ("a circle left of two boxes", [("circle", "circle"), ("boxes", "box")]),
    ("three circles and a box", [("circles", "circle"), ("box", "box")]),
    ("traffic cones near a traffic cone", [("traffic cones", "Traffic_Cone"), ("traffic cone", "Traffic_Cone")]),
    ("a red square and a dog in traffic", []),  # neither a name of the file nor a full phrase
])
def test_a_foreign_files_own_category_names_and_plurals_are_matched(caption: str, expected: list) -> None:
    from captioner.evaluation.attention_metrics import category_table

    words = caption.split()
    table = category_table(FOREIGN)
    found = [(" ".join(words[m.noun_start:m.end]), m.category) for m in find_mentions(words, table)]
    assert found == expected


def test_coco_names_in_a_foreign_file_keep_their_synonyms_but_the_files_names_win() -> None:
    from captioner.evaluation.attention_metrics import category_table

    table = category_table(["Dog", "plant", "potted plant", "box"])
    words = "a puppy and two dogs by a plant and a potted plant".split()
    found = [(" ".join(words[m.noun_start:m.end]), m.category) for m in find_mentions(words, table)]
    assert found == [("puppy", "Dog"), ("dogs", "Dog"), ("plant", "plant"), ("potted plant", "potted plant")]


def test_the_vocabulary_follows_the_declared_categories() -> None:
    from captioner.data.coco import InstanceBoxes
    from captioner.evaluation.attention_metrics import detect_vocabulary

    boxes = {1: [ObjectBox("circle", (0, 0, 8, 8))]}
    assert detect_vocabulary(boxes) == "shapes"
    assert detect_vocabulary(InstanceBoxes(boxes, categories=["circle", "square"])) == "shapes"
    assert detect_vocabulary({1: [ObjectBox("dog", (0, 0, 8, 8))]}) == "coco"
    # the split's boxes are all shapes, but the file also names "box": its own names are used
    table = detect_vocabulary(InstanceBoxes(boxes, categories=["circle", "box"]))
    assert table.name == "categories" and table.phrases[("boxes",)] == "box"


def _write_foreign_dataset(root) -> None:
    """Two images (64 x 64 and 128 x 64) with COCO-format captions and boxes of FOREIGN categories."""
    import json

    images = [{"id": 1, "file_name": "1.png", "width": 64, "height": 64},
              {"id": 2, "file_name": "2.png", "width": 128, "height": 64}]
    captions = [{"id": 1, "image_id": 1, "caption": "A circle left of two boxes."},
                {"id": 2, "image_id": 2, "caption": "A traffic cone and a circle."}]
    boxes = [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [0, 0, 16, 16]},
             {"id": 2, "image_id": 1, "category_id": 2, "bbox": [32, 32, 16, 16]},
             {"id": 3, "image_id": 1, "category_id": 2, "bbox": [48, 48, 16, 16]},
             {"id": 4, "image_id": 2, "category_id": 3, "bbox": [0, 0, 64, 64]}]
    categories = [{"id": i + 1, "name": n} for i, n in enumerate(FOREIGN)]
    (root / "images").mkdir()
    (root / "captions_test.json").write_text(json.dumps({"images": images, "annotations": captions}))
    (root / "instances_test.json").write_text(json.dumps({"images": images, "annotations": boxes,
                                                          "categories": categories}))


def test_attention_correctness_on_a_foreign_coco_format_dataset(tmp_path) -> None:
    """The evaluate path (load_instances -> attention_correctness_for_results) scores the file's names."""
    from captioner.data.coco import load_caption_set, load_instances

    _write_foreign_dataset(tmp_path)
    cs = load_caption_set(tmp_path, "test")
    instances = load_instances(tmp_path, "test")
    assert instances.categories == FOREIGN
    g = 4
    words1 = tokenize("a circle left of two boxes")
    att1 = np.full((len(words1), g, g), 1 / g**2)
    att1[1] = one_hot(g, 3, 3)  # "circle" looks at the far corner: mass 0, a miss
    att1[5] = 0.6 * one_hot(g, 2, 2) + 0.4 * one_hot(g, 0, 3)  # "boxes": 0.6 on the first box
    words2 = tokenize("a traffic cone and a circle")  # cells of image 2 are 32 x 16 pixels
    att2 = np.full((len(words2), g, g), 1 / g**2)
    att2[1] = 0.55 * one_hot(g, 0, 0) + 0.45 * one_hot(g, 3, 3)  # "traffic": 0.55 inside the cone's box
    att2[2] = one_hot(g, 2, 1)  # "cone": x 32..64, y 32..48, inside
    results = [SimpleNamespace(words=words1, attention=torch.tensor(att1)),
               SimpleNamespace(words=words2, attention=att2)]
    out = attention_correctness_for_results(results, cs, instances, EncoderConfig(name="tiny", grid=g))
    assert out["vocabulary"] == "categories"
    assert (out["words_scored"], out["images_scored"], out["objects_invented"]) == (4, 2, 1)  # image 2's circle
    assert out["attention_correctness"] == pytest.approx((0.0 + 0.6 + 0.55 + 1.0) / 4)
    assert out["uniform_baseline"] == pytest.approx((1 / 16 + 2 / 16 + 0.5 + 0.5) / 4)
    assert out["pointing_accuracy"] == pytest.approx(0.75)
    assert out["invented_rate"] == pytest.approx(1 / 4)
    assert out["objects_correct"] is None  # colour-and-shape accuracy is for the synthetic scenes only
    # the bug this fixes: read with the COCO table, not one of these words is an object word
    assert attention_correctness_for_results(results, cs, instances, EncoderConfig(name="tiny", grid=g),
                                             vocabulary="coco")["words_scored"] == 0
