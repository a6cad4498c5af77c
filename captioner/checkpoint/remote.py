"""Where a checkpoint named by the user lives: a local file, a run folder, a URL or a Hub repository.

:func:`resolve_checkpoint` turns what ``captioner.load(spec)`` and ``--checkpoint`` accept (a file, a run
folder, ``https://...[#sha256=HEX]`` or ``hf://org/repo[@revision][/path]``; docs/share_and_show.md has the
table) into a local file, then read as any local checkpoint is. A URL is downloaded once into the cache
(``$CAPTIONER_CACHE``, default ``~/.cache/captioner``), resumable, renamed into place only when complete
and verified; an ``hf://`` file not yet in the Hub's cache has its size and first bytes checked here first.

A download is bounded in size and time (:class:`captioner.network.Bounds`), only safetensors are
taken, and the header is checked against the model its config builds before the body is fetched;
a refused download leaves nothing in the cache. Credentials in a URL are never shown. Offline mode
(``CAPTIONER_OFFLINE=1`` or ``HF_HUB_OFFLINE=1``) uses the cache and fetches nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import torch

from captioner.checkpoint.store import (MAX_CHECKPOINT_BYTES, MAX_HEADER_BYTES, REFERENCE_KEY, TRUNK, ZIP_MAGIC,
                                        check_header, parse_header)
from captioner.config import model_config_from_dict
from captioner.errors import CaptionerError, CheckpointError, ConfigError, DataError
from captioner.files import hold_lock, lock_file, release_lock_file
from captioner.models.model import build_model
from captioner.network import (Bounds, DownloadError, Refused, download, file_digest, read_head, redact,
                               show_progress)
from captioner.text import Vocabulary

__all__ = ["CACHE_ENV", "DEFAULT_HUB_FILE", "MAX_URL_BYTES", "OFFLINE_ENV", "RUN_FOLDER_FILES", "HubSpec",
           "cache_root", "cached_hint", "check_tensors_fit", "checkpoint_head", "is_remote", "offline", "parse_hub", "resolve_checkpoint",
           "split_sha256", "url_cache_path"]

log = logging.getLogger(__name__)

CACHE_ENV = "CAPTIONER_CACHE"
OFFLINE_ENV = "CAPTIONER_OFFLINE"
DEFAULT_HUB_FILE = "model.safetensors"
RUN_FOLDER_FILES = ("best.safetensors", "latest.safetensors", DEFAULT_HUB_FILE)
URL_RETRIES = 3  # a connection cut mid-file is resumed this many times before giving up
MAX_URL_BYTES = MAX_CHECKPOINT_BYTES  # a larger file could not be loaded anyway
URL_BOUNDS = Bounds(max_bytes=MAX_URL_BYTES)
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def offline() -> bool:
    """True when ``CAPTIONER_OFFLINE`` or ``HF_HUB_OFFLINE`` is set to 1/true/yes/on."""
    return _truthy(os.environ.get(OFFLINE_ENV)) or _truthy(os.environ.get("HF_HUB_OFFLINE"))


def cache_root() -> Path:
    """``$CAPTIONER_CACHE``, else ``$XDG_CACHE_HOME/captioner``, else ``~/.cache/captioner``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "captioner"


def is_remote(spec: object) -> bool:
    """Whether ``spec`` names a URL or a Hub repository (anything with a ``scheme://``) rather than a path."""
    return isinstance(spec, str) and bool(_SCHEME.match(spec))


def split_sha256(spec: str, sha256: str | None = None) -> tuple[str, str | None]:
    """``(spec without its #sha256=... fragment, the expected lowercase SHA-256 or None)``; ``ConfigError`` if malformed."""
    base, _, fragment = spec.partition("#")
    found = None
    if fragment:
        for key, value in urllib.parse.parse_qsl(fragment, keep_blank_values=True):
            if key.lower() == "sha256":
                found = value
    found = _checked_hash(spec, found) if found is not None else None
    given = _checked_hash(spec, sha256) if sha256 is not None else None
    if found and given and found != given:
        raise ConfigError(f"{spec}: the URL says sha256={found} but sha256={given} was given")
    return base, found or given


def _checked_hash(spec: str, value: object) -> str:
    if not isinstance(value, str) or not _SHA256.fullmatch(value):
        raise ConfigError(f"{spec}: sha256 must be 64 hex digits, got {str(value)[:80]!r}")
    return value.lower()


