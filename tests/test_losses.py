"""CaptionLoss: cross-entropy with padding, doubly stochastic penalty, REINFORCE with baseline + entropy."""

from __future__ import annotations

import math

import pytest
import torch

from captioner.errors import ConfigError
from captioner.models.base import DecoderOutput
from captioner.training.objective import CaptionLoss, doubly_stochastic_penalty

V = 7


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
    assert doubly_stochastic_penalty(attention, targets != 0, "sum").item() == pytest.approx(0.35)  # the paper
    assert doubly_stochastic_penalty(attention, targets != 0, "mean").item() == pytest.approx(0.35 / 2)  # over N = 2
    # excess: only coverage above 1 counts: (0.36 + 0.16) / 2 and (0.09 + 0) / 2, batch mean
    assert doubly_stochastic_penalty(attention, targets != 0).item() == pytest.approx((0.26 + 0.045) / 2)
    out = DecoderOutput(logits=logits, attention=attention)
    result = CaptionLoss(alpha_c=2.0, ds_form="sum")(out, targets)
    assert result.parts["doubly_stochastic"] == pytest.approx(0.35)
    assert result.total.item() == pytest.approx(result.parts["ce"] + 0.7, rel=1e-5)
    assert result.objective.item() == pytest.approx(result.total.item())
    assert result.terms["weighted_doubly_stochastic"].item() == pytest.approx(0.7)
    assert "doubly_stochastic" not in CaptionLoss(alpha_c=0.0)(out, targets).parts
    with pytest.raises(ConfigError, match="ds_form"):
        CaptionLoss(ds_form="max")


@pytest.mark.parametrize("grid", [4, 8, 14])
def test_penalty_forms_and_their_pull_towards_uniform_attention(grid: int):
    """With T < N words the paper's penalty (sum) is minimised by uniform attention and charges more
    than a nat per caption for looking at one region per word; the tutorial's mean shrinks that pull
    but keeps it; the excess form charges nothing for either and only penalises staring."""
    n, t = grid * grid, 12
    mask = torch.ones(1, t, dtype=torch.bool)
    uniform = torch.full((1, t, n), 1.0 / n)
    peaked = torch.zeros(1, t, n)
    peaked[0, torch.arange(t), torch.arange(t) % n] = 1.0  # one distinct region per word (while they last)
    staring = torch.zeros(1, t, n)
    staring[0, :, 0] = 1.0  # every word on region 0
    pen = {form: [doubly_stochastic_penalty(a, mask, form).item() for a in (uniform, peaked, staring)]
           for form in ("sum", "mean", "excess")}
    for form in ("sum", "mean"):
        u, p, _ = pen[form]
        assert u <= p + 1e-6  # uniform attention is their minimum
    if n > 2 * t:
        assert pen["sum"][1] - pen["sum"][0] > 1.0  # more than a nat per caption for looking
    assert pen["mean"][1] - pen["mean"][0] <= 0.25 + 1e-6
    u, p, s = pen["excess"]
    if n >= t:
        assert u == p == 0.0  # no pull either way
    assert s == pytest.approx((t - 1) ** 2 / n)  # staring at one region all caption is what it charges


