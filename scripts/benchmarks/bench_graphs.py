"""The SAT training step and beam search as CUDA graphs, against eager mode and the tutorial decoder.

Shape legend: B batch, N regions, D feature width, V vocabulary, K beams.

``sat_graph``: one training step (forward + loss + backward + Adam) at the paper's sizes (B 32,
14x14x2048, V 10,000, width 512, captions of 11-21 words; ``bench_sat.py``), captions per second of:

* ``tutorial``: the tutorial-style decoder (``bench_sat.TutorialSAT``), fp32;
* ``fp32`` / ``fp32_graph``: our decoder eager / captured (``captioner.training.step``);
* ``bf16`` / ``bf16_graph``: the same under bf16 autocast (fp32 weights, the optimizer's master copy);
* ``hard`` / ``hard_graph``: the hard-attention decoder eager / captured (fp32).

Every row uses the same Adam (fused on CUDA) and the same batch; a row's figure is the best of three
rounds of ``steps`` steps in a row (rounds interleaved across rows, so load hits every row alike).
The check: with dropout off, the captured step's loss and gradients against the eager step's
(``check_*``), and the bf16 loss against fp32.

``beam_graph``: images per second of greedy and beam-3 search (20 words) over 256 images at the
paper's sizes, eager against ``captioner.decoding.graphs.GraphedSteps`` in the same run, and how
many images got the same caption, score and attention (all of them, or it is a bug).

    python scripts/benchmark.py --only sat_graph --only beam_graph --json [--quick]

On a CPU (``--quick``, the GPU check's dry run) the same code runs with the graph wrappers in their
eager static-buffer mode, at tiny sizes.
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sat import PAPER, QUICK, TutorialSAT, make_batch, tutorial_loss  # noqa: E402
from timing import sync  # noqa: E402

from captioner.decoding.graphs import GraphedSteps  # noqa: E402
from captioner.decoding.search import SearchRules, DecodeOptions, decode  # noqa: E402
from captioner.models.lstm import SATDecoder  # noqa: E402
from captioner.training.objective import CaptionLoss  # noqa: E402
from captioner.training.step import GraphedStep  # noqa: E402


def _rounds(fns: dict[str, Callable[[], None]], device: torch.device, steps: int, rounds: int = 3) -> dict[str, float]:
    """Seconds per step of each function: the best round of ``steps`` calls in a row, after two warm-up calls."""
    for fn in fns.values():
        fn()
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            sync(device)
            best[name] = min(best[name], (time.perf_counter() - t0) / steps)
    return best


def _adam(module: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.Adam(module.parameters(), lr=1e-4, fused=device.type == "cuda")


def _check(decoder: SATDecoder, features: torch.Tensor, tokens: torch.Tensor, device: torch.device) -> dict:
    """Captured vs eager with dropout off: loss and gradient differences (fp32), and bf16's loss."""
    model = copy.deepcopy(decoder)
    model.dropout.p = 0.0
    loss_fn = CaptionLoss(alpha_c=1.0, ds_form="sum").to(device)
    model.zero_grad(set_to_none=True)
    eager = loss_fn(model(features, tokens[:, :-1]), tokens[:, 1:]).total
    eager.backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    graphed = GraphedStep(model, loss_fn, pad_id=0)
    for _ in range(2):  # capture, then replay
        result = graphed(features, tokens)
    rel = max(float((p.grad - g).abs().max() / g.abs().max().clamp(min=1e-12))
              for p, g in zip(model.parameters(), eager_grads))
    bf16 = GraphedStep(copy.deepcopy(model), loss_fn, pad_id=0, autocast_dtype=torch.bfloat16)(features, tokens)
    return {"check_loss_abs_diff": abs(float(result.total) - float(eager.detach())), "check_grad_max_rel_diff": rel,
            "check_bf16_loss_rel_diff": abs(float(bf16.total) - float(eager.detach())) / abs(float(eager.detach())),
            "check_graph_stats": graphed.stats.as_dict()}


