"""Does attention follow the concept detectors? ``python scripts/experiments/concept_maps_on_references.py CKPT``.

CKPT: a checkpoint whose decoder reads concepts (``train.concepts``). On a COCO folder with boxes
(default ``../shared/data/coco2017-mini``), every reference caption is fed to the decoder (as
``captioner evaluate`` does for ``reference_attention_correctness``), and its words that are concepts
are scored twice against the boxes: with the decoder's attention at the step that predicts each, and
with the concept detectors' own map of that word in the photo (the target the concept guide pulls
attention towards). Prints both ratios with their 95% intervals and pointing accuracies: the gap
between them is how far the decoder falls short of the maps it was guided by.

With ``concepts.prior`` it also says how well the pointer foresees the concept: at every
reference word that is a concept the head finds in the photo, the share of steps whose pointer puts
the most weight on that concept, its mean weight there and on "none", beside the decoder's own
probability of the word and how often the word is its first choice; and the decoder's attention on the
same words with a pointer that always foresees the next word's concept (an oracle: its pointer logits
replaced by the truth, "none" for words that are no concept).
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch

from captioner.errors import CaptionerError


def pointer_report(engine, cs, load, concept_of: dict[str, int], min_prob: float = 0.1) -> str:  # noqa: ANN001
    """How well the concept prior's pointer foresees the concept words of the reference captions."""
    decoder, vocab = engine.model.decoder, engine.vocab
    none = decoder.extension.concepts
    steps = first = 0
    on_concept = on_none = word_prob = word_first = 0.0
    with torch.no_grad():
        for i, record in enumerate(cs.images):
            features, _ = engine.model.encode(load(i).unsqueeze(0))
            probs = decoder.extension.concept_probs(features)[0]  # (K,)
            for caption in cs.captions.get(record.image_id, []):
                ids = vocab.encode(caption)
                out = decoder(features, torch.tensor([ids[:-1]]))
                q = out.aux["concept_pointer"][0].exp()  # (T, K+1)
                p = out.logits[0].softmax(-1)  # (T, V)
                for t, wid in enumerate(ids[1:]):
                    k = concept_of.get(vocab.itos[wid])
                    if k is None or probs[k] < min_prob:
                        continue
                    steps += 1
                    first += int(q[t].argmax() == k)
                    on_concept += float(q[t, k])
                    on_none += float(q[t, none])
                    word_prob += float(p[t, wid])
                    word_first += float(p[t].argmax() == wid)
    if not steps:
        return "pointer: no reference word is a concept the head finds"
    return (f"pointer on {steps} concept words: first choice {first / steps:.2f}, weight on the concept "
            f"{on_concept / steps:.2f}, on none {on_none / steps:.2f}; the decoder's own p(word) "
            f"{word_prob / steps:.2f}, first choice {word_first / steps:.2f}")


@contextlib.contextmanager
def oracle_pointer(decoder, vocab_size: int):  # noqa: ANN001, ANN201
    """Within it, the concept prior's pointer always names the concept of the word each step predicts
    ("none" for other words): its logits are replaced by the truth before the prior is formed."""
    none = decoder.extension.concepts
    table = torch.full((vocab_size,), none, dtype=torch.long)  # vocabulary id -> its concept, else "none"
    table[decoder.extension.concept_ids] = torch.arange(none)
    reading = decoder.extension  # the concept reading: its prior_map forms the prior
    own_forward, own_map = decoder.forward, reading.prior_map
    truth: dict[str, object] = {}

    def forward(features, tokens, need_all_attention=False):  # noqa: ANN001, ANN202
        following = torch.full_like(tokens, none)  # (B, T): the concept of the word step t predicts
        following[:, :-1] = table[tokens[:, 1:]]
        truth.update(following=following, step=0)
        return own_forward(features, tokens, need_all_attention)

    def prior_map(pointer, logp, maps):  # noqa: ANN001, ANN202
        if pointer.dim() == 3:  # the Transformer: every step at once
            k = truth["following"]
        else:  # SAT: one step per call
            k = truth["following"][:, truth["step"]]
            truth["step"] += 1
        sure = torch.full_like(pointer, -60.0).scatter(-1, k.unsqueeze(-1), 60.0)
        sure[..., :none] -= logp.unsqueeze(-2) if pointer.dim() == 3 else logp  # cancel the photo's log P
        return own_map(sure, logp, maps)

    decoder.forward, reading.prior_map = forward, prior_map
    try:
        yield
    finally:
        del decoder.forward, reading.prior_map


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint whose decoder reads concepts")
    parser.add_argument("--data", default="../shared/data/coco2017-mini", help="COCO folder with instances")
    parser.add_argument("--split", default="train2017", help="split with boxes (default: train2017)")
    args = parser.parse_args(argv)
    import captioner
    from captioner.data.coco import load_caption_set, load_instances
    from captioner.data.dataset import image_loader
    from captioner.evaluation.attention_metrics import reference_correctness
    from captioner.evaluation.evaluate import ForcedCaption, ratio_line, reference_attention

    try:
        engine = captioner.load(args.checkpoint, device="cpu")
        decoder = engine.model.decoder
        if not getattr(decoder.extension, "concepts", 0):
            raise CaptionerError(f"{args.checkpoint}: its decoder reads no concepts (train it with train.concepts)")
        cs = load_caption_set(args.data, args.split)
        instances = load_instances(args.data, args.split, None)
        if instances is None:
            raise CaptionerError(f"{args.data} [{args.split}]: no instances file, so no boxes to score against")
        concept_of = {engine.vocab.itos[i]: k for k, i in enumerate(decoder.extension.concept_ids.tolist())}
        forced = reference_attention(engine, cs, progress=False)
        prior = getattr(decoder.extension, "concept_prior", False)
        if prior:
            with oracle_pointer(decoder, len(engine.vocab)):
                foreseen = reference_attention(engine, cs, progress=False)
        load = image_loader(cs, engine.transform)
        on_maps, on_attention, on_foreseen = [], [], []
        with torch.no_grad():
            for i, refs in enumerate(forced):
                features, grid = engine.model.encode(load(i).unsqueeze(0))
                maps = decoder.extension.concept_head.maps(features)[0].reshape(-1, int(grid[0]), int(grid[1]))  # (K, g, g)
                uniform = torch.full(maps.shape[1:], 1.0 / maps[0].numel())
                mine, theirs, oracle = [], [], []
                for r, ref in enumerate(refs):  # words that are not concepts are hidden from the scorer
                    words = [w if w in concept_of else "<none>" for w in ref.words]
                    mine.append(ForcedCaption(words, torch.stack([maps[concept_of[w]] if w in concept_of else uniform
                                                                  for w in ref.words])))
                    theirs.append(ForcedCaption(words, ref.attention))
                    if prior:
                        oracle.append(ForcedCaption(words, foreseen[i][r].attention))
                on_maps.append(mine)
                on_attention.append(theirs)
                on_foreseen.append(oracle)
        scored = [("the decoder's attention", on_attention)]
        if prior:
            scored.append(("... with an oracle pointer", on_foreseen))
        for name, captions in (*scored, ("the concept detectors' maps", on_maps)):
            r = reference_correctness(captions, cs, instances, engine.config.encoder)
            if not r["words_scored"]:
                print(f"{name}: no reference word is both a concept and a box's category")
                continue
            print(f"{name}: {ratio_line(r)}")
        if getattr(decoder.extension, "concept_prior", False):
            print(pointer_report(engine, cs, load, concept_of))
    except CaptionerError as exc:
        print(f"concept_maps_on_references: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
