"""Every size priced before anything is allocated; every input read before any model loads; a dataset's
image files stay inside it.

A size option whose memory passes what the machine has is one line naming the options to lower
(``captioner lm --hidden``, ``captioner concepts --hidden/--concepts``); a batch of photos larger than
memory allows (``--batch-size 4096``) is read and encoded in parts, with the same captions. A missing
input is named before a model is read. A caption file that names an image outside its image folder
(``..``, an absolute path) is refused in one line naming the file and the entry, unless asked for.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

import captioner
import captioner.device
import captioner.inference
from captioner.cli import main
from captioner.commands.concepts import head_bytes
from captioner.commands.lm import training_bytes
from captioner.data.coco import load_caption_set
from captioner.errors import DataError

GIB = 1 << 30


@pytest.fixture()
def memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine has 16 GiB available, whatever it really has."""
    monkeypatch.setattr(captioner.device, "available_memory", lambda: 16 * GIB)


@pytest.fixture()
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading a model fails the test: what is checked must be checked before."""
    def refuse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a model was loaded before the inputs were checked")

    import captioner.checkpoint.store as store

    monkeypatch.setattr(captioner.inference, "load", refuse)
    monkeypatch.setattr(store, "read_file", refuse)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, untrained_checkpoint) -> Path:
    return untrained_checkpoint(tmp_path_factory.mktemp("tiny"), "sat_soft_tiny")


def _err(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.strip()


# --- sizes ---

def test_the_language_models_price_counts_its_parameters() -> None:
    from captioner.language import CaptionLanguageModel, LanguageModelConfig

    for vocab, embed, hidden in ((3301, 256, 512), (50, 8, 16)):
        with torch.device("meta"):
            params = sum(p.numel() for p in CaptionLanguageModel(LanguageModelConfig(vocab, embed, hidden)).parameters())
        assert training_bytes(vocab, embed, hidden, 0, 20) == 4 * 5 * params
    assert training_bytes(3301, 256, 65536, 128, 20) > 300 * GIB  # the case that asked for 68 GB and crashed
    assert training_bytes(3301, 256, 512, 128, 20) < GIB  # the default trains anywhere


@pytest.mark.parametrize("hidden, gib", [(65536, "333.3"), (20000, "33.9")])
def test_lm_refuses_a_hidden_size_beyond_memory_before_reading_a_model(hidden, gib, tmp_path, memory, capsys,
                                                                       monkeypatch) -> None:
    captions = tmp_path / "captions.json"
    captions.write_text(json.dumps({"annotations": [{"image_id": 1, "caption": "a dog runs"}] * 3}))
    argv = ["lm", "--captions", str(captions), "--out", str(tmp_path / "lm.safetensors"), "--hidden", str(hidden)]
    monkeypatch.setattr(captioner.inference, "load", lambda *a, **k: pytest.fail("the captioner's weights loaded"))
    assert main(argv) == 1
    assert _err(capsys) == (f"captioner lm: error: a language model with --hidden {hidden}, --embed 256 and "
                            f"--batch-size 128 over 3301 words would need about {gib} GiB of memory, more than this "
                            "machine has available now (16.0 GiB); lower --hidden, --embed or --batch-size")
    assert not (tmp_path / "lm.safetensors").exists()


def test_lm_names_a_missing_caption_file_before_any_model(tmp_path, no_model, capsys) -> None:
    assert main(["lm", "--captions", str(tmp_path / "nope.json"), "--out", str(tmp_path / "lm.safetensors")]) == 1
    assert _err(capsys) == f"captioner lm: error: {tmp_path / 'nope.json'}: caption file not found (--captions)"


def test_concepts_refuses_a_head_beyond_memory(tmp_path, memory, capsys) -> None:
    assert head_bytes(1280, 49, 0, 1000) == 4 * (5 * (1280 * 1000 + 1000) + 3 * 256 * 49 * 1000)
    argv = ["concepts", "--preset", "sat_soft_tiny", "--data", str(tmp_path), "--out", str(tmp_path / "c.safetensors"),
            "--hidden", "65536", "--concepts", "100000"]
    assert main(argv) == 1
    err = _err(capsys)
    assert err.startswith("captioner concepts: error: a concept head with --hidden 65536 and --concepts 100000 over ")
    assert err.endswith("more than this machine has available now (16.0 GiB); lower --hidden or --concepts")


def test_a_batch_beyond_memory_is_encoded_in_parts_with_the_same_captions(tiny, tmp_path, monkeypatch) -> None:
    photos = []
    for i in range(5):
        photos.append(tmp_path / f"{i}.png")
        Image.new("RGB", (40, 30), (40 * i, 90, 200 - 30 * i)).save(photos[-1])
    model = captioner.load(tiny, device="cpu")
    alone = [c.text for c in model.caption(photos, batch_size=1, max_len=4)]
    side = model.transform.size
    monkeypatch.setattr(captioner.inference, "STREAM_BYTES", 2 * 3 * side * side * 4 * 18)  # two photos' worth
    assert model.stream_chunk(4096) == 2 and model.stream_chunk(1) == 1
    seen = []
    encode = model.model.encode
    monkeypatch.setattr(model.model, "encode", lambda pixels: seen.append(len(pixels)) or encode(pixels))
    assert [c.text for c in model.caption(photos, batch_size=4096, max_len=4)] == alone
    assert seen == [2, 2, 1]


def test_the_shipped_encoders_batch_is_priced() -> None:
    """EfficientNet-Lite0 at 224 px: 4096 photos at once asked for 3.2 GB in one tensor; now 99 at a time."""
    class Engine:
        transform = type("T", (), {"size": 224})()

    assert captioner.inference.Captioner.stream_chunk(Engine(), 4096) == 99
    assert captioner.inference.Captioner.stream_chunk(Engine(), 8) == 8


# --- inputs before models ---

def test_attend_and_caption_name_a_missing_photo_before_any_model(tmp_path, no_model, capsys) -> None:
    missing = tmp_path / "nope.jpg"
    assert main(["attend", str(missing), "--out", str(tmp_path / "o")]) == 1
    assert _err(capsys) == f"captioner attend: error: {missing}: file not found"
    assert main(["caption", str(missing)]) == 1
    assert _err(capsys) == f"captioner caption: error: {missing}: file not found"


def test_evaluate_and_distill_read_the_dataset_before_any_model(tmp_path, tiny, monkeypatch, capsys) -> None:
    monkeypatch.setattr(captioner.inference, "load", lambda *a, **k: pytest.fail("a model loaded first"))
    import captioner.evaluation.evaluate as evaluate
    import captioner.training.distill as distill

    monkeypatch.setattr(evaluate, "load", lambda *a, **k: pytest.fail("a model loaded first"))
    monkeypatch.setattr(distill, "load", lambda *a, **k: pytest.fail("a model loaded first"))
    absent = tmp_path / "absent"
    assert main(["evaluate", str(tiny), "--data", str(absent), "--out", str(tmp_path / "e")]) == 1
    assert _err(capsys) == f"captioner evaluate: error: {absent}: dataset path does not exist"
    assert main(["distill", "words", str(tiny), "--data", str(absent), "--out", str(tmp_path / "w.safetensors")]) == 1
    assert _err(capsys) == f"captioner distill: error: {absent}: dataset path does not exist"


# --- a dataset's files stay inside it ---

@pytest.fixture()
def dataset(tmp_path: Path) -> Path:
    from captioner.data.shapes import make_shapes

    make_shapes(tmp_path / "d", images=12, image_size=32)
    return tmp_path / "d"


def _rename_first(dataset: Path, name: str) -> None:
    path = dataset / "captions_train.json"
    data = json.loads(path.read_text())
    data["images"][0]["file_name"] = name
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("name, how", [("../../../../../etc/passwd", "it leaves the folder"),
                                       ("/etc/passwd", "an absolute path"),
                                       ("../captions_train.json", "it leaves the folder")])
def test_a_file_name_that_leaves_the_image_folder_is_refused(dataset, name, how) -> None:
    _rename_first(dataset, name)
    image_id = json.loads((dataset / "captions_train.json").read_text())["images"][0]["id"]
    with pytest.raises(DataError) as info:
        load_caption_set(dataset, "train")
    assert str(info.value) == (f"{dataset / 'captions_train.json'}: image {image_id}'s file {name!r} is outside the "
                               f"dataset's image folder {dataset / 'images'} ({how}); it is not read unless allowed "
                               "(data.files_outside=true; evaluate: --files-outside)")
    cs = load_caption_set(dataset, "train", files_outside=True)  # asked for: read where it points
    assert str(cs.images[0].path).endswith(name.lstrip("/"))


def test_a_name_that_stays_inside_is_read(dataset) -> None:
    _rename_first(dataset, "sub/../00001.png")
    assert load_caption_set(dataset, "train").images[0].file_name == "sub/../00001.png"


def test_a_karpathy_filepath_that_leaves_is_refused(tmp_path) -> None:
    images = tmp_path / "k" / "images"
    images.mkdir(parents=True)
    split = {"images": [{"filename": "passwd", "filepath": "../../../../etc", "imgid": 0, "split": "train",
                         "sentences": [{"raw": "a file", "tokens": ["a", "file"]}]}], "dataset": "coco"}
    (tmp_path / "k" / "dataset_coco.json").write_text(json.dumps(split))
    with pytest.raises(DataError, match=r"dataset_coco\.json: image 0's file 'passwd' is outside the dataset's image "
                                        r"folder .* \(it leaves the folder\)"):
        load_caption_set(tmp_path / "k" / "dataset_coco.json", "train", tmp_path / "k" / "images")


def test_train_and_evaluate_refuse_such_a_dataset_in_one_line(dataset, tiny, tmp_path, capsys) -> None:
    _rename_first(dataset, "/etc/passwd")
    assert main(["evaluate", str(tiny), "--data", str(dataset), "--split", "train", "--out", str(tmp_path / "e")]) == 1
    assert "is outside the dataset's image folder" in _err(capsys)
    assert main(["train", "--preset", "sat_soft_tiny", "--data", str(dataset), "--out", str(tmp_path / "run"),
                 "--epochs", "1"]) == 1
    assert "is outside the dataset's image folder" in _err(capsys)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").glob("*.safetensors"))


def test_train_prices_the_model_and_the_batch_before_the_first_write(dataset, tmp_path, memory, capsys) -> None:
    out = tmp_path / "run"
    argv = ["train", "--preset", "sat_soft_tiny", "--data", str(dataset), "--out", str(out), "--epochs", "1"]
    assert main(argv + ["--set", "model.decoder.hidden_dim=30000"]) == 1
    err = _err(capsys)
    assert err.startswith("captioner train: error: training with train.batch_size 8 (8 per process), ")
    assert err.endswith("more than this machine has available now (16.0 GiB); lower train.batch_size (--batch-size) "
                        "or the model's widths")
    assert not out.exists()  # refused before the run folder was made


def test_a_batch_is_priced_at_most_at_the_captions_the_split_has(memory) -> None:
    from captioner.config import get_preset
    from captioner.training.loop import check_training_memory

    cfg = get_preset("sat_soft_tiny", **{"train.batch_size": 10**6})
    check_training_memory(cfg, 40, torch.device("cpu"), captions=50)  # no batch holds more than 50 captions
    with pytest.raises(captioner.errors.ConfigError, match=r"train\.batch_size 1000000 \(1000000 per process\)"):
        check_training_memory(cfg, 40, torch.device("cpu"), captions=10**7)
