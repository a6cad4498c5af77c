"""Reading weights files: tensors only, bounded, with one-line errors.

Used by the encoders (``captioner.models.encoder``, ``captioner.models.lite0``) for their pretrained
weights; checkpoints have their own reader (``captioner.checkpoint``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from captioner.errors import CheckpointError
from captioner.files import check_regular

MAX_WEIGHTS_BYTES = 4 << 30  # a weights file larger than this is refused before it is opened


def looks_like_path(weights: str) -> bool:
    """Whether an ``encoder.weights`` value names a file (rather than, e.g., a torchvision weights name)."""
    return "/" in weights or "\\" in weights or Path(weights).suffix in (".pth", ".pt", ".bin", ".safetensors")


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Read a tensors-only state dict (``torch.save`` with ``weights_only=True``, or safetensors).

    Only a regular file of at most :data:`MAX_WEIGHTS_BYTES` is opened (a named pipe would block ``open``).
    """
    check_regular(path, MAX_WEIGHTS_BYTES, CheckpointError, "weights file")
    try:
        if path.suffix == ".safetensors":
            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated file, pickled code, not a torch file ...
        raise CheckpointError(f"{path}: cannot read weights ({type(exc).__name__}: {str(exc)[:120]})") from None
    for key in ("state_dict", "model"):  # common wrappers
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: not a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in state.items()}


def load_strict(module: nn.Module, state: dict[str, torch.Tensor], source: str | Path) -> None:
    """``load_state_dict(strict=True)`` with a one-line ``CheckpointError`` naming ``source``."""
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [k for k in own if k in state and own[k].shape != state[k].shape]
    problems = []
    for label, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", shapes)):
        if keys:
            problems.append(f"{len(keys)} {label} (e.g. {keys[0]})")
    if problems:
        raise CheckpointError(f"{source}: weights do not match this encoder: {'; '.join(problems)}")
    module.load_state_dict(state, strict=True)
