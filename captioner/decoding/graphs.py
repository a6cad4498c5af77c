"""Decoding steps replayed as CUDA graphs, and the capture the graphed training step shares.

Shape legend: R rows of the decoder batch (images, or images x beams), N regions, D feature width,
V vocabulary.

:class:`GraphedSteps` wraps a decoder of fixed-size state (the SAT LSTM) and is itself a
``CaptionDecoder``, so greedy and beam search run unchanged. A shape is captured the second time it
is seen (at most ``max_graphs``); each ``step`` copies its inputs into that shape's static buffers
and replays the graph, bit for bit the eager step. Constants are copied only when the search hands
over a new ``static`` dict. A step's outputs are the graph's buffers, overwritten by the next step.

:func:`record_graph` warms the work up on a side stream (lazy set-up happens there) and records
one call on it; a failure is returned, not raised, so the caller can run that shape eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from captioner.errors import ConfigError
from captioner.models.base import CaptionDecoder, State

log = logging.getLogger(__name__)


@dataclass
class Recorded:
    """What :func:`record_graph` got: the graph and the recorded call's outputs, or why it failed."""

    graph: Any = None  # torch.cuda.CUDAGraph, None when the capture failed
    out: Any = None  # what the recorded call returned (tensors in the graph's memory)
    failure: str | None = None  # the first line of the error when it failed


def record_graph(work: Callable[[], Any], device: torch.device, warmup: int = 1,
                 before: Callable[[], None] | None = None) -> Recorded:
    """Run ``work`` ``warmup`` times on a side stream, then record one call of it as a CUDA graph.

    ``before`` runs before every call (e.g. to clear gradients). Returns ``Recorded(graph, out)``, or
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


MAX_GRAPHS = 4  # shapes given buffers and a graph per wrapper (each holds R x (N x D + N x A) values); more: eager
CAPTURE_AFTER = 2  # a shape gets its buffers and graph on its second use (one seen once is not worth a capture)


@dataclass
class GraphCounts:
    """What a wrapper that replays CUDA graphs did: graphs captured, replays, steps run eagerly (a shape
    not captured, or a failed capture), and failed captures. Decoding and training both keep them."""

    captures: int = 0
    replays: int = 0
    eager_steps: int = 0
    failed: int = 0


@dataclass
class DecodeGraphStats(GraphCounts):
    """What a :class:`GraphedSteps` did."""

    shapes: int = 0
    static_copies: int = 0  # per-image constants copied into the buffers (a new State.static dict)

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class _Entry:
    prev: torch.Tensor  # (R,)
    static: dict[str, torch.Tensor]
    dynamic: dict[str, torch.Tensor]
    last_static: dict[str, Any] | None = None  # the caller's dict the buffers hold (kept alive: `is` stays sound)
    graph: Any = None
    out: tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor] | None = None
    eager: bool = False
    keys: list[str] = field(default_factory=list)


def _key(prev: torch.Tensor, state: State) -> tuple | None:
    """The shape key of a step, or None when the state holds anything but tensors."""
    parts: list[Any] = [tuple(prev.shape), prev.dtype]
    for group in (state.static, state.dynamic):
        for name in sorted(group):
            value = group[name]
            if not isinstance(value, torch.Tensor):
                return None
            parts.append((name, tuple(value.shape), value.dtype))
        parts.append("|")
    return tuple(parts)


class GraphedSteps(CaptionDecoder):
    """``decoder`` (fixed-size state, eval mode) with its ``step`` replayed from CUDA graphs.

    ``capture``: default when the decoder is on a CUDA device; False runs the same buffers eagerly.
    """

    def __init__(self, decoder: CaptionDecoder, max_graphs: int = MAX_GRAPHS, capture: bool | None = None) -> None:
        super().__init__()
        if decoder.state_bytes_per_word():
            raise ConfigError(f"{type(decoder).__name__}'s state grows with every word; only decoders with a "
                              "fixed-size state (the SAT LSTM) can replay their steps as graphs")
        if max_graphs < 0:
            raise ConfigError(f"max_graphs must be >= 0, got {max_graphs}")
        param = next(decoder.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        if capture is None:
            capture = device.type == "cuda"
        if capture and device.type != "cuda":
            raise ConfigError(f"graphed decoding needs a CUDA device (the decoder is on {device})")
        self.decoder = decoder
        self.vocab_size = decoder.vocab_size
        self.capture, self.max_graphs = capture, max_graphs
        self.stats = DecodeGraphStats()
        self._entries: dict[tuple, _Entry] = {}  # shapes seen CAPTURE_AFTER times: buffers (and a graph)
        self._seen: dict[tuple, int] = {}  # times each shape was seen before it got buffers
        self.train(decoder.training)

    def init_state(self, features: torch.Tensor) -> State:
        return self.decoder.init_state(features)

    def state_bytes_per_word(self) -> int:
        return 0

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, need_all_attention: bool = False):  # noqa: ANN201
        return self.decoder(features, tokens, need_all_attention)

    @property
    def graphs(self) -> int:
        return sum(e.graph is not None for e in self._entries.values())

    def step(self, prev_tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, State, torch.Tensor]:
        key = _key(prev_tokens, state)
        if key is None or torch.is_grad_enabled():  # a non-tensor state, or a step that must keep its graph
            self.stats.eager_steps += 1
            return self.decoder.step(prev_tokens, state)
        entry = self._entries.get(key)
        if entry is None:
            seen = self._seen.get(key, 0) + 1
            self._seen[key] = seen
            if seen == 1:
                self.stats.shapes += 1
            if seen < CAPTURE_AFTER or len(self._entries) >= self.max_graphs:  # no buffers for this shape
                self.stats.eager_steps += 1
                return self.decoder.step(prev_tokens, state)
            entry = self._entries[key] = _Entry(torch.empty_like(prev_tokens),
                                                {k: torch.empty_like(v) for k, v in state.static.items()},
                                                {k: torch.empty_like(v) for k, v in state.dynamic.items()},
                                                eager=not self.capture)
        entry.prev.copy_(prev_tokens)
        if state.static is not entry.last_static:
            for k, v in state.static.items():
                entry.static[k].copy_(v)
            entry.last_static = state.static
            self.stats.static_copies += 1
        for k, v in state.dynamic.items():
            entry.dynamic[k].copy_(v)
        if entry.graph is None and not entry.eager:
            self._capture(entry)
        if entry.graph is None:
            self.stats.eager_steps += 1
            log_probs, new, attn = self.decoder.step(entry.prev, State(entry.static, entry.dynamic))
            return log_probs, State(state.static, new.dynamic, outputs=new.outputs), attn
        entry.graph.replay()
        self.stats.replays += 1
        log_probs, dynamic, attn = entry.out
        return log_probs, State(state.static, dict(dynamic)), attn

    def _capture(self, entry: _Entry) -> None:
        recorded = record_graph(lambda: self.decoder.step(entry.prev, State(entry.static, entry.dynamic)),
                                entry.prev.device, warmup=1)
        if recorded.graph is None:  # this shape runs eagerly, reported
            entry.eager = True
            self.stats.failed += 1
            log.warning("graphed decoding: capturing a step of %d rows failed (%s); it runs eagerly",
                        entry.prev.shape[0], recorded.failure[:200])
            return
        graph, (log_probs, new, attn) = recorded.graph, recorded.out
        entry.graph, entry.out = graph, (log_probs, new.dynamic, attn)
        self.stats.captures += 1
