"""evaluate_checkpoint / caption_split / the evaluate command on the tiny shapes set."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from captioner.config import get_preset
from captioner.device import resolve_device
from captioner.errors import ConfigError, DataError, ImageLoadError
from captioner.evaluation import evaluate as ev
from captioner.evaluation.metrics import caption_metrics
from captioner.text import Vocabulary


@pytest.fixture(scope="module")
def checkpoint(tiny_shapes: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An (untrained) tiny SAT checkpoint whose vocabulary covers the shapes captions."""
    from captioner.checkpoint.store import save_checkpoint
    from captioner.data.coco import load_caption_set
    from captioner.models.model import build_model

    vocab = Vocabulary.build(load_caption_set(tiny_shapes, "train").all_captions())
    torch.manual_seed(0)
    model = build_model(get_preset("sat_soft_tiny").model, len(vocab))
    path = tmp_path_factory.mktemp("run") / "best.safetensors"
    save_checkpoint(path, model, vocab)
    return path


def _references(root: Path, split: str) -> dict[int, list[str]]:
    data = json.loads((root / f"captions_{split}.json").read_text())
    refs: dict[int, list[str]] = {}
    for ann in data["annotations"]:
        refs.setdefault(ann["image_id"], []).append(ann["caption"])
    return refs


def test_evaluate_writes_consistent_metrics_and_results(checkpoint: Path, tiny_shapes: Path, tmp_path: Path) -> None:
    report = ev.evaluate_checkpoint(checkpoint, tiny_shapes, split="test", beam_size=2, max_len=8, batch_size=4,
                                    out_dir=tmp_path, progress=False, meteor=False, coco_caption=False)
    metrics_file, results_file = tmp_path / "metrics_test.json", tmp_path / "captions_test_results.json"
    saved = json.loads(metrics_file.read_text())
    rows = json.loads(results_file.read_text())
    refs = _references(tiny_shapes, "test")
    assert sorted(r["image_id"] for r in rows) == sorted(refs) and len(rows) == 6
    assert saved["num_images"] == 6 and saved["num_references"] == sum(len(r) for r in refs.values())
    # the scores are those of the written captions against ALL references of the same image
    expected = caption_metrics([r["caption"] for r in rows], [refs[r["image_id"]] for r in rows], meteor=False)
    for key in ("BLEU-1", "BLEU-4", "CIDEr-D"):
        assert saved[key] == pytest.approx(expected[key]) and 0.0 <= saved[key] <= 10.0
    assert saved["METEOR"] is None and saved["SPICE"] is None
    assert saved["split"] == "test" and saved["beam_size"] == 2 and saved["checkpoint"] == str(checkpoint)
    assert saved["decoding"] == {"beam_size": 2, "max_len": 8}  # what differs from DecodeOptions()
    assert "0-1" in saved["scale"] and "x100" in saved["note"]
    assert saved["paths"] == {"metrics": str(metrics_file), "results": str(results_file)}
    entropy = saved["attention"]["attention_entropy"]
    assert saved["attention"]["uniform_entropy"] == pytest.approx(math.log(16))
    assert entropy is None or 0.0 <= entropy <= math.log(16) + 1e-6
    assert isinstance(saved["attention_correctness"], dict)  # the shapes have boxes
    assert "words_scored" in saved["attention_correctness"]
    forced = saved["reference_attention_correctness"]  # every reference caption's shape words, teacher-forced
    assert forced["captions_scored"] == saved["num_references"] and forced["words_scored"] > 0
    assert 0.0 <= forced["attention_correctness"] <= 1.0 and forced["vocabulary"] == "shapes"
    # the returned extras: per-image results aligned with the images
    assert [r.text for r in report["results"]] == [row["caption"] for row in rows]
    assert [rec.image_id for rec in report["caption_set"].images] == [row["image_id"] for row in rows]
    assert all(r.attention.shape == (len(r.words), 4, 4) for r in report["results"])
    assert {k: v for k, v in report.items() if k not in ("results", "caption_set")} == saved


