"""Distributed data parallel (DDP) helpers for runs launched by ``torchrun``.

``torchrun --nproc_per_node=K -m captioner train ...`` sets ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK``; :func:`setup` then joins the process group (NCCL on CUDA, Gloo on CPU) and picks
this rank's device. Without those variables everything here degrades to single-process no-ops,
so the training loop calls the same functions either way.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from captioner.device import resolve_device

log = logging.getLogger(__name__)

# Rank r seeds its dropout / attention-sampling stream at seed + r * RANK_SEED_STRIDE: a prime far
# beyond any step count, so the ranks' streams never start on the same seed.
RANK_SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job.

    Attributes:
        rank: global rank (0 writes files, logs and progress bars).
        world_size: number of processes (1 without torchrun).
        local_rank: rank on this machine (picks the GPU).
        device: the torch device this rank trains on.
        initialized: True when this call joined a process group (and must leave it).
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    initialized: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def setup(device_name: str) -> DistInfo:
    """Join the torchrun process group when launched by torchrun; otherwise a single process.

    Args:
        device_name: ``TrainConfig.device`` (``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:1"``).

    Returns:
        A ``DistInfo``; call :func:`cleanup` with it when training ends.
    """
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
