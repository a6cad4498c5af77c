"""Word-level distillation: the teacher's top-k words along the training captions (``write_word_targets``)
and the KL term that trains a student on them (``train.word_distill``)."""

from __future__ import annotations

import csv
import os
import re
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


# ----------------------------------------------------------------------------- crafted targets files

WORDS = ["<pad>", "<bos>", "<eos>", "<unk>", "a", "red", "square"]


def crafted(path: Path, meta: dict[str, str] | None = None, **tensors: torch.Tensor) -> Path:
    """A well-formed two-caption targets file (top_k 2), with ``meta`` and ``tensors`` replacing its own."""
    from safetensors.torch import save_file

    good = {"tokens": torch.tensor([1, 4, 5, 6, 2, 1, 6, 2], dtype=torch.int32),  # <bos> a red square <eos>, <bos> square <eos>
            "offsets": torch.tensor([0, 5, 8]), "step_offsets": torch.tensor([0, 4, 6]),
            "image": torch.tensor([0, 1], dtype=torch.int32),
            "top_ids": torch.tensor([[4, 5]] * 6, dtype=torch.int32),
            "top_probs": torch.tensor([[0.6, 0.3]] * 6, dtype=torch.float16)}
    header = {"format": "captioner-word-targets", "version": "1", "split": "train", "top_k": "2",
              "vocab": json.dumps(WORDS), "images": json.dumps(["one.png", "two.png"]), "teacher": "t"}
    save_file({**good, **tensors}, str(path), {**header, **(meta or {})})
    return path


BAD_TARGETS = {  # name: (meta, tensors, the field and the fault the one line names)
    "tokens 2-D": ({}, {"tokens": torch.ones(2, 4, dtype=torch.int32)}, r"tensor 'tokens' has shape \(2, 4\); it must have 1 dimension"),
    "top_ids of another width": ({}, {"top_ids": torch.ones(6, 3, dtype=torch.int32)},
                                 r"tensor 'top_ids' has shape \(6, 3\); .* top_k 2 it must be \(6, 2\)"),
    "offsets too short": ({}, {"offsets": torch.tensor([0, 8])}, r"tensor 'offsets' has shape \(2,\); with 2 captions"),
    "float tokens": ({}, {"tokens": torch.ones(8)}, "tensor 'tokens' is F32; it must be an integer type"),
    "integer probabilities": ({}, {"top_probs": torch.ones(6, 2, dtype=torch.int32)},
                              "tensor 'top_probs' is I32; it must be a floating type"),
    "id beyond the vocabulary": ({}, {"top_ids": torch.tensor([[4, 5]] * 5 + [[4, 70]], dtype=torch.int32)},
                                 r"tensor 'top_ids' holds 70 at \(5, 1\), outside 0..6 \(the ids of the 7-word vocabulary\)"),
    "negative id": ({}, {"top_ids": torch.tensor([[4, -1]] * 6, dtype=torch.int32)},
                    r"tensor 'top_ids' holds -1 at \(0, 1\), outside 0..6"),
    "token beyond the vocabulary": ({}, {"tokens": torch.tensor([1, 4, 5, 99, 2, 1, 6, 2], dtype=torch.int32)},
                                    "tensor 'tokens' holds 99 at 3, outside 0..6"),
    "image beyond the list": ({}, {"image": torch.tensor([0, 2], dtype=torch.int32)},
                              "tensor 'image' holds 2 at 1, outside 0..1 .indices into the metadata's 2 images"),
    "offsets past the tokens": ({}, {"offsets": torch.tensor([0, 5, 9])}, "tensor 'offsets' runs from 0 to 9; it must run from 0 to 8"),
    "offsets going back": ({}, {"offsets": torch.tensor([0, 9, 8]), "step_offsets": torch.tensor([0, 4, 6])},
                           "tensor 'offsets' gives caption 1 -1 tokens; each caption has at least <bos> and <eos>"),
    "steps not the tokens'": ({}, {"step_offsets": torch.tensor([0, 3, 6])},
                              "tensor 'step_offsets' gives caption 0 3 steps; its 5 tokens predict 4"),
    "NaN probability": ({}, {"top_probs": torch.tensor([[0.6, float("nan")]] * 6)},
                        r"tensor 'top_probs' holds nan at \(0, 1\); probabilities are finite and within \[0, 1\]"),
    "inf probability": ({}, {"top_probs": torch.tensor([[0.6, 0.3]] * 5 + [[float("inf"), 0.0]])},
                        r"tensor 'top_probs' holds inf at \(5, 0\)"),
    "negative probability": ({}, {"top_probs": torch.tensor([[0.6, -0.3]] * 6)}, r"holds -0.3\d* at \(0, 1\)"),
    "probabilities over 1": ({}, {"top_probs": torch.tensor([[0.9, 0.8]] * 6)},
                             "tensor 'top_probs' row 0 sums to 1.7; the probabilities of one step sum to at most 1"),
    "vocab not JSON": ({"vocab": "[a, b"}, {}, r"metadata 'vocab' is not JSON \(a list of strings\)"),
    "vocab of numbers": ({"vocab": "[1, 2, 3, 4, 5, 6, 7]"}, {}, "metadata 'vocab' must be a JSON list of strings"),
    "vocab of two words": ({"vocab": '["a", "b"]'}, {}, "metadata 'vocab' holds 2 words; a vocabulary has at least"),
    "images an object": ({"images": '{"0": "one.png"}'}, {}, "metadata 'images' must be a JSON list of strings"),
    "top_k a word": ({"top_k": "eight"}, {}, "metadata 'top_k' 'eight' is not an integer"),
    "top_k past the vocabulary": ({"top_k": "20000"}, {"top_ids": torch.zeros(6, 20000, dtype=torch.int32),
                                                       "top_probs": torch.zeros(6, 20000, dtype=torch.float16)},
                                  r"metadata 'top_k' 20000 is outside 1..7 \(at most 1000 and at most the vocabulary's 7 words\)"),
    "top_k 0": ({"top_k": "0"}, {"top_ids": torch.zeros(6, 0, dtype=torch.int32),
                                 "top_probs": torch.zeros(6, 0, dtype=torch.float16)}, "metadata 'top_k' 0 is outside 1..7"),
}


