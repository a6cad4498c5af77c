"""The compositional split of the scenes (make-shapes --unseen-pairs K) and its seen/unseen scores."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from captioner.commands import make_shapes as command
from captioner.data.coco import ObjectBox, load_caption_set, load_instances
from captioner.data.shapes import MAX_UNSEEN_PAIRS, held_out_pairs, make_shapes
from captioner.errors import ConfigError, DataError
from captioner.evaluation.attention_metrics import compositional_scores, pair_named
from captioner.text import tokenize


def _pairs(root: Path, split: str) -> list[tuple[str, str]]:
    data = json.loads((root / f"instances_{split}.json").read_text())
    names = {c["id"]: c["name"] for c in data["categories"]}
    return [(a["color"], names[a["category_id"]]) for a in data["annotations"]]


@pytest.fixture(scope="module")
def unseen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("unseen")
    make_shapes(out, images=150, seed=5, image_size=32, unseen_pairs=4)
    return out


def test_held_out_pairs_are_kept_out_of_train_and_val(unseen: Path) -> None:
    held = held_out_pairs(5, 4)
    assert len(set(held)) == 4 and len({c for c, _ in held}) == 4 and len({s for _, s in held}) == 4
    for split in ("train", "val"):
        pairs = _pairs(unseen, split)
        assert pairs and not set(pairs) & set(held), split
    test = _pairs(unseen, "test")
    assert set(test) & set(held)
    data = json.loads((unseen / "instances_test.json").read_text())
    scenes = {}
    for a in data["annotations"]:
        scenes.setdefault(a["image_id"], []).append((a["color"], a["category_id"]))
    with_unseen = sum(any((c, data["categories"][k - 1]["name"]) in held for c, k in objs) for objs in scenes.values())
    assert with_unseen >= len(scenes) // 2  # every other test scene holds one
    for split in ("train", "val", "test"):  # every file names the held-out pairs
        for kind in ("captions", "instances"):
            assert json.loads((unseen / f"{kind}_{split}.json").read_text())["info"]["unseen_pairs"] == [
                list(p) for p in held]
    assert load_instances(unseen, "test").unseen_pairs == held
    # every colour and every shape still occurs in training
    train = _pairs(unseen, "train")
    assert {c for c, _ in held} <= {c for c, _ in train} and {s for _, s in held} <= {s for _, s in train}


def test_without_unseen_pairs_the_files_are_the_usual_ones(tmp_path: Path) -> None:
    make_shapes(tmp_path, images=9, seed=3, image_size=32)
    assert "unseen_pairs" not in json.loads((tmp_path / "instances_test.json").read_text())["info"]
    assert load_instances(tmp_path, "test").unseen_pairs == []
    for bad in (-1, MAX_UNSEEN_PAIRS + 1, True):
        with pytest.raises(ConfigError, match="unseen_pairs must be an integer from 0 to 18"):
            make_shapes(tmp_path, images=9, unseen_pairs=bad)


def test_a_bad_unseen_pairs_entry_is_a_one_line_error(unseen: Path, tmp_path: Path) -> None:
    data = json.loads((unseen / "instances_test.json").read_text())
    data["info"]["unseen_pairs"] = ["red circle"]
    (tmp_path / "instances_test.json").write_text(json.dumps(data))
    with pytest.raises(DataError, match=r"instances_test.json: info.unseen_pairs must be a list of \[colour, shape\]"):
        load_instances(tmp_path, "test")


def test_make_shapes_command_names_the_held_out_pairs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path), "--images", "12", "--image-size", "32", "--unseen-pairs", "2"])
    assert command.run(args) == 0
    held = held_out_pairs(0, 2)
    assert capsys.readouterr().out.strip().endswith("held out of train and val: " +
                                                    ", ".join(f"{c} {s}" for c, s in held))


def test_scores_split_seen_and_unseen_scenes() -> None:
    star = ObjectBox("star", (0, 0, 5, 5), {"color": "purple"})
    triangle = ObjectBox("triangle", (9, 0, 5, 5), {"color": "green"})
    circle = ObjectBox("circle", (0, 0, 5, 5), {"color": "red"})
    assert pair_named(tokenize("a small purple star and a green triangle"), star)
    assert not pair_named(tokenize("a small green star and a purple triangle"), star)
    instances = {1: [star, triangle], 2: [circle], 3: [star]}
    instances = SimpleNamespace(get=instances.get, unseen_pairs=[("purple", "star")])
    images = [SimpleNamespace(image_id=i) for i in (1, 2, 3)]
    results = [SimpleNamespace(words=tokenize(t)) for t in
               ("a large green star to the left of a purple triangle", "a red circle", "a purple star")]
    scores = compositional_scores(results, SimpleNamespace(images=images), instances)
    assert scores["scenes_unseen"] == 2 and scores["scenes_seen"] == 1 and scores["objects_unseen"] == 2
    assert scores["objects_correct_seen"] == 1.0 and scores["objects_correct_unseen"] == 0.5
    assert scores["unseen_pairs_named"] == 0.5  # the star of scene 1 was named green
    assert scores["seen_pairs_named"] == 0.5  # the triangle of scene 1 was named purple; the circle right
    assert compositional_scores(results, SimpleNamespace(images=images), {}) is None


def test_evaluate_reports_seen_and_unseen(unseen: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import torch

    from captioner.checkpoint.store import save_checkpoint
    from captioner.cli import main
    from captioner.config import get_preset
    from captioner.models.model import build_model
    from captioner.text import Vocabulary

    vocab = Vocabulary.build(load_caption_set(unseen, "train").all_captions())
    torch.manual_seed(0)
    model = build_model(get_preset("sat_soft_tiny", **{"model.encoder.image_size": 32}).model, len(vocab))
    save_checkpoint(tmp_path / "m.safetensors", model, vocab)
    assert main(["evaluate", str(tmp_path / "m.safetensors"), "--data", str(unseen), "--split", "test",
                 "--beam", "1", "--max-len", "4", "--no-progress", "--no-meteor", "--no-coco-caption",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"objects correct, scenes with seen pairs only: [\d.]+ \(\d+ scenes\); with an unseen pair: "
                     r"[\d.]+ \(\d+ scenes\)", out)
    corr = json.loads((tmp_path / "metrics_test.json").read_text())["attention_correctness"]
    assert corr["scenes_seen"] + corr["scenes_unseen"] == 15 and corr["scenes_unseen"] >= 8
    assert 0.0 <= corr["unseen_pairs_named"] <= 1.0
