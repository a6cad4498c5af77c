"""The package's label stage against the experiment script that fitted the shipped model's fourth release.

On a subset of Flickr8k (``--photos`` training and 20 dev photos), from the same model without labels
(``--init``: the third release, ``git show 73f6fb8^:captioner/weights/flickr8k.safetensors``), with the
script as it was before the port (``--before``: ``git show 25be87a:scripts/experiments/everyday_levers.py``):

* the script's ``features`` and ``teacher`` jobs on the subset, and ``captioner evaluate --split train``;
* the script's ``Probe`` and the package's stage (``captioner train --preset flickr8k_labels`` resolved, then
  ``captioner.training.label_stage.build_label_stage``), compared: vocabulary, copy and veto buffers, person
  probe, prior shift, cached regions and class probabilities, teacher captions, and the model's keys and
  shapes against the shipped ``flickr8k``;
* the script's own ``train()`` for ``--steps`` steps, its batches, random state and losses recorded, then
  the same batches through the package's ``train_step`` from the script's initial weights: the losses step
  by step and the weights after them.

Prints one JSON object. About 6 minutes at 100 photos and 5 steps on a busy 2-core CPU.

    git show 73f6fb8^:captioner/weights/flickr8k.safetensors > runs/third.safetensors
    git show 25be87a:scripts/experiments/everyday_levers.py > runs/everyday_levers_before.py
    python scripts/experiments/label_stage_check.py --init runs/third.safetensors \\
        --before runs/everyday_levers_before.py --work runs/label_stage_check
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.util
import json
import os
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

import captioner
from captioner import device as ddp
from captioner.cli import main as captioner_main
from captioner.commands import train as train_command
from captioner.models.labels import fit_person_probe
from captioner.models.model import resolve_model
from captioner.training import label_stage
from captioner.training.loop import read_init_checkpoint
from captioner.training.run import seed_everything

ROOT = Path(__file__).resolve().parents[2]


def subset(data: Path, out: Path, photos: int) -> Path:
    """``out/flickr8k``: the first ``photos`` training and 20 dev photos of ``data/flickr8k`` (images linked)."""
    src, dst = data / "flickr8k", out / "flickr8k"
    (dst / "images").mkdir(parents=True, exist_ok=True)
    rows = list(csv.reader(open(src / "splits.tsv"), delimiter="\t"))
    keep = {"train": sorted(r[0] for r in rows[1:] if r[1] == "train")[:photos],
            "dev": sorted(r[0] for r in rows[1:] if r[1] == "dev")[:20]}
    with open(dst / "splits.tsv", "w", newline="") as f:
        writer = csv.writer(f, delimiter="\t")
        writer.writerow(rows[0])
        writer.writerows([n, split] for split, names in keep.items() for n in names)
    names = set(keep["train"]) | set(keep["dev"])
    captions = json.loads((src / "captions_coco_format.json").read_text())
    captions["images"] = [i for i in captions["images"] if i["file_name"] in names]
    ids = {i["id"] for i in captions["images"]}
    captions["annotations"] = [a for a in captions["annotations"] if a["image_id"] in ids]
    (dst / "captions_coco_format.json").write_text(json.dumps(captions))
    for n in names:
        if not os.path.lexists(dst / "images" / n):
            os.symlink((src / "images" / n).resolve(), dst / "images" / n)
    return dst


def script_cache(lv: types.ModuleType, args: argparse.Namespace, names: list[str]) -> None:
    """The script's ``features`` job on ``names`` (and 4 everyday photos), then its ``teacher`` job."""
    sets = lv.read_sets(args.data)
    reader = lv.labelled(captioner.load(args.base))
    with torch.no_grad():  # the features job's loop
        for key, paths in (("coco168", sets["paths168"][:4]), ("flickr8k", [args.data / "flickr8k/images" / n for n in names])):
            regions, probs = [], []
            for s in range(0, len(paths), 64):
                both = reader.encode([str(p) for p in paths[s:s + 64]])[0]
                regions.append(both[..., :1280].half())
                probs.append(reader.model.decoder.extension.class_probs(both).half())
            torch.save({"names": [Path(p).name for p in paths], "regions": torch.cat(regions), "probs": torch.cat(probs)},
                       args.cache / f"features_{key}.pt")
    lv.teacher(args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--init", type=Path, required=True, help="the model without labels (the third release)")
    p.add_argument("--before", type=Path, required=True, help="everyday_levers.py as it was before the port")
    p.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "label_stage_check")
    p.add_argument("--photos", type=int, default=100, help="training photos of the subset (>= 48)")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    spec = importlib.util.spec_from_file_location("everyday_levers", args.before)
    lv = importlib.util.module_from_spec(spec)
    sys.modules["everyday_levers"] = lv
    spec.loader.exec_module(lv)
    data = subset(args.data, args.work / "data", args.photos)
    teacher = args.work / "teacher" / "captions_train_results.json"
    captioner_main(["evaluate", str(args.init), "--data", str(data), "--split", "train", "--beam", "3", "--no-progress",
                    "--no-coco-caption", "--no-meteor", "--device", "cpu", "--force", "--out", str(teacher.parent)])
    levers = lv.parse(["train", "--data", str(args.data), "--cache", str(args.work / "script"), "--base", str(args.init),
                       "--photo-targets", "shipped", "--attend-kd", "1", "--steps", str(args.steps)])
    levers.cache.mkdir(exist_ok=True)
    names = sorted(r[0] for r in csv.reader(open(data / "splits.tsv"), delimiter="\t") if r[0] != "image")
    script_cache(lv, levers, names)
    report: dict = {}

    torch.manual_seed(levers.seed)  # the script's main()
    lv.random.seed(levers.seed)
    probe = lv.Probe(levers)
    overrides = [f"train.labels.teacher={teacher}",
                 f"train.labels.text={args.data}/coco2017-mini/annotations/captions_val2017_text_only.json",
                 f"train.labels.text_exclude={args.data}/coco2014-val168/annotations/captions_val2014.json",
                 "data.shared_feature_cache=false", "train.val_max_images=20"]
    ns = argparse.Namespace(preset="flickr8k_labels", config=None, overrides=overrides, data=str(data),
                            out=str(args.work / "run"), epochs=None, batch_size=None, lr=None, time_budget=None,
                            device="cpu", skip_missing=False, resume=False, init=str(args.init), overwrite=True)
    cfg, out = train_command.resolve(ns)
    cfg = dataclasses.replace(cfg, model=resolve_model(cfg.model))
    init = read_init_checkpoint(cfg.train.init)
    label_stage.check_init(init, cfg.model)
    seed_everything(cfg.train.seed)
    stage = label_stage.build_label_stage(cfg, init, out, ddp.setup("cpu"), progress=False, overwrite=True)

    report["vocabulary"] = {"script": len(probe.itos), "package": len(stage.data.vocab),
                            "equal": probe.itos == stage.data.vocab.itos}
    shipped, ours = captioner.load("flickr8k").model.state_dict(), stage.model.state_dict()
    report["keys_and_shapes_as_shipped"] = shipped.keys() == ours.keys() and all(
        shipped[k].shape == ours[k].shape for k in shipped)
    for name in ("copy_ids", "label_category", "word_category", "veto_tau"):
        report[f"{name}_equal"] = torch.equal(getattr(stage.decoder.extension, name), getattr(probe.ext, name))
    report["prior_shift"] = {"script": probe.shift, "package": stage.shift}
    order = [probe.c8["names"].index(r.path.name) for r in stage.data.train_set.images]
    probs = label_stage.photo_class_probs(stage.decoder.extension, stage.data, torch.device("cpu"))
    report["class_probs_max_abs_diff"] = float((probe.c8["probs"][order].float() - probs).abs().max())
    report["regions_equal"] = torch.equal(stage.features(list(range(len(order)))), probe.c8["regions"][order].float())
    rows = torch.tensor(probe.train_rows)
    flags = torch.tensor([i in probe.rows_by_flag[True] for i in probe.train_rows])
    again = fit_person_probe(probe.c8["probs"][rows], flags)
    report["probe_equal_on_the_script_probabilities"] = bool(
        torch.equal(again.w, probe.person.w) and torch.equal(again.mu, probe.person.mu) and again.b == float(probe.person.b))
    theirs = json.loads((levers.cache / "shipped_train.json").read_text())
    same = sum(theirs[r.path.name] == t[0] for r, t in zip(stage.data.train_set.images, stage.targets))
    report["teacher_captions_identical"] = f"{same}/{len(stage.targets)}"

    # the script's train(): each step's batch, random state and loss recorded
    start = {k: v.clone() for k, v in probe.dec.state_dict().items()}
    steps: list[dict] = []
    probe.dec.register_forward_pre_hook(lambda module, inputs: steps.append(
        {"rng": torch.get_rng_state(), "regions": inputs[0].detach().clone(), "labels": probe.given.clone()}))
    cross_entropy, kl = F.cross_entropy, probe.attention_kl

    def recorded_ce(logits: torch.Tensor, targets: torch.Tensor, **kw: object) -> torch.Tensor:
        value = cross_entropy(logits, targets, **kw)
        steps[-1].update(targets=targets.detach().clone(), ce=float(value))
        return value

    def recorded_kl(*a: torch.Tensor) -> torch.Tensor:
        value = kl(*a)
        steps[-1]["kl"] = float(value)
        return value

    lv.F = types.SimpleNamespace(cross_entropy=recorded_ce)
    probe.attention_kl = recorded_kl
    t0 = time.time()
    probe.train()
    report["script_seconds"] = round(time.time() - t0, 1)
    steps = [s for s in steps if "ce" in s]  # the decoder trained, not the base one
    # ... and the same batches through the package, from the same weights and random state
    stage.decoder.load_state_dict(start)
    stage.decoder.train()
    optimizer = label_stage.stage_optimizer(stage.decoder, cfg)
    t0, rows_out = time.time(), []
    for s in steps:
        tokens = torch.cat([torch.ones(len(s["regions"]), 1, dtype=torch.long),
                            s["targets"].view(len(s["regions"]), -1)], 1)
        torch.set_rng_state(s["rng"])
        ours = label_stage.train_step(stage, optimizer, s["regions"], s["labels"], tokens, levers.batch)
        rows_out.append({"script": [s["ce"], s["kl"]], "package": [ours["ce"], ours["attention_kl"]]})
    report["package_seconds"] = round(time.time() - t0, 1)
    report["steps (cross-entropy, attention KL)"] = rows_out
    report["max_abs_loss_diff"] = max(abs(sum(r["script"]) - sum(r["package"])) for r in rows_out)
    end = probe.dec.state_dict()
    report["weights_max_abs_diff_after"] = max(float((end[k].float() - v.float()).abs().max())
                                               for k, v in stage.decoder.state_dict().items() if v.numel())
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
