"""Transformer decoder: shapes, gradients, causality, cache == full forward, attention paths,
padding, beam reordering, tied embeddings, overfitting one batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from captioner.config import get_preset
from captioner.errors import ConfigError
from captioner.models.base import State
from captioner.models.registry import build_decoder
from captioner.models.transformer import MultiHeadAttention, TransformerCaptionDecoder

V, D, G = 13, 12, 3  # vocabulary, feature width, grid (N = 9)
N = G * G
BOS, EOS = 1, 2


def make_decoder(seed: int = 0, **kwargs) -> TransformerCaptionDecoder:
    torch.manual_seed(seed)
    args = dict(vocab_size=V, feature_dim=D, grid=G, d_model=16, num_layers=2, num_heads=4, ff_dim=32,
                dropout=0.0, max_len=8)
    args.update(kwargs)
    return TransformerCaptionDecoder(**args)


def inputs(batch: int = 3, steps: int = 6, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(batch, N, D, generator=gen)
    tokens = torch.randint(3, V, (batch, steps), generator=gen)
    tokens[:, 0] = BOS
    return features, tokens


def run_steps(dec: TransformerCaptionDecoder, state: State, tokens: torch.Tensor) -> tuple[torch.Tensor, State]:
    """Feed tokens (B, T) one by one; returns log-probs (B, T, V) and the final state."""
    out = []
    for t in range(tokens.shape[1]):
        lp, state, _ = dec.step(tokens[:, t], state)
        out.append(lp)
    return torch.stack(out, dim=1), state


def test_shapes_and_attention_rows() -> None:
    dec = make_decoder().eval()
    features, tokens = inputs()
    out = dec(features, tokens, need_all_attention=True)
    assert out.logits.shape == (3, 6, V)
    assert out.attention.shape == (3, 6, N)
    assert out.all_attention.shape == (3, 6, 2, 4, N)
    assert out.attention_entropy.shape == (3, 6)
    # every head of every layer is a distribution over regions
    torch.testing.assert_close(out.all_attention.sum(-1), torch.ones(3, 6, 2, 4))
    assert (out.all_attention >= 0).all()
    # the overlay view is the last layer averaged over heads
    torch.testing.assert_close(out.attention, out.all_attention[:, :, -1].mean(2))
    assert (out.attention_entropy <= torch.log(torch.tensor(float(N))) + 1e-5).all()
    assert dec(features, tokens).all_attention is None


def test_every_parameter_gets_a_finite_gradient() -> None:
    dec = make_decoder(dropout=0.1).train()
    features, tokens = inputs()
    out = dec(features, tokens)
    targets = torch.randint(3, V, tokens.shape)
    F.cross_entropy(out.logits.reshape(-1, V), targets.reshape(-1)).backward()
    for name, p in dec.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_causality() -> None:
    dec = make_decoder().eval()
    features, tokens = inputs()
    base = dec(features, tokens).logits
    changed = tokens.clone()
    changed[:, 3] = (changed[:, 3] + 1 - 3) % (V - 3) + 3  # a different real token
    logits = dec(features, changed).logits
    torch.testing.assert_close(logits[:, :3], base[:, :3], rtol=0, atol=1e-6)
    assert (logits[:, 3:] - base[:, 3:]).abs().max() > 1e-3  # later steps do see it


def test_regions_matter_and_positions_matter() -> None:
    dec = make_decoder().eval()
    features, tokens = inputs()
    base = dec(features, tokens).logits
    assert (dec(features.flip(1), tokens).logits - base).abs().max() > 1e-3  # 2-D region positions
    assert (dec(torch.randn_like(features), tokens).logits - base).abs().max() > 1e-3


@pytest.mark.parametrize("use_cache", [True, False])
def test_step_by_step_equals_full_forward(use_cache: bool) -> None:
    dec = make_decoder(num_layers=3).eval()
    features, tokens = inputs(steps=12)  # longer than the position table (max_len + 2 = 10)
    with torch.no_grad():
        full = dec(features, tokens)
        state = dec.init_state(features, use_cache=use_cache)
        log_probs, attn = [], []
        for t in range(tokens.shape[1]):
            lp, state, a = dec.step(tokens[:, t], state)
            log_probs.append(lp)
            attn.append(a)
    torch.testing.assert_close(torch.stack(log_probs, 1), full.logits.log_softmax(-1), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.stack(attn, 1), full.attention, rtol=0, atol=1e-5)
    assert state.dynamic["step"] == tokens.shape[1]
    if use_cache:
        assert state.dynamic["self_k"][0].shape == (3, 4, tokens.shape[1], 4)


def test_step_does_not_modify_state() -> None:
    dec = make_decoder().eval()
    features, tokens = inputs()
    state = dec.init_state(features)
    _, s1, _ = dec.step(tokens[:, 0], state)
    lp_a, _, _ = dec.step(tokens[:, 1], s1)
    lp_b, _, _ = dec.step(tokens[:, 1], s1)  # same state twice (beam search keeps old states)
    assert state.dynamic["step"] == 0 and state.dynamic["self_k"][0].shape[2] == 0
    torch.testing.assert_close(lp_a, lp_b, rtol=0, atol=0)
    # the projected regions are per-image constants: computed once, passed on as the same objects
    assert s1.static is state.static and set(state.static) == {"memory_k", "memory_v"}


def test_fused_and_manual_attention_agree() -> None:
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, kv_dim=16).eval()
    x, mem = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
    for source, causal in ((None, True), (mem, False)):
        fused, w_none = mha(x, source, causal=causal)
        manual, w = mha(x, source, causal=causal, need_weights=True)
        assert w_none is None and w.shape == (2, 4, 5, 5 if source is None else 7)
        torch.testing.assert_close(fused, manual, rtol=0, atol=1e-5)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 5))
        if causal:
            assert (w.triu(1) == 0).all()
    # the decoder: all layers manual (need_all_attention) == mostly fused
    dec = make_decoder(num_layers=3).eval()
    features, tokens = inputs()
    torch.testing.assert_close(dec(features, tokens, need_all_attention=True).logits,
                               dec(features, tokens).logits, rtol=0, atol=1e-5)


def test_padding_does_not_change_real_tokens() -> None:
    dec = make_decoder().eval()
    features, _ = inputs(batch=2)
    short = torch.tensor([[BOS, 5, 6, EOS]])  # caption of image 0 alone
    long = torch.tensor([[BOS, 7, 8, 9, 10, 11, EOS]])
    batch = torch.zeros(2, 7, dtype=torch.long)
    batch[0, :4], batch[1] = short[0], long[0]  # padded with 0 after <eos>
    inp, tgt = batch[:, :-1], batch[:, 1:]
    logits = dec(features, inp).logits
    alone = dec(features[:1], short[:, :-1]).logits
    torch.testing.assert_close(logits[0, :3], alone[0], rtol=0, atol=1e-5)
    loss = F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1), ignore_index=0, label_smoothing=0.1)
    alone_long = dec(features[1:], long[:, :-1]).logits
    per_token = torch.cat([
        F.cross_entropy(alone[0], short[0, 1:], reduction="none", label_smoothing=0.1),
        F.cross_entropy(alone_long[0], long[0, 1:], reduction="none", label_smoothing=0.1),
    ])
    torch.testing.assert_close(loss, per_token.mean(), rtol=0, atol=1e-5)
    # whatever sits in the padded slots, the loss of the real tokens is the same
    noisy = inp.clone()
    noisy[0, 4:] = torch.tensor([9, 9])
    noisy_logits = dec(features, noisy).logits
    loss2 = F.cross_entropy(noisy_logits.reshape(-1, V), tgt.reshape(-1), ignore_index=0, label_smoothing=0.1)
    torch.testing.assert_close(loss2, loss, rtol=0, atol=1e-6)


def test_state_select_matches_running_on_the_reordered_batch() -> None:
    dec = make_decoder().eval()
    features, tokens = inputs()
    index = torch.tensor([2, 0, 0, 1])
    with torch.no_grad():
        _, state = run_steps(dec, dec.init_state(features), tokens[:, :3])
        state = state.select(index)
        after, _ = run_steps(dec, state, tokens[index, 3:])
        reference, _ = run_steps(dec, dec.init_state(features[index]), tokens[index])
    assert state.dynamic["self_k"][1].shape[0] == 4 and state.static["memory_k"][0].shape[0] == 4
    torch.testing.assert_close(after, reference[:, 3:], rtol=0, atol=1e-5)


def test_tied_embeddings_share_the_parameter() -> None:
    tied, untied = make_decoder(tie_embeddings=True), make_decoder(tie_embeddings=False)
    assert tied.out.weight is tied.embed.weight
    assert untied.out.weight is not untied.embed.weight
    n_tied = sum(p.numel() for p in tied.parameters())
    assert sum(p.numel() for p in untied.parameters()) - n_tied == V * 16
    assert "out.weight" in tied.state_dict()  # both names appear; they are the same tensor
    assert tied.state_dict()["out.weight"].data_ptr() == tied.state_dict()["embed.weight"].data_ptr()


def test_bad_features_raise_config_error() -> None:
    dec = make_decoder()
    _, tokens = inputs()
    with pytest.raises(ConfigError, match="N=16"):
        dec(torch.randn(3, 16, D), tokens)
    with pytest.raises(ConfigError, match="D=5"):
        dec.init_state(torch.randn(3, N, 5))
    with pytest.raises(ConfigError, match="num_heads=3"):
        make_decoder(num_heads=3)


def test_builder_reads_the_config() -> None:
    cfg = get_preset("transformer_tiny", **{"model.decoder.tie_embeddings": True}).model.decoder
    dec = build_decoder(cfg, feature_dim=D, vocab_size=V, grid=G)
    assert isinstance(dec, TransformerCaptionDecoder)
    assert (dec.d_model, dec.num_layers, dec.num_heads, dec.max_len) == (32, 2, 4, cfg.max_len)
    assert dec.blocks[0].ff[0].out_features == cfg.ff_dim
    assert dec.out.weight is dec.embed.weight


def test_registered_builder() -> None:
    cfg = get_preset("transformer_tiny").model.decoder
    from captioner.models.model import build_decoder

    assert isinstance(build_decoder(cfg, feature_dim=D, vocab_size=V, grid=G), TransformerCaptionDecoder)


def test_overfit_one_batch_then_greedy_reproduces_the_captions() -> None:
    captions = [[5, 6, 7, 8], [9, 10, 6], [11, 12, 5, 10, 7], [8, 8, 9]]
    batch = torch.zeros(4, 7, dtype=torch.long)
    for i, words in enumerate(captions):
        batch[i, : len(words) + 2] = torch.tensor([BOS, *words, EOS])
    torch.manual_seed(0)
    features = torch.randn(4, N, D)
    dec = make_decoder(d_model=32, ff_dim=64, tie_embeddings=True).train()
    opt = torch.optim.Adam(dec.parameters(), lr=1e-2)
    for _ in range(120):
        logits = dec(features, batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, V), batch[:, 1:].reshape(-1), ignore_index=0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.02
    dec.eval()
    with torch.no_grad():
        state, prev = dec.init_state(features), torch.full((4,), BOS)
        emitted = []
        for _ in range(8):
            log_probs, state, _ = dec.step(prev, state)
            prev = log_probs.argmax(-1)
            emitted.append(prev)
    emitted = torch.stack(emitted, 1).tolist()
    greedy = [row[: row.index(EOS)] if EOS in row else row for row in emitted]
    assert greedy == captions