def url_cache_path(url: str) -> Path:
    """Where a URL's file is cached: ``<cache>/urls/<first 16 hex of sha256(url)>/<file name>``."""
    try:
        parsed = urllib.parse.urlsplit(url)
        parsed.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as exc:
        raise CheckpointError(f"{redact(url)[:200]}: not a valid URL ({exc})") from None
    name = urllib.parse.unquote(parsed.path.rsplit("/", 1)[-1]) or "checkpoint.safetensors"
    name = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "checkpoint.safetensors"
    key = hashlib.sha256(url.encode("utf-8")).hexdigest()[:16]
    return cache_root() / "urls" / key / name


@dataclass(frozen=True)
class HubSpec:
    """``hf://org/repo[@revision][/file]`` taken apart."""

    repo_id: str
    filename: str
    revision: str | None

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        return f"hf://{self.repo_id}{rev}/{self.filename}"


def parse_hub(spec: str) -> HubSpec:
    """Parse ``hf://org/repo[@revision][/path/in/repo]``; CheckpointError when it is not one."""
    rest = spec[len("hf://"):]
    parts = [p for p in rest.split("/")]
    if len(parts) < 2 or not parts[0] or not parts[1] or any(p in ("", ".", "..") for p in parts):
        raise CheckpointError(f"{spec}: a hub checkpoint is hf://ORG/REPO[@REVISION][/FILE]")
    repo, _, revision = parts[1].partition("@")
    filename = "/".join(parts[2:]) or DEFAULT_HUB_FILE
    return HubSpec(f"{parts[0]}/{repo}", filename, revision or None)


# bytes per element of each safetensors dtype, and which torch dtypes a tensor stored so may load into
SAFETENSORS_DTYPES = {"BOOL": (1, "bool"), "U8": (1, "int"), "I8": (1, "int"), "I16": (2, "int"), "U16": (2, "int"),
                      "I32": (4, "int"), "U32": (4, "int"), "I64": (8, "int"), "U64": (8, "int"),
                      "F8_E4M3": (1, "float"), "F8_E5M2": (1, "float"), "F16": (2, "float"), "BF16": (2, "float"),
                      "F32": (4, "float"), "F64": (8, "float")}


def _kind(dtype: torch.dtype) -> str:
    return "bool" if dtype == torch.bool else "float" if dtype.is_floating_point else "int"


def checkpoint_head(head: bytes) -> tuple[bool, int | None]:
    """The :data:`captioner.network.Inspect` of a downloaded checkpoint: ``(done, size)`` from its first bytes.

    Pickle-based files are refused at their first bytes; the safetensors header must be a captioner
    checkpoint's with contiguous spans of the right sizes, its tensors those of its model (:func:`check_tensors_fit`).
    """
    if len(head) < 9:
        return False, None
    if head[:4] == ZIP_MAGIC or (head[0] == 0x80 and 2 <= head[1] <= 5):
        kind = "a zip (torch.save's format)" if head[:4] == ZIP_MAGIC else "pickle data"
        raise Refused(f"refused: not a safetensors checkpoint ({kind}, which can run code when loaded: only "
                      "safetensors files are downloaded)")
    length = int.from_bytes(head[:8], "little")
    if head[8:9] != b"{" or length > MAX_HEADER_BYTES:
        raise Refused(f"not a checkpoint (its first bytes {head[:9].hex()} are not a safetensors header)")
    if len(head) < 8 + length:
        return False, None
    try:
        header = json.loads(head[8:8 + length])
        meta = header.get("__metadata__") or {}
        check_header(Path("the download"), meta)
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        spans = sorted((_span(name, entry), name) for name, entry in tensors.items())
    except CheckpointError as exc:
        reason = str(exc).removeprefix("the download: ")
        raise Refused(reason if reason.startswith("not a") else f"not a captioner checkpoint ({reason})") from None
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise Refused(f"not a checkpoint (a corrupt safetensors header: {type(exc).__name__})") from None
    end = 0
    for (start, stop), _name in spans:  # safetensors lays tensors end to end, from offset 0
        if start != end:
            raise Refused("not a checkpoint (its safetensors header has gaps or overlaps between tensors)")
        end = stop
    check_tensors_fit(meta, tensors)
    return True, 8 + length + end


