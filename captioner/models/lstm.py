"""Show, Attend and Tell decoder (Xu et al. 2015): an LSTM that attends over image regions.

Shape legend: B batch, N regions, D feature width, T caption steps, V vocabulary,
M word embedding width, H LSTM width, A attention width.

At step t, with h, c the LSTM state after step t-1 and y the previous word:

    h0, c0 = tanh(init_h(mean_i f_i)), tanh(init_c(mean_i f_i))
    alpha  = softmax_i(w . tanh(W_f f_i + W_h h))            # AdditiveAttention
    z      = sum_i alpha_i f_i  (soft)  |  f_s, s ~ alpha     # hard (training)
    beta   = sigmoid(f_beta(h))                               # a scalar gate per caption
    h, c   = LSTMCell([E y; beta z], (h, c))
    p(y')  = softmax(L_o(dropout(E y + L_h dropout(h) + L_z beta z)))   # deep output

The concept prior (``concept_prior``, with K concepts read): the map a word gets is chosen before the
word is written, so a decoder that knows which concept it is about to name can look there first. A
pointer over the photo's concepts, read from the same h and from the previous word y (which h has
not yet read: the attention of step t sees the LSTM state of step t-1), gives

    u      = W_q h + U_q E y                                   # (K+1): K concepts, then "none"
    q      = softmax(u_{1..K} + log P(concept k in image) ; u_{K+1})
    prior  = sum_k q_k m_k + q_none / N                        # m_k: concept k's map (B,K,N)
    alpha  = softmax_i(w . tanh(W_f f_i + W_h h) + lambda log prior_i)

with lambda learned (starting at 1): a product of the decoder's own attention and the maps of what it
expects to say; "none" leaves the attention as it was. The pointer's log q is ``aux["concept_pointer"]``
(B,T,K+1), trained by ``train.concept_pointer`` to name the concept of the word that follows.

``step`` is the readable one-step reference; ``forward`` computes the same thing for all steps,
with the time-independent work hoisted out of the loop: ``W_f f`` once per image, the
embedding half of the LSTM input projection for all steps in one matmul, one fused matmul of
``h`` with ``[W_hh; W_h; f_beta]`` per step, and the deep output over all steps after the loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from captioner.config import SATConfig
from captioner.config.decoders import check_hard_test_mode
from captioner.errors import ConfigError
from captioner.models.attention import (AdditiveAttention, hard_test_context, region_features, sample_regions,
                                        soft_context)
from captioner.models.base import CaptionDecoder, DecoderOutput, State
from captioner.models.concepts import SHARPNESS
from captioner.models.registry import register_decoder


def lstm_update(gates: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LSTM cell update from pre-activation gates (B,4H) in ``nn.LSTMCell`` order (i, f, g, o)."""
    i, f, g, o = gates.chunk(4, dim=-1)  # (B, H) each
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)  # (B, H)
    h = torch.sigmoid(o) * torch.tanh(c)  # (B, H)
    return h, c


