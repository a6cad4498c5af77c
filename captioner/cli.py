"""The ``captioner`` console script (also ``python -m captioner``).

Each subcommand lives in ``captioner/commands/<name>.py`` with ``NAME``, ``HELP``, ``EXAMPLES``,
``add_arguments(parser)`` and ``run(args) -> int``, importing only argparse at module level.
Exit codes: 0 success; 1 an error (one line on stderr, never a traceback); 2 a usage error; 130
interrupted (Ctrl-C); 141 stdout closed early (``| head -1``).
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from captioner.version import __version__
from captioner.errors import CaptionerError, one_line

COMMAND_MODULES = ("make_shapes", "train", "concepts", "distill", "lm", "evaluate", "caption", "attend", "export",
                   "serve", "demo", "download")

EPILOG = """examples:
  captioner demo                                   # generate shapes, train 3 decoders, write runs/demo/report.html
  captioner make-shapes --out data/shapes --images 3000 --seed 0
  captioner train --preset sat_soft_lite --data data/shapes --out runs/sat
  captioner evaluate runs/sat/best.safetensors --data data/shapes --split test --beam 3
  captioner caption photo.jpg --checkpoint runs/sat/best.safetensors
  captioner lm --captions coco/captions_train2014.json --out coco_lm.safetensors   # caption text, no photos
  captioner attend photo.jpg --checkpoint runs/sat/best.safetensors --out overlays/
  captioner caption photo.jpg -c 'https://example.org/model.safetensors#sha256=...'   # or -c hf://org/repo
  captioner export runs/sat --out export/sat           # checkpoint + SHA-256 + model card, for the Hub
  captioner serve -c runs/sat/best.safetensors         # a local page: drop a photo, hover the words
  captioner download flickr8k --root data/flickr8k     # a dataset's archives, resumable and checked

run 'captioner COMMAND --help' for each command's options and examples."""


EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a tool whose reader went away


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (``captioner train: error: ...``), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {_short(message)} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
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
        p.set_defaults(_run=mod.run, _interrupted=getattr(mod, "INTERRUPTED", "interrupted"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code. With ``argv`` None, a late Ctrl-C at exit also prints one line."""
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
    if not args.verbose:  # the package's lines only: no other library's INFO (torch's cache stats at exit)
        for name in QUIET_LIBRARIES:
            logging.getLogger(name).setLevel(logging.WARNING)
    prog = f"captioner {args.command}"
    code = run_reporting_errors(prog, lambda: int(args._run(args) or 0), args._interrupted)
    if argv is None:
        interrupt_quietly_at_exit(prog, code)
        _EXIT.append(code)
    return code


QUIET_LIBRARIES = ("torch", "timm", "PIL", "filelock", "urllib3", "huggingface_hub", "matplotlib", "h11", "uvicorn.error")
_EXIT: list[int] = []  # the exit code of the console command, once main(None) has returned


@atexit.register  # registered before torch is imported: runs after every other exit function
def _end_at_once() -> None:
    """The console command's last step: flush and end the process with its exit code, without the
    interpreter's own shutdown, where Python's Ctrl-C handler is gone (a Ctrl-C there was exit -2).
    Does nothing when ``main`` was called from a program (``main(argv)``)."""
    if not _EXIT:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, RuntimeError):
            pass
    os._exit(_EXIT[-1])


def interrupt_quietly_at_exit(prog: str, code: int) -> None:
    """From now on, Ctrl-C flushes the output, prints one line and exits 130 at once (not a traceback from an exit handler)."""
    def handler(signum: int, frame: object) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, RuntimeError):  # closed, or a reentrant call during a flush
                pass
        os.write(2, f"{prog}: interrupted while exiting (the command had finished with exit code {code})\n"
                    .encode("utf-8", "replace"))
        os._exit(130)

    try:
        signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread
        pass


MAX_MESSAGE = 1000  # characters of an error line: a bad value is quoted by a prefix, never whole


def _short(message: str) -> str:
    """``message`` on one line and at most :data:`MAX_MESSAGE` characters."""
    text = one_line(message[:4 * MAX_MESSAGE])
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE - 3] + "..."


def run_reporting_errors(prog: str, run: Callable[[], int], interrupted: str = "interrupted") -> int:
    """``run()``'s exit code, or the one-line report of a failure (1), an interrupt (130) or a closed reader (141)."""
    try:
        return run()
    except CaptionerError as exc:
        print(f"{prog}: error: {_short(str(exc))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: {interrupted}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"{prog}: error: {_short(where + (exc.strerror or str(exc)))}", file=sys.stderr)
        return 1


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush cannot fail again on the closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout replaced by an object without a descriptor
        pass


if __name__ == "__main__":
    sys.exit(main())
