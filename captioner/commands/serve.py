"""``captioner serve``: a local web page that captions photos and shows where each word looked.

Loads each checkpoint once (file, run folder, URL or ``hf://`` id, as ``--checkpoint`` everywhere),
then serves :mod:`captioner.share.server` with uvicorn on 127.0.0.1 (``--host`` to open it to
other machines, with a warning). Needs the ``serve`` extra (FastAPI, uvicorn, python-multipart).
"""

from __future__ import annotations

import argparse
import re

from captioner.commands.options import MAX_BEAM, add_precision_argument, encoder_precision, float_range, int_range
from captioner.commands.caption import CHECKPOINT_HELP, add_refresh_argument

NAME = "serve"
HELP = "serve a local web page: drop a photo, read the caption, hover each word to see its attention"
EXAMPLES = """
  captioner serve -c runs/demo/sat_soft/best.safetensors            # then open http://127.0.0.1:8000
  captioner serve -c soft=runs/sat/best.safetensors -c tf=runs/tf/best.safetensors --port 8080   # side by side
  captioner serve -c 'https://example.org/model.safetensors#sha256=...' --examples photos/
  captioner serve -c hf://org/captioner-sat --host 0.0.0.0            # reachable from other machines
"""

_NAMED = re.compile(r"^([A-Za-z0-9_.-]+)=(.+)$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", "-c", action="append", metavar="[NAME=]CKPT",
                        help=CHECKPOINT_HELP + "; repeat for several models, NAME= names one on the page")
    add_refresh_argument(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=int_range(0, 65535), default=8000,
                        help="port (default: 8000; 0: any free port, printed)")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1 or auto")
    add_precision_argument(parser, decoder=False)
    parser.add_argument("--examples", metavar="DIR", default=None,
                        help="offer the images in DIR as examples (default: the package's example photos, and "
                             "synthetic scenes for a model trained on them)")
    parser.add_argument("--max-upload-mb", type=float_range(0, 1024, low_open=True), default=20.0,
                        help="largest upload in MiB, over 0 and at most 1024 (default: 20)")
    parser.add_argument("--max-megapixels", type=float_range(0, 64, low_open=True), default=40.0,
                        help="largest image in megapixels, over 0 and at most 64 (default: 40; the page shrinks "
                             "larger photos before it sends them, this guards other clients)")
    parser.add_argument("--max-beam", type=int_range(1, MAX_BEAM), default=5,
                        help=f"largest beam offered, 1 to {MAX_BEAM} (default: 5)")


def model_name(spec: str, taken: set[str]) -> tuple[str, str]:
    """``(name on the page, checkpoint spec)`` of one ``--checkpoint`` value (``NAME=SPEC`` or ``SPEC``)."""
    named = _NAMED.match(spec)
    if named and "://" not in named.group(1):
        return named.group(1), named.group(2)
    base = spec.split("#", 1)[0].split("?", 1)[0].rstrip("/")
    parts = [p for p in re.split(r"[/\\]", base) if p]
    stem = re.sub(r"\.(safetensors|pt|pth|bin)$", "", parts[-1]) if parts else "model"
    if base.startswith("hf://") and len(parts) >= 3:  # hf://org/repo[/file]: the repository names it
        stem = "/".join(parts[1:3]) + ("" if len(parts) == 3 or stem == "model" else f"/{stem}")
    elif stem in ("best", "latest", "model") and len(parts) > 1:
        stem = f"{parts[-2]}/{stem}"
    name, n = stem, 1
    while name in taken:
        n += 1
        name = f"{stem}-{n}"
    return name, spec


def model_card_of(spec: str) -> str | None:
    """The model card of a checkpoint: a shipped model's own, or the card ``captioner export`` writes
    (``README.md`` beside the checkpoint file, or in the folder named); None when there is none."""
    from pathlib import Path

    from captioner.errors import CaptionerError
    from captioner.files import read_text
    from captioner.pretrained import is_model_name, model_card

    if is_model_name(spec):
        return model_card(spec)
    if "://" in spec:
        return None
    path = Path(spec)
    readme = (path if path.is_dir() else path.parent) / "README.md"
    try:
        text = read_text(readme, 1 << 20) if readme.is_file() else ""
    except CaptionerError:
        return None
    return text if "library_name: captioner" in text else None  # a card export wrote, not any README


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _listen(host: str, port: int):  # noqa: ANN202 - a socket.socket
    """The listening socket, bound now: a taken address is a one-line error, and ``--port 0`` gets its port."""
    import socket

    from captioner.errors import ConfigError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host}: unknown address ({exc.strerror})") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror}); choose another --port") from None
    return sock


def run(args: argparse.Namespace) -> int:
    import logging

    from captioner.errors import ConfigError

    log = logging.getLogger("captioner.serve")
    try:
        import uvicorn

        from captioner.share.server import ServedModel, ServeLimits, create_app
    except ImportError as exc:
        raise ConfigError(f"captioner serve needs FastAPI and uvicorn ({exc.name} is missing): "
                          "pip install 'captioner[serve]'") from None
    from captioner.device import resolve_device
    from captioner.files import MiB
    from captioner.inference import load
    from captioner.commands.caption import default_model
    from captioner.pretrained import PHOTOS
    from captioner.share.server import default_examples, folder_examples

    specs = args.checkpoint or [default_model()]
    user_examples = folder_examples(args.examples) if args.examples else None  # checked before any model loads
    device = resolve_device(args.device, option="--device")
    models, taken = [], set()
    for spec in specs:
        name, spec = model_name(spec, taken)
        taken.add(name)
        loaded = load(spec, device=device, refresh=args.refresh, precision=encoder_precision(args))
        models.append(ServedModel(name, loaded, card=model_card_of(spec)))
        log.info("loaded %s as %r", spec, name)
    # photo models get the example photos, models trained on the synthetic scenes get scenes (by vocabulary)
    examples = user_examples or default_examples([m.captioner.vocab.itos for m in models], PHOTOS)
    limits = ServeLimits(max_bytes=max(1, int(args.max_upload_mb * MiB)), max_pixels=max(1, int(args.max_megapixels * 1e6)),
                         max_beam=args.max_beam, host=args.host)
    app = create_app(models, examples, limits)
    with _listen(args.host, args.port) as sock:  # bound here: --port 0 gets its port before it is printed
        port = sock.getsockname()[1]
        if not is_loopback(args.host):
            log.warning("warning: serving on %s: anyone who can reach this machine on port %d can use this page "
                        "(there is no login); use the default --host 127.0.0.1 to keep it on this machine",
                        args.host, port)
        shown = f"[{args.host}]" if ":" in args.host else args.host
        print(f"serving {', '.join(m.name for m in models)} on http://{shown}:{port}  (Ctrl-C stops)", flush=True)
        config = uvicorn.Config(app, host=args.host, port=port, log_level="warning", access_log=False,
                                **limits.uvicorn_options())
        uvicorn.Server(config).run(sockets=[sock])
    return 0
