"""Show, Attend and Tell decoder: shapes, gradients, hard sampling, stepping == teacher forcing, overfit."""

from __future__ import annotations

import pytest
import torch

from captioner.config import get_preset
from captioner.errors import ConfigError
from captioner.models.base import DecoderOutput
from captioner.models.lstm import AdditiveAttention, SATDecoder
from captioner.models.model import build_decoder, build_model
from captioner.training.objective import CaptionLoss

V, D, N = 23, 12, 9


def _decoder(**kw) -> SATDecoder:
    args = {"vocab_size": V, "feature_dim": D, "embed_dim": 8, "hidden_dim": 10, "attention_dim": 7, "dropout": 0.0}
    return SATDecoder(**{**args, **kw})


def _batch(b: int = 3, t: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, N, D, generator=gen), torch.randint(1, V, (b, t), generator=gen)


def _step_all(decoder: SATDecoder, features: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    state = decoder.init_state(features)
    log_probs, attention = [], []
    for t in range(tokens.shape[1]):
        lp, state, alpha = decoder.step(tokens[:, t], state)
        log_probs.append(lp)
        attention.append(alpha)
    return torch.stack(log_probs, 1), torch.stack(attention, 1)


def test_additive_attention_equals_the_tanh_formula():
    torch.manual_seed(0)
    attention = AdditiveAttention(feature_dim=D, hidden_dim=10, attention_dim=7)
    features, hidden = torch.randn(3, N, D) * 3, torch.randn(3, 10) * 3
    scores = attention.score(torch.tanh(attention.feature_proj(features) + attention.hidden_proj(hidden)[:, None]))
    expected = scores.squeeze(-1).log_softmax(-1)  # e = w . tanh(W_f f + W_h h), alpha = softmax(e)
    torch.testing.assert_close(attention(attention.project(features), hidden), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_forward_shapes_and_attention_is_a_distribution(attention):
    decoder = _decoder(attention=attention, dropout=0.2).train()
    features, tokens = _batch(b=4, t=5)
    out = decoder(features, tokens)
    assert out.logits.shape == (4, 5, V)
    assert out.attention.shape == (4, 5, N) and out.attention_entropy.shape == (4, 5)
    torch.testing.assert_close(out.attention.sum(-1), torch.ones(4, 5))
    beta = out.aux["beta"]
    assert beta.shape == (4, 5) and bool(((beta > 0) & (beta < 1)).all())
    assert out.aux["context"].shape == (4, 5, D)
    assert (out.sample_log_probs is not None) == (attention == "hard")
    assert bool((out.attention_entropy <= torch.log(torch.tensor(float(N))) + 1e-5).all())
    assert decoder.eval()(features, tokens).sample_log_probs is None


def test_hard_samples_are_single_regions_with_their_log_prob():
    torch.manual_seed(0)
    decoder = _decoder(attention="hard", hard_soft_prob=0.0).train()
    features, tokens = _batch(b=5, t=7)
    out = decoder(features, tokens)
    region = out.aux["region"]  # (B, T)
    assert bool((region >= 0).all())
    rows = torch.arange(5).unsqueeze(1).expand(5, 7)
    assert torch.equal(out.aux["context"], features[rows, region])  # exactly one region's feature
    expected = out.attention.gather(2, region.unsqueeze(-1)).squeeze(-1).log()
    torch.testing.assert_close(out.sample_log_probs, expected)
    assert len(set(region.flatten().tolist())) > 1  # it does sample, not always the same region

    soft = _decoder(attention="hard", hard_soft_prob=1.0).train()
    soft.load_state_dict(decoder.state_dict())
    out = soft(features, tokens)
    assert bool((out.aux["region"] == -1).all()) and bool((out.sample_log_probs == 0).all())
    torch.testing.assert_close(out.aux["context"], torch.einsum("btn,bnd->btd", out.attention, features))


def test_hard_soft_prob_mixes_per_caption_and_step():
    torch.manual_seed(1)
    out = _decoder(attention="hard", hard_soft_prob=0.5).train()(*_batch(b=8, t=10))
    soft_steps = out.aux["region"] == -1
    assert 0.2 < soft_steps.float().mean().item() < 0.8
    assert bool((out.sample_log_probs[soft_steps] == 0).all()) and bool((out.sample_log_probs[~soft_steps] < 0).all())


def test_reinforce_is_the_only_gradient_into_hard_attention():
    torch.manual_seed(0)
    decoder = _decoder(attention="hard", hard_soft_prob=0.0).train()
    features, tokens = _batch(b=6, t=6)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    out = decoder(features, inputs)
    ce_only = CaptionLoss(reinforce_weight=0.0, entropy_weight=0.0)(out, targets).total
    attn_params = list(decoder.attention.parameters())
    grads = torch.autograd.grad(ce_only, attn_params, retain_graph=True, allow_unused=True)
    assert all(g is None or not g.any() for g in grads)  # the sampled context is not differentiable in alpha
    loss = CaptionLoss(reinforce_weight=1.0, entropy_weight=0.0)
    loss(out, targets)  # first batch initialises the baseline to its mean reward
    reinforce = loss(out, targets).total - ce_only
    grads = torch.autograd.grad(reinforce, attn_params, allow_unused=True)
    assert all(g is not None and bool(g.isfinite().all()) for g in grads)
    names = [name for name, _ in decoder.attention.named_parameters()]
    assert grads[names.index("score.weight")].any() and grads[names.index("feature_proj.weight")].any()


@pytest.mark.parametrize("preset", ["sat_soft_tiny", "sat_hard_tiny"])
def test_every_decoder_parameter_gets_a_gradient_and_frozen_encoder_none(preset):
    torch.manual_seed(0)
    model = build_model(get_preset(preset).model, vocab_size=V).train()
    images = torch.randn(4, 3, 64, 64)
    tokens = torch.randint(1, V, (4, 8))
    tokens[0, 6:] = 0  # padding
    out = model(images, tokens[:, :-1])
    loss = CaptionLoss(alpha_c=1.0, entropy_weight=0.01)
    loss(out, tokens[:, 1:])
    loss(out, tokens[:, 1:]).total.backward()
    for name, p in model.decoder.named_parameters():
        assert p.grad is not None and bool(p.grad.isfinite().all()) and bool(p.grad.any()), name
    assert all(p.grad is None for p in model.encoder.parameters())


@pytest.mark.parametrize("attention,mode", [("soft", "expectation"), ("hard", "expectation"), ("hard", "argmax")])
def test_teacher_forcing_equals_stepping(attention, mode):
    torch.manual_seed(0)
    decoder = _decoder(attention=attention, hard_test_mode=mode, dropout=0.4).eval()
    _assert_forward_equals_stepping(decoder, *_batch(b=3, t=7))


def _assert_forward_equals_stepping(decoder: SATDecoder, features: torch.Tensor, tokens: torch.Tensor) -> None:
    with torch.no_grad():
        out = decoder(features, tokens)
        log_probs, attention_steps = _step_all(decoder, features, tokens)
    torch.testing.assert_close(out.logits.log_softmax(-1), log_probs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.attention, attention_steps, atol=1e-6, rtol=1e-5)


def test_stepping_reads_the_weights_as_they_are_after_a_change():
    torch.manual_seed(0)
    decoder = _decoder().eval()
    features, tokens = _batch(b=2, t=4)
    with torch.no_grad():
        before, _ = _step_all(decoder, features, tokens)  # the step's fused weights are kept between steps
        for weight in (decoder.lstm.weight_hh, decoder.attention.hidden_proj.weight, decoder.gate.bias):
            weight.add_(0.5)  # in place, as an optimizer step: the kept weights must not be read again
            after, _ = _step_all(decoder, features, tokens)
            assert not torch.allclose(after, before)
            torch.testing.assert_close(decoder(features, tokens).logits.log_softmax(-1), after, atol=1e-5, rtol=1e-5)
            before = after
    with torch.enable_grad():  # training (self-critical sampling): a fresh product with its graph, never kept
        decoder.train()
        lp, _, _ = decoder.step(tokens[:, 0], decoder.init_state(features))
        lp.sum().backward()
        assert decoder.lstm.weight_hh.grad is not None and decoder.gate.weight.grad is not None


def test_region_positions_tell_regions_apart_and_keep_forward_equal_to_stepping():
    """N = 9 regions = a 3 x 3 grid: with ``region_positions`` two identical region features get
    different attention scores (their rows and columns differ); without it they cannot."""
    torch.manual_seed(0)
    decoder = _decoder(grid=3, region_positions=True).eval()
    features, tokens = _batch(b=2, t=5)
    _assert_forward_equals_stepping(decoder, features, tokens)
    same = features[:, :1].expand(-1, N, -1)  # every region holds the same feature
    plain = _decoder().eval()
    with torch.no_grad():
        assert torch.allclose(plain(same, tokens).attention, torch.full((2, 5, N), 1.0 / N), atol=1e-6)
        assert not torch.allclose(decoder(same, tokens).attention, torch.full((2, 5, N), 1.0 / N), atol=1e-3)
    with pytest.raises(ConfigError, match="3x3 grid"):
        decoder(torch.randn(2, 16, D), tokens)
    with pytest.raises(ConfigError, match="grid size"):
        _decoder(region_positions=True)


def test_argmax_and_expectation_differ_for_hard_attention():
    torch.manual_seed(0)
    decoder = _decoder(attention="hard").eval()
    features, tokens = _batch()
    with torch.no_grad():
        expectation = decoder(features, tokens).logits
        decoder.hard_test_mode = "argmax"
        out = decoder(features, tokens)
    assert not torch.allclose(expectation, out.logits)
    rows = torch.arange(3).unsqueeze(1).expand(3, 6)
    assert torch.equal(out.aux["context"], features[rows, out.attention.argmax(-1)])
    with pytest.raises(ConfigError, match="sample"):
        decoder.hard_test_mode = "sample"


def test_state_select_picks_batch_rows():
    decoder = _decoder().eval()
    features, tokens = _batch(b=3)
    with torch.no_grad():
        start = decoder.init_state(features)
        lp, state, _ = decoder.step(tokens[:, 0], start)
        assert state.static is start.static and set(state.static) == {"features", "projected"}
        assert set(state.dynamic) == {"h", "c"}
        index = torch.tensor([2, 0, 0, 1])
        moved = state.select(index)
        lp_moved, _, alpha_moved = decoder.step(tokens[index, 1], moved)
        lp_ref, _, alpha_ref = decoder.step(tokens[:, 1], state)
    torch.testing.assert_close(lp_moved, lp_ref[index])
    torch.testing.assert_close(alpha_moved, alpha_ref[index])


def test_outputs_follow_input_order():
    decoder = _decoder(dropout=0.3).eval()
    features, tokens = _batch(b=5, t=6)
    tokens[1, 3:] = 0
    tokens[3, 2:] = 0
    perm = torch.tensor([3, 0, 4, 1, 2])
    with torch.no_grad():
        out = decoder(features, tokens)
        permuted = decoder(features[perm], tokens[perm])
    torch.testing.assert_close(permuted.logits, out.logits[perm])
    torch.testing.assert_close(permuted.attention, out.attention[perm])


def test_registry_builds_from_config():
    cfg = get_preset("sat_hard_tiny").model.decoder
    decoder = build_decoder(cfg, feature_dim=D, vocab_size=V, grid=3)
    assert isinstance(decoder, SATDecoder) and decoder.attention_type == "hard"
    assert decoder.lstm.hidden_size == cfg.hidden_dim and decoder.embedding.embedding_dim == cfg.embed_dim
    assert isinstance(decoder(*_batch()), DecoderOutput)


def test_overfit_one_batch_then_greedy_stepping_reproduces_it():
    torch.manual_seed(0)
    cfg = get_preset("sat_soft_tiny").model.decoder
    decoder = build_decoder(cfg, feature_dim=D, vocab_size=V, grid=3)
    captions = [[5, 6, 7, 8], [9, 10, 11], [5, 12, 13, 14, 15], [16, 6, 17]]
    tokens = torch.zeros(4, 7, dtype=torch.long)
    for i, words in enumerate(captions):
        tokens[i, : len(words) + 2] = torch.tensor([1, *words, 2])
    features = torch.randn(4, N, D)
    loss_fn = CaptionLoss(alpha_c=0.1)
    optimizer = torch.optim.Adam(decoder.parameters(), lr=1e-2)
    decoder.train()
    for _ in range(150):
        optimizer.zero_grad()
        loss = loss_fn(decoder(features, tokens[:, :-1]), tokens[:, 1:])
        loss.total.backward()
        optimizer.step()
    assert loss.parts["ce"] < 0.05

    decoder.eval()
    with torch.no_grad():
        state = decoder.init_state(features)
        prev = torch.full((4,), 1, dtype=torch.long)
        generated = []
        for _ in range(8):
            log_probs, state, _ = decoder.step(prev, state)
            prev = log_probs.argmax(-1)
            generated.append(prev)
    out = torch.stack(generated, 1).tolist()
    decoded = [row[: row.index(2)] if 2 in row else row for row in out]
    assert decoded == captions


def _compiled_vs_eager(backend: str) -> None:
    torch.manual_seed(0)
    eager = _decoder()
    compiled = _decoder()
    compiled.load_state_dict(eager.state_dict())
    compiled.compile_recurrence(backend=backend)
    features, tokens = _batch(b=4, t=5)
    outs = []
    for model in (eager, compiled):
        out = model(features, tokens)
        CaptionLoss(alpha_c=1.0)(out, tokens).total.backward()
        outs.append((out, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (a, ga), (b, gb) = outs
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.attention, a.attention, rtol=1e-5, atol=1e-5)
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], rtol=1e-4, atol=1e-5, msg=name)
    assert compiled.state_dict().keys() == eager.state_dict().keys()  # checkpoints are unchanged


@pytest.mark.slow  # torch.compile traces the step: about 3 s
def test_compiled_recurrence_equals_eager_mode():
    """``train.compile``: the compiled per-word step gives eager mode's outputs and gradients (graph
    capture checked with the aot_eager backend, which needs no C++ compiler)."""
    _compiled_vs_eager("aot_eager")


@pytest.mark.slow
def test_compiled_recurrence_with_inductor_equals_eager_mode():
    """The default backend generates and compiles C++ (a GPU build would generate Triton): same numbers."""
    _compiled_vs_eager("inductor")
