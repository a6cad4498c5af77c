"""The training step: ``train_one_epoch`` runs forward, loss, backward and step over an epoch's batches.

Each batch goes through ``step_deferred`` (never waits for the device) or ``step_synchronised``
(under torchrun or with ``train.skip_nonfinite``, which see the loss before the optimizer steps);
``train.cuda_graph`` replays forward, loss and backward as one captured graph (``GraphedStep``). The
bookkeeping around them (counters, meters, logs, non-finite values) is ``captioner.training.run``'s.
docs/training.md explains both steps.

Shape legend: B batch, T caption steps (with ``<bos>``/``<eos>``), V vocabulary.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from captioner import device as ddp
from captioner.decoding.graphs import GraphCounts, record_graph
from captioner.errors import ConfigError
from captioner.features.dtype import model_input
from captioner.training.objective import Batch, LossResult, TrainModel
from captioner.training.optim import budget_decay, clip_and_step
from captioner.training.run import EpochLog, Run, add_means, nonfinite_error, read_stats, skip_batch, skip_empty

log = logging.getLogger(__name__)


BUCKET_MULTIPLE = 8  # decoder steps are padded up to a multiple of this
MAX_GRAPHS = 8  # graphs kept per GraphedStep; shapes beyond run eagerly
WARMUP_STEPS = 3  # eager steps on a side stream before a capture (lazy cuBLAS / autograd set-up)


def bucket_steps(steps: int, multiple: int = BUCKET_MULTIPLE) -> int:
    """Decoder steps padded up to a multiple of ``multiple`` (at least one bucket)."""
    if multiple < 1:
        raise ConfigError(f"bucket multiple must be >= 1, got {multiple}")
    return max(multiple, math.ceil(steps / multiple) * multiple)


@dataclass
class GraphStats(GraphCounts):
    """What a :class:`GraphedStep` did, by shape too."""

    buckets: dict[tuple[int, ...], int] = field(default_factory=dict)  # shape key -> steps run with it

    def as_dict(self) -> dict[str, Any]:
        return {"captures": self.captures, "replays": self.replays, "eager_steps": self.eager_steps,
                "failed_captures": self.failed,
                "buckets": {"x".join(map(str, k)): v for k, v in sorted(self.buckets.items())}}


@dataclass
class _Entry:
    """Static buffers of one shape and, once captured, its graph and outputs."""

    features: torch.Tensor  # (B, N, D)
    tokens: torch.Tensor  # (B, S'+1) long
    image_index: torch.Tensor  # (B,) long, -1 when the caller gave none
    graph: Any = None  # torch.cuda.CUDAGraph
    stats: torch.Tensor | None = None  # (2 + terms,) total, objective, terms (static output of the graph)
    keys: list[str] = field(default_factory=list)
    grads: list[torch.Tensor | None] = field(default_factory=list)
    eager: bool = False  # capture failed or graphs ran out: run eagerly on the buffers


class GraphedStep:
    """Forward, loss and backward of ``decoder`` on padded static buffers, captured per shape on CUDA.

    Args:
        criterion: the training objective (``loss(model, batch)``) or a bare ``CaptionLoss``.
        autocast_dtype: run forward and loss under autocast of this dtype (None: fp32).
        multiple, max_graphs: bucket steps to a multiple of this; at most this many captured shapes.
        capture: capture CUDA graphs (default: when the decoder is on a CUDA device).
    """

    def __init__(self, decoder: nn.Module, criterion: nn.Module, pad_id: int, autocast_dtype: torch.dtype | None = None,
                 multiple: int = BUCKET_MULTIPLE, max_graphs: int = MAX_GRAPHS, capture: bool | None = None) -> None:
        params = [p for p in decoder.parameters() if p.requires_grad]
        if not params:
            raise ConfigError("train.cuda_graph: the decoder has no trainable parameters")
        self.device = params[0].device
        if capture is None:
            capture = self.device.type == "cuda"
        if capture and self.device.type != "cuda":
            raise ConfigError(f"train.cuda_graph needs a CUDA device (the decoder is on {self.device})")
        if max_graphs < 0:
            raise ConfigError(f"max_graphs must be >= 0, got {max_graphs}")
        bucket_steps(1, multiple)  # checks multiple
        self.decoder, self.criterion, self.pad_id = decoder, criterion, pad_id
        self.params = params
        self.autocast_dtype = autocast_dtype
        self.multiple, self.max_graphs, self.capture = multiple, max_graphs, capture
        self.stats = GraphStats()
        self._entries: dict[tuple[int, ...], _Entry] = {}

    # ------------------------------------------------------------------ the step

    def key(self, features: torch.Tensor, tokens: torch.Tensor) -> tuple[int, int, int, int]:
        """``(B, N, D, S')`` of a batch: features (B,N,D), tokens (B,L)."""
        if features.dim() != 3 or tokens.dim() != 2 or features.shape[0] != tokens.shape[0]:
            raise ValueError(f"features {tuple(features.shape)} and tokens {tuple(tokens.shape)}: "
                             "expected (B, N, D) and (B, L)")
        if tokens.shape[1] < 2:
            raise ValueError(f"tokens {tuple(tokens.shape)}: a caption needs <bos> and at least one target")
        B, N, D = features.shape
        return B, N, D, bucket_steps(tokens.shape[1] - 1, self.multiple)

    def __call__(self, features: torch.Tensor, tokens: torch.Tensor,
                 image_index: torch.Tensor | None = None) -> LossResult:
        """One batch: features (B,N,D), tokens (B,L), image_index (B,) -> the loss, gradients left in ``.grad``."""
        key = self.key(features, tokens)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._new_entry(key, features.dtype)
        self._fill(entry, features, tokens, image_index)
        self.stats.buckets[key] = self.stats.buckets.get(key, 0) + 1
        if entry.graph is None and not entry.eager:
            self._capture(key, entry)
        if entry.graph is not None:
            entry.graph.replay()
            self.stats.replays += 1
            for p, g in zip(self.params, entry.grads):
                p.grad = g
            stats = entry.stats.clone()  # the next replay overwrites the graph's own outputs
            keys = entry.keys
        else:
            stats, keys = self._eager(entry)
        return LossResult(total=stats[0], objective=stats[1], terms=dict(zip(keys, stats[2:].unbind())),
                          captions=key[0])

    @property
    def graphs(self) -> int:
        """Graphs held now."""
        return sum(e.graph is not None for e in self._entries.values())

    # ------------------------------------------------------------------ pieces

    def _new_entry(self, key: tuple[int, ...], dtype: torch.dtype) -> _Entry:
        B, N, D, steps = key
        entry = _Entry(torch.zeros(B, N, D, dtype=dtype, device=self.device),
                       torch.full((B, steps + 1), self.pad_id, dtype=torch.long, device=self.device),
                       torch.full((B,), -1, dtype=torch.long, device=self.device))
        held = sum(not e.eager for e in self._entries.values())
        if not self.capture or held >= self.max_graphs:
            entry.eager = True
            if self.capture:
                log.warning("train.cuda_graph: %d graphs held; batches of shape %s run eagerly", held, key)
        self._entries[key] = entry
        return entry

    def _fill(self, entry: _Entry, features: torch.Tensor, tokens: torch.Tensor,
              image_index: torch.Tensor | None) -> None:
        """Copy a batch into the entry's buffers; the steps beyond it become ``<pad>``."""
        L = tokens.shape[1]
        entry.features.copy_(features, non_blocking=True)
        if image_index is not None:
            entry.image_index.copy_(image_index, non_blocking=True)
        entry.tokens[:, :L].copy_(tokens, non_blocking=True)
        if L < entry.tokens.shape[1]:
            entry.tokens[:, L:].fill_(self.pad_id)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        # the cast cache must be off under capture (cached casts would outlive the graph's pool)
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, cache_enabled=False)

    def _forward_backward(self, entry: _Entry) -> tuple[torch.Tensor, list[str]]:
        """Loss and gradients on the entry's buffers: the work a graph records."""
        with self._autocast():
            if hasattr(self.criterion, "loss"):  # a training objective: its extra terms too
                batch = Batch(entry.features, entry.tokens, entry.image_index)
                result = self.criterion.loss(TrainModel(self.decoder, self.decoder), batch)
            else:
                out = self.decoder(entry.features, entry.tokens[:, :-1])  # logits (B, S', V)
                result = self.criterion(out, entry.tokens[:, 1:])
        keys = sorted(result.terms)
        stats = torch.stack([result.total.detach().float(), result.objective.float(),
                             *(result.terms[k].float() for k in keys)])  # (2 + terms,)
        result.total.backward()
        return stats, keys

    def _clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def _eager(self, entry: _Entry) -> tuple[torch.Tensor, list[str]]:
        self._clear_grads()
        self.stats.eager_steps += 1
        return self._forward_backward(entry)

    def _capture(self, key: tuple[int, ...], entry: _Entry) -> None:
        """Warm up on a side stream, then record the step; a failure leaves the shape eager (logged)."""
        saved = {k: v.detach().clone() for k, v in self.criterion.state_dict().items()}
        try:
            recorded = record_graph(lambda: self._forward_backward(entry), self.device, warmup=WARMUP_STEPS,
                                    before=self._clear_grads)
        finally:
            # warm-up steps ran for real: give the loss its moving averages back (REINFORCE baseline)
            with torch.no_grad():
                for k, v in self.criterion.state_dict().items():
                    if k in saved:
                        v.copy_(saved[k])
        if recorded.graph is None:  # this shape runs eagerly, reported
            entry.eager, entry.graph = True, None
            self.stats.failed += 1
            log.warning("train.cuda_graph: capturing shape %s failed (%s); it runs eagerly", key,
                        recorded.failure[:200])
            self._clear_grads()
            return
        graph, (stats, keys) = recorded.graph, recorded.out
        entry.graph, entry.stats, entry.keys = graph, stats, keys
        entry.grads = [p.grad for p in self.params]
        self.stats.captures += 1
        log.info("train.cuda_graph: captured shape (B %d, N %d, D %d, %d steps); %d graph(s)", *key,
                 self.stats.captures)


