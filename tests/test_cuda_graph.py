"""``train.cuda_graph``: the padded static-buffer step equals the plain step; buckets are chosen and reused.

The capture itself needs CUDA (the last test); on the CPU the same wrapper runs its padded
static-buffer path eagerly, which is what a graph records.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from captioner.config import get_preset
from captioner.errors import ConfigError
from captioner.models.lstm import SATDecoder
from captioner.training.objective import CaptionLoss
from captioner.training.step import GraphedStep, bucket_steps, check_cuda_graph

V, D, N = 30, 12, 9


def _decoder(attention: str = "soft", device: str = "cpu") -> SATDecoder:
    torch.manual_seed(0)
    return SATDecoder(V, D, embed_dim=8, hidden_dim=16, attention_dim=8, dropout=0.0, attention=attention).to(device)


def _batch(lengths: list[int], seed: int = 1, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """features (B,N,D) and tokens (B, max length) ``[<bos>=1 w.. <eos>=2 <pad>=0..]``."""
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(len(lengths), N, D, generator=gen).relu()
    tokens = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, n in enumerate(lengths):
        tokens[i, 0], tokens[i, n - 1] = 1, 2
        tokens[i, 1:n - 1] = torch.randint(4, V, (n - 2,), generator=gen)
    return features.to(device), tokens.to(device)


def _loss(**kw) -> CaptionLoss:  # noqa: ANN003
    return CaptionLoss(pad_id=0, alpha_c=1.0, ds_form="excess", entropy_weight=0.01, **kw)


def _eager(decoder: SATDecoder, loss: CaptionLoss, features: torch.Tensor, tokens: torch.Tensor):  # noqa: ANN202
    decoder.zero_grad(set_to_none=True)
    result = loss(decoder(features, tokens[:, :-1]), tokens[:, 1:])
    result.total.backward()
    return result, {n: p.grad.clone() for n, p in decoder.named_parameters() if p.grad is not None}


def _grads(decoder: SATDecoder) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in decoder.named_parameters() if p.grad is not None}


def _assert_same(result, grads, other, other_grads) -> None:  # noqa: ANN001
    assert torch.allclose(result.total, other.total, rtol=1e-5, atol=1e-6), (result.total, other.total)
    assert torch.allclose(result.objective, other.objective, rtol=1e-5, atol=1e-6)
    assert set(result.terms) == set(other.terms)
    for k in result.terms:
        assert torch.allclose(result.terms[k], other.terms[k], rtol=1e-5, atol=1e-6), k
    assert set(grads) == set(other_grads)
    for name in grads:
        assert torch.allclose(grads[name], other_grads[name], rtol=1e-4, atol=1e-6), name


def test_bucket_steps_rounds_up_to_the_multiple() -> None:
    assert [bucket_steps(s) for s in (1, 7, 8, 9, 16, 17)] == [8, 8, 8, 16, 16, 24]
    assert bucket_steps(5, multiple=1) == 5
    with pytest.raises(ConfigError, match="bucket multiple must be >= 1, got 0"):
        bucket_steps(5, multiple=0)


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_padded_static_step_equals_the_eager_step(attention: str) -> None:
    """Steps padded from 9 to 16: the loss terms and every gradient are the plain step's (the hard
    decoder's samples too: the padded steps draw their random numbers after the real ones)."""
    features, tokens = _batch([10, 7, 5, 8])  # 9 decoder steps -> bucket 16
    decoder, loss = _decoder(attention), _loss()
    torch.manual_seed(5)
    eager, eager_grads = _eager(decoder, loss, features, tokens)
    graphed = GraphedStep(_decoder(attention), _loss(), pad_id=0, capture=False)
    torch.manual_seed(5)
    result = graphed(features, tokens)
    _assert_same(result, _grads(graphed.decoder), eager, eager_grads)
    assert graphed.stats.as_dict() == {"captures": 0, "replays": 0, "eager_steps": 1, "failed_captures": 0,
                                       "buckets": {f"4x{N}x{D}x16": 1}}
    if attention == "hard":  # the REINFORCE baseline moved exactly as in the plain step
        assert torch.equal(graphed.criterion.baseline, loss.baseline)


def test_a_short_batch_after_a_long_one_of_the_same_bucket_leaves_no_stale_tokens() -> None:
    """Buffers are reused across a bucket: the steps beyond a batch's own must be <pad> again."""
    graphed = GraphedStep(_decoder(), _loss(), pad_id=0, capture=False)
    long_f, long_t = _batch([9, 9, 9], seed=2)  # 8 steps -> bucket 8
    short_f, short_t = _batch([4, 3, 4], seed=3)  # 3 steps -> bucket 8
    graphed(long_f, long_t)
    buffer = graphed._entries[(3, N, D, 8)].tokens
    pointer = buffer.data_ptr()
    result = graphed(short_f, short_t)
    assert buffer.data_ptr() == pointer and len(graphed._entries) == 1  # the same buffers, reused
    assert torch.equal(buffer[:, :4], short_t) and bool((buffer[:, 4:] == 0).all())
    eager, eager_grads = _eager(_decoder(), _loss(), short_f, short_t)
    _assert_same(result, _grads(graphed.decoder), eager, eager_grads)


