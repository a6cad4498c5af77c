"""The levers for everyday photos, one change at a time, on the shipped SAT model (a probe, not a recipe).

The shipped decoder is fine-tuned from its own weights with its vocabulary grown by the COCO caption
words (>= 5 uses) and a reading of the labels the encoder sees:

* **labels**: the package lexicon (:mod:`captioner.concepts.labels`) over the ImageNet head of the
  original top stage (reading (b) of ``label_quality.py``), plus a **person** score: a logistic probe
  of the head's 1000 log-probabilities fitted on Flickr8k train (a person is named in >= 3 of 5
  captions), shifted at COCO evaluation by the log-odds of the person prior in the COCO caption text
  against Flickr8k's. Read into the LSTM's initial state and the deep output (zero-initialised);
* ``--copy``: a pointer-generator over the lexicon words (p = (1 - g) p_gen + g p_copy, the gate g
  read from the deep output, p_copy a softmax of ``sharp * log label + word bias``), after LSTM-C
  (Yao et al. 2017);
* ``--text``: COCO caption-only rows (the dev photos' ids left out) beside the Flickr8k rows, their
  labels read from their own words and noised (75% kept, 0.15-0.95, a few spurious; the person score
  drawn from the probe's scores on Flickr8k photos with the same person flag), their regions those of
  a Flickr8k photo with the same person flag (``matched``), zeros or a random photo;
* ``--photo-targets shipped``: the Flickr8k rows' captions are the shipped model's own (beam 3),
  a self-distillation that keeps what its SCST taught it; ``--reading a``: the labels from the head
  on the shipped regions (as :mod:`captioner.concepts.labels` reads them) instead of the original
  top stage;
* at decoding, ``--veto G``: object words (the CHAIR table) whose labels say absent (lexicon words of
  their category below ``--veto-tau``, person below ``--veto-person-tau``) lose G from their logit;
  ``--rerank G``: the beam's n-best re-ranked by score - G x unsupported object mentions;
  ``--no-repeat 1``: no content word twice (the copy otherwise repeats a label: "a door with a door").

Scores: coco-caption CIDEr-D / BLEU-4 and :func:`captioner.evaluation.chair.chair_scores` on
``coco2014-val168`` (beam 3), CIDEr-D / BLEU-4 on the first 1,000 Flickr8k dev photos.

    python scripts/experiments/everyday_levers.py features            # once: runs/everyday/features_*.pt
    python scripts/experiments/everyday_levers.py teacher             # once: runs/everyday/shipped_train.json
    python scripts/experiments/everyday_levers.py train --steps 600 --out runs/everyday/a.pt [--copy 0 ...]
    python scripts/experiments/everyday_levers.py eval --init runs/everyday/a.pt [--veto 10 | --rerank 3]
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import captioner
from captioner.concepts.labels import label_head, read_lexicon
from captioner.config import DecodeOptions, EncoderConfig
from captioner.data.coco import load_caption_set
from captioner.decoding.search import beam_search
from captioner.evaluation.chair import chair_scores, named_objects
from captioner.evaluation.metrics import bleu, cider_d
from captioner.models.base import SATExtension
from captioner.models.encoder import efficientnet_lite_state_dict
from captioner.text import STOP_WORDS, tokenize

ROOT = Path(__file__).resolve().parents[2]


def read_sets(data: Path) -> dict:
    """Flickr8k train/dev captions, coco2014-val168 references, COCO caption-only text without the dev ids."""
    split, caps8 = {}, {}
    for name in ("train", "dev"):
        cs = load_caption_set(data / "flickr8k", name)
        for r in cs.images:
            split[r.path.name], caps8[r.path.name] = name, cs.captions[r.image_id]
    dev = load_caption_set(data / "coco2014-val168", "val2014")
    images168 = sorted(dev.images, key=lambda r: r.image_id)
    coco = json.loads((data / "coco2017-mini/annotations/captions_val2017_text_only.json").read_text())
    dev_ids = {r.image_id for r in images168}
    text = [a for a in coco["annotations"] if a["image_id"] not in dev_ids]
    return {"split": split, "caps8": caps8, "refs168": [dev.captions[r.image_id] for r in images168],
            "paths168": [r.path for r in images168], "text": text, "dropped": len(coco["annotations"]) - len(text)}


@torch.no_grad()
def features(args: argparse.Namespace) -> None:
    """Regions of the shipped encoder (float16) and the original ImageNet head's class probabilities."""
    sets = read_sets(args.data)
    shipped = captioner.load("flickr8k")
    original = copy.deepcopy(shipped.model)
    wheel = efficientnet_lite_state_dict("efficientnet_lite0")
    trunk = {k: v for k, v in wheel.items() if not k.startswith("classifier.")}
    original.encoder.trunk.load_state_dict(trunk, strict=False)  # the top stage the fine-tuning changed, as shipped
    w, b = wheel["classifier.weight"].float(), wheel["classifier.bias"].float()
    reader = captioner.inference.Captioner(original, shipped.vocab)
    names = sorted(sets["split"])
    for key, paths in (("coco168", sets["paths168"]), ("flickr8k", [args.data / "flickr8k/images" / n for n in names])):
        out = args.cache / f"features_{key}.pt"
        if out.exists():
            continue
        regions, probs, t0 = [], [], time.time()
        for s in range(0, len(paths), 64):
            regions.append(shipped.encode([str(p) for p in paths[s:s + 64]])[0].half())
            pooled = reader.encode([str(p) for p in paths[s:s + 64]])[0].mean(1)
            probs.append(torch.softmax(pooled @ w.T + b, -1).half())
            print(f"{key}: {min(s + 64, len(paths))}/{len(paths)} photos, {time.time() - t0:.0f} s", flush=True)
        args.cache.mkdir(parents=True, exist_ok=True)
        torch.save({"names": [Path(p).name for p in paths], "regions": torch.cat(regions), "probs": torch.cat(probs)}, out)