def _span(name: str, entry: object) -> tuple[int, int]:
    """A header entry's ``data_offsets``, checked against the bytes its dtype and shape take."""
    if not isinstance(entry, dict):
        raise Refused(f"not a checkpoint (tensor {name[:80]!r}: its header entry is not an object)")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in SAFETENSORS_DTYPES:
        raise Refused(f"not a checkpoint (tensor {name[:80]!r}: unknown dtype {str(dtype)[:20]!r})")
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                              for n in shape):
        raise Refused(f"not a checkpoint (tensor {name[:80]!r}: its shape is not a list of sizes)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(n, int) and n >= 0 for n in offsets)
            and offsets[0] <= offsets[1]):
        raise Refused(f"not a checkpoint (tensor {name[:80]!r}: bad data_offsets)")
    size = SAFETENSORS_DTYPES[dtype][0] * math.prod(shape)
    if offsets[1] - offsets[0] != size:
        raise Refused(f"not a checkpoint (tensor {name[:80]!r}: {dtype} of shape {shape} is {size} bytes, its data "
                      f"spans {offsets[1] - offsets[0]})")
    return offsets[0], offsets[1]


def check_tensors_fit(meta: dict, tensors: dict) -> None:
    """Refuse (``Refused``) a header whose tensors are not those of the model its config builds on the meta device.

    Every state-dict tensor must be stored, an alias or a trunk tensor by reference, and every stored
    one must match a name, shape and kind (float, integer or bool).
    """
    where = Path("the download")
    try:
        info = parse_header(where, meta)
        config = model_config_from_dict(info["config"])
        words = len(Vocabulary.from_dict(info["vocab"]))
        if words != info["vocab_size"]:
            raise CheckpointError(f"its vocabulary has {words} words, its vocab_size says {info['vocab_size']}")
        with torch.device("meta"):
            expected = build_model(config, vocab_size=info["vocab_size"], load_pretrained=False).state_dict()
    except (CaptionerError, ValueError, TypeError, KeyError, RuntimeError) as exc:
        reason = str(exc).removeprefix("the download: ").splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise Refused(f"not a checkpoint (its config does not build a model: {reason})") from None
    by_reference = TRUNK if meta.get(REFERENCE_KEY) else None
    unexpected = [k for k in tensors if k not in expected]
    if unexpected:
        raise Refused(f"not a checkpoint of the model its config builds (tensor {unexpected[0][:120]!r} is not one "
                      f"of the model's{f', +{len(unexpected) - 1} more' if len(unexpected) > 1 else ''})")
    aliases = info["aliases"]
    missing = [k for k in expected if k not in tensors and aliases.get(k) not in tensors
               and not (by_reference and k.startswith(by_reference))]
    if missing:
        raise Refused(f"not a checkpoint of the model its config builds (the model's tensor {missing[0][:120]!r} "
                      "is not in the file)")
    for name, entry in tensors.items():
        want = expected[name]
        if tuple(entry["shape"]) != tuple(want.shape):
            raise Refused(f"not a checkpoint of the model its config builds (tensor {name[:120]!r} has shape "
                          f"{tuple(entry['shape'])}, the model's {tuple(want.shape)})")
        if SAFETENSORS_DTYPES[entry["dtype"]][1] != _kind(want.dtype):
            raise Refused(f"not a checkpoint of the model its config builds (tensor {name[:120]!r} is "
                          f"{entry['dtype']}, the model's is {want.dtype})")


def cached_hint(spec: object, path: Path) -> str:
    """For a message about a file that failed to load: how to fetch it again, when it came from a download."""
    if not is_remote(spec):
        return ""
    return f"; it is a cached download of {redact(str(spec))[:200]}: load it again with --refresh (refresh=True) " \
           f"or delete {path}"