def test_reinforce_uses_a_normalised_length_free_advantage_and_entropy_bonus():
    loss = CaptionLoss(reinforce_weight=2.0, entropy_weight=0.1, baseline_decay=0.9)
    assert {"baseline", "advantage_var"} <= set(loss.state_dict())
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    entropy = torch.tensor([[1.0, 2.0, 3.0], [0.5, 1.5, 99.0]])  # the padded 99 must be ignored
    expected_entropy = (1.0 + 2.0 + 3.0 + 0.5 + 1.5) / 5

    state = {}
    for seed in (0, 1):
        logits, targets = _logits_targets(seed)
        nll = _manual_nll(logits, targets)
        reward = torch.tensor([-sum(nll[0]) / 3, -(nll[1][0] + nll[1][1]) / 2])  # mean log-likelihood per word
        sample_lp = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -0.7, -5.0]], requires_grad=True)
        out = DecoderOutput(logits=logits, sample_log_probs=sample_lp, attention_entropy=entropy)
        result = loss(out, targets)
        if seed == 0:
            b = reward.mean().item()
            var = ((reward - b) ** 2).mean().item()
        else:
            b, var = state["b"], state["var"]
        normalised = ((reward - b) / math.sqrt(var)).clamp(-5, 5)
        term = -2.0 * (normalised[0] * -3.5 + normalised[1] * -1.0).item() / 5  # token mean over 5 words
        assert result.parts["baseline"] == pytest.approx(b, rel=1e-5)
        assert result.parts["advantage_scale"] == pytest.approx(math.sqrt(var), rel=1e-5)
        assert result.parts["reinforce"] == pytest.approx(term, rel=1e-4, abs=1e-6)
        assert result.parts["entropy"] == pytest.approx(expected_entropy)
        # the objective is what the model minimises, not the surrogate: ce - bonus
        assert result.objective.item() == pytest.approx(result.parts["ce"] - 0.1 * expected_entropy, rel=1e-5)
        assert result.total.item() == pytest.approx(result.objective.item() + term, rel=1e-4)
        result.total.backward()
        expected_grad = (-2.0 * normalised / 5).unsqueeze(1) * mask
        torch.testing.assert_close(sample_lp.grad, expected_grad)
        state = {"b": 0.9 * b + 0.1 * reward.mean().item() if seed else reward.mean().item(),
                 "var": 0.9 * var + 0.1 * ((reward - b) ** 2).mean().item()}
        assert loss.baseline.item() == pytest.approx(state["b"], rel=1e-5)
        assert loss.advantage_var.item() == pytest.approx(state["var"], rel=1e-5)

    loss.eval()  # validation never moves the baseline
    logits, targets = _logits_targets(2)
    loss(DecoderOutput(logits=logits, sample_log_probs=torch.zeros(2, 3)), targets)
    assert loss.baseline.item() == pytest.approx(state["b"], rel=1e-5)
    assert int(loss.baseline_updates) == 2


def test_one_reinforce_update_raises_the_log_probability_of_the_better_sample():
    """Two captions sampled regions 0 and 1 of the same attention distribution; caption 0 is
    explained better (higher log-likelihood). One gradient step on the REINFORCE term must make
    region 0 more likely and region 1 less likely."""
    scores = torch.zeros(1, 4, requires_grad=True)  # attention logits over 4 regions, shared by both rows
    optimizer = torch.optim.SGD([scores], lr=0.5)
    log_alpha = scores.log_softmax(-1).expand(2, 4)  # (B, N)
    sample_lp = torch.stack([log_alpha[0, 0], log_alpha[1, 1]]).view(2, 1)  # (B, T=1)
    logits = torch.zeros(2, 1, V)
    logits[0, 0, 4] = 5.0  # caption 0's word is likely given its sample, caption 1's is not
    targets = torch.tensor([[4], [4]])
    loss = CaptionLoss(reinforce_weight=1.0)
    result = loss(DecoderOutput(logits=logits, sample_log_probs=sample_lp), targets)
    assert result.parts["ce"] > 0
    before = scores.detach().log_softmax(-1)[0]
    result.total.backward()
    optimizer.step()
    after = scores.detach().log_softmax(-1)[0]
    assert after[0] > before[0]  # the better-rewarded region gained probability
    assert after[1] < before[1]


def test_transformer_style_output_only_has_cross_entropy():
    logits, targets = _logits_targets()
    out = DecoderOutput(logits=logits, attention=torch.full((2, 3, 4), 0.25), attention_entropy=torch.ones(2, 3))
    assert set(CaptionLoss(alpha_c=1.0)(out, targets).parts) == {"ce", "doubly_stochastic"}
    assert set(CaptionLoss(entropy_weight=0.5)(out, targets).parts) == {"ce"}


def test_bad_loss_options_are_config_errors():
    with pytest.raises(ConfigError, match="label_smoothing"):
        CaptionLoss(label_smoothing=1.0)
    with pytest.raises(ConfigError, match="baseline_decay"):
        CaptionLoss(baseline_decay=1.5)
