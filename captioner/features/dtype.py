"""How the feature cache stores its values: float16, or bfloat16 when float16 cannot hold them.

Shape legend: b images in a batch, N regions, D feature width.

``float16`` (format version 1) holds up to 65504; ``bfloat16`` (version 2, float32's range, 8
significant bits) is chosen as soon as one batch exceeds that, the earlier rows converted in place.
NumPy has no bfloat16, so the map holds its bits as ``uint16``. NaN or inf features are refused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from captioner.errors import DataError

FLOAT16_MAX = float(torch.finfo(torch.float16).max)  # 65504
BFLOAT16_MAX = float(torch.finfo(torch.bfloat16).max)  # ~3.39e38
VERSIONS = {1: "float16", 2: "bfloat16"}  # trailer format version -> stored dtype
_TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_MAP = {"float16": np.float16, "bfloat16": np.uint16}  # numpy dtype of the memory map
_CHUNK = 1 << 22  # values converted at a time when a build widens to bfloat16


def version_of(dtype: str) -> int:
    """The trailer format version of a cache that stores ``dtype``."""
    return {v: k for k, v in VERSIONS.items()}[dtype]


def map_dtype(dtype: str) -> type:
    """The numpy dtype of a cache's memory map (raw ``uint16`` bits for bfloat16)."""
    return _MAP[dtype]


def decode_row(row: np.ndarray, dtype: str) -> torch.Tensor:
    """One stored row (N, D) of the memory map -> a float32 (N, D) tensor (a copy)."""
    return stored_rows(row, dtype).float()


def stored_rows(rows: np.ndarray, dtype: str) -> torch.Tensor:
    """Stored rows (..., N, D) of the memory map -> a tensor of the stored 2-byte dtype (a copy)."""
    if dtype == "float16":
        return torch.from_numpy(np.array(rows, dtype=np.float16))
    bits = np.array(rows, dtype=np.uint16).view(np.int16)  # torch has few uint16 ops
    return torch.from_numpy(bits).view(torch.bfloat16)


STORED_TORCH = frozenset(_TORCH.values())  # the dtypes cached features travel in before model_input


def model_input(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A loader's batch ``x`` on ``device``, float16/bfloat16 features widened there to float32 (exactly)."""
    x = x.to(device, non_blocking=True)
    return x.float() if x.dtype in STORED_TORCH else x


def encode_rows(feats: torch.Tensor, dtype: str) -> np.ndarray:
    """Features (b, N, D) -> a contiguous (b, N, D) array of 2-byte values ready to write."""
    rows = feats.to("cpu", _TORCH[dtype])
    return rows.numpy() if dtype == "float16" else rows.view(torch.int16).numpy()


def peak(feats: torch.Tensor) -> float:
    """The largest |value| of a batch (NaN when it holds a NaN, inf when it holds an inf)."""
    return float(feats.detach().abs().amax())


def check_range(feats: torch.Tensor, top: float, encoder: str, images: list[str], what: str) -> None:
    """Refuse (``DataError`` naming the encoder, the first bad image and value) NaN/inf or beyond-bfloat16 features."""
    if np.isfinite(top) and top <= BFLOAT16_MAX:
        return
    flat = feats.detach().flatten(1)  # (b, N*D)
    if np.isfinite(top):
        row = int(flat.abs().amax(1).argmax())
        raise DataError(f"encoder {encoder} produced a feature of {top:.4g} for image {images[row]}, beyond what "
                        f"{what} can store (bfloat16 reaches {BFLOAT16_MAX:.4g})")
    bad = ~torch.isfinite(flat)
    row = int(bad.any(1).float().argmax())
    value = float(flat[row][bad[row]][0])
    raise DataError(f"encoder {encoder} produced non-finite features ({value}) for image {images[row]}; "
                    f"{what} was not written")


def widen_in_place(path: Path, values: int) -> None:
    """Convert the first ``values`` float16 values of ``path`` to bfloat16 bits, chunk by chunk."""
    if values == 0:
        return
    data = np.memmap(path, dtype=np.uint16, mode="r+", shape=(values,))  # raw bits both ways
    for start in range(0, values, _CHUNK):
        part = torch.from_numpy(np.array(data[start:start + _CHUNK]).view(np.float16))
        data[start:start + _CHUNK] = part.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    data.flush()
    del data