def check_cuda_graph(train_cfg: Any, decoder_name: str, on_features: bool, device: torch.device,
                     distributed: bool) -> None:
    """Refuse ``train.cuda_graph`` where it cannot run, with one line saying why."""
    if device.type != "cuda":
        raise ConfigError(f"train.cuda_graph needs a CUDA device (training on {device}); set it to false")
    if decoder_name != "sat":
        raise ConfigError(f"train.cuda_graph captures the SAT decoders' step; decoder {decoder_name!r} is not one")
    if not on_features:
        raise ConfigError("train.cuda_graph needs cached features (data.feature_cache=true, a frozen encoder)")
    if distributed:
        raise ConfigError("train.cuda_graph runs on one process; it is not supported under torchrun")
    if train_cfg.objective != "xe":
        raise ConfigError(f"train.cuda_graph captures the cross-entropy step; train.objective={train_cfg.objective!r}")
    if train_cfg.compile:
        raise ConfigError("train.cuda_graph and train.compile are alternatives; set one of them to false")
    if train_cfg.attention_supervision:
        raise ConfigError("train.cuda_graph does not capture train.attention_supervision (its box targets are built "
                          "per batch on the host); set one of them to 0/false")
    if train_cfg.amp == "fp16" or (train_cfg.amp == "auto" and not torch.cuda.is_bf16_supported()):
        raise ConfigError("train.cuda_graph does not capture fp16 with a gradient scaler; use train.amp=bf16 or off")