@torch.no_grad()
def teacher(args: argparse.Namespace) -> None:
    """The shipped model's own captions (beam 3) of the Flickr8k train photos, for ``--photo-targets``."""
    out = args.cache / "shipped_train.json"
    sets, shipped = read_sets(args.data), captioner.load("flickr8k")
    c8, vocab, dec = torch.load(args.cache / "features_flickr8k.pt"), shipped.vocab, shipped.model.decoder.eval()
    rows = [i for i, n in enumerate(c8["names"]) if sets["split"][n] == "train"]
    caps, t0 = {}, time.time()
    for s in range(0, len(rows), 100):
        chunk = rows[s:s + 100]
        hyps = beam_search(dec, c8["regions"][chunk].float(), vocab.bos_id, vocab.eos_id, DecodeOptions(),
                           [vocab.pad_id, vocab.bos_id, vocab.unk_id])
        for i, hs in zip(chunk, hyps):
            caps[c8["names"][i]] = " ".join(vocab.itos[t] for t in hs[0].tokens)
        print(f"teacher: {len(caps)}/{len(rows)} photos, {time.time() - t0:.0f} s", flush=True)
    out.write_text(json.dumps(caps, indent=0))


def says_person(caption: str) -> bool:
    return "person" in named_objects(caption)


class PersonProbe:
    """A logistic probe of the ImageNet head's log-probabilities: is a person in the photo."""

    def __init__(self, probs: torch.Tensor, flags: torch.Tensor) -> None:
        x = probs.float().clamp_min(1e-6).log()
        self.mu, self.sd = x.mean(0), x.std(0) + 1e-4
        z = (x - self.mu) / self.sd
        self.w = torch.zeros(z.size(1), requires_grad=True)
        self.b = torch.zeros(1, requires_grad=True)
        opt = torch.optim.Adam([self.w, self.b], lr=1e-2)
        for _ in range(300):
            loss = F.binary_cross_entropy_with_logits(z @ self.w + self.b, flags.float()) + 1e-3 * self.w.pow(2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        self.w, self.b = self.w.detach(), self.b.detach()

    def logit(self, probs: torch.Tensor) -> torch.Tensor:
        return ((probs.float().clamp_min(1e-6).log() - self.mu) / self.sd) @ self.w + self.b


class LabelReading(SATExtension):
    """Labels (B, W + 1) into the initial state and the deep output; the labels ride along for the copy."""

    def __init__(self, words: int, hidden: int, embed: int) -> None:
        super().__init__()
        self.to_state, self.to_out = nn.Linear(words + 1, 2 * hidden), nn.Linear(words + 1, embed)
        for lin in (self.to_state, self.to_out):
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)
        self.gate = nn.Linear(embed, 1)
        nn.init.zeros_(self.gate.weight)
        nn.init.constant_(self.gate.bias, -3.0)
        self.sharp = nn.Parameter(torch.tensor(1.0))
        self.word_bias = nn.Parameter(torch.zeros(words))
        self.labels: torch.Tensor | None = None  # set per batch

    def read(self, features: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"labels": self.labels.to(features.dtype)}

    def initial_state(self, static: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.to_state(static["labels"])

    def output(self, static: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([self.to_out(static["labels"]), static["labels"]], -1)  # (B, M + W + 1)


class Probe:
    """The grown, label-reading shipped decoder and everything a run needs."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        sets = read_sets(args.data)
        self.sets = sets
        c8, c168 = (torch.load(args.cache / f"features_{k}.pt") for k in ("flickr8k", "coco168"))
        if args.reading == "a":  # the head on the shipped regions, as captioner.concepts.labels reads them
            head = label_head(EncoderConfig(name="efficientnet_lite0"))  # the shipped encoder's wheel
            for c in (c8, c168):
                regions = c["regions"]
                c["probs"] = torch.cat([head.class_probs(regions[s:s + 500]) for s in range(0, len(regions), 500)])
        self.c8, self.c168 = c8, c168
        self.train_rows = [i for i, n in enumerate(c8["names"]) if sets["split"][n] == "train"]
        self.dev_rows = [i for i, n in enumerate(c8["names"]) if sets["split"][n] == "dev"][:1000]
        flags = torch.tensor([sum(map(says_person, sets["caps8"][n])) >= 3 for n in c8["names"]])
        rows = torch.tensor(self.train_rows)
        self.person = PersonProbe(c8["probs"][rows], flags[rows])
        scores = self.person.logit(c8["probs"][rows])
        self.person_scores = {True: scores[flags[rows]], False: scores[~flags[rows]]}
        self.rows_by_flag = {f: [i for i in self.train_rows if bool(flags[i]) == f] for f in (True, False)}
        by_image = collections.defaultdict(list)
        for a in sets["text"]:
            by_image[a["image_id"]].append(a["caption"])
        prior_coco = sum(sum(map(says_person, c)) >= 3 for c in by_image.values()) / len(by_image)
        prior_f8k = flags[rows].float().mean().item()
        self.shift = math.log(prior_coco / (1 - prior_coco)) - math.log(prior_f8k / (1 - prior_f8k))
        self.text = [a["caption"] for a in sets["text"]]
        if args.photo_targets != "human":
            self.teacher = json.loads((args.cache / "shipped_train.json").read_text())
        self.lexicon = read_lexicon()
        self.to_words = self.lexicon.matrix()  # (1000, W)
        self._build_model()
        print(f"person prior Flickr8k {prior_f8k:.2f}, COCO text {prior_coco:.2f} (shift {self.shift:+.2f}); "
              f"vocabulary {self.vocab0} -> {len(self.itos)}; {len(self.text)} text rows "
              f"({sets['dropped']} dev captions left out)", flush=True)

    def _build_model(self) -> None:
        args, words = self.args, self.lexicon.words
        shipped = captioner.load("flickr8k")
        self.vocab, dec = shipped.vocab, shipped.model.decoder
        counts = collections.Counter(w for c in self.text for w in tokenize(c))
        self.itos = list(self.vocab.itos)
        known = set(self.itos)
        if args.text:  # the words of the text rows (>= 5 uses); without them the vocabulary stays the shipped one
            self.itos += sorted(w for w, n in counts.items() if n >= 5 and w not in known)
        self.stoi = {w: i for i, w in enumerate(self.itos)}
        v0, v, m = dec.vocab_size, len(self.itos), dec.embed_dim
        self.vocab0 = v0
        with torch.no_grad():
            emb, out = nn.Embedding(v, m), nn.Linear(m, v)
            emb.weight[:v0], out.weight[:v0], out.bias[:v0] = dec.embedding.weight, dec.out_word.weight, dec.out_word.bias
            emb.weight[v0:] = dec.embedding.weight[4:v0].mean(0) + 0.01 * torch.randn(v - v0, m)
            out.weight[v0:] = 0.01 * torch.randn(v - v0, m)
            out.bias[v0:] = dec.out_word.bias[4:].min()
        dec.embedding, dec.out_word, dec.vocab_size = emb, out, v
        self.ext = LabelReading(len(words), dec.hidden_dim, m)
        dec.extension = self.ext
        ids = [self.stoi.get(w, -1) if " " not in w else -1 for w in words]
        self.copy_mask = torch.tensor([i >= 0 for i in ids])
        self.copy_idx = torch.tensor([max(i, 0) for i in ids])
        # the veto: which label column supports which vocabulary token (its CHAIR category)
        lex_cat = collections.defaultdict(list)
        for k, w in enumerate(words):
            cats = named_objects(w)
            if len(cats) == 1:
                lex_cat[cats[0]].append(k)
        self.lex_cat = lex_cat
        self.support, blind = torch.zeros(len(words) + 1, v), torch.zeros(v, dtype=torch.bool)
        for w, i in self.stoi.items():
            cats = named_objects([w]) if i > 3 else []
            if len(cats) == 1:
                blind[i] = cats[0] != "person" and cats[0] not in lex_cat  # a category no ImageNet class sees
                for k in ([len(words)] if cats[0] == "person" else lex_cat.get(cats[0], [])):
                    self.support[k, i] = 1.0
        self.tau = torch.where(self.support[len(words)] > 0, args.veto_person_tau, args.veto_tau)
        self.vetoable = self.support.sum(0) > 0  # (V,) the object words some label column speaks for
        if args.veto_blind:  # ... and those of the categories no label column sees, vetoed always
            self.vetoable |= blind
        dec._deep_output = self._deep_output  # the copy and the veto around the paper's deep output
        self.dec = dec
        if args.init:
            print("init from", args.init, dec.load_state_dict(torch.load(args.init)["decoder"], strict=False), flush=True)

    def _deep_output(self, emb: torch.Tensor, h: torch.Tensor, gated: torch.Tensor, added: torch.Tensor) -> torch.Tensor:
        dec, ext, args, w = self.dec, self.ext, self.args, len(self.lexicon.words)
        m = dec.embed_dim
        labels = added[..., m:]
        x = dec.dropout(emb + dec.out_hidden(dec.dropout(h)) + dec.out_context(gated) + added[..., :m])
        gen = dec.out_word(x)
        if args.veto and not dec.training:
            gen = gen - args.veto * (((labels.float() @ self.support) < self.tau) & self.vetoable).float()
        if not args.copy:
            return gen
        gate = ext.gate(x).float()
        logp = F.logsigmoid(-gate) + F.log_softmax(gen.float(), -1)
        scores = (ext.sharp * labels[..., :w].float().clamp_min(1e-4).log() + ext.word_bias).masked_fill(~self.copy_mask, -1e4)
        copied = F.logsigmoid(gate) + F.log_softmax(scores, -1)
        idx = self.copy_idx.expand(*logp.shape[:-1], w)
        mixed = torch.where(self.copy_mask, torch.logaddexp(logp.gather(-1, idx), copied), logp.gather(-1, idx))
        return logp.scatter(-1, idx[..., self.copy_mask], mixed[..., self.copy_mask])

    def photo_labels(self, probs: torch.Tensor, shift: float = 0.0) -> torch.Tensor:
        person = torch.sigmoid(self.person.logit(probs) + shift)[:, None]
        return torch.cat([probs.float() @ self.to_words, person * float(self.args.person)], 1)

    def text_labels(self, caption: str) -> torch.Tensor:
        words, tokens = self.lexicon.words, tokenize(caption)
        v, said, joined = torch.zeros(len(words) + 1), set(tokens), " ".join(tokens)
        for k, w in enumerate(words):
            if (w in joined if " " in w else (w in said or w + "s" in said or w + "es" in said)) and random.random() < 0.75:
                v[k] = random.uniform(0.15, 0.95)
        for _ in range(random.randint(0, 3)):
            v[random.randrange(len(words))] += random.uniform(0.0, 0.1)
        if v[:-1].sum() > 1:
            v[:-1] /= v[:-1].sum()
        pool = self.person_scores[says_person(caption)]
        v[-1] = torch.sigmoid(pool[random.randrange(len(pool))]) * float(self.args.person)
        return v

    def photo_target(self, name: str) -> str:
        kind = self.args.photo_targets
        if kind == "shipped" or (kind == "mix" and random.random() < 0.5):
            return self.teacher[name]
        return random.choice(self.sets["caps8"][name])

    def encode(self, caption: str, longest: int = 21) -> list[int]:
        ids = [self.stoi.get(w, self.vocab.unk_id) for w in tokenize(caption)][:longest - 2]
        return [self.vocab.bos_id, *ids, self.vocab.eos_id]

    def unsupported(self, caption: str, labels: torch.Tensor) -> int:
        w, bad = len(self.lexicon.words), 0
        for cat in named_objects(caption):
            if cat == "person":
                bad += float(labels[w]) < self.args.veto_person_tau
            elif cat in self.lex_cat:
                bad += float(labels[self.lex_cat[cat]].sum()) < self.args.veto_tau
        return bad

    @torch.no_grad()
    def decode(self, regions: torch.Tensor, labels: torch.Tensor) -> list[str]:
        args, vocab = self.args, self.vocab
        k = args.rerank_beam if args.rerank else 3
        opts = DecodeOptions(beam_size=k, max_len=20, n_best=k, no_repeat_words=bool(args.no_repeat))
        content = tuple(i for i, w in enumerate(self.itos) if i > 3 and w not in STOP_WORDS)
        self.dec.eval()
        out = []
        for s in range(0, regions.size(0), 50):
            self.ext.labels = labels[s:s + 50]
            hyps = beam_search(self.dec, regions[s:s + 50].float(), vocab.bos_id, vocab.eos_id, opts,
                               [vocab.pad_id, vocab.bos_id, vocab.unk_id], content)
            for j, hs in enumerate(hyps):
                texts = [" ".join(self.itos[t] for t in h.tokens) for h in hs]
                best = max(range(len(hs)), key=lambda i: hs[i].score - args.rerank * self.unsupported(texts[i], labels[s + j])) \
                    if args.rerank else 0
                out.append(texts[best])
        return out

    def evaluate(self) -> dict:
        t0 = time.time()
        shift = {"coco": (self.shift, 0.0), "none": (0.0, 0.0), "always": (self.shift, self.shift)}[self.args.person_shift]
        caps = self.decode(self.c168["regions"], self.photo_labels(self.c168["probs"], shift[0]))
        refs = self.sets["refs168"]
        ch = chair_scores(caps, refs)
        res = {"coco168": {"CIDEr-D": 100 * cider_d(caps, refs), "BLEU-4": 100 * bleu(caps, refs)["BLEU-4"],
                           "CHAIR-s": 100 * ch.chair_s, "CHAIR-i": 100 * ch.chair_i, "coverage": 100 * ch.coverage}}
        if self.args.flickr8k_dev:
            rows = self.dev_rows
            d = self.decode(self.c8["regions"][rows], self.photo_labels(self.c8["probs"][rows], shift[1]))
            r = [self.sets["caps8"][self.c8["names"][i]] for i in rows]
            res["flickr8k_dev"] = {"CIDEr-D": 100 * cider_d(d, r), "BLEU-4": 100 * bleu(d, r)["BLEU-4"]}
        print(json.dumps({k: {m: round(v, 1) for m, v in d.items()} for k, d in res.items()}),
              f"({time.time() - t0:.0f} s)", flush=True)
        return {"scores": res, "coco168": caps}

    def train(self) -> None:
        args, dec, ext, vocab = self.args, self.dec, self.ext, self.vocab
        new = list(ext.parameters())
        old = [p for p in dec.parameters() if all(p is not q for q in new)]
        opt = torch.optim.Adam([{"params": old, "lr": args.lr}, {"params": new, "lr": args.ext_lr}])
        dec.train()
        t0, losses, b = time.time(), [], args.batch
        for step in range(1, args.steps + 1):
            rows = random.sample(self.train_rows, b)
            seqs = [self.encode(self.photo_target(self.c8["names"][i])) for i in rows]
            regions, labels = self.c8["regions"][rows].float(), self.photo_labels(self.c8["probs"][rows])
            if args.text:
                texts = random.sample(self.text, b)
                seqs += [self.encode(c) for c in texts]
                if args.text_regions == "zeros":
                    more = torch.zeros(b, *regions.shape[1:])
                elif args.text_regions == "random":
                    more = self.c8["regions"][random.sample(self.train_rows, b)].float()
                else:
                    more = self.c8["regions"][[random.choice(self.rows_by_flag[says_person(c)]) for c in texts]].float()
                regions = torch.cat([regions, more])
                labels = torch.cat([labels, torch.stack([self.text_labels(c) for c in texts])])
            tokens = torch.full((len(seqs), max(map(len, seqs))), vocab.pad_id, dtype=torch.long)
            for i, s in enumerate(seqs):
                tokens[i, :len(s)] = torch.tensor(s)
            ext.labels = labels
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = dec(regions, tokens[:, :-1]).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten(), ignore_index=vocab.pad_id)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(dec.parameters(), 5.0)
            opt.step()
            losses.append(loss.item())
            if step % 50 == 0:
                print(f"step {step} loss {sum(losses[-50:]) / 50:.3f} {time.time() - t0:.0f} s", flush=True)
        print(f"trained {args.steps} steps in {time.time() - t0:.0f} s", flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("job", choices=("features", "teacher", "train", "eval"))
    p.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    p.add_argument("--cache", type=Path, default=ROOT / "runs" / "everyday")
    p.add_argument("--init", default="", help="a probe checkpoint to start from (train) or score (eval)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "everyday" / "probe.pt")
    p.add_argument("--json", type=Path, help="where the scores and captions go (default: beside --out / --init)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=48, help="Flickr8k rows per step (and as many text rows)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--ext-lr", type=float, default=1e-3)
    p.add_argument("--photo-targets", choices=("human", "shipped", "mix"), default="human",
                   help="the Flickr8k rows' captions: people's, the shipped model's own (beam 3; `teacher` job), or half each")
    p.add_argument("--reading", choices=("a", "b"), default="b",
                   help="the labels from the head on the shipped regions (a, as the package reads them) or on the "
                        "original top stage (b, the cached probabilities)")
    p.add_argument("--copy", type=int, default=1)
    p.add_argument("--person", type=int, default=1)
    p.add_argument("--text", type=int, default=1)
    p.add_argument("--text-regions", choices=("matched", "zeros", "random"), default="matched")
    p.add_argument("--veto", type=float, default=0.0)
    p.add_argument("--veto-tau", type=float, default=0.05)
    p.add_argument("--veto-blind", type=int, default=0,
                   help="1: the veto also silences the object words of the COCO categories no ImageNet class sees")
    p.add_argument("--veto-person-tau", type=float, default=0.5)
    p.add_argument("--no-repeat", type=int, default=0, help="1: no content word twice in a caption (DecodeOptions)")
    p.add_argument("--rerank", type=float, default=0.0)
    p.add_argument("--rerank-beam", type=int, default=10)
    p.add_argument("--flickr8k-dev", type=int, default=1)
    p.add_argument("--person-shift", choices=("coco", "none", "always"), default="coco",
                   help="where the person score is shifted by the COCO/Flickr8k prior log-odds: on the everyday "
                        "set only (as measured), nowhere, or on both sets (one model for every photo)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main() -> None:
    args = parse()
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    if args.job == "features":
        features(args)
        return
    if args.job == "teacher":
        teacher(args)
        return
    probe = Probe(args)
    if args.job == "train":
        probe.train()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"decoder": probe.dec.state_dict(), "itos": probe.itos, "args": {k: str(v) for k, v in vars(args).items()}},
                   args.out)
    result = probe.evaluate()
    out = args.json or (args.out if args.job == "train" else Path(args.init or args.out)).with_suffix(".json")
    out.write_text(json.dumps({**result, "args": {k: str(v) for k, v in vars(args).items()}}, indent=1))


if __name__ == "__main__":
    main()
