"""Timing helpers shared by the ``bench_*.py`` benchmarks beside it (not a benchmark itself)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_times(fns: dict[str, Callable[[], None]], device: torch.device, repeats: int) -> dict[str, float]:
    """Seconds of the fastest of ``repeats`` calls of each function (interleaved, after a warm-up
    call each), so that load from other processes hits both sides of a comparison alike."""
    best = {}
    for name, fn in fns.items():
        fn()
        best[name] = float("inf")
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            best[name] = min(best[name], time.perf_counter() - t0)
    return best
