"""The ``captioner`` console script (also ``python -m captioner``).

Each subcommand lives in ``captioner/commands/<name>.py`` and provides ``NAME``, ``HELP``,
``EXAMPLES``, ``add_arguments(parser)`` and ``run(args) -> int``. Command modules import only
argparse at module level, so ``captioner --help`` starts fast; heavy imports happen inside ``run``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from captioner.version import __version__
from captioner.errors import CaptionerError

COMMAND_MODULES = ("make_shapes", "train", "evaluate", "caption", "attend", "demo")

EPILOG = """examples:
  captioner demo                                   # generate shapes, train 3 decoders, write runs/demo/report.html
  captioner make-shapes --out data/shapes --images 3000 --seed 0
  captioner train --preset sat_soft_lite --data data/shapes --out runs/sat
  captioner evaluate runs/sat/best.safetensors --data data/shapes --split test --beam 3
  captioner caption photo.jpg --checkpoint runs/sat/best.safetensors
  captioner attend photo.jpg --checkpoint runs/sat/best.safetensors --out overlays/

run 'captioner COMMAND --help' for each command's options and examples."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="captioner",
        description="Image captioning with visual attention: train, evaluate, caption, and see what each word looked at.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"captioner {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        mod = importlib.import_module(f"captioner.commands.{module_name}")
        p = sub.add_parser(
            mod.NAME,
            help=mod.HELP,
            description=mod.HELP,
            epilog="examples:\n" + mod.EXAMPLES.strip("\n"),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code (0 ok, 1 failure, 2 usage error)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help / --version / usage errors
        return int(exc.code or 0)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(message)s" if not args.verbose else "%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args._run(args) or 0)
    except CaptionerError as exc:
        print(f"captioner {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"captioner {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
