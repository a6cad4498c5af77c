"""``captioner caption``: caption image files, folders and globs with a trained checkpoint.

One line per image on stdout (``path<TAB>caption``, or JSON lines with ``--json``). A file that
cannot be read gets its own one-line error on stderr and the others are still captioned; the exit
code is 1 when any input failed. Output is unambiguous for any file name: JSON lines keep
undecodable bytes as surrogate escapes (``os.fsencode`` restores them), and in the plain output a
name or caption holding a tab, a control character or such bytes, or starting with a double
quote, is written as a JSON string.
"""

from __future__ import annotations

import argparse
import errno
import glob
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from captioner.commands.options import (add_decoding_arguments, decoding_overrides, encoder_precision, float_range,
                                        int_range)

NAME = "caption"
HELP = "caption images (files, folders, globs) with a checkpoint; optionally write attention overlays"
EXAMPLES = """
  captioner caption photo.jpg                          # the shipped model
  captioner caption photo.jpg --checkpoint runs/sat/best.safetensors
  captioner caption photos/ 'more/*.png' --checkpoint best.safetensors --beam 5 --json > captions.jsonl
  captioner caption photo.jpg --checkpoint best.safetensors --overlay overlays/   # overlays/photo/attention.*
  captioner caption photos/ --checkpoint best.safetensors --device auto --batch-size 32
  captioner caption photo.jpg --labels --json          # + the words the encoder's ImageNet head sees
"""

CHECKPOINT_HELP = ("checkpoint: a shipped model's name (captioner.available_models(); default: the shipped "
                   "default model), a .safetensors file, a run folder, an https:// URL (cached; #sha256=HEX checks "
                   "it) or hf://ORG/REPO[/FILE]")
_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")
_AMBIGUOUS = re.compile(r"[\x00-\x1f\x7f\ud800-\udfff]")  # control characters (tab, newline) and raw bytes
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"})
_GLOB_CHARS = frozenset("*?[")
MAX_LABELS = 50  # --labels K at most


def add_refresh_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--refresh", action="store_true",
                        help="download a URL or hf:// checkpoint again even when it is cached (a bad cached copy)")


def checkpoints(args: argparse.Namespace) -> str | list[str]:
    """``--checkpoint`` as :func:`captioner.load` takes it: one path, or the list of an ensemble's;
    without it the shipped default model, named on stderr."""
    if not args.checkpoint:
        return default_model()
    return args.checkpoint[0] if len(args.checkpoint) == 1 else args.checkpoint


