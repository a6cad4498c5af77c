"""One training step: forward, loss, optimizer step, and what to do with non-finite values.

``step_function`` picks ``step_deferred`` (never waits for the device) or ``step_synchronised``
(under torchrun or with ``train.skip_nonfinite``); ``nonfinite_error`` names what a non-finite loss
points to. docs/training.md explains both.

Shape legend: B batch, T caption steps (with ``<bos>``/``<eos>``), V vocabulary.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from captioner.config import EncoderConfig, TrainConfig
from captioner.decoding.graphs import record_graph
from captioner.errors import CaptionerError, ConfigError
from captioner.features.dtype import model_input
from captioner.training import distributed as ddp
from captioner.training.objective import Batch, LossResult, TrainModel, weighted_terms
from captioner.training.optim import clip_and_step, nonfinite_tensors
from captioner.training.run import Run

log = logging.getLogger(__name__)


HUGE = 1e3  # a pretrained encoder's features stay well below this after pooling


def _encoder_name(enc: EncoderConfig) -> str:
    return enc.name if enc.pretrained else f"{enc.name} with random weights (model.encoder.pretrained=false)"


def first_loss_cause(inputs: torch.Tensor | None, encoder: EncoderConfig, autocast: torch.dtype | None) -> str:
    """The likely cause of a non-finite loss at the first step, in a few words for one error line.

    Args:
        inputs: the batch the loss came from: features (B, N, D) or images (B, 3, S, S).
        encoder: the run's encoder configuration.
        autocast: the run's autocast dtype (None for fp32).

    Returns:
        A clause naming the largest input value and what to change.
    """
    fp16 = "; train.amp=fp16 overflows beyond 65504, try train.amp=bf16" if autocast == torch.float16 else ""
    if inputs is None or inputs.numel() == 0:
        return f"check the input data and the encoder {_encoder_name(encoder)}{fp16}"
    top = float(inputs.detach().abs().amax())
    if inputs.dim() != 3:  # images: the features are made inside the model
        if not math.isfinite(top):
            return f"the batch's input images hold {top} values"
        return (f"the input images are finite, so the encoder {_encoder_name(encoder)} may produce huge "
                f"activations, or the decoder's initialisation is at fault{fp16}")
    if not math.isfinite(top):
        return (f"the batch's input features hold {top} values: delete the feature cache (in "
                f"data.feature_cache_dir, $CAPTIONER_FEATURE_CACHE or the run's features/) so that it is rebuilt and checked")
    if top > HUGE:
        return (f"the batch's input features reach {top:.3g}, far beyond a pretrained encoder's: the encoder "
                f"{_encoder_name(encoder)} produces huge activations that overflow the decoder{fp16}")
    return (f"the batch's input features are finite (largest |value| {top:.3g}), so look at the decoder's "
            f"initialisation and the model config{fp16}")


BUCKET_MULTIPLE = 8  # decoder steps are padded up to a multiple of this
MAX_GRAPHS = 8  # graphs kept per GraphedStep; shapes beyond run eagerly
WARMUP_STEPS = 3  # eager steps on a side stream before a capture (lazy cuBLAS / autograd set-up)


def bucket_steps(steps: int, multiple: int = BUCKET_MULTIPLE) -> int:
    """Decoder steps padded up to a multiple of ``multiple`` (at least one bucket)."""
    if multiple < 1:
        raise ConfigError(f"bucket multiple must be >= 1, got {multiple}")
    return max(multiple, math.ceil(steps / multiple) * multiple)


@dataclass
class GraphStats:
    """What a :class:`GraphedStep` did: graphs captured, replays, eager steps, failed captures."""

    captures: int = 0
    replays: int = 0
    eager_steps: int = 0
    failed: int = 0
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
        decoder: the trained decoder (``forward(features, tokens)``; the SAT decoders).
        criterion: the training objective (``CrossEntropy``: ``loss(model, batch)``) or a bare
            ``CaptionLoss`` (``criterion(output, targets)``); its targets ignore ``pad_id``.
        pad_id: the ``<pad>`` id the padding uses (the loss's).
        autocast_dtype: run forward and loss under autocast of this dtype (None: fp32).
        multiple: bucket steps to a multiple of this.
        max_graphs: at most this many captured shapes.
        capture: capture CUDA graphs (default: when the decoder's parameters are on a CUDA device).
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
        """One batch: features (B,N,D), tokens (B,L) ``[<bos> w.. <eos> <pad>..]``, image_index (B,).

        Leaves the gradients in every parameter's ``.grad`` (the caller clips and steps; it must not
        zero them to None between this call and the optimizer step) and returns the batch's loss.
        """
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


MAX_SKIPPED_IN_A_ROW = 50  # train.skip_nonfinite: this many non-finite batches in a row stop the run
BUDGET_DECAY_FLOOR = 0.05  # train.budget_decay: the lr factor reached when the time budget runs out


def name_list(keys: list[str]) -> str:
    """``"a"``, or ``"a and 2 more"``: tensor names in a one-line error."""
    return keys[0] + (f" and {len(keys) - 1} more" if len(keys) > 1 else "")


def nonfinite_error(run: Run, value: float, epoch: int, step: int | None = None,
                    inputs: torch.Tensor | None = None) -> CaptionerError:
    """The one-line error for a non-finite loss ``value`` at ``step`` (default: the current step).

    At step 1 (before any weight update) it names the likely cause from the batch ``inputs``.
    """
    step = run.progress.step if step is None else step
    last_good = run.folder.last_good()
    if step == 1:  # before any weight update: the inputs or the model as built, never the lr
        return CaptionerError(f"non-finite loss ({value}) at the first step (epoch {epoch + 1} step 1), before any "
                              f"weight update, so neither the learning rate nor skipping batches can help: "
                              f"{first_loss_cause(inputs, run.cfg.model.encoder, run.learner.precision.dtype)}; "
                              f"{last_good}")
    bad_grad_step = run.session.bad_grad_step
    note = "" if bad_grad_step is None else f"; the gradient norm was non-finite at step {bad_grad_step}"
    return CaptionerError(f"non-finite loss ({value}) at epoch {epoch + 1} step {step}; "
                          f"{last_good} (set train.skip_nonfinite=true to skip such batches{note})")


def skip_batch(run: Run, epoch: int, why: str, objective_state: dict[str, torch.Tensor] | None) -> None:
    """``train.skip_nonfinite``: count and report a skipped batch, and stop when skipping cannot help."""
    prog, session = run.progress, run.session
    prog.skipped += 1
    session.skipped_in_a_row += 1
    if objective_state is not None:
        run.learner.objective.load_state_dict(objective_state)  # e.g. a REINFORCE baseline updated from this batch
    if run.info.is_main:
        log.warning("skipping batch at step %d: %s", prog.step, why)
    bad = nonfinite_tensors(run.learner.model)
    if bad:
        raise CaptionerError(f"non-finite weights ({name_list(bad)}) at epoch {epoch + 1} step {prog.step}: "
                             f"skipping batches cannot help; {run.folder.last_good()}")
    if session.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
        raise CaptionerError(f"{session.skipped_in_a_row} batches in a row were non-finite (last at epoch "
                             f"{epoch + 1} step {prog.step}); stopping; {run.folder.last_good()}")


def budget_decay(optimizer: torch.optim.Optimizer, t: TrainConfig, seconds: float) -> None:
    """``train.budget_decay``: scale the lrs the schedule just set by ``1 - seconds / budget`` (floored).

    Args:
        optimizer: its param groups' ``lr`` are scaled in place.
        t: ``train.budget_decay`` and ``train.time_budget`` decide; nothing happens without both.
        seconds: time since this call of ``train`` began.
    """
    if not t.budget_decay or not t.time_budget:
        return
    factor = max(BUDGET_DECAY_FLOOR, 1.0 - seconds / t.time_budget)
    for group in optimizer.param_groups:
        group["lr"] *= factor


def add_means(run: Run, means: dict[str, float], captions: float) -> None:
    """Add a reading to the epoch and log-window meters; warn once when a regulariser outweighs the CE."""
    if not captions:
        return
    run.progress.epoch_meter.add(means, captions)
    run.progress.window_meter.add(means, captions)
    ce = means.get("ce", math.nan)
    heavy = {name: value for name, value in weighted_terms(means).items() if value > ce}
    if heavy and not run.session.warned_regulariser and run.info.is_main:
        run.session.warned_regulariser = True
        name, value = max(heavy.items(), key=lambda kv: kv[1])
        hint = {"doubly_stochastic": "lower train.alpha_c or use train.ds_form=excess",
                "entropy": "lower train.entropy_weight",
                "grounding": "lower train.attention_supervision"}.get(name, "lower its weight")
        log.warning("the weighted %s term (%.3g) outweighs the cross-entropy (%.3g) at step %d: it, not the "
                    "captions, now drives the attention (%s)", name.replace("_", " "), value, ce,
                    run.progress.step, hint)


def read_stats(run: Run, epoch: int, inputs: torch.Tensor | None = None) -> None:
    """Bring the device-side loss statistics to the meters; stop on a non-finite loss among them."""
    session = run.session
    reading = session.stats.read()
    if reading.bad_grad_step is not None and session.bad_grad_step is None:
        session.bad_grad_step = reading.bad_grad_step
        if run.info.is_main:
            log.warning("non-finite gradient norm at step %d (set train.skip_nonfinite=true to skip such batches)",
                        reading.bad_grad_step)
    if reading.bad_loss is not None:
        step, value = reading.bad_loss
        raise nonfinite_error(run, value, epoch, step, inputs if step == 1 else None)
    add_means(run, reading.means, reading.captions)


def _optimizer_step(run: Run, loss: torch.Tensor, params: list[nn.Parameter]) -> Any:  # -> StepResult
    """Clip and step, then advance the schedule (and the budget decay) when the optimizer stepped."""
    learner = run.learner
    step = clip_and_step(loss, learner.optimizer, params, run.cfg.train.grad_clip, learner.precision,
                         backward=learner.graphed is None)  # a captured step has run its backward
    if step:
        learner.scheduler.step()
        budget_decay(learner.optimizer, run.cfg.train, run.clock.session_seconds())
    return step


def _batch_on_device(run: Run, batch: Any) -> Batch:
    """The loader's ``(x, tokens, image_index)`` with ``x`` and ``tokens`` moved to the run's device.

    Cached features arrive in their stored float16/bfloat16 and become float32 here, on the device
    (``model_input``): the model, the captured step's static buffers and the loss see float32.
    """
    x, tokens, image_index = batch
    device = run.info.device
    return Batch(model_input(x, device), tokens.to(device, non_blocking=True), image_index)  # tokens (B, T)


def _loss(run: Run, batch: Batch) -> LossResult:
    """The objective's loss of ``batch`` under the run's precision, gradients cleared for the backward."""
    learner = run.learner
    if learner.graphed is not None:  # train.cuda_graph: forward, loss and backward replayed as one graph
        return learner.graphed(batch.x, batch.tokens, batch.image_index)
    with learner.precision.autocast():
        result = learner.objective.loss(learner.train_model(), batch)
    learner.optimizer.zero_grad(set_to_none=True)
    return result


def _skip_empty(run: Run, time_up: bool) -> tuple[bool, float]:
    """A batch of which no image could be read (``data.skip_missing``): nothing is trained."""
    if run.info.is_main:
        log.warning("skipping batch at step %d: none of its images could be read", run.progress.step)
    return time_up, 0.0


def step_deferred(run: Run, batch: Any, params: list[nn.Parameter], epoch: int) -> tuple[bool, float]:
    """One batch on one process without ``train.skip_nonfinite``: the step never waits for the device.

    The loss terms go to ``run.session.stats`` and are checked when read (:func:`read_stats`); the
    first step is read at once, so that a failure there is diagnosed from its own batch.

    Args:
        run: the run; its learner is stepped and its session updated (``run.progress.step``
            already counts this batch).
        batch: ``(x, tokens (B,T), image_index)`` from the train loader, where x is images
            (B,3,S,S) or cached features (B,N,D); None when ``data.skip_missing`` left it empty.
        params: every trained parameter (:meth:`Learner.params`).
        epoch: 0-based epoch (for messages).

    Returns:
        ``(time_up, captions)``: the time budget ran out, and the captions trained (0 when skipped).
    """
    if batch is None:
        return _skip_empty(run, run.clock.time_up())
    prog, learner, session = run.progress, run.learner, run.session
    batch = _batch_on_device(run, batch)
    result = _loss(run, batch)
    last_lr = learner.optimizer.param_groups[0]["lr"]
    step = _optimizer_step(run, result.total, params)
    session.stats.add(result, result.captions, prog.step, step.grad_norm if learner.precision.scaler is None else None)
    session.last_lr = last_lr
    if prog.step == 1:  # a first-step failure is diagnosed from its own batch
        read_stats(run, epoch, inputs=batch.x)
    return run.clock.time_up(), float(result.captions)


def step_synchronised(run: Run, batch: Any, params: list[nn.Parameter], epoch: int) -> tuple[bool, float]:
    """One batch under torchrun or with ``train.skip_nonfinite``: the loss is read before the update.

    One all-reduce carries every rank's loss statistics and its "time is up" vote; a non-finite
    loss stops the run, or with ``train.skip_nonfinite`` skips the batch (the objective's state
    put back as it was before the batch), as does a non-finite gradient norm.

    Args and returns: as :func:`step_deferred`; ``time_up`` and ``captions`` are agreed by all ranks.
    """
    cfg, info, prog, learner, session = run.cfg, run.info, run.progress, run.learner, run.session
    reduce_on = info.device if info.device.type == "cuda" else torch.device("cpu")
    if cfg.data.skip_missing and info.distributed:  # every rank skips a batch left empty on any rank
        flags = torch.tensor([float(batch is None), float(run.clock.time_up())], dtype=torch.float64,
                             device=reduce_on)
        flags = ddp.all_reduce_sum(flags, info).cpu()
        if flags[0] > 0:
            return _skip_empty(run, bool(flags[1] > 0))
    elif batch is None:
        return _skip_empty(run, not info.distributed and run.clock.time_up())
    batch = _batch_on_device(run, batch)
    objective_state = ({k: v.detach().clone() for k, v in learner.objective.state_dict().items()}
                       if cfg.train.skip_nonfinite else None)
    result = _loss(run, batch)
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
    step = _optimizer_step(run, result.total, params)
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


def step_function(run: Run) -> Callable[[Run, Any, list[nn.Parameter], int], tuple[bool, float]]:
    """The step this run takes: :func:`step_synchronised` under torchrun or with ``train.skip_nonfinite``
    (which must decide before the optimizer steps), else :func:`step_deferred`."""
    return step_synchronised if run.info.distributed or run.cfg.train.skip_nonfinite else step_deferred
