"""Command-line option helpers the commands share: finite floats and the decoding flags.

Imports only argparse, math and :mod:`captioner.errors` (the CLI's ``--help`` stays fast).

Option value types (argparse ``type=`` callables): a value argparse cannot take is reported by the
parser as one usage line and exit code 2.

The search flags every command shares (``--beam``, ``--max-len``, ``--allow-unk``,
``--no-repeat-ngram``, ``--no-repeat-words``): a flag left out is not passed on, so the one
default, ``DecodeOptions()`` (beam 3, 20 words, ``<unk>`` banned: :mod:`captioner.config.schema`),
applies to every command as to the Python API and to training's validation.
"""

from __future__ import annotations

import argparse
import math

from captioner.errors import ConfigError

def finite_float(text: str) -> float:
    """``float(text)``, refusing ``nan``, ``inf`` and ``-inf`` (they pass every ``<`` and ``>`` test wrongly)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


FLAGS = {"beam": "beam_size", "max_len": "max_len"}  # option dest -> DecodeOptions field


def add_decoding_arguments(parser: argparse.ArgumentParser, beam_help: str = "beam size; 1 = greedy") -> None:
    parser.add_argument("--beam", type=int, default=None, metavar="K", help=f"{beam_help} (default: 3)")
    parser.add_argument("--max-len", type=int, default=None, metavar="N", help="longest caption in words (default: 20)")
    parser.add_argument("--allow-unk", action="store_true", help="let captions contain <unk> (banned by default)")
    parser.add_argument("--no-repeat-ngram", type=int, default=None, metavar="N",
                        help="never repeat an N-gram within a caption (3: no repeated trigram; default: off)")
    parser.add_argument("--no-repeat-words", action="store_true",
                        help="never use a content word (not 'a', 'the', 'in'...) twice in a caption")


def decoding_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The ``DecodeOptions`` fields the user set, checked (one line naming the flag when < 1)."""
    out: dict[str, object] = {}
    for dest, field in FLAGS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if value < 1:
            raise ConfigError(f"--{dest.replace('_', '-')} must be >= 1, got {value}")
        out[field] = value
    if getattr(args, "allow_unk", False):
        out["allow_unk"] = True
    ngram = getattr(args, "no_repeat_ngram", None)
    if ngram is not None:
        if ngram < 2 and ngram != 0:
            raise ConfigError(f"--no-repeat-ngram must be 0 (off) or >= 2, got {ngram}")
        out["no_repeat_ngram"] = ngram
    if getattr(args, "no_repeat_words", False):
        out["no_repeat_words"] = True
    return out
