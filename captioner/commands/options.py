"""Command-line option helpers the commands share: number types with ranges and the decoding flags.

Imports only argparse, math and :mod:`captioner.errors` (``--help`` stays fast). A search flag left
out is not passed on, so ``DecodeOptions()``'s defaults apply to every command as to the Python API.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from captioner.config import EVERYDAY_PHOTOS, flags_of
from captioner.errors import ConfigError

def int_range(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number between ``low`` and ``high`` (None: no upper bound)."""
    def whole(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text[:40]!r}") from None
        if value < low or (high is not None and value > high):
            span = f">= {low}" if high is None else f"between {low} and {high}"
            raise argparse.ArgumentTypeError(f"must be {span}, got {value}")
        return value

    whole.__name__ = "whole number"
    return whole


def float_range(low: float, high: float, low_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in ``[low, high]`` (``(low, high]`` when ``low_open``)."""
    def number(text: str) -> float:
        value = finite_float(text)
        if value < low or (low_open and value == low) or value > high:
            span = f"{'over' if low_open else 'at least'} {low:g} and at most {high:g}"
            raise argparse.ArgumentTypeError(f"must be {span}, got {text[:40]}")
        return value

    number.__name__ = "number"
    return number


def finite_float(text: str) -> float:
    """``float(text)``, refusing ``nan``, ``inf`` and ``-inf`` (they pass every ``<`` and ``>`` test wrongly)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text[:40]!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text[:40]!r}")
    return value


FLAGS = {"beam": "beam_size", "max_len": "max_len"}  # option dest -> DecodeOptions field
MAX_BEAM = 10_000  # beams (their memory with the caption length is checked when the search is planned)
MAX_LEN = 100_000  # words in a caption


def add_decoding_arguments(parser: argparse.ArgumentParser, beam_help: str = "beam size; 1 = greedy") -> None:
    parser.add_argument("--beam", type=int_range(1, MAX_BEAM), default=None, metavar="K",
                        help=f"{beam_help} (default: 3)")
    parser.add_argument("--max-len", type=int_range(1, MAX_LEN), default=None, metavar="N",
                        help="longest caption in words (default: 20)")
    parser.add_argument("--allow-unk", action="store_true", help="let captions contain <unk> (banned by default)")
    parser.add_argument("--no-repeat-ngram", type=int_range(0, MAX_LEN), default=None, metavar="N",
                        help="never repeat an N-gram within a caption (3: no repeated trigram; default: off)")
    parser.add_argument("--no-repeat-words", action="store_true",
                        help="never use a content word (not 'a', 'the', 'in'...) twice in a caption")
    parser.add_argument("--veto", type=float_range(0.0, 100.0), default=None, metavar="G",
                        help="a model reading the encoder's labels: object words its labels say are absent lose G "
                             "log-probability (10: never said; default: 0, off)")
    parser.add_argument("--constrain", type=float_range(0.0, 1.0), default=None, metavar="P",
                        help="a model reading the encoder's labels: each caption holds one of the words whose "
                             "label is at least P likely (constrained beam search; default: 0, off)")
    parser.add_argument("--fill-slots", type=float_range(0.0, 1.0), default=None, metavar="P",
                        help="a model reading the encoder's labels: an object word its labels say is absent "
                             "becomes the object they see where that word looked, when at least P likely there "
                             "(slots filled by detections; 0.05 suits the shipped model; default: 0, off)")
    parser.add_argument("--lm-weight", type=float_range(0.0, 10.0), default=None, metavar="W",
                        help="add W times a caption language model's log-probability to every word (shallow "
                             "fusion: sentences as people write them about everyday photos; default: 0, off)")
    parser.add_argument("--everyday", action="store_true",
                        help=f"the 'everyday photos' setting, for a model reading the encoder's labels: "
                             f"{flags_of(EVERYDAY_PHOTOS)} (flags given beside it win)")
    parser.add_argument("--lm", default=None, metavar="FILE",
                        help="the language model of --lm-weight: a file written by captioner lm (default: coco, "
                             "the packaged one, COCO caption text)")
    add_precision_argument(parser)


PRECISIONS = ("float32", "bfloat16", "int8")  # --precision: the decoder's (float32, bfloat16) or the encoder's (int8)


def add_precision_argument(parser: argparse.ArgumentParser, decoder: bool = True) -> None:
    """``--precision``; ``decoder``: with the decoder's bfloat16 (commands that take the decoding flags)."""
    bfloat16 = ("bfloat16: the decoder in bfloat16 (searches about twice as fast on a CPU with native bfloat16, "
                "a few captions differing), the encoder float32; ") if decoder else ""
    parser.add_argument("--precision", choices=PRECISIONS if decoder else ("float32", "int8"), default=None,
                        help=f"float32: every part in float32; {bfloat16}int8: the encoder in 8-bit integers on a "
                             "CPU (a model whose calibration ships with it, as the shipped one's), the decoder "
                             "float32 (default: float32)")


def encoder_precision(args: argparse.Namespace) -> str | None:
    """The encoder's arithmetic ``--precision`` asks for (``load(precision=...)``): int8 for int8, float32 for
    float32 and bfloat16 (the decoder's), None when the flag is left out (the default)."""
    precision = getattr(args, "precision", None)
    if precision is None:
        return None
    return "int8" if precision == "int8" else "float32"


def decoding_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The ``DecodeOptions`` fields the user set, checked (one line naming the flag when < 1); ``--everyday``
    sets :data:`~captioner.config.EVERYDAY_PHOTOS` under the other flags."""
    out: dict[str, object] = dict(EVERYDAY_PHOTOS) if getattr(args, "everyday", False) else {}
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
    if getattr(args, "precision", None) in ("float32", "bfloat16"):  # the decoder's; int8 is the encoder's
        out["precision"] = args.precision
    if getattr(args, "veto", None) is not None:
        out["veto"] = args.veto
    if getattr(args, "constrain", None) is not None:
        out["constrain"] = args.constrain
    if getattr(args, "fill_slots", None) is not None:
        out["fill_slots"] = args.fill_slots
    if getattr(args, "lm_weight", None) is not None:
        out["lm_weight"] = args.lm_weight
    if getattr(args, "lm", None) is not None:
        if not out.get("lm_weight"):
            raise ConfigError(f"--lm names the language model of --lm-weight W; give --lm-weight too "
                              f"({EVERYDAY_PHOTOS['lm_weight']:g} for example)")
        out["lm"] = args.lm
    return out
