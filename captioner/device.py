"""The one place a device name (``auto``, ``cpu``, ``cuda``, ``cuda:1``) becomes a ``torch.device``.

Used by the inference API, training (one device per ``torchrun`` rank), evaluation and the
commands. A name that is not a device, or CUDA asked for on a machine without it, is a one-line
``ConfigError`` that names the option it came from (``--device``, ``device``, ``train.device``).
"""

from __future__ import annotations

import torch

from captioner.errors import ConfigError

DEVICE_HINT = "use auto, cpu, cuda or cuda:N"


def resolve_device(spec: str | torch.device, local_rank: int = 0, option: str = "device") -> torch.device:
    """``"auto"`` -> ``cuda:<local_rank>`` when CUDA is available, else ``cpu``; other names are checked.

    Args:
        spec: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:N"`` (or a ``torch.device``).
        local_rank: the GPU that ``"auto"`` and a bare ``"cuda"`` mean (``torchrun``'s ``LOCAL_RANK``).
        option: what the user set, for the error message (``"--device"``, ``"train.device"``).

    Returns:
        The device; a CUDA device always carries its index.

    Raises:
        ConfigError: ``spec`` is not a device, CUDA is asked for but absent, or the GPU index is out
            of range.
    """
    where = f"{option} {str(spec)!r}" if option.startswith("-") else f"{option}={str(spec)!r}"
    if str(spec) == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"{where} is not a device ({DEVICE_HINT})") from None
    if device.type == "cpu":
        return device
    if device.type == "mps" and torch.backends.mps.is_available():
        return device
    if device.type != "cuda":  # meta, xla, hpu ...: torch parses them, the models cannot run there
        raise ConfigError(f"{where}: {device.type} devices are not supported here ({DEVICE_HINT})")
    if not torch.cuda.is_available():
        raise ConfigError(f"{where}: CUDA is not available on this machine")
    if device.index is None:
        device = torch.device(f"cuda:{local_rank}")
    count = torch.cuda.device_count()
    if device.index >= count:
        raise ConfigError(f"{where}: GPU {device.index} does not exist (this machine has {count}: 0..{count - 1})")
    return device