def test_a_crafted_targets_file_reads_back(tmp_path):
    tensors, meta = read_word_targets(crafted(tmp_path / "good.safetensors"))
    assert meta["top_k"] == "2" and tensors["top_ids"].shape == (6, 2)


@pytest.mark.parametrize("case", sorted(BAD_TARGETS))
def test_each_bad_field_of_a_targets_file_is_one_line_naming_it(case, tmp_path):
    meta, tensors, message = BAD_TARGETS[case]
    path = crafted(tmp_path / "bad.safetensors", meta, **tensors)
    with pytest.raises(DataError) as info:
        read_word_targets(path)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"{path}: ") and re.search(message, text), text


def test_training_with_a_bad_targets_file_stops_in_one_line(tiny_shapes, tmp_path, capsys):
    """The reproduction: NaN probabilities once trained to a negative loss with rc 0; now one line, rc 1,
    and nothing written."""
    path = crafted(tmp_path / "nan.safetensors", top_probs=torch.tensor([[0.6, float("nan")]] * 6))
    code = main(["train", "--data", str(tiny_shapes), "--preset", "sat_soft_tiny", "--out", str(tmp_path / "r"),
                 "--epochs", "1", "--no-progress", "--set", f"train.word_distill={path}"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert f"{path}: tensor 'top_probs' holds nan at (0, 1)" in err
    assert not (tmp_path / "r").exists()  # checked before the run folder, its config or a feature cache is written


def test_special_files_are_refused_before_opening(tmp_path):
    fifo = tmp_path / "words.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match="words.safetensors: is a named pipe, not a regular file"):
        read_word_targets(fifo)
    link = tmp_path / "zero.safetensors"
    link.symlink_to("/dev/zero")
    with pytest.raises(DataError, match="zero.safetensors: is a character device, not a regular file"):
        read_word_targets(link)
    from captioner.training.distill import teacher_dataset

    data = tmp_path / "data"
    data.mkdir()
    (data / "captions_coco_format.json").write_text('{"images": [], "annotations": []}')
    (tmp_path / "results.json").write_text("[]")
    os.mkfifo(data / "splits.tsv")
    with pytest.raises(DataError, match="splits.tsv: is a named pipe, not a regular file"):
        teacher_dataset(data, tmp_path / "results.json", tmp_path / "out")


def test_the_command_and_the_library_share_the_top_k_cap(tmp_path):
    from captioner.commands import distill as command
    from captioner.training import distill

    assert command.MAX_TOP_K == distill.MAX_TOP_K
    with pytest.raises(ConfigError, match="top_k must be an integer from 1 to 1000, got 1001"):
        write_word_targets("unused", tmp_path, tmp_path / "w.safetensors", top_k=1001)