def default_model() -> str:
    """The shipped default model's name, announced on stderr (what a command uses without -c)."""
    from captioner.pretrained import DEFAULT_MODEL, MODELS

    print(f"captioner: using the shipped model {DEFAULT_MODEL!r} ({MODELS[DEFAULT_MODEL].summary}); "
          "-c CHECKPOINT picks another", file=sys.stderr, flush=True)
    return DEFAULT_MODEL


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``caption`` and ``attend``."""
    parser.add_argument("--checkpoint", "-c", action="append", metavar="CKPT",
                        help=CHECKPOINT_HELP + "; repeat it for an ensemble (the mean of the models' word probabilities)")
    add_refresh_argument(parser)
    add_decoding_arguments(parser)
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1 or auto (GPU when present)")
    parser.add_argument("--labels", type=int_range(0, MAX_LABELS), nargs="?", const=5, default=0, metavar="K",
                        help="also the K words (default 5) the encoder's ImageNet head sees in each photo, with their "
                             "probability and map: in --json, attention.json and a <stem>_labels.png overlay")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", metavar="PATH", help="image files, folders of images, or globs")
    add_common_arguments(parser)
    parser.add_argument("--batch-size", type=int_range(1, 4096), default=8,
                        help="images per decoding batch, 1 to 4096 (default: 8)")
    parser.add_argument("--json", action="store_true",
                        help='JSON lines: {"path", "caption", "score", "tokens", "seconds"} (+ "labels" with --labels)')
    parser.add_argument("--overlay", metavar="DIR", default=None,
                        help="also write attention overlays (PNG grid, GIF, JSON, HTML) to DIR/<image stem>/")
    add_force_argument(parser, "--overlay")
    add_style_arguments(parser)


def add_force_argument(parser: argparse.ArgumentParser, option: str) -> None:
    parser.add_argument("--force", action="store_true",
                        help=f"replace files in {option} that captioner did not write (its own earlier files are "
                             "replaced without it)")


def add_style_arguments(parser: argparse.ArgumentParser) -> None:
    """``--style``, ``--cmap`` and ``--alpha``: how the overlays draw attention (caption --overlay, attend)."""
    parser.add_argument("--style", choices=("heat", "light"), default="heat",
                        help="heat (default): a colour map over the photo, transparent where a word did not look, "
                             "its strongest region at the top on any photo; light: the photo itself where the word "
                             "looked, darkened where it did not")
    parser.add_argument("--cmap", default="viridis",
                        help="colour map of the heat style (matplotlib name, default: viridis)")
    parser.add_argument("--alpha", type=float_range(0, 1), default=0.75,
                        help="strength 0..1: the darkest dimming (light) or the opacity at the top (heat) (default: 0.75)")


def _why_not_a_file(path: Path) -> str | None:
    """Why a folder or glob entry cannot be captioned (``"a named pipe, not a regular file"``), or None."""
    import stat as stat_module

    from captioner.files import file_kind

    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "broken symbolic link" if path.is_symlink() else "file not found"
    except OSError as exc:
        return "symbolic link loop" if exc.errno == errno.ELOOP else (exc.strerror or str(exc))
    if stat_module.S_ISDIR(mode):
        return "a directory, not an image file"
    kind = file_kind(mode)
    return None if kind is None else f"a {kind}, not a regular file"


def _scan(entries: list[Path], problems: list[str]) -> list[Path]:
    """The entries that are regular files; each other one is a problem line saying why it is skipped."""
    files = []
    for entry in sorted(entries):
        why = _why_not_a_file(entry)
        if why is None:
            files.append(entry)
        else:
            problems.append(f"{entry}: skipped: {why}")
    return files


def expand_paths(items: list[str]) -> tuple[list[Path], list[str]]:
    """Files, folders (their images, sorted) and globs -> (files, one-line problems).

    A missing path without glob characters is kept for loading to report; in a folder only image
    names count, and those that are not regular files are reported.
    """
    files: list[Path] = []
    problems: list[str] = []
    for item in items:
        path = Path(item)
        if path.is_dir():
            try:
                entries = [p for p in path.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS]
            except OSError as exc:
                problems.append(f"{item}: cannot list folder ({exc.strerror or exc})")
                continue
            found = _scan(entries, problems)
            if not entries:
                problems.append(f"{item}: no images in folder (extensions: {', '.join(sorted(IMAGE_EXTENSIONS))})")
            files += found
        elif not os.path.lexists(path) and _GLOB_CHARS & set(item):
            matches = [Path(p) for p in glob.glob(item) if not Path(p).is_dir()]
            if not matches:
                problems.append(f"{item}: no files match")
            files += _scan(matches, problems)
        else:
            files.append(path)
    return files, problems


def check_positive(args: argparse.Namespace, *flags: str) -> None:
    from captioner.errors import ConfigError

    for flag in flags:
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")


def unique_dir(root: Path, stem: str, used: set[str]) -> Path:
    """``root/<safe stem>`` (or ``-2``... when stems repeat), always inside ``root``."""
    from captioner.files import safe_name

    stem = safe_name(stem)
    name, n = stem, 1
    while name in used:
        n += 1
        name = f"{stem}-{n}"
    used.add(name)
    return root / name


def json_line(row: Any) -> str:
    """``row`` as one JSON line, valid UTF-8 whatever the names hold: lone surrogates (undecodable bytes of a
    file name) are written as ``\\udcXX`` escapes instead of raw bytes."""
    return _LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(row, ensure_ascii=False))


def plain_field(text: str) -> str:
    """``text`` as is, or as a JSON string when it could make a ``path<TAB>caption`` line ambiguous."""
    if text.startswith('"') or _AMBIGUOUS.search(text):
        return json_line(text)
    return text


def _error(message: str) -> None:
    from captioner.errors import one_line

    print(f"captioner {NAME}: error: {one_line(message)}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from captioner.errors import ConfigError
    from captioner.files import MANIFEST, Outputs

    decoding = decoding_overrides(args)
    check_positive(args, "batch_size")
    if not 0.0 <= args.alpha <= 1.0:
        raise ConfigError(f"--alpha must be in [0, 1], got {args.alpha}")
    if args.overlay:  # matplotlib (colour maps) loads only when overlays are asked for
        from captioner.viz.overlays import colormap_lut

        colormap_lut(args.cmap)  # a bad colour map name fails before any work
        from captioner.files import writable_folder

        writable_folder(args.overlay, ConfigError)  # so does a folder that cannot be written
    from captioner.device import resolve_device
    from captioner.inference import decode_options, load

    files, problems = expand_paths(args.paths)
    if not any(os.path.lexists(path) for path in files):  # no input to caption: said before any model loads
        for problem in problems + [f"{path}: file not found" for path in files]:
            _error(problem)
        return 1
    used_dirs: set[str] = {MANIFEST}  # a photo named .captioner-files.json.png gets a folder of another name
    out_dirs = [unique_dir(Path(args.overlay), path.stem, used_dirs) for path in files] if args.overlay else []
    outputs = Outputs(Path(args.overlay or "."), force=args.force, option="--overlay")
    if args.overlay:  # a user's file in the way is refused before any work
        from captioner.viz.overlays import overlay_paths

        outputs.check([p for d in out_dirs for p in overlay_paths(d).values()])
    model = load(checkpoints(args), device=resolve_device(args.device, option="--device"), refresh=args.refresh,
                 precision=encoder_precision(args))
    options = decode_options(None, **decoding)
    for problem in problems:
        _error(problem)
    # each overlay file is recorded in the manifest as it is written: after an error or Ctrl-C the
    # overlays written so far are known as captioner's
    failed = _caption_files(args, model, options, files, out_dirs, outputs) or bool(problems)
    return 1 if failed else 0


def _caption_files(args: argparse.Namespace, model: Any, options: Any, files: list[Path], out_dirs: list[Path],
                   outputs: Any) -> bool:
    """Caption ``files`` (and write their overlays into ``out_dirs``, each recorded in ``outputs``), one line
    each; True when any failed."""
    from captioner.data.images import load_image
    from captioner.errors import EmptyCaptionError, ImageLoadError

    if args.overlay:  # the overlays' drawing, pages and GIF code: only for --overlay (a plain caption's start)
        from captioner.viz.overlays import write_overlays
    failed = False
    t0, done = time.perf_counter(), 0
    # files are read, encoded and searched in an overlapping pipeline (Captioner.caption_stream)
    results = model.caption_stream(files, options, attention=bool(args.overlay), batch_size=args.batch_size,
                                   labels=args.labels)
    for index, (path, result) in enumerate(zip(files, results)):
        if isinstance(result, (ImageLoadError, EmptyCaptionError)):
            _error(str(result))
            failed = True
            continue
        done += 1
        row: dict[str, Any] = {"path": str(path), "caption": result.text, "score": round(float(result.score), 4),
                               "tokens": list(result.words),
                               "seconds": round((time.perf_counter() - t0) / done, 4)}  # mean per photo so far
        if result.concepts is not None:  # a model with concept detectors: the photo's tags
            row["concepts"] = [{"word": w, "prob": p} for w, p in result.concepts]
        if result.labels is not None:  # --labels: what the encoder's ImageNet head sees
            row["labels"] = [{"word": w, "prob": p} for w, p, _ in result.labels]
        if args.overlay:
            try:  # overlays are drawn on the full-size photo
                image = load_image(path)
            except ImageLoadError as exc:
                _error(str(exc))
                failed = True
                continue
            out_dir = out_dirs[index]
            write_overlays(image, result, out_dir, cmap=args.cmap, alpha=args.alpha, style=args.style,
                           outputs=outputs)
            row["overlay"] = str(out_dir)
        line = json_line(row) if args.json else f"{plain_field(str(path))}\t{plain_field(result.text)}"
        print(line, flush=True)
    return failed