def test_reference_attention_is_the_decoders_teacher_forced_attention(checkpoint: Path, tiny_shapes: Path) -> None:
    """Each reference, fed after <bos>, gives one map per word: the decoder's own forward on that caption
    alone, whatever else shares the batch; words outside the vocabulary keep their written form."""
    import captioner
    from captioner.data.coco import load_caption_set

    engine = captioner.load(checkpoint, device="cpu")
    cs = load_caption_set(tiny_shapes, "test").subset(range(3))
    cs.captions[cs.images[0].image_id] = ["a zorblax circle", "a big red square"]
    forced = ev.reference_attention(engine, cs, batch_size=2, progress=False)
    assert [len(refs) for refs in forced] == [len(cs.references(r.image_id)) for r in cs.images]
    first = forced[0][0]
    assert first.words == ["a", "zorblax", "circle"] and first.attention.shape == (3, 4, 4)
    torch.testing.assert_close(first.attention.sum((1, 2)), torch.ones(3))
    vocab = engine.vocab
    from PIL import Image

    pixels = engine.transform(Image.open(cs.images[0].path).convert("RGB")).unsqueeze(0)
    with torch.no_grad():
        features, _ = engine.model.encode(pixels)
        alone = engine.model.decoder(features, torch.tensor([[vocab.bos_id, vocab.stoi["a"], vocab.unk_id]])).attention
    torch.testing.assert_close(first.attention, alone[0].reshape(3, 4, 4), atol=1e-5, rtol=1e-4)
    # the reading step: word t takes the map of the step whose input is word t
    reading = ev.reference_attention(engine, cs, batch_size=2, progress=False, reading_step=True)[0][0]
    with torch.no_grad():
        ids = [vocab.bos_id, vocab.stoi["a"], vocab.unk_id, vocab.stoi["circle"]]
        read = engine.model.decoder(features, torch.tensor([ids])).attention
    assert reading.words == first.words
    torch.testing.assert_close(reading.attention, read[0, 1:].reshape(3, 4, 4), atol=1e-5, rtol=1e-4)


def test_reference_attention_can_be_left_out(checkpoint: Path, tiny_shapes: Path, tmp_path: Path) -> None:
    report = ev.evaluate_checkpoint(checkpoint, tiny_shapes, split="test", beam_size=1, max_len=6, out_dir=tmp_path,
                                    progress=False, meteor=False, coco_caption=False, references_attention=False)
    assert report["reference_attention_correctness"] is None and report["attention_correctness"] is not None


def test_reference_correctness_counts_an_images_captions_as_one_unit() -> None:
    from types import SimpleNamespace

    from captioner.data.coco import ObjectBox
    from captioner.evaluation.attention_metrics import reference_correctness

    peak = torch.zeros(4, 4)
    peak[0, 0] = 1.0  # all attention in the top-left cell, where the circle is
    spread = torch.full((4, 4), 1 / 16)
    record = SimpleNamespace(image_id=1, size=lambda: (64, 64))
    refs = [SimpleNamespace(words=["a", "circle"], attention=torch.stack([spread, peak])),
            SimpleNamespace(words=["one", "circle"], attention=torch.stack([spread, spread]))]
    boxes = {1: [ObjectBox("circle", (0, 0, 16, 16))]}
    summary = reference_correctness([refs], SimpleNamespace(images=[record]), boxes,
                                    get_preset("sat_soft_tiny").model.encoder, vocabulary="shapes")
    assert summary["captions_scored"] == 2 and summary["words_scored"] == 2 and summary["images_scored"] == 1
    assert summary["attention_correctness"] == pytest.approx((1.0 + 1 / 16) / 2)
    assert summary["pointing_accuracy"] == pytest.approx(1.0)  # a uniform map's first cell is its argmax
    with pytest.raises(DataError, match="reference captions of 1 images for 2 images"):
        reference_correctness([refs], SimpleNamespace(images=[record, record]), boxes,
                              get_preset("sat_soft_tiny").model.encoder)


