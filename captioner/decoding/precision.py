"""Decoding in bfloat16: the search's arithmetic in 16-bit floats, for speed on a CPU with native
bfloat16 (``avx512_bf16`` or AMX) or a GPU.

``DecodeOptions(precision="bfloat16")`` (``--precision bfloat16``) makes :func:`captioner.decoding.search.decode`
search with :func:`decoder_for` (the decoder's weights and the region features in bfloat16) instead of
the decoder itself. The beams are still ranked in float64 and the attention maps returned in float32;
only the decoder's products are rounded to bfloat16's 8 significant bits, so a near tie between two
words can fall the other way: on Flickr8k dev 40 of the 1,000 captions differ from float32 decoding
(docs/benchmarks.md gives the scores of both; they do not move beyond that noise). float32, the default, is the reference.

* The SAT LSTM without an extension decodes with :class:`FusedSATSteps`: the same step with its
  matrix products fused (three per word instead of eight) and the word-embedding half of the LSTM's
  input product read from a table. This is what halves the search's time on a CPU, where it is
  bound by those products.
* Any other decoder (the Transformer, the SAT with concepts, an ensemble) decodes with a bfloat16
  copy of itself.

The low-precision decoder is built on first use and kept beside the decoder (never a submodule, so
checkpoints never see it); it is rebuilt when a weight changes (an optimizer step, ``load_state_dict``,
``.to()``).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from captioner.config.schema import DECODE_PRECISIONS
from captioner.models.attention import soft_context
from captioner.models.base import CaptionDecoder, State
from captioner.models.lstm import SATDecoder, lstm_update

PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # DecodeOptions.precision -> dtype
assert tuple(PRECISIONS) == DECODE_PRECISIONS


class FusedSATSteps(CaptionDecoder):
    """The stepping of a :class:`~captioner.models.lstm.SATDecoder` (soft attention, or hard attention
    at test time with the expected context, no extension) with its products fused, in ``dtype``.

    At step t, with ``q`` the products of h_{t-1} the step needs (W_hh h, the attention's W_h h,
    f_beta h; computed at the end of the step before) and y the previous word:

        alpha        = softmax_i(w . tanh(W_f f_i + W_h h))          # as AdditiveAttention
        z            = beta * sum_i alpha_i f_i,   beta = sigmoid(f_beta h)
        [Wz z; Lz z] = [W_ih[:, M:]; L_z] z                          # one product
        gates        = T[y] + W_hh h + Wz z,   T = E W_ih[:, :M]^T + b_ih + b_hh (a table, V x 4H)
        h', c'       = LSTM update
        [Lh h'; q']  = [L_h; W_hh; W_h; f_beta] h'                   # one product: this step's output, the next step's q
        p(y')        = softmax(L_o(E y + Lh h' + Lz z))

    The same function as ``SATDecoder.step`` in eval mode; only the order of the sums differs. The
    attention's B*g*N*A sums and sigmoids run in float32 whatever ``dtype`` is (on a CPU they are
    faster there than in bfloat16, and the maps closer to float32 decoding's).
    Weights are a snapshot taken at construction (:func:`decoder_for` rebuilds it when they change).
    """

    groups_rows = True

    def __init__(self, decoder: SATDecoder, dtype: torch.dtype) -> None:
        super().__init__()
        if decoder.extension is not None or not fuses(decoder):
            raise ValueError("FusedSATSteps takes a SAT decoder with soft (or expected hard) attention and no extension")
        self.decoder = [decoder]  # a list: not a submodule (the snapshot below is what steps read)
        self.vocab_size = decoder.vocab_size
        self.dtype = dtype
        H, M, A = decoder.hidden_dim, decoder.embed_dim, decoder.attention_dim
        self.sizes = (H, M, A)
        lstm, att = decoder.lstm, decoder.attention
        with torch.no_grad():
            table = F.linear(decoder.embedding.weight, lstm.weight_ih[:, :M], lstm.bias_ih + lstm.bias_hh)  # (V, 4H)
            zeros = lstm.bias_hh.new_zeros(M + 4 * H)
            w_h = torch.cat([decoder.out_hidden.weight, lstm.weight_hh, 2.0 * att.hidden_proj.weight,  # 2 W_h h
                             decoder.gate.weight])
            b_h = torch.cat([zeros, 2.0 * att.hidden_proj.bias, decoder.gate.bias])
            weights = {
                "table": table, "embedding": decoder.embedding.weight,
                "w_h": w_h, "b_h": b_h,  # (M + 4H + A + 1, H)
                "w_z": torch.cat([lstm.weight_ih[:, M:], decoder.out_context.weight]),  # (4H + M, D)
                "w_o": decoder.out_word.weight, "b_o": decoder.out_word.bias,
                "w_s": 2.0 * att.score.weight,
                "w_f": 2.0 * att.feature_proj.weight, "b_f": 2.0 * att.feature_proj.bias,
            }
            self.weights = {k: v.detach().to(dtype).contiguous() for k, v in weights.items()}
            self.weights["w_s32"] = weights["w_s"].detach().float().contiguous()

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, need_all_attention: bool = False):  # noqa: ANN201
        raise TypeError("FusedSATSteps only decodes step by step; train the SATDecoder itself")

    def init_state(self, features: torch.Tensor) -> State:
        """features (B,N,D) -> static {features in ``dtype``, projected in float32}, dynamic {q (B, 4H+A+1),
        c (B,H)} in ``dtype``."""
        decoder, (H, M, _) = self.decoder[0], self.sizes
        regions = decoder._regions(features)
        h, c = decoder._initial_hc(regions, {})  # (B, H) each, in the features' dtype
        low = regions.to(self.dtype)
        w = self.weights
        projected = F.linear(low, w["w_f"], w["b_f"]).float()  # (B, N, A): 2 W_f f, kept in float32 (below)
        q = F.linear(h.to(self.dtype), w["w_h"][M:], w["b_h"][M:])  # (B, 4H + A + 1)
        return State({"features": low, "projected": projected}, {"q": q, "c": c.to(self.dtype)})

    def step(self, prev_tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, State, torch.Tensor]:
        """prev_tokens (R,) -> (log_probs (R,V) float32, new state, attention (R,N) float32)."""
        (H, M, A), w, group = self.sizes, self.weights, state.group
        q, c = state.dynamic["q"], state.dynamic["c"]
        hh, query, gate = q.split([4 * H, A, 1], dim=-1)  # (R, 4H), (R, A): 2 W_h h, (R, 1)
        projected, features = state.static["projected"], state.static["features"]
        b, n, a = projected.shape
        # the attention's B*g*N*A sums and sigmoids in float32: on a CPU faster than in bfloat16
        gates = (projected.unsqueeze(1) + query.float().view(b, group, 1, a)).sigmoid_().view(b * group, n, a)
        log_alpha = F.log_softmax(F.linear(gates, w["w_s32"]).squeeze(-1), dim=-1)  # (R, N)
        alpha = log_alpha.exp()
        gated = torch.sigmoid(gate) * soft_context(alpha.to(self.dtype), features, group)  # (R, D)
        z_gates, z_out = F.linear(gated, w["w_z"]).split([4 * H, M], dim=-1)
        h, c = lstm_update(w["table"][prev_tokens] + hh + z_gates, c)  # (R, H)
        h_out, q = F.linear(h, w["w_h"], w["b_h"]).split([M, 4 * H + A + 1], dim=-1)
        deep = w["embedding"][prev_tokens] + h_out + z_out  # (R, M)
        log_probs = F.log_softmax(F.linear(deep, w["w_o"], w["b_o"]).float(), dim=-1)  # (R, V)
        return log_probs, State(state.static, {"q": q, "c": c}, group), alpha


def fuses(decoder: nn.Module) -> bool:
    """Whether :class:`FusedSATSteps` computes ``decoder``'s eval-mode step: a SAT decoder with no
    extension whose test-time context is the expectation (soft, or hard with ``expectation``)."""
    return (isinstance(decoder, SATDecoder) and decoder.extension is None
            and (decoder.attention_type == "soft" or decoder.hard_test_mode == "expectation"))


def decoder_for(decoder: nn.Module, precision: str) -> nn.Module:
    """The decoder a search in ``precision`` steps: ``decoder`` itself for float32; for bfloat16 a
    :class:`FusedSATSteps` of it (:func:`fuses`) or else a bfloat16 copy, kept on ``decoder`` until a
    weight changes.

    Raises:
        ValueError: a precision that is not in :data:`PRECISIONS`.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: use one of {sorted(PRECISIONS)}")
    dtype = PRECISIONS[precision]
    if dtype == torch.float32:
        return decoder
    tensors = [*decoder.parameters(), *decoder.buffers()]
    device = tensors[0].device if tensors else torch.device("cpu")
    key = (dtype, device, getattr(decoder, "hard_test_mode", None),
           tuple((t.data_ptr(), t._version) for t in tensors))
    cached = decoder.__dict__.get("_low_precision")
    if cached is not None and cached[0] == key:
        return cached[1]
    low = FusedSATSteps(decoder, dtype) if fuses(decoder) else _copy_in(decoder, dtype)
    low.eval()
    decoder.__dict__["_low_precision"] = (key, low)
    return low


def prepare(decoder: nn.Module, features: torch.Tensor, precision: str) -> tuple[nn.Module, torch.Tensor]:
    """(the decoder to step, the features to give its ``init_state``) for a search in ``precision``:
    :class:`FusedSATSteps` takes the float32 features (it computes the initial state from them in
    float32), a bfloat16 copy takes them in bfloat16."""
    stepper = decoder_for(decoder, precision)
    if stepper is decoder or isinstance(stepper, FusedSATSteps):
        return stepper, features
    return stepper, features.to(PRECISIONS[precision])


def _copy_in(decoder: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``decoder`` with its floating-point weights in ``dtype`` (the original untouched), but
    for the submodules that declare ``runs_in_float32`` (the concept head)."""
    saved = decoder.__dict__.pop("_low_precision", None)  # not copied into the copy
    try:
        low = copy.deepcopy(decoder).to(dtype)
        for module in low.modules():
            if getattr(module, "runs_in_float32", False):
                module.float()
        return low
    finally:
        if saved is not None:
            decoder.__dict__["_low_precision"] = saved
