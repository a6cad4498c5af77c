"""Weights checked on load, and checkpoint names helped.

A damaged copy of a checkpoint (bit rot, a bad disk, a bad transfer) is refused in one line that
names the tensor: every floating tensor must be finite, and a file that records the CRC-32 of its
weights (every checkpoint and release file captioner writes) must match it. A name that is neither
a file nor a shipped model lists the shipped models and the nearest one; an empty name is refused.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import captioner
from captioner.checkpoint.store import CHECKSUM_KEY, load_checkpoint, weights_checksum
from captioner.cli import main
from captioner.errors import CheckpointError
from captioner.pretrained import nearest_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, untrained_checkpoint) -> Path:
    return untrained_checkpoint(tmp_path_factory.mktemp("tiny"), "sat_soft_tiny")


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def _tensor_offset(path: Path, name: str) -> int:
    """Where tensor ``name``'s bytes start in the safetensors file."""
    header = _header(path)
    n = struct.unpack("<Q", path.read_bytes()[:8])[0]
    return 8 + n + header[name]["data_offsets"][0]


def test_a_checkpoint_records_the_checksum_of_its_weights(tiny: Path) -> None:
    meta = _header(tiny)["__metadata__"]
    assert meta[CHECKSUM_KEY] == weights_checksum(load_file(str(tiny)))
    assert len(meta[CHECKSUM_KEY]) == 8
    load_checkpoint(tiny)  # an intact file loads


def test_the_checksum_changes_with_any_byte(tiny: Path) -> None:
    state = load_file(str(tiny))
    name = sorted(k for k, v in state.items() if v.is_floating_point())[0]
    base = weights_checksum(state)
    changed = dict(state)
    changed[name] = state[name].clone()
    changed[name].view(-1)[0] = torch.nextafter(changed[name].view(-1)[0], torch.tensor(1.0))  # one ulp
    assert weights_checksum(changed) != base
    renamed = {("x" + k if k == name else k): v for k, v in state.items()}
    assert weights_checksum(renamed) != base


def test_a_bit_flipped_copy_is_refused_naming_the_damage(tiny: Path, tmp_path: Path, capsys) -> None:
    """64 bytes of 0xff inside an LSTM weight: NaN in the tensor, and a checksum that no longer matches."""
    name = "decoder.lstm.weight_ih"
    data = bytearray(tiny.read_bytes())
    at = _tensor_offset(tiny, name)
    data[at: at + 64] = b"\xff" * 64
    bad = tmp_path / "bitflip.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"^{bad}: damaged weights: their CRC-32 is [0-9a-f]{{8}}, the file "
                                              r"recorded [0-9a-f]{8} when it was written \(a bad disk, copy or "
                                              r"transfer\); use an intact copy$"):
        load_checkpoint(bad)
    photo = tmp_path / "p.png"
    from PIL import Image

    Image.new("RGB", (32, 32), (90, 20, 200)).save(photo)
    assert main(["caption", "-c", str(bad), str(photo)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "damaged weights" in captured.err


def test_non_finite_weights_are_refused_naming_the_tensor_without_a_checksum(tiny: Path, tmp_path: Path) -> None:
    """A file written elsewhere (no checksum in its header) is still checked: every float tensor finite."""
    state = load_file(str(tiny))
    meta = _header(tiny)["__metadata__"]
    del meta[CHECKSUM_KEY]
    state["decoder.lstm.weight_ih"] = state["decoder.lstm.weight_ih"].clone()
    state["decoder.lstm.weight_ih"].view(-1)[:3] = float("nan")
    state["decoder.lstm.weight_ih"].view(-1)[3] = float("inf")
    path = tmp_path / "nan.safetensors"
    save_file(state, str(path), metadata=meta)
    n = state["decoder.lstm.weight_ih"].numel()
    with pytest.raises(CheckpointError, match=rf"^{path}: damaged weights: tensor decoder\.lstm\.weight_ih holds "
                                              rf"4 of {n} values that are NaN or infinite; use an intact copy"):
        load_checkpoint(path)
    state["decoder.lstm.weight_ih"] = torch.nan_to_num(state["decoder.lstm.weight_ih"])
    save_file(state, str(path), metadata=meta)
    load_checkpoint(path)  # finite and no checksum: loads


def test_a_release_file_records_the_checksum_of_what_it_holds(tiny: Path, tmp_path: Path) -> None:
    from captioner.checkpoint.store import pack_release

    out = tmp_path / "release.safetensors"
    pack_release(tiny, out, half=True)
    assert _header(out)["__metadata__"][CHECKSUM_KEY] == weights_checksum(load_file(str(out)))
    load_checkpoint(out)


def test_the_shipped_model_passes_the_checks() -> None:
    from captioner.checkpoint.store import check_weights, read_file
    from captioner.pretrained import pretrained_path

    path = pretrained_path("flickr8k")
    header, state = read_file(path, want_tensors=True)
    check_weights(path, header, state)  # finite (it has no checksum entry: its SHA-256 is pinned instead)


# --- names ---

@pytest.mark.parametrize("spec, near", [("FLICKR8K", "flickr8k"), ("flickr8k ", "flickr8k"), ("flikr8k", "flickr8k"),
                                        ("nope", None)])
def test_an_unknown_name_lists_the_shipped_models_and_the_nearest(spec: str, near: str | None, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert nearest_model(spec) == near
    hint = f"; did you mean '{near}'\\?" if near else ""
    with pytest.raises(CheckpointError, match=rf"^'{spec}': checkpoint not found: no such file or folder, and not a "
                                              rf"shipped model \(shipped: flickr8k\){hint}$"):
        captioner.load(spec)


@pytest.mark.parametrize("spec", ["", "  "])
def test_an_empty_name_is_refused_as_empty_not_taken_as_this_folder(spec: str, tmp_path: Path, tiny: Path,
                                                                     monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    os.link(tiny, tmp_path / "best.safetensors")  # a run folder: '' must not load ./best.safetensors
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=rf"^checkpoint name '{spec}' is empty: give a shipped model's name "
                                              r"\(flickr8k\), a checkpoint file, a run folder or a URL$"):
        captioner.load(spec)
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "x.png")
    assert main(["caption", "-c", spec, str(tmp_path / "x.png")]) == 1
    assert "is empty" in capsys.readouterr().err