def test_scores_use_the_right_references(checkpoint: Path, tiny_shapes: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """An oracle that answers each image with one of its own references scores BLEU 1."""
    from captioner.inference import Caption

    def oracle(engine, caption_set, *args, **kwargs):
        results = [Caption(caption_set.references(r.image_id)[0], [], [], 0.0, (4, 4), torch.zeros(0, 4, 4))
                   for r in caption_set.images]
        return ev.SplitCaptions(caption_set, results, [])

    monkeypatch.setattr(ev, "caption_split", oracle)
    report = ev.evaluate_checkpoint(checkpoint, tiny_shapes, split="val", out_dir=tmp_path, progress=False,
                                    meteor=False, coco_caption=False)
    assert report["BLEU-1"] == pytest.approx(1.0) and report["BLEU-4"] == pytest.approx(1.0)
    assert report["CIDEr-D"] > 1.0


def test_caption_split_is_batch_invariant_and_defaults_next_to_checkpoint(checkpoint: Path, tiny_shapes: Path) -> None:
    from captioner.data.coco import load_caption_set
    from captioner.inference import load

    loaded = load(checkpoint, device="cpu")
    cs = load_caption_set(tiny_shapes, "val")
    part = cs.subset([0, 1, 2, 3, 4])
    one = ev.caption_split(loaded, part, beam_size=1, max_len=5, batch_size=1, progress=False)
    many = ev.caption_split(loaded, part, beam_size=1, max_len=5, batch_size=3, progress=False)
    assert [r.text for r in one.results] == [r.text for r in many.results] and len(one.results) == 5
    report = ev.evaluate_checkpoint(checkpoint, tiny_shapes, split="val", beam_size=1, max_images=2,
                                    progress=False, meteor=False, coco_caption=False)
    assert report["num_images"] == 2 and report["images_listed"] == len(cs)
    assert (checkpoint.parent / "metrics_val.json").is_file()
    assert len(json.loads((checkpoint.parent / "captions_val_results.json").read_text())) == 2


def test_missing_and_unreadable_images(checkpoint: Path, tiny_shapes: Path, tmp_path: Path) -> None:
    from captioner.data.coco import load_caption_set

    root = tmp_path / "shapes"
    shutil.copytree(tiny_shapes, root)
    images = load_caption_set(root, "test").images
    # A file whose header is garbage is caught by check_images before any decoding ...
    images[2].path.write_bytes(b"broken")
    with pytest.raises(DataError, match=rf"1 of 6 image files cannot be read \(e.g. {images[2].file_name}: "):
        ev.evaluate_checkpoint(checkpoint, root, out_dir=tmp_path, progress=False, meteor=False, coco_caption=False)
    shutil.copy(tiny_shapes / "images" / images[2].file_name, images[2].path)
    # ... truncated pixel data (a valid header) is only seen when the image is decoded.
    data = images[3].path.read_bytes()
    images[3].path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ImageLoadError, match=images[3].file_name):
        ev.evaluate_checkpoint(checkpoint, root, out_dir=tmp_path, progress=False, meteor=False, coco_caption=False)
    images[1].path.unlink()
    with pytest.raises(DataError, match=rf"1 of 6 image files are missing \(e.g. {images[1].file_name}\)"):
        ev.evaluate_checkpoint(checkpoint, root, out_dir=tmp_path, progress=False, meteor=False, coco_caption=False)
    report = ev.evaluate_checkpoint(checkpoint, root, out_dir=tmp_path, batch_size=2, progress=False,
                                    skip_missing=True, meteor=False, coco_caption=False)
    assert report["missing_images"] == 1 and report["unreadable_images"] == [images[3].file_name]
    assert report["num_images"] == 4
    ids = [row["image_id"] for row in json.loads((tmp_path / "captions_test_results.json").read_text())]
    assert sorted(ids) == sorted(r.image_id for i, r in enumerate(images) if i not in (1, 3))


def test_bad_inputs_raise_clear_errors(checkpoint: Path, tiny_shapes: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match="unknown split 'nope'"):
        ev.evaluate_checkpoint(checkpoint, tiny_shapes, split="nope", out_dir=tmp_path, progress=False)
    with pytest.raises(ConfigError, match="max_images"):
        ev.evaluate_checkpoint(checkpoint, tiny_shapes, max_images=0, out_dir=tmp_path, progress=False)
    with pytest.raises(ConfigError, match="device='gpu7'"):
        resolve_device("gpu7")


