"""``captioner lm``: learn a caption language model from caption text alone, for ``--lm-weight``."""

from __future__ import annotations

import argparse
import os

from captioner.commands.options import int_range

MAX_EPOCHS, MAX_WIDTH = 1_000, 65_536

NAME = "lm"
INTERRUPTED = "interrupted: --out holds the best epoch that finished, if one did"
HELP = ("learn a language model of captions from caption text without photos (COCO-format caption files), in a "
        "model's vocabulary; caption, attend and evaluate fuse it into the search with --lm FILE --lm-weight W")
EXAMPLES = """
  captioner lm --captions coco/annotations/captions_train2014.json --out coco_lm.safetensors
  captioner lm -c runs/sat/best.safetensors --captions text.json --leave-out dev/captions.json --out lm.safetensors
  captioner caption photo.jpg --lm coco_lm.safetensors --lm-weight 0.5
  captioner caption photo.jpg --lm-weight 0.5     # the packaged language model (COCO caption text)
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--checkpoint", default="flickr8k", metavar="MODEL",
                        help="the captioner whose vocabulary the language model speaks: a shipped model's name or a "
                             "checkpoint (default: flickr8k, the shipped model)")
    parser.add_argument("--captions", action="append", required=True, metavar="FILE",
                        help="a COCO-format caption file to learn from (only the captions are read; repeatable)")
    parser.add_argument("--leave-out", action="append", default=[], metavar="FILE",
                        help="a COCO-format caption file whose image ids are left out of the text (a dev set whose "
                             "captions the text also holds; repeatable)")
    parser.add_argument("--out", required=True, metavar="FILE", help="the language model file to write (.safetensors)")
    parser.add_argument("--force", action="store_true", help="replace --out when it exists")
    parser.add_argument("--epochs", type=int_range(1, MAX_EPOCHS), default=5,
                        help=f"passes over the text, 1 to {MAX_EPOCHS} (default 5); the epoch with the lowest "
                             "held-out perplexity is kept")
    parser.add_argument("--hidden", type=int_range(1, MAX_WIDTH), default=512, help="LSTM width (default 512)")
    parser.add_argument("--embed", type=int_range(1, MAX_WIDTH), default=256, help="word embedding width (default 256)")
    parser.add_argument("--batch-size", type=int_range(1, 65_536), default=128, help="captions per step (default 128)")
    parser.add_argument("--seed", type=int_range(0, 2**63 - 1), default=0, help="random seed (default 0)")
    parser.add_argument("--half", action="store_true", help="store the weights in float16 (half the file)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def training_bytes(vocab_size: int, embed: int, hidden: int, batch_size: int, words: int) -> int:
    """Bytes that training a one-layer LSTM language model of these widths needs: its float32 weights five
    times (the weights, their gradients, Adam's two moments, the best epoch's copy) and one step's
    activations over ``words`` + 1 positions (logits, their softmax and gradient; the LSTM's gates)."""
    params = vocab_size * embed + 4 * hidden * (embed + hidden) + 8 * hidden + hidden * vocab_size + vocab_size
    activations = batch_size * (words + 1) * (3 * vocab_size + 12 * hidden + 2 * embed)
    return 4 * (5 * params + activations)


def run(args: argparse.Namespace) -> int:
    from captioner.checkpoint.store import as_checkpoint_error, read_checkpoint_metadata
    from captioner.training.concepts import check_output_file, concepts_output
    from captioner.device import check_memory
    from captioner.errors import DataError
    from captioner.files import check_regular
    from captioner.inference import checkpoint_path
    from captioner.language import (MAX_WORDS, LanguageModelConfig, caption_texts, save_language_model,
                                    train_language_model)
    from captioner.text import Vocabulary

    out = check_output_file(args.out, args.force, "--out", "lm.safetensors")  # before anything is read or trained
    for option, paths in (("--captions", args.captions), ("--leave-out", args.leave_out)):
        for path in paths:  # the inputs first: a missing file is named before any model is read
            if not os.path.lexists(path):
                raise DataError(f"{path}: caption file not found ({option})")
            check_regular(path, None, DataError, "caption file")
    source = checkpoint_path(args.checkpoint)
    header = read_checkpoint_metadata(source)  # only the vocabulary is needed: the weights are not loaded
    need = training_bytes(header["vocab_size"], args.embed, args.hidden, args.batch_size, MAX_WORDS)
    check_memory(need, f"a language model with --hidden {args.hidden}, --embed {args.embed} and --batch-size "
                       f"{args.batch_size} over {header['vocab_size']} words", "lower --hidden, --embed or --batch-size")
    with as_checkpoint_error(source, "bad vocabulary in checkpoint"):
        vocab = Vocabulary.from_dict(header["vocab"])
    captions, read = caption_texts(args.captions, args.leave_out)
    for entry in read["files"]:
        print(f"{entry['file']}: {entry['captions']} captions")
    if args.leave_out:
        print(f"left out {read['left_out']} captions of the image ids in {', '.join(args.leave_out)}")
    about = {"checkpoint": str(args.checkpoint), **read}

    def epoch_done(lm, report, improved) -> None:  # noqa: ANN001
        # a better epoch is on disk at once: an interrupt loses nothing
        ppl = report["perplexity"][-1]
        print(f"epoch {len(report['perplexity'])}: held-out perplexity {ppl:.2f}"
              f"{'' if improved else ' (not kept: no better)'}, {report['seconds']:.0f} s", flush=True)
        if improved:
            save_language_model(out, lm, vocab, {**about, **report}, half=args.half)
            concepts_output(out, True, "--out").record([out])

    config = LanguageModelConfig(len(vocab), embed_dim=args.embed, hidden_dim=args.hidden)
    _, report = train_language_model(captions, vocab, epochs=args.epochs, batch_size=args.batch_size, config=config,
                                     seed=args.seed, progress=not args.no_progress, on_epoch=epoch_done)
    print(f"wrote {out}: {report['captions']} captions learnt, {report['held_out']} held out; perplexity "
          f"{report['perplexity'][report['best_epoch'] - 1]:.2f} (epoch {report['best_epoch']}), {report['seconds']:.0f} s")
    return 0