def _fetch_url(url: str, sha256: str | None, progress: bool | None, refresh: bool = False) -> Path:
    dest, shown = url_cache_path(url), redact(url)
    if dest.is_file() and refresh and not offline():
        dest.unlink()
        log.info("%s: --refresh: the cached copy %s was removed, fetching again", shown, dest)
    if dest.is_file():
        if sha256 is None:
            return dest
        got = file_digest(dest)
        if got == sha256:
            return dest
        dest.unlink()
        log.warning("%s: cached copy %s has SHA-256 %s, not %s; it was removed, fetching again", shown, dest, got,
                    sha256)
    if offline():
        raise CheckpointError(f"{shown}: not in the cache and offline mode is on ({OFFLINE_ENV}/HF_HUB_OFFLINE); "
                              f"download it where there is a network to {dest} (curl -L -o '{dest}' '{shown}') "
                              "and run again, or give a local path")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"{dest.parent}: cannot create the checkpoint cache ({exc.strerror or exc}); "
                              f"set {CACHE_ENV} to a writable folder") from None
    try:
        with hold_lock(lock_file(dest)):  # two processes never write the same .part file
            if dest.is_file():  # another process finished it while we waited for the lock
                return _fetch_url(url, sha256, progress)
            log.info("downloading %s -> %s", shown, dest)
            try:
                download(url, dest, checksum=sha256, algorithm="sha256", progress=show_progress(progress),
                         error=CheckpointError, retries=URL_RETRIES, bounds=URL_BOUNDS, inspect=checkpoint_head)
            except DownloadError as exc:
                raise CheckpointError(f"{exc}; nothing is cached at {dest}: fetch the file there by hand "
                                      "(or anywhere, and give its path)") from None
            except DataError as exc:
                raise CheckpointError(str(exc)) from None
    finally:  # the lock file goes, and the cache folders with it when a failure left nothing to resume
        release_lock_file(lock_file(dest))
        with contextlib.suppress(OSError):
            dest.parent.parent.rmdir()  # <cache>/urls, when no other download is there
    if sha256 is None:
        digest = file_digest(dest)
        log.info("%s: SHA-256 %s (add #sha256=%s to the URL to check it next time)", shown, digest, digest)
    return dest


def _hub_status(exc: BaseException) -> int | None:
    """The HTTP status behind a hub client error (it hides a server error behind "not in the cache")."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if isinstance(status, int):
            return status
        exc = exc.__cause__ or exc.__context__
    return None


def _hub_error(hub: HubSpec, exc: Exception) -> CheckpointError:
    name = type(exc).__name__
    first = (str(exc).strip().splitlines() or [name])[0][:200]
    status = _hub_status(exc)
    if status is not None and status >= 500:
        return CheckpointError(f"{hub}: the Hub answered HTTP {status} (a server error, not a missing network); "
                               "try again later, or give a local path")
    if name in ("LocalEntryNotFoundError", "OfflineModeIsEnabled"):
        rev = f" --revision {hub.revision}" if hub.revision else ""
        return CheckpointError(f"{hub}: not in the Hugging Face cache and the Hub cannot be reached (offline mode or "
                               f"no network); where there is a network run `hf download {hub.repo_id} "
                               f"{hub.filename}{rev}` (it fills the same cache), or give a local path")
    if name == "RepositoryNotFoundError":
        return CheckpointError(f"{hub}: repository {hub.repo_id} not found on the Hub (or private: log in "
                               "with `hf auth login` or set HF_TOKEN)")
    if name in ("EntryNotFoundError", "RemoteEntryNotFoundError"):
        return CheckpointError(f"{hub}: no file {hub.filename} in {hub.repo_id}")
    if name == "RevisionNotFoundError":
        return CheckpointError(f"{hub}: no revision {hub.revision} in {hub.repo_id}")
    return CheckpointError(f"{hub}: download from the Hub failed ({name}: {first})")


@contextlib.contextmanager
def _quiet(*prefixes: str):  # noqa: ANN202
    """No records from the loggers whose names start with ``prefixes`` while the block runs (the hub
    client logs each retry; the failure is reported as one line)."""
    names = [n for n in list(logging.root.manager.loggerDict) if n.startswith(prefixes)]
    loggers = [logging.getLogger(n) for n in {*names, *prefixes}]
    states = [lg.disabled for lg in loggers]
    for lg in loggers:
        lg.disabled = True
    try:
        yield
    finally:
        for lg, state in zip(loggers, states):
            lg.disabled = state


def _check_hub_file(hub: HubSpec, endpoint: str | None) -> None:
    """Refuse a hub file before ``huggingface_hub`` fetches its body, as a URL's download is refused: over
    :data:`MAX_URL_BYTES` by its stated size, then by its first bytes (:func:`checkpoint_head`: a pickle,
    a header that is not a captioner checkpoint of the model its config builds, a size the server
    contradicts). A file already in the Hub's cache is not asked for again. When the server cannot be
    asked (no network, an error), the download itself says what went wrong (or uses the cache)."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.utils import build_hf_headers

    if isinstance(try_to_load_from_cache(hub.repo_id, hub.filename, revision=hub.revision), str):
        return  # cached (a path; otherwise None, or a marker that the file is known not to exist)
    try:
        url = hf_hub_url(hub.repo_id, hub.filename, revision=hub.revision, endpoint=endpoint)
        size = get_hf_file_metadata(url, endpoint=endpoint, library_name="captioner").size
    except Exception:  # noqa: BLE001 - reported by hf_hub_download, which also knows the cache
        return
    if size is not None and size > MAX_URL_BYTES:
        raise CheckpointError(f"{hub}: too large: {size} bytes where the limit is {MAX_URL_BYTES} bytes; "
                              "nothing was fetched")
    try:
        stated = read_head(url, checkpoint_head, build_hf_headers(library_name="captioner"), label=str(hub),
                           bounds=URL_BOUNDS, error=CheckpointError)
    except DownloadError:  # unreachable now: hf_hub_download reports it in its own words
        return
    if size is not None and stated is not None and stated != size:
        raise CheckpointError(f"{hub}: the server sends {size} bytes, the file's header says {stated}; "
                              "nothing was fetched")


