"""The inference API (``captioner.load`` + ``Captioner.caption``) and the one device resolver."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import captioner
from captioner.data.images import load_image
from captioner.device import resolve_device
from captioner.errors import CheckpointError, ConfigError, DataError, ImageLoadError
from captioner.inference import Caption, Captioner, load
from captioner.viz.overlays import read_attention_json


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, untrained_checkpoint) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    paths = {name: untrained_checkpoint(root, name) for name in ("sat_soft_tiny", "transformer_tiny")}
    crop = tmp_path_factory.mktemp("crop")
    paths["center_crop"] = untrained_checkpoint(crop, "transformer_tiny", **{"model.encoder.resize": "center_crop"})
    return paths


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(1)
    Image.fromarray(rng.integers(0, 255, (48, 96, 3), dtype=np.uint8)).save(folder / "wide.png")
    Image.fromarray(rng.integers(0, 255, (80, 40, 3), dtype=np.uint8)).save(folder / "tall.png")
    (folder / "broken.jpg").write_bytes(b"not a jpeg")
    return folder


def _greedy(model: Captioner, path: Path, max_len: int) -> list[int]:
    """Greedy decoding written out by hand against init_state/step: argmax of the allowed words."""
    vocab, net = model.vocab, model.model
    x = model.transform(load_image(path)).unsqueeze(0)  # (1, 3, S, S)
    with torch.no_grad():
        features, _ = net.encode(x)  # (1, N, D)
        state = net.decoder.init_state(features)
        prev, tokens = torch.tensor([vocab.bos_id]), []
        for _ in range(max_len):
            log_probs, state, _ = net.decoder.step(prev, state)  # (1, V)
            log_probs[:, [vocab.pad_id, vocab.bos_id, vocab.unk_id]] = float("-inf")
            prev = log_probs.argmax(-1)  # (1,)
            if int(prev) == vocab.eos_id:
                break
            tokens.append(int(prev))
    return tokens


@pytest.mark.parametrize("preset", ["sat_soft_tiny", "transformer_tiny"])
def test_path_image_and_tensor_give_the_same_caption(checkpoints, photos, preset, untrained_checkpoint):
    model = load(checkpoints[preset], device="cpu")
    path = photos / "wide.png"
    image = load_image(path)
    tensor = model.transform(image)  # (3, S, S)
    results = model.caption([path, str(path), image, tensor], max_len=5)
    assert all(isinstance(r, Caption) for r in results) and len(results) == 4
    assert len({tuple(r.words) for r in results}) == 1 and len(results[0].words) == 5
    assert len({r.score for r in results}) == 1 and results[0].score < 0.0
    assert results[0].text == " ".join(results[0].words) and set(results[0].words) <= set(untrained_checkpoint.words)
    assert results[0].tokens == [model.vocab.stoi[w] for w in results[0].words]
    # a single item, a batch tensor and a batch split over several decoding batches: the same answer
    single = model.caption(path, max_len=5)
    batch = model.caption(torch.stack([tensor, model.transform(load_image(photos / "tall.png"))]), max_len=5,
                          batch_size=1)
    assert single[0].words == results[0].words and batch[0].words == results[0].words and len(batch) == 2
    assert model.caption([], max_len=5) == []


@pytest.mark.parametrize("preset", ["sat_soft_tiny", "transformer_tiny"])
def test_beam_one_is_greedy(checkpoints, photos, preset):
    model = load(checkpoints[preset], device="cpu")
    for name in ("wide.png", "tall.png"):
        result = model.caption(photos / name, beam=1, max_len=6)[0]
        assert result.tokens == _greedy(model, photos / name, 6)


@pytest.mark.parametrize("preset", ["sat_soft_tiny", "transformer_tiny"])
def test_attention_rows_are_distributions_over_the_grid(checkpoints, photos, preset):
    model = load(checkpoints[preset], device="cpu")
    plain = model.caption(photos / "wide.png", max_len=4)[0]
    assert plain.attention is None and plain.all_attention is None
    result = model.caption(photos / "wide.png", max_len=4, attention=True)[0]
    g = model.config.encoder.grid
    assert result.grid == (g, g) and result.words == plain.words
    rows = result.attention.reshape(len(result.words), -1)  # (L, N)
    assert rows.shape == (4, g * g)
    torch.testing.assert_close(rows.sum(-1), torch.ones(4), atol=1e-5, rtol=0)
    assert bool((rows >= 0).all())


def test_all_heads_for_the_transformer_match_its_overlay_view(checkpoints, photos):
    model = load(checkpoints["transformer_tiny"], device="cpu")
    result = model.caption(photos / "wide.png", beam=3, max_len=4, all_heads=True)[0]
    decoder = model.config.decoder
    g = model.config.encoder.grid
    assert result.all_attention.shape == (4, decoder.num_layers, decoder.num_heads, g, g)  # (L, layers, heads, g, g)
    per_head = result.all_attention.reshape(4, decoder.num_layers, decoder.num_heads, g * g)  # (L, layers, heads, N)
    torch.testing.assert_close(per_head.sum(-1), torch.ones(4, decoder.num_layers, decoder.num_heads),
                               atol=1e-5, rtol=0)
    # teacher forcing the chosen caption reproduces the search's attention (last layer, mean of heads)
    torch.testing.assert_close(result.all_attention[:, -1].mean(1), result.attention, atol=1e-4, rtol=0)
    forced = model.teacher_forced(photos / "wide.png", result.tokens)
    torch.testing.assert_close(forced, result.all_attention)
    lstm = load(checkpoints["sat_soft_tiny"], device="cpu")
    assert lstm.caption(photos / "wide.png", max_len=3, all_heads=True)[0].all_attention is None


def test_crop_box_is_what_the_attend_command_draws(checkpoints, photos, tmp_path, capsys):
    from captioner.cli import main

    model = load(checkpoints["center_crop"], device="cpu")
    result = model.caption(photos / "wide.png", max_len=3, attention=True)[0]
    assert result.image_size == (96, 48) and result.box == (24, 0, 72, 48)  # the centred 48 x 48 square
    assert main(["attend", str(photos / "wide.png"), "-c", str(checkpoints["center_crop"]), "--out", str(tmp_path),
                 "--max-len", "3"]) == 0
    record = read_attention_json(tmp_path / "attention.json")
    assert record.box == tuple(float(v) for v in result.box) and record.words == result.words
    np.testing.assert_allclose(record.attention, result.attention.numpy(), atol=1e-6)
    capsys.readouterr()
    stretch = load(checkpoints["sat_soft_tiny"], device="cpu").caption(photos / "tall.png", max_len=2)[0]
    assert stretch.box == (0, 0, 40, 80) and stretch.image_size == (40, 80)
    tensor = model.caption(model.transform(load_image(photos / "wide.png")), max_len=3)[0]
    assert tensor.box is None and tensor.image_size is None and tensor.words == result.words


def test_bad_inputs_are_one_line_errors(checkpoints, photos, tmp_path):
    model = load(checkpoints["sat_soft_tiny"], device="cpu")
    missing = tmp_path / "nowhere.jpg"
    with pytest.raises(ImageLoadError) as info:
        model.caption([photos / "wide.png", missing])
    assert isinstance(info.value, DataError) and str(info.value) == f"{missing}: file not found"
    with pytest.raises(ImageLoadError, match=r"broken\.jpg: not an image file$"):
        model.caption(str(photos / "broken.jpg"))
    with pytest.raises(DataError, match=r"already transformed to \(3, 64, 64\).*got \(3, 32, 32\)"):
        model.caption(torch.zeros(3, 32, 32))
    with pytest.raises(DataError, match="cannot caption a int"):
        model.caption(7)
    with pytest.raises(ConfigError, match="batch_size"):
        model.caption(photos / "wide.png", batch_size=0)
    with pytest.raises(ConfigError, match="beam_size"):
        model.caption(photos / "wide.png", beam=0)
    with pytest.raises(CheckpointError, match="absent.safetensors"):
        load(tmp_path / "absent.safetensors", device="cpu")


def test_device_resolver(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(ConfigError, match=r"^device='gpu' is not a device \(use auto, cpu, cuda or cuda:N\)$"):
        resolve_device("gpu")
    with pytest.raises(ConfigError, match=r"^--device 'gpu' is not a device"):
        resolve_device("gpu", option="--device")
    with pytest.raises(ConfigError, match=r"^train\.device='tpu:x' is not a device"):
        resolve_device("tpu:x", option="train.device")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto", local_rank=1) == torch.device("cpu")
    with pytest.raises(ConfigError, match=r"^device='cuda:1': CUDA is not available on this machine$"):
        resolve_device("cuda:1")
    with pytest.raises(ConfigError, match="CUDA is not available"):
        load("never-read.safetensors", device="cuda")  # the device is checked before the file
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto", local_rank=1) == torch.device("cuda:1")
    assert resolve_device("cuda", local_rank=1) == torch.device("cuda:1")
    assert resolve_device("cuda") == torch.device("cuda:0")
    with pytest.raises(ConfigError, match=r"^device='cuda:5': GPU 5 does not exist \(this machine has 2: 0\.\.1\)$"):
        resolve_device("cuda:5")


def test_top_level_load(checkpoints, photos):
    """``captioner.load`` is the inference layer's (its light import: test_caption_cli)."""
    assert captioner.load is load and captioner.Captioner is Captioner and captioner.Caption is Caption
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        captioner.nope  # noqa: B018
    model = captioner.load(checkpoints["sat_soft_tiny"], device="cpu")
    assert "sat" in repr(model) and model.device == torch.device("cpu")