def test_command_prints_table_and_json(checkpoint: Path, tiny_shapes: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    from captioner.cli import main

    base = ["evaluate", str(checkpoint), "--data", str(tiny_shapes), "--beam", "1", "--max-len", "6",
            "--out", str(tmp_path), "--no-progress", "--device", "cpu", "--no-meteor", "--no-coco-caption"]
    assert main(base) == 0
    table = capsys.readouterr().out
    saved = json.loads((tmp_path / "metrics_test.json").read_text())
    assert re.search(rf"\n  BLEU-4 +{saved['BLEU-4']:.4f}\n", table)
    assert re.search(rf"\n  CIDEr-D +{saved['CIDEr-D']:.4f}\n", table)
    assert "0-1 scale" in table and re.search(r"METEOR +unavailable", table)
    assert f"wrote {tmp_path / 'metrics_test.json'}" in table
    assert f"wrote {tmp_path / 'captions_test_results.json'}" in table
    before = (tmp_path / "metrics_test.json").read_bytes()
    assert main(base + ["--json", "--beam", "2"]) == 1  # an earlier evaluation is not replaced silently
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "metrics_test.json: already exists, written by an earlier run (and 1 more)" in err
    assert "choose another --out or pass --force to replace it" in err and (tmp_path / "metrics_test.json").read_bytes() == before
    assert main(base + ["--json", "--force"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["BLEU-4"] == saved["BLEU-4"] and printed["num_images"] == 6
    assert main(base + ["--beam", "0"]) == 2  # refused while parsing
    assert "captioner evaluate: error: argument --beam: must be between 1 and 10000, got 0" in capsys.readouterr().err
    assert main(["evaluate", str(tmp_path / "none.safetensors"), "--data", str(tiny_shapes)]) == 1
    assert "none.safetensors" in capsys.readouterr().err
    assert main(["evaluate", "--help"]) == 0
    assert "captioner evaluate runs/sat/best.safetensors --data data/shapes" in capsys.readouterr().out


def test_command_reports_coco_caption_beside_the_built_in_scores(checkpoint: Path, tiny_shapes: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from captioner.cli import main
    from captioner.evaluation import metrics as cc

    if cc.unavailable_reason() is not None:
        pytest.skip(cc.unavailable_reason())
    argv = ["evaluate", str(checkpoint), "--data", str(tiny_shapes), "--beam", "1", "--max-len", "6",
            "--out", str(tmp_path), "--no-progress", "--device", "cpu", "--no-meteor"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    saved = json.loads((tmp_path / "metrics_test.json").read_text())
    rows = json.loads((tmp_path / "captions_test_results.json").read_text())
    refs = _references(tiny_shapes, "test")
    expected, _ = cc.coco_caption_metrics([r["caption"] for r in rows], [refs[r["image_id"]] for r in rows],
                                          meteor=False)
    assert {k: saved[k] for k in cc.COCO_KEYS} == pytest.approx(expected)
    assert saved["coco/METEOR"] is None and saved["coco_caption_note"].endswith("METEOR off")
    built_in, coco = table.split("built-in scores (captioner's tokeniser):\n")[1].split(f"{cc.LABEL}:\n")
    assert re.search(rf"^  BLEU-4 +{saved['BLEU-4']:.4f}$", built_in, re.M)
    assert re.search(rf"^  BLEU-4 +{saved['coco/BLEU-4']:.4f}$", coco, re.M)
    assert re.search(rf"^  CIDEr-D +{saved['coco/CIDEr-D']:.4f}$", coco, re.M)
    assert f"coco-caption BLEU-4 {saved['coco/BLEU-4']:.4f} is" in coco


def test_without_java_the_built_in_scores_come_with_one_line(checkpoint: Path, tiny_shapes: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from captioner.cli import main
    from captioner.evaluation import metrics as cc

    monkeypatch.setattr(cc, "unavailable_reason", lambda: "needs Java on PATH for the PTB tokeniser")
    assert main(["evaluate", str(checkpoint), "--data", str(tiny_shapes), "--beam", "1", "--max-len", "6",
                 "--out", str(tmp_path), "--no-progress", "--device", "cpu", "--no-meteor"]) == 0
    table = capsys.readouterr().out
    saved = json.loads((tmp_path / "metrics_test.json").read_text())
    assert all(saved[k] is None for k in cc.COCO_KEYS) and saved["BLEU-4"] is not None
    note = "coco-caption scores not computed: needs Java on PATH for the PTB tokeniser"
    assert saved["coco_caption_note"] == note and table.count(note) == 1 and cc.LABEL not in table


def test_format_report_shows_attention_and_skips() -> None:
    from captioner.commands.evaluate import format_report

    report = {"checkpoint": "c.safetensors", "data": "d", "split": "test", "num_images": 4, "num_references": 20,
              "beam_size": 3, "BLEU-1": 0.5, "BLEU-2": 0.4, "BLEU-3": 0.3, "BLEU-4": 0.243, "CIDEr-D": 1.06,
              "METEOR": None, "ROUGE-L": None, "SPICE": None, "missing_images": 1, "unreadable_images": ["x.png"],
              "attention": {"attention_entropy": 1.5, "uniform_entropy": math.log(16)},
              "attention_correctness": {"attention_correctness": 0.41, "uniform_baseline": 0.1, "words_scored": 12,
                                        "pointing_accuracy": 0.75, "objects_correct": 0.5},
              "paths": {"metrics": "m.json", "results": "r.json"}}
    text = format_report(report)
    assert "BLEU-4 0.2430 is 24.3 in a paper's table" in text
    assert re.search(r"METEOR +unavailable", text)
    assert "attention entropy: 1.500 nats (uniform 2.773)" in text
    assert "attention correctness: 0.4100 (uniform baseline 0.1000, 12 words)" in text
    assert "pointing accuracy: 0.7500" in text and "objects correct: 0.5000" in text
    assert "skipped: 1 missing, 1 unreadable images" in text
    report["attention_correctness"] |= {"ratio": 4.1, "ratio_interval": [3.2, 5.05], "images_scored": 9,
                                        "pointing_interval": [0.5, 0.917]}
    text = format_report(report)
    assert ("attention correctness: 0.4100 (uniform baseline 0.1000, 12 words): 4.10x uniform, 95% interval "
            "3.20x-5.05x over the 9 images") in text
    assert "pointing accuracy: 0.7500 (95% interval 0.50-0.92)" in text
    report["attention_correctness"] = {"words_scored": 0, "objects_correct": None, "vocabulary": "categories"}
    assert "no object word was generated (matched against the instances file's category names)" in \
        format_report(report)
    report["attention_correctness"] = None
    assert "attention correctness" not in format_report(report)


def test_evaluate_validation_and_caption_decode_alike(checkpoint: Path, tiny_shapes: Path, tmp_path: Path) -> None:
    """One pipeline, one default: ``evaluate``, training's validation and ``caption`` give the same
    captions for the same images with no decoding option given (``DecodeOptions()``: beam 3)."""
    from captioner.config import Config
    from captioner.data.coco import load_caption_set
    from captioner.data.dataset import CaptionEvalDataset, collate_images, image_loader
    from captioner.inference import load
    from captioner.training.loop import validate

    images = 6
    report = ev.evaluate_checkpoint(checkpoint, tiny_shapes, split="val", max_images=images, out_dir=tmp_path,
                                    progress=False, meteor=False, coco_caption=False)
    evaluated = [r.text for r in report["results"]]
    model = load(checkpoint, device="cpu")
    cs = report["caption_set"]
    captioned = [c.text for c in model.caption([rec.path for rec in cs.images])]
    cfg = Config()  # what a run's validation uses when nothing is set
    loader = torch.utils.data.DataLoader(CaptionEvalDataset(cs, image_loader(cs, model.transform)), batch_size=4,
                                         collate_fn=collate_images)
    shard = validate(model.model, loader, cs, model.vocab, cfg.train.val_beam, cfg.train.val_max_len,
                     torch.device("cpu"), on_features=False, options=cfg.decoding)
    assert len(evaluated) == images and evaluated == captioned == shard["hypotheses"]
    assert report["beam_size"] == 3 and report["max_len"] == 20
    greedy = [c.text for c in model.caption([rec.path for rec in cs.images], beam=1)]
    assert greedy != captioned  # the shared default is beam search, not greedy


def test_ratio_line_known_answer() -> None:
    from captioner.evaluation.evaluate import ratio_line

    summary = {"ratio": 1.5, "ratio_interval": (1.25, 1.75), "pointing_accuracy": 0.5, "words_scored": 40,
               "captions_scored": 12}
    assert ratio_line(summary) == "1.50x uniform [95% 1.25-1.75], pointing 0.50, 40 words of 12 captions"
    assert ratio_line(summary, with_captions=False) == "1.50x uniform [95% 1.25-1.75], pointing 0.50, 40 words"
    assert ratio_line({**summary, "ratio_interval": None}).startswith("1.50x uniform [95% nan-nan]")
