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

An optional ``self.extension`` (:class:`~captioner.models.base.SATExtension`) is called at named
points: the initial state, rows read from h, an attention filter, the deep output, ``aux``.

One step, :meth:`SATDecoder._update`, serves ``forward``, ``step`` and :class:`FusedSATSteps`.
``W_f f`` is computed once per image. Since ``tanh(x) = 2 sigmoid(2x) - 1`` and softmax ignores a
constant, ``alpha = softmax_i(2 w . sigmoid(2 W_f f_i + 2 W_h h))`` exactly, with the cheaper sigmoid:
``project`` returns ``2 W_f f`` and the query is ``2 W_h h``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from captioner.config import SATConfig
from captioner.config.decoders import HARD_TEST_MODES, check_hard_test_mode
from captioner.errors import ConfigError
from captioner.models.base import CaptionDecoder, DecoderOutput, SATExtension, State, expand_groups
from captioner.models.registry import register_decoder


class AdditiveAttention(nn.Module):
    """``alpha = softmax_i(w . tanh(W_f f_i + W_h h))`` over D-wide regions, an H-wide query, A-wide scores."""

    def __init__(self, feature_dim: int, hidden_dim: int, attention_dim: int) -> None:
        super().__init__()
        self.feature_proj = nn.Linear(feature_dim, attention_dim)  # W_f
        self.hidden_proj = nn.Linear(hidden_dim, attention_dim)  # W_h
        self.score = nn.Linear(attention_dim, 1, bias=False)  # w

    def doubled(self) -> dict[str, torch.Tensor]:
        """The layers times 2 as this module computes with them: ``w_f``, ``b_f``, ``w_h``, ``b_h``, ``w_s``."""
        return {"w_f": 2.0 * self.feature_proj.weight, "b_f": 2.0 * self.feature_proj.bias,
                "w_h": 2.0 * self.hidden_proj.weight, "b_h": 2.0 * self.hidden_proj.bias, "w_s": 2.0 * self.score.weight}

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """features (B,N,D) -> 2 W_f f (B,N,A); compute once per image."""
        return F.linear(features, 2.0 * self.feature_proj.weight, 2.0 * self.feature_proj.bias)  # (B, N, A)

    @staticmethod
    def log_weights(projected: torch.Tensor, query: torch.Tensor, w_s: torch.Tensor, group: int = 1) -> torch.Tensor:
        """Log attention weights (B*group,N) from ``project(f)`` (B,N,A), the query (B*group,A), ``2 w`` (1,A).

        ``group``: queries per image (beams), consecutive rows: query row r reads image ``r // group``.
        """
        b, n, a = projected.shape
        gates = (projected.unsqueeze(1) + query.to(projected.dtype).view(b, group, 1, a)).sigmoid_()  # tanh as sigmoid
        scores = F.linear(gates.view(b * group, n, a), w_s).squeeze(-1)  # (B*group, N), up to a per-row constant
        return F.log_softmax(scores, dim=-1)  # (B*group, N)

    def forward(self, projected: torch.Tensor, hidden: torch.Tensor, group: int = 1) -> torch.Tensor:
        """projected = project(f) (B,N,A), hidden (B*group,H) -> log alpha (B*group,N)."""
        att = self.doubled()
        return self.log_weights(projected, F.linear(hidden, att["w_h"], att["b_h"]), att["w_s"], group)


def soft_context(alpha: torch.Tensor, features: torch.Tensor, group: int = 1) -> torch.Tensor:
    """Expected context: alpha (B*group,N), features (B,N,D) -> (B*group,D); row r reads image ``r // group``."""
    b, n = features.shape[:2]
    return torch.bmm(alpha.to(features.dtype).view(b, group, n), features).view(b * group, -1)  # (B*group, D)


def region_features(features: torch.Tensor, index: torch.Tensor, group: int = 1) -> torch.Tensor:
    """The feature of one region per row: features (B,N,D), index (B*group,) -> (B*group,D)."""
    rows = torch.arange(index.shape[0], device=features.device) // group
    return features[rows, index]  # (B*group, D)


