"""Word-level distillation: the teacher's top-k words along the training captions (``write_word_targets``)
and the KL term that trains a student on them (``train.word_distill``)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import captioner
from captioner.cli import main
from captioner.config import get_preset
from captioner.data.coco import load_caption_set
from captioner.errors import ConfigError, DataError
from captioner.models.base import DecoderOutput
from captioner.text import Vocabulary
from captioner.training.distill import WordDistillation, read_word_targets, write_word_targets
from captioner.training.objective import Batch


@pytest.fixture(scope="module")
def teacher(tiny_shapes: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SAT trained one epoch on tiny_shapes: its vocabulary is the one a student of the same data builds."""
    out = tmp_path_factory.mktemp("teacher")
    assert main(["train", "--data", str(tiny_shapes), "--preset", "sat_soft_tiny", "--out", str(out), "--epochs", "1",
                 "--no-progress", "--set", "train.val_max_images=4", "--set", "train.batch_size=16"]) == 0
    return out / "best.safetensors"


@pytest.fixture(scope="module")
def targets(teacher: Path, tiny_shapes: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("targets") / "words.safetensors"
    summary = write_word_targets(teacher, tiny_shapes, out, top_k=4, batch_size=7, progress=False)
    cs = load_caption_set(tiny_shapes, "train")
    assert summary["images"] == len(cs) and summary["captions"] == cs.num_captions and summary["top_k"] == 4
    assert 0.0 < summary["mass"] <= 1.0
    return out


def teacher_log_probs(teacher: Path, tiny_shapes: Path, image: int, caption: str) -> tuple[torch.Tensor, list[int]]:
    model = captioner.load(teacher, device="cpu")
    cs = load_caption_set(tiny_shapes, "train")
    features, _ = model.encode(cs.images[image].path)  # (1, N, D)
    ids = model.vocab.encode(caption)
    with torch.no_grad():
        out = model.model.eval().decoder(features, torch.tensor([ids[:-1]]))
    return torch.log_softmax(out.logits.float(), dim=-1)[0], ids  # (T-1, V)


def test_distill_words_command_writes_the_same_file(teacher, targets, tiny_shapes, tmp_path, capsys):
    out = tmp_path / "words.safetensors"
    assert main(["distill", "words", str(teacher), "--data", str(tiny_shapes), "--out", str(out), "--top-k", "4",
                 "--batch-size", "7", "--device", "cpu", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["top_k"] == 4 and summary["captions"] == load_caption_set(tiny_shapes, "train").num_captions
    (mine, meta), (ref, ref_meta) = read_word_targets(out), read_word_targets(targets)
    assert meta == ref_meta and mine.keys() == ref.keys()
    assert all(torch.equal(mine[k], ref[k]) for k in ref)
    assert main(["distill", "words", str(teacher), "--data", str(tiny_shapes), "--out", str(out), "--top-k", "0"]) == 2


def test_word_targets_hold_the_teachers_top_words_of_every_step(teacher, targets, tiny_shapes):
    tensors, meta = read_word_targets(targets)
    cs = load_caption_set(tiny_shapes, "train")
    assert json.loads(meta["images"]) == [r.file_name for r in cs.images]
    assert json.loads(meta["vocab"]) == captioner.load(teacher, device="cpu").vocab.itos
    c = 7  # a caption in the second batch of images (batch_size=7, five captions an image)
    image = int(tensors["image"][c])
    start, end = int(tensors["offsets"][c]), int(tensors["offsets"][c + 1])
    ids = tensors["tokens"][start:end].tolist()
    caption = next(cap for cap in cs.captions[cs.images[image].image_id]
                   if captioner.load(teacher, device="cpu").vocab.encode(cap) == ids)
    log_probs, _ = teacher_log_probs(teacher, tiny_shapes, image, caption)
    s0, s1 = int(tensors["step_offsets"][c]), int(tensors["step_offsets"][c + 1])
    assert s1 - s0 == len(ids) - 1  # one step per predicted word, <eos> included
    expected_probs, expected_ids = log_probs.exp().topk(4, dim=-1)
    assert torch.equal(tensors["top_ids"][s0:s1].long(), expected_ids)
    torch.testing.assert_close(tensors["top_probs"][s0:s1].float(), expected_probs, atol=1e-3, rtol=1e-2)


def test_the_term_is_the_kl_to_the_renormalised_top_k(teacher, targets, tiny_shapes):
    """A student that is the teacher still differs from the teacher's top-k by exactly -log(kept mass)
    at each step; a caption the file lacks gets no term; a student vocabulary in another order reads
    the same words."""
    cs = load_caption_set(tiny_shapes, "train")
    vocab = captioner.load(teacher, device="cpu").vocab
    record = cs.images[3]
    caption = cs.captions[record.image_id][1]
    log_probs, ids = teacher_log_probs(teacher, tiny_shapes, 3, caption)
    term = WordDistillation(targets, cs, vocab, weight=1.0, max_len=30)
    tokens = torch.tensor([ids, ids])
    tokens[1, 1] = vocab.stoi["square"] if tokens[1, 1] != vocab.stoi["square"] else vocab.stoi["circle"]
    batch = Batch(x=torch.zeros(2, 1), tokens=tokens, image_index=torch.tensor([3, 3]))
    out = DecoderOutput(logits=torch.stack([log_probs, log_probs]))
    mass = log_probs.exp().topk(4, dim=-1).values.sum(dim=-1)  # (T-1,)
    value = term(out, batch)
    torch.testing.assert_close(value, -torch.log(mass).mean(), atol=2e-3, rtol=1e-3)
    assert float(term.stats["word_distill_rows"]) == 0.5  # the altered caption is not the teacher's
    assert float(value) > 0
    # the same words under a student vocabulary in reverse order: the same value
    words = vocab.itos[4:]
    reverse = Vocabulary(list(reversed(words)))
    perm = torch.tensor([reverse.stoi[w] for w in vocab.itos])  # teacher id -> student id
    student_logits = torch.empty_like(log_probs)
    student_logits[:, perm] = log_probs
    student_tokens = perm[torch.tensor(ids)]
    term_r = WordDistillation(targets, cs, reverse, weight=1.0, max_len=30)
    value_r = term_r(DecoderOutput(logits=student_logits[None]),
                     Batch(x=torch.zeros(1, 1), tokens=student_tokens[None], image_index=torch.tensor([3])))
    torch.testing.assert_close(value_r, value, atol=1e-5, rtol=1e-5)


def test_a_cut_caption_keeps_the_teachers_steps_but_not_its_end(teacher, targets, tiny_shapes):
    cs = load_caption_set(tiny_shapes, "train")
    vocab = captioner.load(teacher, device="cpu").vocab
    caption = cs.captions[cs.images[0].image_id][0]
    full = vocab.encode(caption)
    cut = vocab.encode(caption, max_len=2)  # [<bos> w1 w2 <eos>]
    term = WordDistillation(targets, cs, vocab, weight=1.0, max_len=2)
    ids, probs, _ = term.lookup(torch.tensor([cut]), torch.tensor([0]))
    assert len(full) > len(cut)
    assert probs[0, :2].sum(dim=-1).gt(0).all() and float(probs[0, 2].sum()) == 0.0  # no teacher <eos> after w2


def test_training_reads_the_targets_and_logs_the_term(targets, tiny_shapes, tmp_path):
    out = tmp_path / "student"
    assert main(["train", "--data", str(tiny_shapes), "--preset", "sat_soft_tiny", "--out", str(out), "--epochs", "1",
                 "--no-progress", "--set", "train.val_max_images=4", "--set", "train.batch_size=16",
                 "--set", "train.log_every=1", "--set", f"train.word_distill={targets}",
                 "--set", "train.word_distill_weight=0.5"]) == 0
    rows = [r for r in csv.DictReader(open(out / "metrics.csv", newline="")) if r["kind"] == "step"]
    assert rows and all(float(r["word_distill"]) >= 0 for r in rows)
    assert all(float(r["word_distill_rows"]) == 1.0 for r in rows)  # every training caption is in the file
    alpha_c = json.loads((out / "config.json").read_text())["train"]["alpha_c"]
    for r in rows:  # the objective is the cross-entropy, the doubly stochastic penalty and the weighted term
        extra = alpha_c * float(r["doubly_stochastic"] or 0)
        assert float(r["loss"]) == pytest.approx(float(r["ce"]) + extra + 0.5 * float(r["word_distill"]), rel=1e-4)


def test_bad_targets_are_refused_in_one_line(targets, tiny_shapes, tmp_path, capsys):
    base = ["train", "--data", str(tiny_shapes), "--preset", "sat_soft_tiny", "--out", str(tmp_path / "r"),
            "--epochs", "1", "--no-progress"]
    assert main([*base, "--set", f"train.word_distill={tmp_path / 'none.safetensors'}"]) != 0
    err = capsys.readouterr().err
    assert "none.safetensors: word-distillation targets not found" in err and "Traceback" not in err
    other = tmp_path / "other.safetensors"
    tensors, meta = read_word_targets(targets)
    from safetensors.torch import save_file

    save_file(tensors, str(other), {**meta, "images": json.dumps(["elsewhere.jpg"] * len(json.loads(meta["images"])))})
    cs = load_caption_set(tiny_shapes, "train")
    with pytest.raises(DataError, match="none of its .* captions is a caption of the training set"):
        WordDistillation(other, cs, Vocabulary(["a"]), 1.0, 30)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a file")
    with pytest.raises(DataError, match="garbage.safetensors: not a safetensors file"):
        read_word_targets(garbage)
    with safe_open(str(targets), framework="pt") as f:
        assert f.metadata()["format"] == "captioner-word-targets"
    with pytest.raises(ConfigError, match="word_distill_weight must be a number >= 0"):
        get_preset("sat_soft_tiny", **{"train.word_distill_weight": -1.0})