class SATDecoder(CaptionDecoder):
    """LSTM decoder with soft or hard additive attention over regions.

    Args:
        vocab_size: V, output vocabulary size.
        feature_dim: D, region feature width.
        embed_dim: M, word embedding width (also the deep-output width).
        hidden_dim: H, LSTM width.
        attention_dim: A, additive attention width.
        dropout: dropout on h before L_h and on the deep output before L_o.
        attention: "soft" (deterministic) or "hard" (stochastic, trained with REINFORCE).
        hard_test_mode: hard attention in eval mode: "expectation" (the soft context) or "argmax"
            (the feature of the most attended region).
        hard_soft_prob: hard attention in training: the probability, drawn independently for every
            caption and step, of using the expected (soft) context instead of a sampled region.
        concepts, concept_hidden, concept_pooling, concept_sharpness: K and the shape of the frozen concept
            head (``CaptionDecoder.add_concept_head``); K > 0 feeds the photo's K concept probabilities into
            h0, c0 and the deep output. 0: no concepts.
        concept_prior: multiply the attention by the maps of the concepts a pointer expects next
            (module docstring); needs ``concepts``.

    The options are validated once, by ``SATConfig`` (``captioner.config.decoders``).
    """

    def __init__(self, vocab_size: int, feature_dim: int, embed_dim: int = 512, hidden_dim: int = 512,
                 attention_dim: int = 512, dropout: float = 0.5, attention: str = "soft",
                 hard_test_mode: str = "expectation", hard_soft_prob: float = 0.5, grid: int | None = None,
                 region_positions: bool = False, concepts: int = 0, concept_hidden: int = 512,
                 concept_pooling: str = "lse", concept_sharpness: float = SHARPNESS,
                 concept_prior: bool = False) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.feature_dim = feature_dim
        self.embed_dim = embed_dim
        self.hidden_dim = hidden_dim
        self.attention_dim = attention_dim
        self.attention_type = attention
        self.hard_soft_prob = hard_soft_prob
        self.hard_test_mode = hard_test_mode

        self.embedding = nn.Embedding(vocab_size, embed_dim)  # E
        self.init_h = nn.Linear(feature_dim, hidden_dim)
        self.init_c = nn.Linear(feature_dim, hidden_dim)
        self.attention = AdditiveAttention(feature_dim, hidden_dim, attention_dim)
        self.gate = nn.Linear(hidden_dim, 1)  # f_beta: a scalar gate
        self.lstm = nn.LSTMCell(embed_dim + feature_dim, hidden_dim)
        self.out_hidden = nn.Linear(hidden_dim, embed_dim, bias=False)  # L_h
        self.out_context = nn.Linear(feature_dim, embed_dim, bias=False)  # L_z
        self.out_word = nn.Linear(embed_dim, vocab_size)  # L_o
        self.dropout = nn.Dropout(dropout)
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        self.grid = grid
        if region_positions:
            if not grid:
                raise ConfigError("region_positions needs the grid size")
            self.row = nn.Embedding(grid, feature_dim)  # added to every region feature of grid row r
            self.col = nn.Embedding(grid, feature_dim)  # ... and of grid column c
            nn.init.normal_(self.row.weight, std=0.1)
            nn.init.normal_(self.col.weight, std=0.1)
        self.region_positions = region_positions
        self.add_concept_head(feature_dim, concepts, concept_hidden, concept_pooling, concept_sharpness)
        if concepts:  # the photo's concept probabilities (B, K) go into h0, c0 and the deep output
            self.init_concepts = nn.Linear(concepts, 2 * hidden_dim, bias=False)  # into h0 and c0
            self.out_concepts = nn.Linear(concepts, embed_dim, bias=False)  # L_p: into the deep output
        self.add_concept_prior(hidden_dim, concept_prior)  # W_q reads h
        if concept_prior:
            self.concept_query_word = nn.Linear(embed_dim, concepts + 1, bias=False)  # U_q: ... and the previous word
        self._compiled_recurrence = None  # set by compile_recurrence()

    @property
    def hard_test_mode(self) -> str:
        """How hard attention picks the context in eval mode (a test-time switch, checked as the config checks it)."""
        return self._hard_test_mode

    @hard_test_mode.setter
    def hard_test_mode(self, mode: str) -> None:
        self._hard_test_mode = check_hard_test_mode(mode)

    # ------------------------------------------------------------------ shared pieces

    def _regions(self, features: torch.Tensor) -> torch.Tensor:
        """features (B,N,D), dense, with the row and column embeddings added when ``region_positions``."""
        features = features.contiguous()
        if not self.region_positions:
            return features
        n = features.shape[1]
        if n != self.grid ** 2:
            raise ConfigError(f"features have {n} regions, this decoder was built for a {self.grid}x{self.grid} grid")
        idx = torch.arange(n, device=features.device)
        return features + (self.row(idx // self.grid) + self.col(idx % self.grid)).to(features.dtype)  # (B, N, D)

    def _initial_hc(self, features: torch.Tensor, concepts: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        mean = features.mean(dim=1)  # (B, D)
        h, c = self.init_h(mean), self.init_c(mean)  # (B, H) each
        if concepts is not None:
            ph, pc = self.init_concepts(concepts.to(h.dtype)).chunk(2, dim=-1)
            h, c = h + ph, c + pc
        return torch.tanh(h), torch.tanh(c)

    def _context(self, log_alpha: torch.Tensor, features: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Context (B,D) for one step, plus (hard, training) the sampled log-prob (B,) and region (B,).

        Rows that use the expected context instead (probability ``hard_soft_prob``) get log-prob 0
        and region -1.
        """
        alpha = log_alpha.exp()  # (B, N)
        if self.attention_type == "soft":
            return soft_context(alpha, features), None, None
        if not self.training:
            return hard_test_context(alpha, features, self.hard_test_mode), None, None
        index, log_prob = sample_regions(log_alpha)  # (B,), (B,)
        context = region_features(features, index)  # (B, D)
        if self.hard_soft_prob > 0:
            use_soft = torch.rand(index.shape, device=index.device) < self.hard_soft_prob  # (B,)
            context = torch.where(use_soft.unsqueeze(1), soft_context(alpha, features), context)
            log_prob = log_prob.masked_fill(use_soft, 0.0)
            index = index.masked_fill(use_soft, -1)
        return context, log_prob, index

    def _apply_prior(self, log_alpha: torch.Tensor, pointer: torch.Tensor, logp: torch.Tensor, maps: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention (B,N) reshaped by the concept prior: pointer logits W_q h + U_q E y (B,K+1), log P(concept)
        (B,K), maps (B,K,N) -> (log alpha (B,N), the pointer's log q (B,K+1))."""
        prior, log_q = self.concept_prior_map(pointer, logp, maps)  # (B, N), (B, K+1)
        return F.log_softmax(log_alpha + self.prior_scale * prior.clamp(min=1e-12).log(), dim=-1), log_q

    def _deep_output(self, emb: torch.Tensor, h: torch.Tensor, gated: torch.Tensor,
                     concepts: torch.Tensor | None = None) -> torch.Tensor:
        """L_o(dropout(E y + L_h dropout(h) + L_z beta z [+ L_p p])): (..., M), (..., H), (..., D) -> (..., V).

        ``concepts``: ``L_p p`` (B, M) or (B, 1, M), the projected concept probabilities, when the decoder reads them.
        """
        deep = emb + self.out_hidden(self.dropout(h)) + self.out_context(gated)  # (..., M)
        if concepts is not None:
            deep = deep + concepts
        return self.out_word(self.dropout(deep))  # (..., V)

    # ------------------------------------------------------------------ teacher forcing

    def _recurrence(self, x_gate: torch.Tensor, h: torch.Tensor, c: torch.Tensor, projected: torch.Tensor,
                    features: torch.Tensor, w_query: torch.Tensor, b_query: torch.Tensor, w_ctx: torch.Tensor,
                    prior: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        """One teacher-forced time step: everything that depends on ``h_{t-1}``.

        ``prior``: the concept prior's log P(concept) (B,K), maps (B,K,N) and this step's U_q E y (B,K+1),
        when the decoder has one (then ``w_query`` ends with the pointer's K+1 rows, W_q).

        Returns ``h, c`` (B,H), context (B,D), beta (B,1), log alpha (B,N), for hard attention in
        training the sampled log-prob and region (B,) (else None), and the pointer's log q (B,K+1) (else None).
        """
        H, A = self.hidden_dim, self.attention_dim
        query = F.linear(h, w_query, b_query)  # (B, 4H+A+1 [+K+1])
        h_gates, att_query, gate_logit, pointer = query.split([4 * H, A, 1, query.shape[-1] - 4 * H - A - 1], dim=-1)
        log_alpha = self.attention.log_weights(projected, att_query)  # (B, N)
        log_q = None
        if prior is not None:
            logp, maps, from_word = prior
            log_alpha, log_q = self._apply_prior(log_alpha, pointer + from_word, logp, maps)
        context, log_prob, region = self._context(log_alpha, features)  # (B, D)
        beta = torch.sigmoid(gate_logit)  # (B, 1)
        gates = x_gate + h_gates + F.linear(beta * context, w_ctx)  # (B, 4H)
        h, c = lstm_update(gates, c)  # (B, H)
        return h, c, context, beta, log_alpha, log_prob, region, log_q

    def compile_recurrence(self, backend: str = "inductor", **options) -> None:  # noqa: ANN003
        """Compile the per-word step of ``forward`` with ``torch.compile`` (opt-in; ``train.compile``).

        The time loop stays in Python; each step runs as one compiled graph (fused elementwise
        kernels, fewer launches on a GPU). Weights and ``state_dict`` are untouched. Soft attention
        gives the same numbers as eager mode to float tolerance; hard attention draws its samples
        from the same distribution but from a different random stream.
        """
        self._compiled_recurrence = torch.compile(self._recurrence, backend=backend, dynamic=False, **options)


    def forward(self, features: torch.Tensor, tokens: torch.Tensor, need_all_attention: bool = False) -> DecoderOutput:
        """Teacher-forced pass over all steps.

        Args:
            features: (B,N,D) region features.
            tokens: (B,T) input tokens ``[<bos> w1 .. wn ...][:, :-1]``; padded steps are computed
                and left for the loss to ignore (no sorting, outputs in input order).
            need_all_attention: ignored (one attention map per step).

        Returns:
            DecoderOutput with logits (B,T,V), attention alpha (B,T,N), attention_entropy (B,T),
            sample_log_probs (B,T) (hard attention in training mode), aux["beta"] (B,T),
            aux["context"] (B,T,D) ungated context, aux["region"] (B,T) sampled region or -1 (hard, training),
            aux["concept_pointer"] (B,T,K+1) the pointer's log q and aux["concept_probs"] (B,K) (concept prior).
        """
        _, T = tokens.shape
        H = self.hidden_dim
        concepts, static = self.read_concepts(features)  # (B, K) or None, from the regions as the encoder gave them
        prior = None if static is None else (static["concept_logp"], static["concept_maps"])
        features = self._regions(features)  # read every step: keep it dense
        device_type = features.device.type
        low = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        if low is not None:  # autocast would cast the (B, N, D) features for every step's bmm: cast them once
            features = features.to(low)
        projected = self.attention.project(features)  # (B, N, A), 2 W_f f once per image
        h, c = self._initial_hc(features, concepts)  # (B, H)
        emb = self.embedding(tokens)  # (B, T, M)
        w_ih = self.lstm.weight_ih  # (4H, M + D)
        x_gates = F.linear(emb, w_ih[:, :self.embed_dim], self.lstm.bias_ih + self.lstm.bias_hh)  # (B, T, 4H)
        w_ctx = w_ih[:, self.embed_dim:]  # (4H, D)
        # Everything that reads h_{t-1}: LSTM recurrence, attention query, gate -- one matmul per step.
        w_query = [self.lstm.weight_hh, self.attention.hidden_proj.weight, self.gate.weight]  # (4H+A+1, H)
        b_query = [self.lstm.bias_hh.new_zeros(4 * H), self.attention.hidden_proj.bias, self.gate.bias]
        if prior is not None:  # and the pointer's K+1 rows
            w_query.append(self.concept_query.weight)
            b_query.append(self.concept_query.bias)
        w_query, b_query = torch.cat(w_query), torch.cat(b_query)
        if low is not None:  # the per-step weights cast once too (what autocast's weight cache does in eager mode)
            w_query, b_query, w_ctx = w_query.to(low), b_query.to(low), w_ctx.to(low)
            if prior is not None:
                prior = (prior[0].to(low), prior[1].to(low))
        pointer_words = self.concept_query_word(emb) if prior is not None else None  # (B, T, K+1) U_q E y

        hs, contexts, betas, log_alphas, sample_lps, regions, pointers = [], [], [], [], [], [], []
        recurrence = self._compiled_recurrence or self._recurrence
        for t in range(T):
            h, c, context, beta, log_alpha, log_prob, region, log_q = recurrence(
                x_gates[:, t], h, c, projected, features, w_query, b_query, w_ctx,
                None if prior is None else (*prior, pointer_words[:, t]))
            if log_q is not None:
                pointers.append(log_q)
            hs.append(h)
            contexts.append(context)
            betas.append(beta)
            log_alphas.append(log_alpha)
            if log_prob is not None:
                sample_lps.append(log_prob)
                regions.append(region)

        beta = torch.cat(betas, dim=1)  # (B, T)
        context = torch.stack(contexts, dim=1)  # (B, T, D)
        log_alpha = torch.stack(log_alphas, dim=1)  # (B, T, N)
        alpha = log_alpha.exp()  # (B, T, N)
        concept_out = self.out_concepts(concepts.to(emb.dtype)).unsqueeze(1) if concepts is not None else None
        logits = self._deep_output(emb, torch.stack(hs, dim=1), beta.unsqueeze(-1) * context, concept_out)  # (B,T,V)
        aux = {"beta": beta, "context": context}
        if pointers:
            aux["concept_pointer"] = torch.stack(pointers, dim=1)  # (B, T, K+1)
            aux["concept_probs"] = concepts  # (B, K)
        sample_log_probs = None
        if sample_lps:
            sample_log_probs = torch.stack(sample_lps, dim=1)  # (B, T)
            aux["region"] = torch.stack(regions, dim=1)  # (B, T)
        return DecoderOutput(
            logits=logits,
            attention=alpha,
            sample_log_probs=sample_log_probs,
            attention_entropy=-(alpha * log_alpha).sum(-1),  # (B, T)
            aux=aux,
        )

    # ------------------------------------------------------------------ stepping

    def init_state(self, features: torch.Tensor) -> State:
        """features (B,N,D) -> State(static {features (B,N,D), projected (B,N,A)}, dynamic {h, c (B,H)})."""
        concepts, prior = self.read_concepts(features)
        features = self._regions(features)
        h, c = self._initial_hc(features, concepts)
        static = {"features": features, "projected": self.attention.project(features)}
        if concepts is not None:
            static["concepts"] = self.out_concepts(concepts.to(h.dtype))  # (B, M) L_p p
        if prior is not None:
            static.update(prior)
        return State(static=static, dynamic={"h": h, "c": c})

    def step(self, prev_tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, State, torch.Tensor]:
        """One step: prev_tokens (B,) -> (log_probs (B,V), new state, attention alpha (B,N))."""
        emb = self.embedding(prev_tokens)  # (B, M)
        h, c = state.dynamic["h"], state.dynamic["c"]  # (B, H)
        log_alpha = self.attention(state.static["projected"], h)  # (B, N)
        if self.concept_prior:
            pointer = self.concept_query(h) + self.concept_query_word(emb)  # (B, K+1)
            log_alpha, _ = self._apply_prior(log_alpha, pointer, state.static["concept_logp"],
                                             state.static["concept_maps"])
        context, _, _ = self._context(log_alpha, state.static["features"])  # (B, D)
        gated = torch.sigmoid(self.gate(h)) * context  # (B, D)
        h, c = self.lstm(torch.cat([emb, gated], dim=-1), (h, c))  # (B, H)
        log_probs = F.log_softmax(self._deep_output(emb, h, gated, state.static.get("concepts")), dim=-1)  # (B, V)
        return log_probs, State(state.static, {"h": h, "c": c}), log_alpha.exp()


@register_decoder(SATConfig)
def build_sat_decoder(cfg: SATConfig, feature_dim: int, vocab_size: int, grid: int) -> SATDecoder:
    """Registry builder: a ``SATDecoder`` from a ``SATConfig`` (``grid`` sizes the region positions)."""
    return SATDecoder(
        vocab_size=vocab_size,
        feature_dim=feature_dim,
        embed_dim=cfg.embed_dim,
        hidden_dim=cfg.hidden_dim,
        attention_dim=cfg.attention_dim,
        dropout=cfg.dropout,
        attention=cfg.attention,
        hard_test_mode=cfg.hard_test_mode,
        hard_soft_prob=cfg.hard_soft_prob,
        grid=grid,
        region_positions=cfg.region_positions,
        concepts=cfg.concepts,
        concept_hidden=cfg.concept_hidden,
        concept_pooling=cfg.concept_pooling,
        concept_sharpness=cfg.concept_sharpness,
        concept_prior=cfg.concept_prior,
    )