def _fetch_hub(spec: str, sha256: str | None, progress: bool | None, refresh: bool = False) -> Path:
    hub = parse_hub(spec)
    try:
        from huggingface_hub import constants, hf_hub_download
        from huggingface_hub.utils import _http  # noqa: F401 - its logger exists before _quiet looks
    except ImportError:
        raise CheckpointError(f"{spec}: hub checkpoints need huggingface_hub: pip install 'captioner[hub]'") from None
    local_only = offline() or constants.is_offline_mode()
    endpoint = os.environ.get("HF_ENDPOINT") or None
    try:
        with _quiet("huggingface_hub", "httpx", "httpcore", "urllib3"):  # one line per retry otherwise
            if not local_only:  # size and header first: the Hub client has no bound of its own
                _check_hub_file(hub, endpoint)
            path = Path(hf_hub_download(
                hub.repo_id, hub.filename, revision=hub.revision, local_files_only=local_only,
                force_download=refresh and not local_only,
                endpoint=endpoint, library_name="captioner"))
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - the hub client's error classes, network errors, bad ids
        raise _hub_error(hub, exc) from None
    if sha256 is not None:
        got = file_digest(path)
        if got != sha256:
            with contextlib.suppress(OSError):
                path.unlink()  # the snapshot link; the blob is the Hub cache's business (`hf cache`)
            raise CheckpointError(f"{hub}: SHA-256 {got} does not match {sha256}; the cached link {path} was removed")
    return path


def _run_folder(folder: Path) -> Path:
    for name in RUN_FOLDER_FILES:
        if (folder / name).is_file():
            return folder / name
    raise CheckpointError(f"{folder}: a folder, and it holds no checkpoint ({', '.join(RUN_FOLDER_FILES)})")


def resolve_checkpoint(spec: str | os.PathLike, sha256: str | None = None, progress: bool | None = None,
                       refresh: bool = False) -> Path:
    """The local file (not yet read) behind a checkpoint spec: a file, a run folder, an ``https://`` URL or ``hf://``.

    ``sha256`` checks the file (a local one that differs is left alone); ``refresh`` fetches again even
    when cached. Raises ``CheckpointError`` (bad spec, failed or refused download, hash mismatch,
    offline with nothing cached, no checkpoint in a folder) or ``ConfigError`` (a malformed hash).
    """
    if not isinstance(spec, (str, os.PathLike)):
        raise CheckpointError(f"checkpoint must be a path, URL or hf:// id, got {type(spec).__name__}")
    text = os.fspath(spec)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    scheme = _SCHEME.match(text)
    if scheme:
        base, expected = split_sha256(text, sha256)
        kind = scheme.group(1).lower()
        if kind in ("https", "http"):
            return _fetch_url(base, expected, progress, refresh)
        if kind == "hf":
            return _fetch_hub(base, expected, progress, refresh)
        raise CheckpointError(f"{redact(text)[:200]}: unsupported scheme {kind}://; give a path, an https:// URL "
                              "or hf://ORG/REPO[/FILE]")
    path = Path(text)
    if path.is_dir():
        path = _run_folder(path)
    if sha256 is not None:
        expected = _checked_hash(text, sha256)
        if path.is_file() and (got := file_digest(path)) != expected:
            raise CheckpointError(f"{path}: SHA-256 {got} does not match {expected}")
    return path