def test_a_caption_prints_on_one_line_with_shapes_not_values():
    import torch

    from captioner.inference import Caption

    c = Caption(text="a red circle", words=["a", "red", "circle"], tokens=[4, 5, 6], score=-1.23456, grid=(2, 2),
                attention=torch.full((3, 2, 2), 0.25))
    assert repr(c) == ("Caption(text='a red circle', score=-1.2346, grid=(2, 2), attention=<3x2x2>, "
                       "all_attention=None, image_size=None, box=None, finished=True)")


def _jpeg(path: Path, size: tuple[int, int], orientation: int | None = None) -> Path:
    rng = np.random.default_rng(7)
    coarse = rng.integers(0, 255, (size[1] // 8, size[0] // 8, 3), dtype=np.uint8)
    image = Image.fromarray(coarse).resize(size, Image.Resampling.BICUBIC)
    if orientation is None:
        image.save(path, quality=92)
    else:
        exif = Image.Exif()
        exif[0x0112] = orientation
        image.save(path, quality=92, exif=exif)
    return path


def test_load_for_encoder_decodes_no_more_than_it_keeps(tmp_path):
    """A large JPEG is decoded at a reduced scale whose sides stay >= the encoder's side; the full
    size (EXIF rotation applied) is reported for crop boxes; small JPEGs and PNGs are untouched."""
    from captioner.data.images import load_for_encoder

    big = _jpeg(tmp_path / "big.jpg", (1000, 800))
    image, full = load_for_encoder(big, 224)
    assert full == (1000, 800) and image.size == (500, 400) and image.mode == "RGB"  # 1/4 would be 250 x 200
    assert load_image(big, reduce_to=224).size == image.size and load_image(big).size == (1000, 800)
    rotated = _jpeg(tmp_path / "rotated.jpg", (1000, 600), orientation=6)  # rotate 90: shown 600 x 1000
    image, full = load_for_encoder(rotated, 224)
    assert full == (600, 1000) and image.size == (300, 500)
    small = _jpeg(tmp_path / "small.jpg", (320, 240))
    assert load_for_encoder(small, 224)[0].size == (320, 240)
    png = tmp_path / "big.png"
    Image.open(big).save(png)
    assert load_for_encoder(png, 224)[0].size == (1000, 800)


def test_caption_stream_overlaps_and_keeps_order(checkpoints, photos, tmp_path):
    """The pipeline gives, in input order, the captions of one-batch-at-a-time decoding and the
    error of each unreadable file; the box is measured on the full-size photo."""
    from captioner.decoding.search import DecodeOptions
    from captioner.inference import caption_images

    model = load(checkpoints["center_crop"], device="cpu")
    big = _jpeg(tmp_path / "big.jpg", (900, 600))
    files = [photos / "wide.png", photos / "broken.jpg", big, photos / "tall.png", photos / "wide.png"]
    out = list(model.caption_stream(files, DecodeOptions(beam_size=2, max_len=6), attention=True, batch_size=2))
    assert len(out) == 5 and isinstance(out[1], ImageLoadError) and "broken.jpg" in str(out[1])
    for path, result in zip(files, out):
        if path.name == "broken.jpg":
            continue
        expected = caption_images(model.model, model.transform(load_image(path, reduce_to=model.transform.size))
                                  .unsqueeze(0), model.vocab, DecodeOptions(beam_size=2, max_len=6))[0]
        assert result.tokens == expected.tokens and result.attention.shape[0] == len(result.tokens)
    assert out[2].image_size == (900, 600) and out[2].box == (150, 0, 750, 600)
    with pytest.raises(ImageLoadError, match="broken.jpg"):
        model.caption(files, batch_size=2)
    assert list(model.caption_stream([], DecodeOptions())) == []


def test_encode_gives_the_regions_of_a_batch(checkpoints, photos):
    model = load(checkpoints["sat_soft_tiny"], device="cpu")
    paths = [photos / "wide.png", photos / "tall.png"]
    features, grid = model.encode(paths)
    pixels = torch.stack([model.transform(load_image(p)) for p in paths])
    with torch.no_grad():
        expected, expected_grid = model.model.eval().encode(pixels)  # (2, N, D)
    assert features.shape == expected.shape and grid == tuple(int(g) for g in expected_grid)
    torch.testing.assert_close(features, expected)
    with pytest.raises(ImageLoadError, match="broken.jpg"):
        model.encode([paths[0], photos / "broken.jpg"])
    with pytest.raises(DataError, match="at least one image"):
        model.encode([])


@pytest.mark.parametrize("preset", ["sat_soft_tiny", "transformer_tiny"])
def test_the_models_own_log_probability_is_the_search_score_and_the_step_by_step_sum(checkpoints, photos, preset):
    from captioner.inference import teacher_forced_log_probs

    model = load(checkpoints[preset], device="cpu")
    found = model.caption_nbest(photos / "wide.png", n_best=3, beam=3, max_len=6)
    assert len(found) >= 2
    for c in found:  # no language model, veto or fill: the search ranks by the model alone
        assert c.log_prob == pytest.approx(c.score, abs=1e-4)
    # a caption the search did not choose, finished and not: the sum of step()'s log-probabilities
    vocab, net = model.vocab, model.model
    tokens = [vocab.stoi[w] for w in vocab.itos if w.isalpha()][:3]
    features, _ = model.encode(photos / "wide.png")  # (1, N, D)
    with torch.no_grad():
        state, prev, total = net.decoder.init_state(features), torch.tensor([vocab.bos_id]), []
        for token in [*tokens, vocab.eos_id]:
            log_probs, state, _ = net.decoder.step(prev, state)  # (1, V)
            total.append(float(log_probs[0, token]))
            prev = torch.tensor([token])
    finished, cut = teacher_forced_log_probs(net, features, [tokens, tokens], vocab.bos_id, vocab.eos_id, [True, False])
    assert finished == pytest.approx(sum(total), abs=1e-4) and cut == pytest.approx(sum(total[:-1]), abs=1e-4)
    assert teacher_forced_log_probs(net, features, [], vocab.bos_id, vocab.eos_id) == []
