"""Devices and processes: the one place a device name (``auto``, ``cpu``, ``cuda``, ``cuda:1``) becomes a
``torch.device``, and the ``torchrun`` process group of a distributed run (one device per rank).

Without ``torchrun``'s variables every DDP helper is a single-process no-op. A bad device name, or
CUDA asked for without it, is a one-line ``ConfigError`` naming the option it came from.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from captioner.errors import ConfigError
from captioner.files import size_text


DEVICE_HINT = "use auto, cpu, cuda or cuda:N"
MEMORY_SHARE = 0.8  # of the memory available now, what one sized request may plan for


def available_memory() -> int:
    """Bytes of memory available now (``MemAvailable`` of /proc/meminfo; else the physical memory)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 4 << 30


def check_memory(need: int, what: str, advice: str, device: torch.device | None = None) -> None:
    """Refuse, in one line before anything is allocated, a size whose memory ``need`` (bytes) passes
    :data:`MEMORY_SHARE` of the memory available now (on ``device`` when it is a GPU, else the machine's);
    ``what`` names the sizes, ``advice`` what to lower."""
    where, have = "this machine has", available_memory()
    if device is not None and device.type == "cuda":
        where, have = f"{device} has", int(torch.cuda.mem_get_info(device)[0])
    if need > MEMORY_SHARE * have:
        raise ConfigError(f"{what} would need about {size_text(need)} of memory, more than {where} "
                          f"available now ({size_text(have)}); {advice}")


def resolve_device(spec: str | torch.device, local_rank: int = 0, option: str = "device") -> torch.device:
    """``"auto"`` -> ``cuda:<local_rank>`` when CUDA is available, else ``cpu``; other names are checked.

    ``option`` names what the user set in the ``ConfigError`` (bad name, CUDA absent, index out of
    range). A CUDA device always carries its index.
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


log = logging.getLogger(__name__)

# Rank r seeds its dropout / attention-sampling stream at seed + r * RANK_SEED_STRIDE: a prime far
# beyond any step count, so the ranks' streams never start on the same seed.
RANK_SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int  # global rank (0 writes files, logs and progress bars)
    world_size: int  # number of processes (1 without torchrun)
    local_rank: int  # rank on this machine (picks the GPU)
    device: torch.device  # the torch device this rank trains on
    initialized: bool = False  # True when this call joined a process group (and must leave it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def setup(device_name: str) -> DistInfo:
    """Join the torchrun process group when launched by torchrun, else a single process; call :func:`cleanup` after."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size <= 1:
        return DistInfo(0, 1, 0, resolve_device(device_name, 0, option="train.device"))
    device = resolve_device(device_name, local_rank, option="train.device")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    initialized = False
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, **({"device_id": device} if device.type == "cuda" else {}))
        initialized = True
    if rank == 0:
        log.info("distributed training: %d processes, backend %s", world_size, dist.get_backend())
    return DistInfo(rank, world_size, local_rank, device, initialized)


def cleanup(info: DistInfo) -> None:
    """Leave the process group if :func:`setup` joined it."""
    if info.initialized and dist.is_initialized():
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    """Wait for every rank (no-op for one process)."""
    if info.distributed:
        if info.device.type == "cuda":
            dist.barrier(device_ids=[info.device.index])
        else:
            dist.barrier()


def all_reduce_sum(values: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum a tensor over ranks in place and return it (unchanged for one process)."""
    if info.distributed:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def gather_objects(obj: Any, info: DistInfo) -> list[Any]:
    """Every rank's object, in rank order, on every rank (``[obj]`` for one process)."""
    if not info.distributed:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out
