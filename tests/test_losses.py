"""CaptionLoss: cross-entropy with padding, doubly stochastic penalty, REINFORCE with baseline + entropy."""

from __future__ import annotations

import math

import pytest
import torch

from captioner.errors import ConfigError
from captioner.losses import CaptionLoss, doubly_stochastic_penalty
from captioner.models.base import DecoderOutput

V = 7


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _logits_targets(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 3, V, generator=gen)
    targets = torch.tensor([[4, 5, 2], [6, 2, 0]])  # second caption padded at its last step
    return logits, targets


def _manual_nll(logits: torch.Tensor, targets: torch.Tensor) -> list[list[float]]:
    logp = logits.log_softmax(-1)
    return [[-logp[b, t, targets[b, t]].item() for t in range(targets.shape[1])] for b in range(targets.shape[0])]


def test_cross_entropy_averages_over_non_pad_tokens_only():
    logits, targets = _logits_targets()
    nll = _manual_nll(logits, targets)
    expected = (nll[0][0] + nll[0][1] + nll[0][2] + nll[1][0] + nll[1][1]) / 5
    result = CaptionLoss()(DecoderOutput(logits=logits), targets)
    assert result.parts == {"ce": pytest.approx(expected, rel=1e-5)}
    assert result.total.item() == pytest.approx(expected, rel=1e-5)
    changed = logits.clone()
    changed[1, 2] = 100.0  # the padded step
    assert CaptionLoss()(DecoderOutput(logits=changed), targets).total.item() == pytest.approx(expected, rel=1e-5)


def test_label_smoothing_matches_its_definition():
    logits, targets = _logits_targets()
    eps = 0.2
    logp = logits.log_softmax(-1)
    mask = targets != 0
    nll = -logp.gather(2, targets.unsqueeze(-1)).squeeze(-1)
    smooth = -logp.mean(-1)
    expected = (((1 - eps) * nll + eps * smooth)[mask]).mean()
    result = CaptionLoss(label_smoothing=eps)(DecoderOutput(logits=logits), targets)
    assert result.total.item() == pytest.approx(expected.item(), rel=1e-5)


def test_doubly_stochastic_matches_hand_computation_with_padding():
    attention = torch.tensor([
        [[0.5, 0.5], [0.2, 0.8], [0.9, 0.1]],  # sums over t: 1.6, 1.4 -> 0.36 + 0.16 = 0.52
        [[1.0, 0.0], [0.3, 0.7], [0.6, 0.4]],  # last step padded: 1.3, 0.7 -> 0.09 + 0.09 = 0.18
    ])
    logits, targets = _logits_targets()
    assert doubly_stochastic_penalty(attention, targets != 0).item() == pytest.approx(0.35)
    out = DecoderOutput(logits=logits, attention=attention)
    result = CaptionLoss(alpha_c=2.0)(out, targets)
    assert result.parts["doubly_stochastic"] == pytest.approx(0.35)
    assert result.total.item() == pytest.approx(result.parts["ce"] + 0.7, rel=1e-5)
    assert "doubly_stochastic" not in CaptionLoss(alpha_c=0.0)(out, targets).parts


def test_transformer_style_output_only_has_cross_entropy():
    logits, targets = _logits_targets()
    out = DecoderOutput(logits=logits, attention=torch.full((2, 3, 4), 0.25), attention_entropy=torch.ones(2, 3))
    assert set(CaptionLoss(alpha_c=1.0)(out, targets).parts) == {"ce", "doubly_stochastic"}
    assert set(CaptionLoss(entropy_weight=0.5)(out, targets).parts) == {"ce"}


def test_reinforce_with_moving_average_baseline_and_entropy_bonus():
    loss = CaptionLoss(reinforce_weight=2.0, entropy_weight=0.1, baseline_decay=0.9)
    assert "baseline" in loss.state_dict()
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    entropy = torch.tensor([[1.0, 2.0, 3.0], [0.5, 1.5, 99.0]])  # the padded 99 must be ignored
    expected_entropy = (1.0 + 2.0 + 3.0 + 0.5 + 1.5) / 5

    baselines = []
    for seed in (0, 1):
        logits, targets = _logits_targets(seed)
        nll = _manual_nll(logits, targets)
        reward = torch.tensor([-sum(nll[0]), -(nll[1][0] + nll[1][1])])
        sample_lp = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -0.7, -5.0]], requires_grad=True)
        out = DecoderOutput(logits=logits, sample_log_probs=sample_lp, attention_entropy=entropy)
        result = loss(out, targets)
        b = reward.mean().item() if seed == 0 else baselines[-1]
        advantage = reward - b
        summed_lp = torch.tensor([-3.5, -1.0])
        term = -2.0 * (advantage * summed_lp).mean().item()
        assert result.parts["baseline"] == pytest.approx(b, rel=1e-5)
        assert result.parts["reinforce"] == pytest.approx(term, rel=1e-4, abs=1e-6)
        assert result.parts["entropy"] == pytest.approx(expected_entropy)
        expected_total = result.parts["ce"] + term - 0.1 * expected_entropy
        assert result.total.item() == pytest.approx(expected_total, rel=1e-4)
        result.total.backward()
        expected_grad = (-2.0 * advantage / 2).unsqueeze(1) * mask
        torch.testing.assert_close(sample_lp.grad, expected_grad)
        new_b = reward.mean().item() if seed == 0 else 0.9 * b + 0.1 * reward.mean().item()
        assert loss.baseline.item() == pytest.approx(new_b, rel=1e-5)
        baselines.append(new_b)
    assert not math.isclose(baselines[0], baselines[1])

    loss.eval()  # validation never moves the baseline
    logits, targets = _logits_targets(2)
    loss(DecoderOutput(logits=logits, sample_log_probs=torch.zeros(2, 3)), targets)
    assert loss.baseline.item() == pytest.approx(baselines[-1])
    assert int(loss.baseline_updates) == 2


def test_bad_loss_options_are_config_errors():
    with pytest.raises(ConfigError, match="label_smoothing"):
        CaptionLoss(label_smoothing=1.0)
    with pytest.raises(ConfigError, match="baseline_decay"):
        CaptionLoss(baseline_decay=1.5)