def test_each_shape_gets_its_own_buffers_and_counts() -> None:
    graphed = GraphedStep(_decoder(), _loss(), pad_id=0, capture=False)
    for lengths in ([5, 4], [9, 3], [10, 4], [5, 4, 3], [6, 6]):  # steps 4, 8, 9, 4, 5 at B 2, 2, 2, 3, 2
        graphed(*_batch(lengths))
    assert graphed.stats.buckets == {(2, N, D, 8): 3, (2, N, D, 16): 1, (3, N, D, 8): 1}
    assert graphed.stats.eager_steps == 5 and graphed.stats.captures == 0 and graphed.graphs == 0


def test_gradients_are_left_for_the_optimizer() -> None:
    """The wrapper leaves ``.grad`` in place: an optimizer step after it moves the weights as the
    plain step's would."""
    features, tokens = _batch([6, 5, 4])
    plain, graphed = _decoder(), GraphedStep(_decoder(), _loss(), pad_id=0, capture=False)
    _eager(plain, _loss(), features, tokens)
    graphed(features, tokens)
    for module in (plain, graphed.decoder):
        torch.optim.SGD(module.parameters(), lr=0.1).step()
    for (name, a), b in zip(plain.named_parameters(), graphed.decoder.parameters()):
        assert torch.allclose(a, b, atol=1e-6), name