def backward_step(run: Run, loss: torch.Tensor, params: list[nn.Parameter]) -> Any:  # -> StepResult
    """Backward (unless a captured step ran it), clip and step, then advance the schedule (and the budget decay) when the optimizer stepped."""
    learner = run.learner
    step = clip_and_step(loss, learner.optimizer, params, run.cfg.train.grad_clip, learner.precision,
                         backward=learner.graphed is None)  # a captured step has run its backward
    if step:
        learner.scheduler.step()
        budget_decay(learner.optimizer, run.cfg.train, run.clock.session_seconds())
    return step


def on_device(run: Run, batch: Any) -> Batch:
    """The loader's ``(x, tokens, image_index)`` on the run's device, cached features widened to float32."""
    x, tokens, image_index = batch
    device = run.info.device
    return Batch(model_input(x, device), tokens.to(device, non_blocking=True), image_index)  # tokens (B, T)


def forward_loss(run: Run, batch: Batch) -> LossResult:
    """Forward and the objective's loss of ``batch`` under the run's precision, gradients cleared for the backward."""
    learner = run.learner
    if learner.graphed is not None:  # train.cuda_graph: forward, loss and backward replayed as one graph
        return learner.graphed(batch.x, batch.tokens, batch.image_index)
    with learner.precision.autocast():
        result = learner.objective.loss(learner.train_model(), batch)
    learner.optimizer.zero_grad(set_to_none=True)
    return result