def sat_graph(quick: bool = False) -> dict:
    s = QUICK if quick else PAPER
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    w = s["width"]
    sizes = dict(embed_dim=w, hidden_dim=w, attention_dim=w, dropout=0.5)
    decoder = SATDecoder(s["vocab"], s["feature_dim"], **sizes).to(device).train()
    hard = SATDecoder(s["vocab"], s["feature_dim"], attention="hard", **sizes).to(device).train()
    baseline = TutorialSAT(decoder)
    features, tokens, lengths = (t.to(device) for t in make_batch(s, torch.Generator().manual_seed(0)))
    loss_fn = CaptionLoss(alpha_c=1.0, ds_form="sum").to(device)
    hard_loss = CaptionLoss(alpha_c=1.0, ds_form="sum", entropy_weight=0.01).to(device)
    out: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                 "batch": s["batch"], "steps_in_batch": int(tokens.shape[1]) - 1}
    out.update(_check(decoder, features, tokens, device))
    opt, opt_hard = _adam(decoder, device), _adam(hard, device)

    def eager(model: SATDecoder, crit: CaptionLoss, optimizer: torch.optim.Optimizer, dtype=None):  # noqa: ANN001, ANN202
        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = crit(model(features, tokens[:, :-1]), tokens[:, 1:]).total
            loss.backward()
            optimizer.step()
        return step

    def graphed(wrapper: GraphedStep, optimizer: torch.optim.Optimizer):  # noqa: ANN202
        def step() -> None:
            wrapper(features, tokens)
            optimizer.step()
        return step

    def tutorial() -> None:
        opt.zero_grad(set_to_none=True)
        preds, alphas, targets, _ = baseline(features, tokens, lengths)
        tutorial_loss(preds, alphas, targets, 1.0).backward()
        opt.step()

    wrappers = {"fp32_graph": GraphedStep(decoder, loss_fn, pad_id=0),
                "bf16_graph": GraphedStep(decoder, loss_fn, pad_id=0, autocast_dtype=torch.bfloat16),
                "hard_graph": GraphedStep(hard, hard_loss, pad_id=0)}
    fns = {"tutorial": tutorial, "fp32": eager(decoder, loss_fn, opt), "fp32_graph": graphed(wrappers["fp32_graph"], opt),
           "bf16": eager(decoder, loss_fn, opt, torch.bfloat16), "bf16_graph": graphed(wrappers["bf16_graph"], opt),
           "hard": eager(hard, hard_loss, opt_hard), "hard_graph": graphed(wrappers["hard_graph"], opt_hard)}
    times = _rounds(fns, device, steps=3 if quick else 10)
    for name, t in times.items():
        out[f"{name}_captions_per_s"] = round(s["batch"] / t, 1)
    out["graph_over_tutorial"] = round(times["tutorial"] / times["fp32_graph"], 3)
    out["graph_over_eager"] = round(times["fp32"] / times["fp32_graph"], 3)
    out["bf16_graph_over_fp32_graph"] = round(times["fp32_graph"] / times["bf16_graph"], 3)
    out["bf16_over_fp32_eager"] = round(times["fp32"] / times["bf16"], 3)
    out["hard_graph_over_eager"] = round(times["hard"] / times["hard_graph"], 3)
    out["best_over_tutorial"] = round(times["tutorial"] / min(times["fp32_graph"], times["bf16_graph"]), 3)
    out["graph_stats"] = {name: wr.stats.as_dict() for name, wr in wrappers.items()}
    if device.type == "cuda":
        out["peak_gpu_memory_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
    return out


def _same(a: list, b: list) -> int:
    return sum(x[0].tokens == y[0].tokens and x[0].score == y[0].score and torch.equal(x[0].attention, y[0].attention)
               for x, y in zip(a, b))


def beam_graph(quick: bool = False) -> dict:
    s = QUICK if quick else PAPER
    images = 16 if quick else 256
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    w = s["width"]
    decoder = SATDecoder(s["vocab"], s["feature_dim"], embed_dim=w, hidden_dim=w, attention_dim=w,
                         dropout=0.0).to(device).eval()
    features = torch.randn(images, s["grid"] ** 2, s["feature_dim"], generator=torch.Generator().manual_seed(1))
    features = features.relu().to(device)
    graphed = GraphedSteps(decoder)
    out: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "images": images}
    for name, beam in (("greedy", 1), ("beam3", 3)):
        opts = DecodeOptions(beam_size=beam, max_len=20)
        results = {}

        def run(which: str, dec) -> None:  # noqa: ANN001
            results[which] = decode(dec, features, SearchRules(1, 2, (0, 1)), opts)

        times = _rounds({"eager": lambda: run("eager", decoder), "graph": lambda: run("graph", graphed)},
                        device, steps=1, rounds=3)
        out[f"{name}_eager_images_per_s"] = round(images / times["eager"], 1)
        out[f"{name}_graph_images_per_s"] = round(images / times["graph"], 1)
        out[f"{name}_speedup"] = round(times["eager"] / times["graph"], 3)
        out[f"{name}_same_captions"] = _same(results["eager"], results["graph"])
        out[f"{name}_mean_words"] = sum(len(h[0].tokens) for h in results["eager"]) / images
    out["graph_stats"] = graphed.stats.as_dict()
    return out


BENCHMARKS = {"sat_graph": sat_graph, "beam_graph": beam_graph}

if __name__ == "__main__":
    quick = "--quick" in sys.argv
    print(sat_graph(quick), beam_graph(quick))
