"""Recording one piece of GPU work as a CUDA graph: the capture both graphed paths share.

The captured SAT training step (:mod:`captioner.training.cuda_graph`) and the graphed decoding
steps (:mod:`captioner.decoding.graphs`) record their work the same way: warm it up eagerly on a
side stream (lazy cuBLAS and autograd set-up happens there, and cuBLAS workspaces are per stream,
so none is created mid-capture), then record one call on that same stream. ``thread_local``
capture: a DataLoader's pin-memory thread may touch CUDA while this thread captures. A failure is
returned, not raised, so that the caller can run that shape eagerly and say why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Recorded", "record_graph"]


@dataclass
class Recorded:
    """What :func:`record_graph` got: the graph and the recorded call's outputs, or why it failed."""

    graph: Any = None  # torch.cuda.CUDAGraph, None when the capture failed
    out: Any = None  # what the recorded call returned (tensors in the graph's memory)
    failure: str | None = None  # the first line of the error when it failed


def record_graph(work: Callable[[], Any], device: torch.device, warmup: int = 1,
                 before: Callable[[], None] | None = None) -> Recorded:
    """Run ``work`` ``warmup`` times on a side stream, then record one call of it as a CUDA graph.

    Args:
        work: the computation, reading and writing only static buffers.
        device: its CUDA device.
        warmup: eager calls before the capture.
        before: called before every warm-up call and before the capture (e.g. to clear gradients).

    Returns:
        ``Recorded(graph, out)``; on any error, after synchronising the device,
        ``Recorded(failure=first line of the error)``.
    """
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(side):
            for _ in range(warmup):
                if before is not None:
                    before()
                work()
        torch.cuda.current_stream(device).wait_stream(side)
        if before is not None:
            before()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
            out = work()
    except Exception as exc:  # noqa: BLE001 -- any capture failure: the caller runs the shape eagerly
        torch.cuda.synchronize(device)
        return Recorded(failure=(str(exc).strip().splitlines() or [repr(exc)])[0])
    return Recorded(graph, out)
