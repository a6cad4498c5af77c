"""scripts/experiments/everyday_levers.py: the attention term that holds a fine-tuned decoder's attention
to its base model's (``--attend-kd``, a step of the shipped model's recipe)."""

from __future__ import annotations

import math

import pytest
import torch

from script_modules import load_script


@pytest.fixture(scope="module")
def levers():
    return load_script("experiments/everyday_levers.py")


def test_attention_kl_is_zero_when_the_maps_agree(levers):
    maps = torch.softmax(torch.randn(2, 3, 49), dim=-1)
    assert levers.attention_kl(maps, maps, torch.ones(2, 3, dtype=torch.bool)).item() == pytest.approx(0.0, abs=1e-6)


def test_attention_kl_known_value_counts_only_words(levers):
    target = torch.tensor([[[0.5, 0.5], [1.0, 0.0]]])  # (1, 2, 2)
    trained = torch.tensor([[[0.25, 0.75], [0.5, 0.5]]])
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # the first step's KL
    words = torch.tensor([[True, False]])  # the second step is padding
    assert levers.attention_kl(target, trained, words).item() == pytest.approx(expected, rel=1e-5)
    both = levers.attention_kl(target, trained, torch.ones(1, 2, dtype=torch.bool)).item()
    assert both == pytest.approx((expected + math.log(2.0)) / 2, rel=1e-5)


def test_attention_kl_pulls_the_trained_map_towards_the_target(levers):
    target = torch.softmax(torch.randn(1, 4, 9), dim=-1)
    logits = torch.zeros(1, 4, 9, requires_grad=True)
    opt = torch.optim.SGD([logits], lr=5.0)
    first = None
    for _ in range(200):
        loss = levers.attention_kl(target, torch.softmax(logits, -1), torch.ones(1, 4, dtype=torch.bool))
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.01 * first
    assert torch.allclose(torch.softmax(logits, -1), target, atol=0.02)