def sample_regions(log_alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one region per row, ``s ~ Multinoulli(alpha)``: index (B,) and its log-probability (B,)."""
    index = torch.multinomial(log_alpha.detach().float().exp(), 1).squeeze(1)  # (B,)
    return index, log_alpha.gather(1, index.unsqueeze(1)).squeeze(1)  # (B,), (B,)


def hard_test_context(alpha: torch.Tensor, features: torch.Tensor, mode: str, group: int = 1) -> torch.Tensor:
    """Deterministic hard-attention context for evaluation: the expectation or the argmax region."""
    if mode == "expectation":
        return soft_context(alpha, features, group)  # (B*group, D)
    if mode == "argmax":
        return region_features(features, alpha.argmax(dim=-1), group)  # (B*group, D)
    raise ValueError(f"hard_test_mode={mode!r}: use one of {HARD_TEST_MODES}")


def lstm_update(gates: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LSTM cell update from pre-activation gates (B,4H) in ``nn.LSTMCell`` order (i, f, g, o)."""
    i, f, g, o = gates.chunk(4, dim=-1)  # (B, H) each
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)  # (B, H)
    h = torch.sigmoid(o) * torch.tanh(c)  # (B, H)
    return h, c


@register_decoder(SATConfig)
class SATDecoder(CaptionDecoder):
    """LSTM decoder with soft or hard additive attention over regions (``vocab_size`` .. ``attention_dim``:
    V, D, M, H, A).

    ``attention``: "soft" or "hard" (stochastic, trained with REINFORCE); ``hard_test_mode``: hard attention
    in eval mode, "expectation" (the soft context) or "argmax"; ``hard_soft_prob``: in training, the chance
    per caption and step of the soft context instead of a sampled region; ``region_positions``: learned row
    and column embeddings on the g x g regions; ``extension``: None gives the paper's decoder.
    """

    def __init__(self, vocab_size: int, feature_dim: int, embed_dim: int = 512, hidden_dim: int = 512,
                 attention_dim: int = 512, dropout: float = 0.5, attention: str = "soft",
                 hard_test_mode: str = "expectation", hard_soft_prob: float = 0.5, grid: int | None = None,
                 region_positions: bool = False, extension: SATExtension | None = None) -> None:
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
        self.extension = extension if extension is not None else SATExtension()  # default: every point a no-op
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

    def _initial_hc(self, features: torch.Tensor, extra: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """h0, c0 (B,H) from the mean region feature (plus what the extension adds before the tanh)."""
        mean = features.mean(dim=1)  # (B, D)
        h, c = self.init_h(mean), self.init_c(mean)  # (B, H) each
        added = self.extension.initial_state(extra)
        if added is not None:
            ph, pc = added.chunk(2, dim=-1)
            h, c = h + ph, c + pc
        return torch.tanh(h), torch.tanh(c)

    def _context(self, log_alpha: torch.Tensor, features: torch.Tensor, group: int = 1
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Context (B,D), plus (hard, training) the sampled log-prob (B,) and region (B,), else 0 and -1."""
        alpha = log_alpha.exp()  # (B, N)
        if self.attention_type == "soft":
            return soft_context(alpha, features, group), None, None
        if not self.training:
            return hard_test_context(alpha, features, self.hard_test_mode, group), None, None
        index, log_prob = sample_regions(log_alpha)  # (B,), (B,)
        context = region_features(features, index, group)  # (B, D)
        if self.hard_soft_prob > 0:
            use_soft = torch.rand(index.shape, device=index.device) < self.hard_soft_prob  # (B,)
            context = torch.where(use_soft.unsqueeze(1), soft_context(alpha, features, group), context)
            log_prob = log_prob.masked_fill(use_soft, 0.0)
            index = index.masked_fill(use_soft, -1)
        return context, log_prob, index

    def _deep_output(self, emb: torch.Tensor, h: torch.Tensor, gated: torch.Tensor,
                     static: dict[str, torch.Tensor]) -> torch.Tensor:
        """L_o(dropout(E y + L_h dropout(h) + L_z beta z [+ the extension's output])): (..., M), (..., H), (..., D)
        -> ((..., V), outputs), as the extension's ``word_scores`` gives them."""
        deep = emb + self.out_hidden(self.dropout(h)) + self.out_context(gated)  # (..., M)
        added = static.get("extension_output")
        if added is not None:
            deep = deep + (added.unsqueeze(1) if deep.dim() == 3 else added)
        deep = self.dropout(deep)
        return self.extension.word_scores(self.out_word(deep), deep, static)  # (..., V), outputs

    # ------------------------------------------------------------------ teacher forcing

    def _update(self, q: torch.Tensor, c: torch.Tensor, x_gate: torch.Tensor, projected: torch.Tensor,
                features: torch.Tensor, w_s: torch.Tensor, w_z: torch.Tensor,
                extra: tuple[dict[str, torch.Tensor], torch.Tensor | None] = ({}, None), group: int = 1,
                context: Any = None):
        """One SAT step from the products of h_{t-1}, float32 or fused in a low precision.

        Args:
            q: (B, 4H+A+1 [+R]) ``[W_hh h; 2 W_h h + 2 b_h; f_beta h + b_beta; the extension's R rows]``.
            c: (B,H) the LSTM cell; x_gate: (B,4H) the previous word's half of the input product.
            projected, features: (B/group, N, A) ``2 W_f f``, (B/group, N, D) the regions.
            w_s: (1,A) ``2 w``; w_z: (4H [+ M], D) ``W_ih[:, M:]`` [with ``L_z`` below it].
            extra: the extension's constants; group: decoder rows per image (beams).
            context: ``(log_alpha, features, group) -> (context, log-prob, region)``; default :meth:`_context`.

        Returns:
            ``h, c`` (B,H), ``L_z beta z`` (B,M) or (B,0), context (B,D), beta (B,1), log alpha (B,N), the
            sampled log-prob and region (hard, training; else None), and the extension's record.
        """
        H, A = self.hidden_dim, self.attention_dim
        h_gates, query, gate_logit, rows = q.split([4 * H, A, 1, q.shape[-1] - 4 * H - A - 1], dim=-1)
        log_alpha = self.attention.log_weights(projected, query, w_s, group)  # (B, N)
        log_alpha, record = self.extension.filter_attention(log_alpha, rows, extra[1], extra[0])
        ctx, log_prob, region = (context or self._context)(log_alpha, features, group)  # (B, D)
        beta = torch.sigmoid(gate_logit)  # (B, 1)
        z = F.linear(beta * ctx, w_z)  # (B, 4H [+ M])
        h, c = lstm_update(x_gate + h_gates + z[:, :4 * H], c)  # (B, H)
        return h, c, z[:, 4 * H:], ctx, beta, log_alpha, log_prob, region, record

    def _recurrence(self, x_gate: torch.Tensor, h: torch.Tensor, c: torch.Tensor, projected: torch.Tensor,
                    features: torch.Tensor, w_query: torch.Tensor, b_query: torch.Tensor, w_s: torch.Tensor,
                    w_ctx: torch.Tensor, extra: tuple[dict[str, torch.Tensor], torch.Tensor | None] = ({}, None),
                    group: int = 1):
        """One time step: the products of ``h_{t-1}`` in one matmul, then :meth:`_update`."""
        h, c, _, *outputs = self._update(F.linear(h, w_query, b_query), c, x_gate, projected, features, w_s, w_ctx,
                                         extra, group)
        return h, c, *outputs

    def compile_recurrence(self, backend: str = "inductor", **options) -> None:  # noqa: ANN003
        """Compile the per-word step of ``forward`` with ``torch.compile`` (opt-in; ``train.compile``)."""
        self._compiled_recurrence = torch.compile(self._recurrence, backend=backend, dynamic=False, **options)


    def _query_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything that reads h_{t-1} in one matmul: W_hh, the attention's 2 W_h, f_beta [, the extension's rows]."""
        att = self.attention
        weights = [self.lstm.weight_hh, 2.0 * att.hidden_proj.weight, self.gate.weight]  # (4H+A+1, H)
        biases = [self.lstm.bias_hh.new_zeros(4 * self.hidden_dim), 2.0 * att.hidden_proj.bias, self.gate.bias]
        rows = self.extension.query_weights()
        if rows is not None:
            weights.append(rows[0])
            biases.append(rows[1])
        return torch.cat(weights), torch.cat(biases)

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, need_all_attention: bool = False) -> DecoderOutput:
        """Teacher-forced pass over (B,T) input tokens ``[<bos> w1 .. wn ...][:, :-1]`` (padding left to the loss).

        Returns:
            DecoderOutput with logits (B,T,V), attention (B,T,N), attention_entropy (B,T), sample_log_probs
            (B,T) (hard, training), aux["beta"] (B,T), aux["context"] (B,T,D), aux["region"] (B,T) and the
            extension's ``aux``.
        """
        ext = self.extension
        extra = ext.read(features)  # from the regions as the encoder gave them
        features = self._regions(ext.regions(features))  # read every step: keep it dense
        device_type = features.device.type
        low = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        if low is not None:  # autocast would cast the (B, N, D) features for every step's bmm: cast them once
            features = features.to(low)
        projected = self.attention.project(features)  # (B, N, A), 2 W_f f once per image
        h, c = self._initial_hc(features, extra)  # (B, H)
        emb = self.embedding(tokens)  # (B, T, M)
        w_emb = self.lstm.weight_ih[:, :self.embed_dim]  # (4H, M)
        x_gates = F.linear(emb, w_emb, self.lstm.bias_ih + self.lstm.bias_hh)  # (B, T, 4H)
        steps = self._unroll(x_gates, h, c, projected, features, low, extra, emb)

        beta = torch.cat(steps["beta"], dim=1)  # (B, T)
        context = torch.stack(steps["context"], dim=1)  # (B, T, D)
        log_alpha = torch.stack(steps["log_alpha"], dim=1)  # (B, T, N)
        alpha = log_alpha.exp()  # (B, T, N)
        added = ext.output(extra)  # (B, M) or None
        logits, _ = self._deep_output(emb, torch.stack(steps["h"], dim=1), beta.unsqueeze(-1) * context,
                                      extra if added is None else {**extra, "extension_output": added})  # (B, T, V)
        aux = {"beta": beta, "context": context, **ext.aux(extra, steps["record"])}
        sample_log_probs = None
        if steps["log_prob"]:
            sample_log_probs = torch.stack(steps["log_prob"], dim=1)  # (B, T)
            aux["region"] = torch.stack(steps["region"], dim=1)  # (B, T)
        return DecoderOutput(
            logits=logits,
            attention=alpha,
            sample_log_probs=sample_log_probs,
            attention_entropy=-(alpha * log_alpha).sum(-1),  # (B, T)
            aux=aux,
        )

    def _unroll(self, x_gates: torch.Tensor, h: torch.Tensor, c: torch.Tensor, projected: torch.Tensor,
                features: torch.Tensor, low: torch.dtype | None, extra: dict[str, torch.Tensor], emb: torch.Tensor
                ) -> dict[str, list[Any]]:
        """The recurrence over the T steps of x_gates (B,T,4H), weights fused (and cast once under autocast)."""
        w_query, b_query = self._query_weights()
        w_s, w_ctx = 2.0 * self.attention.score.weight, self.lstm.weight_ih[:, self.embed_dim:]  # (1, A), (4H, D)
        if low is not None:
            w_query, b_query, w_s, w_ctx = w_query.to(low), b_query.to(low), w_s.to(low), w_ctx.to(low)
            extra = {k: v.to(low) for k, v in extra.items()}
        words = self.extension.word_query(emb)  # (B, T, R) or None
        steps: dict[str, list[Any]] = {key: [] for key in ("h", "context", "beta", "log_alpha", "log_prob", "region",
                                                           "record")}
        recurrence = self._compiled_recurrence or self._recurrence
        for t in range(x_gates.shape[1]):
            h, c, *outputs = recurrence(x_gates[:, t], h, c, projected, features, w_query, b_query, w_s, w_ctx,
                                        (extra, None if words is None else words[:, t]))
            steps["h"].append(h)
            for key, value in zip(("context", "beta", "log_alpha", "log_prob", "region", "record"), outputs):
                if value is not None:
                    steps[key].append(value)
        return steps

    # ------------------------------------------------------------------ stepping

    def init_state(self, features: torch.Tensor) -> State:
        """features (B,N,D) -> State(static {features (B,N,D), projected (B,N,A), the extension's constants},
        dynamic {h, c (B,H)})."""
        ext = self.extension
        extra = ext.read(features)
        features = self._regions(ext.regions(features))
        h, c = self._initial_hc(features, extra)
        static = {"features": features, "projected": self.attention.project(features), **extra}
        added = ext.output(extra)
        if added is not None:
            static["extension_output"] = added  # (B, M)
        return State(static=static, dynamic={"h": h, "c": c})

    groups_rows = True  # step reads one copy of an image's regions for all its beams

    def step(self, prev_tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, State, torch.Tensor]:
        """One step: prev_tokens (B,) -> (log_probs (B,V), new state, attention (B,N)).

        A grouped state (``state.group`` g > 1) holds the regions once per image, read by g consecutive rows.
        """
        emb = self.embedding(prev_tokens)  # (B, M)
        group, static = state.group, state.static
        own = extension_constants(static, group)
        if own and group > 1:
            static = {**own, "features": static["features"], "projected": static["projected"]}
        w_x, b_x, w_query, b_query, w_s, w_ctx = self._step_weights()
        extra = (static, self.extension.word_query(emb))
        h, c, context, beta, log_alpha, *_ = self._recurrence(
            F.linear(emb, w_x, b_x), state.dynamic["h"], state.dynamic["c"], static["projected"], static["features"],
            w_query, b_query, w_s, w_ctx, extra, group)
        scores, outputs = self._deep_output(emb, h, beta * context, static)
        return F.log_softmax(scores, dim=-1), State(state.static, {"h": h, "c": c}, group, outputs), log_alpha.exp()

    def _step_weights(self) -> tuple[torch.Tensor, ...]:
        """The fused products one step reads, kept between steps while decoding without gradients."""
        params = [*self.parameters()]
        key = tuple((p.data_ptr(), p._version) for p in params)
        keep = not torch.is_grad_enabled() and not (params[0].is_cuda and torch.cuda.is_current_stream_capturing())
        cached = self.__dict__.get("_step_cache")
        if keep and cached is not None and cached[0] == key:
            return cached[1]
        M = self.embed_dim
        weights = (self.lstm.weight_ih[:, :M], self.lstm.bias_ih + self.lstm.bias_hh, *self._query_weights(),
                   2.0 * self.attention.score.weight, self.lstm.weight_ih[:, M:])
        if keep:
            self.__dict__["_step_cache"] = (key, weights)
        return weights

    def fuses(self) -> bool:
        """Whether :class:`FusedSATSteps` computes this decoder's eval-mode step: an extension that leaves the
        attention alone (its ``query_weights``, ``word_query`` and ``filter_attention`` the defaults: the label
        reading, or none), and a test-time context that is the expectation (soft, or hard with ``expectation``)."""
        kind = type(self.extension)
        attends = any(getattr(kind, point) is not getattr(SATExtension, point)
                      for point in ("query_weights", "word_query", "filter_attention"))
        return not attends and (self.attention_type == "soft" or self.hard_test_mode == "expectation")

    def fused_steps(self, dtype: torch.dtype) -> FusedSATSteps | None:
        """This decoder's eval-mode stepping with its products fused, in ``dtype`` (a snapshot of the weights), or
        None where :meth:`fuses` says it does not apply."""
        return FusedSATSteps(self, dtype) if self.fuses() else None


class FusedSATSteps(CaptionDecoder):
    """The stepping of a soft-attention :class:`SATDecoder` with its products fused, in ``dtype``.

    At step t, with ``q`` the products of h_{t-1} (computed at the end of the step before):

        alpha        = softmax_i(w . tanh(W_f f_i + W_h h))          # as AdditiveAttention
        z            = beta * sum_i alpha_i f_i,   beta = sigmoid(f_beta h)
        [Wz z; Lz z] = [W_ih[:, M:]; L_z] z                          # one product
        gates        = T[y] + W_hh h + Wz z,   T = E W_ih[:, :M]^T + b_ih + b_hh (a table, V x 4H)
        h', c'       = LSTM update
        [Lh h'; q']  = [L_h; W_hh; W_h; f_beta] h'                   # one product
        p(y')        = softmax(L_o(E y + Lh h' + Lz z))

    The attention's sums and sigmoids run in float32. Weights are a snapshot taken at construction.
    """

    groups_rows = True

    def __init__(self, decoder: SATDecoder, dtype: torch.dtype) -> None:
        super().__init__()
        if not decoder.fuses():
            raise ValueError("FusedSATSteps takes a SAT decoder with soft (or expected hard) attention and no extension "
                             "that reads the attention")
        self.decoder = [decoder]  # a list: not a submodule (the snapshot below is what steps read)
        self.vocab_size = decoder.vocab_size
        self.dtype = dtype
        H, M, A = decoder.hidden_dim, decoder.embed_dim, decoder.attention_dim
        self.sizes = (H, M, A)
        lstm = decoder.lstm
        with torch.no_grad():
            att = decoder.attention.doubled()  # 2 W_f, 2 W_h, 2 w
            table = F.linear(decoder.embedding.weight, lstm.weight_ih[:, :M], lstm.bias_ih + lstm.bias_hh)  # (V, 4H)
            zeros = lstm.bias_hh.new_zeros(M + 4 * H)
            w_h = torch.cat([decoder.out_hidden.weight, lstm.weight_hh, att["w_h"], decoder.gate.weight])
            b_h = torch.cat([zeros, att["b_h"], decoder.gate.bias])
            weights = {
                "table": table, "embedding": decoder.embedding.weight,
                "w_h": w_h, "b_h": b_h,  # (M + 4H + A + 1, H)
                "w_z": torch.cat([lstm.weight_ih[:, M:], decoder.out_context.weight]),  # (4H + M, D)
                "w_o": decoder.out_word.weight, "b_o": decoder.out_word.bias,
                "w_s": att["w_s"], "w_f": att["w_f"], "b_f": att["b_f"],
            }
            self.weights = {k: v.detach().to(dtype).contiguous() for k, v in weights.items()}
            self.weights["w_s32"] = weights["w_s"].detach().float().contiguous()

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, need_all_attention: bool = False):  # noqa: ANN201
        raise TypeError("FusedSATSteps only decodes step by step; train the SATDecoder itself")

    @property
    def extension(self) -> SATExtension:
        """The decoder's extension, in float32 (the search sets its switches: veto, the copy's shares)."""
        return self.decoder[0].extension

    def init_state(self, features: torch.Tensor) -> State:
        """features (B,N,D) -> static {features in ``dtype``, projected in float32, the extension's constants},
        dynamic {q (B, 4H+A+1), c (B,H)} in ``dtype``."""
        decoder, (H, M, _) = self.decoder[0], self.sizes
        ext = decoder.extension
        extra = ext.read(features)
        regions = decoder._regions(ext.regions(features))
        h, c = decoder._initial_hc(regions, extra)  # (B, H) each, in the features' dtype
        low = regions.to(self.dtype)
        w = self.weights
        projected = F.linear(low, w["w_f"], w["b_f"]).float()  # (B, N, A): 2 W_f f, kept in float32 (below)
        q = F.linear(h.to(self.dtype), w["w_h"][M:], w["b_h"][M:])  # (B, 4H + A + 1)
        static = {"features": low, "projected": projected, **extra}
        added = ext.output(extra)
        if added is not None:
            static["extension_output"] = added.to(self.dtype)  # (B, M)
        return State(static, {"q": q, "c": c.to(self.dtype)})

    def step(self, prev_tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, State, torch.Tensor]:
        """prev_tokens (R,) -> (log_probs (R,V) float32, new state, attention (R,N) float32)."""
        (H, M, A), w = self.sizes, self.weights
        h, c, z_out, _, _, log_alpha, *_ = self.decoder[0]._update(
            state.dynamic["q"], state.dynamic["c"], w["table"][prev_tokens], state.static["projected"],
            state.static["features"], w["w_s32"], w["w_z"], group=state.group, context=_expected_context)
        h_out, q = F.linear(h, w["w_h"], w["b_h"]).split([M, 4 * H + A + 1], dim=-1)  # this step's L_h h, next q
        deep = w["embedding"][prev_tokens] + h_out + z_out  # (R, M)
        own = extension_constants(state.static, state.group)
        added = own.get("extension_output")
        if added is not None:
            deep = deep + added
        logits = F.linear(deep, w["w_o"], w["b_o"]).float()  # (R, V)
        outputs: dict[str, torch.Tensor] = {}
        if own:  # the extension's word scores (the label reading's copy), read in float32
            logits, outputs = self.decoder[0].extension.word_scores(logits, deep.float(), own)
        log_probs = F.log_softmax(logits, dim=-1)  # (R, V)
        return log_probs, State(state.static, {"q": q, "c": c}, state.group, outputs), log_alpha.exp()


def extension_constants(static: dict[str, torch.Tensor], group: int) -> dict[str, torch.Tensor]:
    """A SAT state's constants other than the regions and their projection (the extension's), one row per
    decoder row (a grouped state's repeated ``group`` times)."""
    return expand_groups({k: v for k, v in static.items() if k not in ("features", "projected")}, group)


def _expected_context(log_alpha: torch.Tensor, features: torch.Tensor, group: int
                      ) -> tuple[torch.Tensor, None, None]:
    """The fused steps' context: the expectation (soft, or hard at test time), whatever the decoder's mode."""
    return soft_context(log_alpha.exp(), features, group), None, None
