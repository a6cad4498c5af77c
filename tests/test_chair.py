"""CHAIR (Rohrbach et al. 2018): object mentions, CHAIR-s / CHAIR-i / coverage, and `captioner evaluate`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from captioner.checkpoint.store import save_checkpoint
from captioner.cli import main
from captioner.config import get_preset
from captioner.evaluation.chair import CHAIR_SYNONYMS, NOT_OBJECTS, chair_scores, named_objects
from captioner.models.model import build_model
from captioner.text import Vocabulary


@pytest.mark.parametrize("caption, objects", [
    ("A man feeds his dog a hot dog.", ["person", "dog", "hot dog"]),
    ("Two hot dogs on a plate", ["hot dog"]),
    ("a teddy bear sitting on a bed", ["teddy bear", "bed"]),
    ("a brown bear in the grass", ["bear"]),
    ("a baseball player swings his bat", ["person", "baseball bat"]),
    ("kids playing baseball in a field", ["person"]),  # the game: no bat, no glove, no ball
    ("a catcher with his glove", ["person", "baseball glove"]),
    ("an orange cat on the dining table", ["cat", "dining table"]),  # orange before a noun is a colour
    ("an orange next to two apples", ["orange", "apple"]),
    ("a glass of orange juice beside a wine glass", ["wine glass", "wine glass"]),
    ("a woman in sunglasses and glasses", ["person"]),
    ("a train pulls into the train station", ["train"]),
    ("people waiting at the bus stop", ["person"]),
    ("a roll of toilet paper on a toilet", ["toilet"]),
    ("a puppy and two kittens on a sofa", ["dog", "cat", "couch"]),
    ("a bike and a motorbike near a jet", ["bicycle", "motorcycle", "airplane"]),
    ("a tv, a television and a laptop computer", ["tv", "tv", "laptop"]),
    ("doughnuts and a cell phone by the fire hydrant", ["donut", "cell phone", "fire hydrant"]),
    ("a tennis player holds a tennis racket", ["person", "tennis racket"]),
    ("the men and women and children", ["person", "person", "person"]),
    ("two mice and a computer mouse", ["mouse", "mouse"]),
    ("a skier on a ski slope", ["person"]),
    ("", []),
])
def test_named_objects_known_answers(caption, objects):
    assert named_objects(caption) == objects


def test_the_table_covers_the_80_categories_and_its_phrases_are_plain_words():
    assert len(CHAIR_SYNONYMS) == 80 and all(category in phrases for category, phrases in CHAIR_SYNONYMS.items()
                                             if category not in {"sports ball"})
    words = [p for phrases in CHAIR_SYNONYMS.values() for p in phrases] + list(NOT_OBJECTS)
    assert all(re.fullmatch(r"[a-z]+( [a-z]+)*", p) for p in words)
    assert len(words) == len(set(words))  # a phrase names one thing
    for category in CHAIR_SYNONYMS:  # every category's own name (and plural) finds it
        assert named_objects(f"a photo of a {category}") == [category]


def test_chair_known_answers():
    captions = ["a dog on a couch", "a cat", "a man riding a horse next to a dog", "a field of grass"]
    references = [["a cat on a sofa", "a cat sleeping on the couch"], ["a kitten sleeping"],
                  ["a woman on a horse"], ["a cow in a field"]]
    scores = chair_scores(captions, references)
    # mentions: dog, couch | cat | person, horse, dog | (none) -> 6; absent: dog (1st), dog (3rd) -> 2
    assert (scores.mentions, scores.hallucinated, scores.captions) == (6, 2, 4)
    assert scores.chair_s == pytest.approx(2 / 4) and scores.chair_i == pytest.approx(2 / 6)
    # reference objects: {cat, couch}, {cat}, {person, horse}, {cow} -> 6; named: couch, cat, person, horse -> 4
    assert scores.coverage == pytest.approx(4 / 6) and scores.objects_source == "references"
    assert scores.per_image[0] == {"named": ["dog", "couch"], "present": ["cat", "couch"], "absent": ["dog"]}
    # with boxes, a boxed object is present though no reference names it; coverage still counts the references'
    boxed = chair_scores(captions, references, boxes=[["dog", "cat"], [], [], []])
    assert (boxed.hallucinated, boxed.chair_s, boxed.coverage) == (1, 1 / 4, pytest.approx(4 / 6))
    assert boxed.objects_source == "boxes and references"
    assert chair_scores(["a dog"], [["a dog"]], boxes=[["Hund"]], categories={"Hund": "dog"}).per_image[0][
        "present"] == ["dog"]
    empty = chair_scores(["a field"], [["grass"]])
    assert (empty.chair_s, empty.chair_i, empty.coverage) == (0.0, None, None)
    assert empty.as_dict() == {"CHAIR-s": 0.0, "CHAIR-i": None, "coverage": None, "captions": 1, "mentions": 0,
                               "hallucinated": 0, "objects": "references"}
    with pytest.raises(ValueError, match="2 captions, 1 reference lists"):
        chair_scores(["a", "b"], [["a"]])


# ----------------------------------------------------------------------------- in `captioner evaluate`


@pytest.fixture(scope="module")
def dog_set(tmp_path_factory) -> tuple[Path, Path]:
    """A flat COCO folder of three photos with boxes, and a checkpoint whose every caption is "dog" five times."""
    root = tmp_path_factory.mktemp("dogs")
    (root / "images").mkdir()
    rng = np.random.default_rng(0)
    images, annotations, boxes = [], [], []
    references = {1: ["a dog in the grass", "a puppy runs"], 2: ["a cat on a couch", "a kitten"],
                  3: ["a field", "grass and trees"]}
    for image_id, refs in references.items():
        name = f"{image_id}.png"
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(root / "images" / name)
        images.append({"id": image_id, "file_name": name, "width": 32, "height": 32})
        annotations += [{"id": 10 * image_id + k, "image_id": image_id, "caption": c} for k, c in enumerate(refs)]
    boxes = [{"id": 1, "image_id": 3, "category_id": 18, "bbox": [0, 0, 10, 10], "area": 100, "iscrowd": 0}]
    (root / "captions_val.json").write_text(json.dumps({"images": images, "annotations": annotations}))
    (root / "instances_val.json").write_text(json.dumps({"images": images, "annotations": boxes,
                                                         "categories": [{"id": 18, "name": "dog"}]}))
    vocab = Vocabulary(["a", "dog", "on"])
    torch.manual_seed(0)
    model = build_model(get_preset("sat_soft_tiny").model, len(vocab), load_pretrained=False).eval()
    with torch.no_grad():  # the output layer says "dog" and never <eos>, whatever the photo
        out = [m for m in model.decoder.modules() if isinstance(m, torch.nn.Linear) and m.out_features == len(vocab)]
        for layer in out:
            layer.weight.zero_()
            layer.bias.fill_(-30.0)
            layer.bias[vocab.stoi["dog"]] = 10.0
    path = root / "dog.safetensors"
    save_checkpoint(path, model, vocab)
    return root, path


def test_evaluate_reports_chair_in_the_table_and_the_metrics_json(dog_set, tmp_path, capsys):
    root, checkpoint = dog_set
    argv = ["evaluate", str(checkpoint), "--data", str(root), "--split", "val", "--out", str(tmp_path),
            "--no-progress", "--no-meteor", "--no-coco-caption", "--no-reference-attention", "--max-len", "5", "--beam", "1"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    saved = json.loads((tmp_path / "metrics_val.json").read_text())
    chair = saved["chair"]
    # photo 1: dog present (references); photo 2: dog absent (a cat); photo 3: dog present (its box)
    assert json.loads((tmp_path / "captions_val_results.json").read_text())[0]["caption"] == "dog dog dog dog dog"
    assert (chair["CHAIR-s"], chair["CHAIR-i"]) == (pytest.approx(1 / 3), pytest.approx(5 / 15))
    assert chair["coverage"] == pytest.approx(1 / 3)  # of dog, cat, couch (the references' objects)
    assert chair["objects"] == "boxes and references" and (chair["mentions"], chair["hallucinated"]) == (15, 5)
    assert chair["hallucinations"] == [{"image_id": 2, "file_name": "2.png", "caption": "dog dog dog dog dog",
                                        "absent": ["dog"], "present": ["cat", "couch"]}]
    assert "object hallucination (CHAIR, COCO's 80 categories; objects present from the boxes and references):" \
        in table
    assert ("CHAIR-s 33.3% (captions naming an absent object), CHAIR-i 33.3% (5 of 15 object mentions absent), "
            "object coverage 33.3% (of the objects the references name)") in table