def step_deferred(run: Run, batch: Any, params: list[nn.Parameter], epoch: int) -> tuple[bool, float]:
    """One batch on one process without ``train.skip_nonfinite``: the step never waits for the device.

    The loss terms are checked when read (:func:`read_stats`); the first step is read at once.
    ``batch``: ``(x, tokens (B,T), image_index)`` or None (left empty by ``data.skip_missing``).
    Returns ``(time_up, captions trained)``.
    """
    if batch is None:
        return skip_empty(run, run.clock.time_up())
    prog, learner, session = run.progress, run.learner, run.session
    batch = on_device(run, batch)
    result = forward_loss(run, batch)
    last_lr = learner.optimizer.param_groups[0]["lr"]
    step = backward_step(run, result.total, params)
    session.stats.add(result, result.captions, prog.step, step.grad_norm if learner.precision.scaler is None else None)
    session.last_lr = last_lr
    if prog.step == 1:  # a first-step failure is diagnosed from its own batch
        read_stats(run, epoch, inputs=batch.x)
    return run.clock.time_up(), float(result.captions)


def step_synchronised(run: Run, batch: Any, params: list[nn.Parameter], epoch: int) -> tuple[bool, float]:
    """One batch under torchrun or with ``train.skip_nonfinite``: the loss is read before the update.

    One all-reduce carries every rank's loss statistics and "time is up" vote; a non-finite loss stops
    the run or (``skip_nonfinite``) skips the batch. Returns as :func:`step_deferred`, agreed by all ranks.
    """
    cfg, info, prog, learner, session = run.cfg, run.info, run.progress, run.learner, run.session
    reduce_on = info.device if info.device.type == "cuda" else torch.device("cpu")
    if cfg.data.skip_missing and info.distributed:  # every rank skips a batch left empty on any rank
        flags = torch.tensor([float(batch is None), float(run.clock.time_up())], dtype=torch.float64,
                             device=reduce_on)
        flags = ddp.all_reduce_sum(flags, info).cpu()
        if flags[0] > 0:
            return skip_empty(run, bool(flags[1] > 0))
    elif batch is None:
        return skip_empty(run, not info.distributed and run.clock.time_up())
    batch = on_device(run, batch)
    objective_state = ({k: v.detach().clone() for k, v in learner.objective.state_dict().items()}
                       if cfg.train.skip_nonfinite else None)
    result = forward_loss(run, batch)
    n = float(result.captions)
    keys = sorted(result.terms)
    stats = torch.stack([result.total.detach().float() * n, result.total.new_tensor(n),
                         *(result.terms[k].float() * n for k in keys), result.objective.float() * n,
                         result.total.new_tensor(float(run.clock.time_up()))]).to(device=reduce_on,
                                                                                 dtype=torch.float64)
    stats = ddp.all_reduce_sum(stats, info).cpu()
    time_up = bool(stats[-1] > 0)
    loss = float(stats[0] / stats[1])
    if not math.isfinite(loss):
        if not cfg.train.skip_nonfinite:
            raise nonfinite_error(run, loss, epoch, inputs=batch.x)
        skip_batch(run, epoch, f"non-finite loss ({loss})", objective_state)
        return time_up, 0.0
    last_lr = learner.optimizer.param_groups[0]["lr"]  # the lr this step uses
    step = backward_step(run, result.total, params)
    if getattr(step, "skipped_nonfinite", False):  # optimizer, its state and the schedule untouched
        skip_batch(run, epoch, f"non-finite gradient norm ({step.grad_norm})", objective_state)
        return time_up, 0.0
    if learner.precision.scaler is None and getattr(step, "nonfinite", False) and session.bad_grad_step is None:
        session.bad_grad_step = prog.step
        if info.is_main:
            log.warning("non-finite gradient norm (%s) at step %d (set train.skip_nonfinite=true to skip such "
                        "batches)", step.grad_norm, prog.step)
    session.last_lr = last_lr
    session.skipped_in_a_row = 0
    parts = {"loss": float(stats[-2] / stats[1]), **{k: float(stats[2 + i] / stats[1]) for i, k in enumerate(keys)}}
    add_means(run, parts, float(stats[1]))
    return time_up, float(stats[1])


def train_one_epoch(run: Run, loader: Any, epoch: int) -> tuple[bool, bool]:
    """Train over ``loader`` (the rest of epoch ``epoch``): forward, loss, backward and step for each batch.

    Returns ``(time_up, complete)``: the time budget ran out (agreed by all ranks), the last batch was
    trained. Raises ``ImageLoadError`` for an unreadable image without ``data.skip_missing``.
    """
    learner = run.learner
    learner.forward.train()
    learner.objective.train()
    params = learner.params()
    step = step_synchronised if run.info.distributed or run.cfg.train.skip_nonfinite else step_deferred
    with EpochLog(run, loader, epoch) as batches:
        for batch in batches:
            time_up, captions = step(run, batch, params, epoch)
            batches.trained(captions)
            if time_up:
                return True, batches.remaining == 0
    return False, True