def test_bad_shapes_and_devices_are_refused_in_one_line() -> None:
    graphed = GraphedStep(_decoder(), _loss(), pad_id=0, capture=False)
    with pytest.raises(ValueError, match=r"expected \(B, N, D\) and \(B, L\)"):
        graphed(torch.zeros(2, N, D), torch.zeros(3, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="needs <bos> and at least one target"):
        graphed(torch.zeros(2, N, D), torch.ones(2, 1, dtype=torch.long))
    with pytest.raises(ConfigError, match=r"train.cuda_graph needs a CUDA device \(the decoder is on cpu\)"):
        GraphedStep(_decoder(), _loss(), pad_id=0, capture=True)


def test_check_cuda_graph_names_what_is_missing() -> None:
    t = get_preset("sat_soft_tiny").train
    cuda = torch.device("cuda")
    with pytest.raises(ConfigError, match=r"needs a CUDA device \(training on cpu\)"):
        check_cuda_graph(t, "sat", True, torch.device("cpu"), False)
    with pytest.raises(ConfigError, match="decoder 'transformer' is not one"):
        check_cuda_graph(t, "transformer", True, cuda, False)
    with pytest.raises(ConfigError, match="needs cached features"):
        check_cuda_graph(t, "sat", False, cuda, False)
    with pytest.raises(ConfigError, match="not supported under torchrun"):
        check_cuda_graph(t, "sat", True, cuda, True)
    t.compile = True
    with pytest.raises(ConfigError, match="train.cuda_graph and train.compile are alternatives"):
        check_cuda_graph(t, "sat", True, cuda, False)


def test_training_with_cuda_graph_on_the_cpu_is_refused_before_anything_is_written(tmp_path) -> None:  # noqa: ANN001
    from captioner.training.loop import train

    cfg = get_preset("sat_soft_tiny", **{"train.device": "cpu", "train.cuda_graph": True,
                                         "data.root": str(tmp_path / "nowhere")})
    with pytest.raises(ConfigError, match=r"train.cuda_graph needs a CUDA device \(training on cpu\)"):
        train(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the capture itself needs a CUDA device")
def test_captured_step_equals_the_eager_step_on_cuda() -> None:
    features, tokens = _batch([10, 7, 5, 8], device="cuda")
    eager, eager_grads = _eager(_decoder(device="cuda"), _loss().cuda(), features, tokens)
    graphed = GraphedStep(_decoder(device="cuda"), _loss().cuda(), pad_id=0)
    for _ in range(2):  # capture, then replay the same graph
        result = graphed(features, tokens)
        _assert_same(result, _grads(graphed.decoder), eager, eager_grads)
    assert (graphed.stats.captures, graphed.stats.replays, graphed.stats.eager_steps) == (1, 2, 0)


class _PadMaskedTerm:
    """An extra loss term that ignores <pad> targets, as a LossTerm must for padded buckets."""

    name, weight = "logit0", 0.1

    def __call__(self, output, batch) -> torch.Tensor:  # noqa: ANN001
        mask = (batch.tokens[:, 1:] != 0).float()  # (B, T)
        return (output.logits[..., 0] * mask).sum() / batch.tokens.shape[0]


def test_a_training_objective_with_extra_terms_gives_its_eager_loss() -> None:
    """The training loop hands the wrapper its ``CrossEntropy`` objective: ``objective.loss`` on the padded
    buffers (extra terms included) equals ``objective.loss`` on the batch, and ``captions`` is the batch."""
    from captioner.training.objective import Batch, CrossEntropy, TrainModel

    features, tokens = _batch([10, 7, 5, 8])
    index = torch.arange(4)

    def objective() -> CrossEntropy:
        return CrossEntropy(extra_terms=[_PadMaskedTerm()], pad_id=0, alpha_c=1.0, entropy_weight=0.01)

    decoder = _decoder()
    eager = objective().loss(TrainModel(decoder, decoder), Batch(features, tokens, index))
    eager.total.backward()
    graphed = GraphedStep(_decoder(), objective(), pad_id=0, capture=False)
    result = graphed(features, tokens, index)
    assert result.captions == eager.captions == 4
    assert "weighted_logit0" in result.terms
    _assert_same(result, _grads(graphed.decoder), eager, _grads(decoder))


class _CountCasts(TorchDispatchMode):
    """Counts dtype casts (``aten._to_copy``) per input shape."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: dict[tuple[int, ...], int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is torch.ops.aten._to_copy.default:
            shape = tuple(args[0].shape)
            self.shapes[shape] = self.shapes.get(shape, 0) + 1
        return func(*args, **(kwargs or {}))


def test_under_autocast_the_features_are_cast_once_and_the_loss_stays_close() -> None:
    """bf16 autocast: the SAT decoder casts the (B,N,D) features once, not at every step's bmm;
    the loss stays within bf16 rounding of fp32, and the padded static-buffer path keeps it."""
    features, tokens = _batch([10, 7, 5, 8])
    decoder, loss = _decoder(), _loss()
    fp32 = loss(decoder(features, tokens[:, :-1]), tokens[:, 1:]).total.detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = decoder(features, tokens[:, :-1])
        bf16 = loss(out, tokens[:, 1:]).total.detach()
    assert out.aux["context"].dtype == torch.bfloat16  # the context came from bf16 features
    with _CountCasts() as casts, torch.autocast("cpu", dtype=torch.bfloat16):
        decoder(features, tokens[:, :-1])
    w_query = decoder.lstm.weight_hh.shape[0] + decoder.attention_dim + 1, decoder.hidden_dim  # (4H+A+1, H)
    w_ctx = decoder.lstm.weight_hh.shape[0], D  # (4H, D)
    # once per batch, not once per step (9 steps here): the features, the fused query weight, the context weight
    assert [casts.shapes.get(s) for s in (tuple(features.shape), w_query, w_ctx)] == [1, 1, 1]
    assert abs(float(bf16) - float(fp32)) < 0.02 * abs(float(fp32))
    graphed = GraphedStep(_decoder(), _loss(), pad_id=0, autocast_dtype=torch.bfloat16, capture=False)
    assert torch.allclose(graphed(features, tokens).total, bf16, rtol=1e-2)


@pytest.mark.slow
def test_the_training_loop_with_the_wrapper_logs_the_plain_loops_losses(tiny_shapes, tmp_path, monkeypatch,
                                                                         caplog) -> None:  # noqa: ANN001
    """The whole loop (``train``) through the wrapper's step -- on the CPU its eager static-buffer path, the
    device check lifted for the test -- logs the losses of the plain loop, step by step (SAT soft, dropout 0)."""
    import ast
    import csv
    import logging

    import captioner.training.loop as loop

    def losses(run) -> list[float]:  # noqa: ANN001
        with open(run / "metrics.csv", newline="") as f:
            return [float(r["loss"]) for r in csv.DictReader(f) if r["kind"] == "step"]

    def config(graph: bool):  # noqa: ANN202
        return get_preset("sat_soft_tiny", **{"data.root": str(tiny_shapes), "train.epochs": 1,
                                              "train.batch_size": 16, "train.log_every": 1, "train.val_max_images": 4,
                                              "train.device": "cpu", "train.cuda_graph": graph,
                                              "data.feature_cache_dir": str(tmp_path / "features")})

    loop.train(config(False), tmp_path / "plain", progress=False)
    monkeypatch.setattr(loop, "check_cuda_graph", lambda *args: None)
    with caplog.at_level(logging.INFO, logger="captioner.training.loop"):
        loop.train(config(True), tmp_path / "graphed", progress=False)
    plain, graphed = losses(tmp_path / "plain"), losses(tmp_path / "graphed")
    assert len(plain) == len(graphed) > 3
    assert graphed == pytest.approx(plain, rel=1e-4)
    (stats,) = [ast.literal_eval(r.getMessage().split(": ", 1)[1]) for r in caplog.records
                if r.getMessage().startswith("train.cuda_graph: {")]
    assert stats["eager_steps"] == len(graphed) and stats["captures"] == 0  # every step went through the wrapper
