"""Every network read is bounded in bytes and in time, and every failure is one line that leaves nothing behind.

Against the misbehaving 127.0.0.1 server of ``tests/hostile_server.py`` (and a fake Hub answering
500), with small bounds so that each test takes well under a few seconds.
"""

from __future__ import annotations

import errno
import hashlib
import http.server
import logging
import re
import threading
import time
from pathlib import Path

import pytest
from PIL import Image

import captioner
from captioner import network as dl
from captioner.checkpoint import remote
from captioner.checkpoint.remote import resolve_checkpoint, url_cache_path
from captioner.cli import main
from captioner.network import Bounds, download
from captioner.errors import CheckpointError, ConfigError, DataError
from hostile_server import hostile

FAST = Bounds(max_bytes=1 << 20, timeout=5, min_rate=1024, window=0.5)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory, untrained_checkpoint) -> bytes:
    return untrained_checkpoint(tmp_path_factory.mktemp("ckpt"), "sat_soft_tiny").read_bytes()


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CAPTIONER_CACHE", str(tmp_path / "cache"))
    for name in ("CAPTIONER_OFFLINE", "HF_HUB_OFFLINE", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(remote, "URL_BOUNDS", Bounds(max_bytes=remote.MAX_URL_BYTES, timeout=5, window=0.5))
    return tmp_path / "cache"


def _files(root: Path) -> list[str]:
    """Files left under ``root`` (lock files aside: they hold no data)."""
    return sorted(p.name for p in root.rglob("*") if p.is_file() and not p.name.endswith(".lock"))


def test_a_stream_of_zeros_stops_after_its_first_bytes(isolated: Path) -> None:
    with hostile(limit=256 << 20) as (url, handler):
        start = time.monotonic()
        with pytest.raises(CheckpointError, match=r"/zeros/model\.safetensors: not a checkpoint \(its first bytes "
                                                  r"000000000000000000 are not a safetensors header\)"):
            resolve_checkpoint(f"{url}/zeros/model.safetensors")
        assert time.monotonic() - start < 3
    assert handler.sent < 32 << 20 and _files(isolated) == []


def _safetensors_head(header: dict) -> bytes:
    import json

    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text


def _metadata(ckpt: bytes) -> dict:
    import json

    length = int.from_bytes(ckpt[:8], "little")
    return json.loads(ckpt[8:8 + length])["__metadata__"]


def test_first_bytes_are_checked_against_what_the_loader_accepts(ckpt: bytes, isolated: Path) -> None:
    announced = 1000 << 20
    big = _safetensors_head({"__metadata__": _metadata(ckpt),
                             "w": {"dtype": "U8", "shape": [announced], "data_offsets": [0, announced]}})
    cases = {  # path -> (first bytes, then zeros up to 256 MiB; the error)
        "pickle": (b"\x80\x02", r"refused: not a safetensors checkpoint \(pickle data, which can run code when "
                               r"loaded: only safetensors files are downloaded\)"),
        "foreign": (_safetensors_head({"w": {"dtype": "U8", "shape": [announced], "data_offsets": [0, announced]}}),
                    r"not a captioner checkpoint \(format='None'\)"),
        "zip": (b"PK\x03\x04" + bytes(22) + (8).to_bytes(2, "little") + bytes(2) + b"evil.exe",
                r"refused: not a safetensors checkpoint \(a zip \(torch.save's format\), which can run code.*"),
        "big": (big, r"not a checkpoint of the model its config builds \(tensor 'w' is not one of the model's\)"),
    }
    remote.URL_BOUNDS = Bounds(max_bytes=64 << 20, timeout=5, window=0.5)  # restored by the fixture
    for name, (prefix, message) in cases.items():
        with hostile(limit=256 << 20, prefix=prefix) as (url, handler):
            start = time.monotonic()
            with pytest.raises(CheckpointError, match=message + r"; nothing was kept"):
                resolve_checkpoint(f"{url}/prefixed/{name}.safetensors", progress=False)
            assert time.monotonic() - start < 5
        assert handler.sent < 32 << 20, name  # stopped at its first bytes, not at the 64 MiB cap
        assert not (isolated / "urls").exists(), name  # no file, no lock, not even an empty folder


def _tensors(ckpt: bytes) -> dict:
    import json

    length = int.from_bytes(ckpt[:8], "little")
    return {k: v for k, v in json.loads(ckpt[8:8 + length]).items() if k != "__metadata__"}


def test_a_lying_checkpoint_stops_at_its_header_under_the_real_bound(ckpt: bytes, isolated: Path) -> None:
    """Each of these announces or streams about 1 GB (under the real 1.x GB bound): refused from the first
    bytes, with nothing left in the cache, not even its folder."""
    announced = 1000 << 20
    meta, tensors = _metadata(ckpt), _tensors(ckpt)
    first = next(k for k in sorted(tensors, key=lambda k: tensors[k]["data_offsets"])
                 if tensors[k]["dtype"] == "F32" and len(tensors[k]["shape"]) == 2)  # a weight matrix
    n = tensors[first]["data_offsets"][1] - tensors[first]["data_offsets"][0]  # its bytes
    wrong_shape = {**tensors, first: {**tensors[first], "shape": [7, 7]}}  # its bytes no longer match its shape
    model_shape = {**tensors, first: {**tensors[first], "shape": [n // 4]}}  # consistent, but not the model's shape
    cases = {
        "unknown_name": (_safetensors_head({"__metadata__": meta, "lm_head.weight": {
            "dtype": "F32", "shape": [announced // 4], "data_offsets": [0, announced]}}),
            r"not a checkpoint of the model its config builds \(tensor 'lm_head\.weight' is not one of the model's\)"),
        "shape_vs_data": (_safetensors_head({"__metadata__": meta, **wrong_shape}),
                          rf"tensor '{first}': F32 of shape \[7, 7\] is 196 bytes, its data spans {n}\)"),
        "shape_vs_model": (_safetensors_head({"__metadata__": meta, **model_shape}),
                           rf"tensor '{first}' has shape \({n // 4},\), the model's \("),
        "missing": (_safetensors_head({"__metadata__": meta, first: {**tensors[first], "data_offsets": [0, n]}}), r"the model's tensor '.*' is "
                                                                                      r"not in the file"),
        "legacy_torch": (remote_magic(), r"refused: not a safetensors checkpoint \(pickle data"),
        "zip_data_pkl": (b"PK\x03\x04" + bytes(22) + (13).to_bytes(2, "little") + bytes(2) + b"arch/data.pkl",
                         r"refused: not a safetensors checkpoint \(a zip"),
    }
    for name, (prefix, message) in cases.items():
        with hostile(limit=announced + len(prefix), prefix=prefix) as (url, handler):
            with pytest.raises(CheckpointError, match=message + r".*; nothing was kept"):
                resolve_checkpoint(f"{url}/prefixed/{name}.safetensors", progress=False)
        assert handler.sent < 32 << 20, name  # stopped at the header, not after 1 GB
        assert not (isolated / "urls").exists(), name


def remote_magic() -> bytes:
    """The first bytes of a legacy ``torch.save`` file (its magic number), as a stream of zeros follows."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save({"x": 1}, buf, _use_new_zipfile_serialization=False)
    return buf.getvalue()[:32]


def test_a_length_that_differs_from_the_header_is_refused_at_once(ckpt: bytes, isolated: Path) -> None:
    with hostile(body=ckpt + bytes(10 << 20)) as (url, handler):
        with pytest.raises(CheckpointError, match=rf"the server sends {len(ckpt) + (10 << 20)} bytes, the "
                                                  rf"file's header says {len(ckpt)}; nothing was kept"):
            resolve_checkpoint(f"{url}/file/model.safetensors", progress=False)
    assert not (isolated / "urls").exists()


def test_a_body_past_max_bytes_is_cut_off_and_removed(tmp_path: Path) -> None:
    dest = tmp_path / "x.bin"
    with hostile(limit=64 << 20) as (url, handler):
        with pytest.raises(DataError, match=r"/zeros: too large: \d+ bytes or more where the limit is 200000 "
                                            "bytes; nothing was kept"):
            download(f"{url}/zeros", dest, progress=False, bounds=Bounds(max_bytes=200_000))
        assert handler.sent < 32 << 20  # cut off long before the end (socket buffers let a loaded server run on)
    with hostile(limit=10 << 30) as (url, handler):  # announced: refused before the body is read
        with pytest.raises(DataError, match=r"too large: 10737418240 bytes or more where the limit is 200000"):
            download(f"{url}/huge", dest, progress=False, checksum="0" * 32, bounds=Bounds(max_bytes=200_000))
    assert _files(tmp_path) == []


def test_a_trickle_is_abandoned_naming_the_bound(tmp_path: Path) -> None:
    with hostile(limit=400, gap=0.02) as (url, handler):
        start = time.monotonic()
        with pytest.raises(DataError, match=r"/trickle: the transfer stalled \(less than 1 KiB/s over 0\.5 s\) "
                                            r"after \d+ bytes; the partial file .* is kept: run again to resume"):
            download(f"{url}/trickle", tmp_path / "t.bin", progress=False, retries=3, bounds=FAST)
        assert time.monotonic() - start < 2.5 and handler.requests == 1


def test_a_stall_costs_one_window_not_one_per_retry(tmp_path: Path) -> None:
    with hostile(hold=5.0) as (url, handler):
        start = time.monotonic()
        with pytest.raises(DataError, match=r"/stall: the transfer stalled .* after 9 bytes"):
            download(f"{url}/stall", tmp_path / "s.bin", progress=False, retries=3, bounds=FAST)
        assert time.monotonic() - start < 2.5 and handler.requests == 1


def test_a_stalled_checkpoint_url_is_one_line_and_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    Image.new("RGB", (8, 8)).save(tmp_path / "photo.png")  # a photo that exists: inputs are read before the model
    with hostile(hold=3.0) as (url, _):
        code = main(["caption", str(tmp_path / "photo.png"), "-c", f"{url}/stall/model.safetensors"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "the transfer stalled (less than 1 KiB/s over 0.5 s)" in err


def test_bounds_must_be_finite() -> None:
    for bad in (float("nan"), float("inf"), 0, -1):
        with pytest.raises(ConfigError, match="must be a finite number > 0"):
            Bounds(window=bad)


def test_a_malformed_url_is_a_checkpoint_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"http://\[::1/model\.safetensors: not a valid URL"):
        captioner.load("http://[::1/model.safetensors")
    with pytest.raises(CheckpointError, match="not a valid URL"):
        url_cache_path("http://127.0.0.1:port/model.safetensors")
    Image.new("RGB", (8, 8)).save(tmp_path / "x.png")  # a photo that exists: inputs are read before the model
    assert main(["caption", str(tmp_path / "x.png"), "-c", "http://[::1/model.safetensors"]) == 1
    assert capsys.readouterr().err.startswith("captioner caption: error: http://[::1/model.safetensors: not a valid")


def test_credentials_in_a_url_are_never_shown(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with hostile() as (url, handler):
        spec = url.replace("http://", "http://me:s3cret@") + "/missing/model.safetensors"
        with pytest.raises(CheckpointError) as info:
            resolve_checkpoint(spec)
        assert handler.auth == "Basic bWU6czNjcmV0"  # sent as HTTP Basic authorization, not shown
    assert "HTTP 404" in str(info.value) and "s3cret" not in str(info.value) and "***@127.0.0.1" in str(info.value)
    assert "s3cret" not in caplog.text


def test_a_full_disk_is_not_called_a_lost_connection(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    class Full:
        def __init__(self, path: Path, mode: str) -> None:
            self.path = path
            Path(path).write_bytes(b"")

        def write(self, data: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def __enter__(self) -> "Full":
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    monkeypatch.setattr(dl, "open_partial", lambda path, append, error: Full(path, "ab" if append else "wb"))
    with hostile(limit=1 << 20) as (url, handler):
        with pytest.raises(DataError, match=r"x\.bin\.part: cannot write the download \(No space left on device\); "
                                            "the partial file was removed; free some space and run again"):
            download(f"{url}/zeros", tmp_path / "x.bin", progress=False, retries=3)
        assert handler.requests == 1
    assert _files(tmp_path) == []


def test_a_short_hashless_download_is_not_kept(ckpt: bytes, isolated: Path) -> None:
    with hostile(body=ckpt, cut=len(ckpt) // 2) as (url, _):
        with pytest.raises(CheckpointError, match=rf"/short/model\.safetensors: got {len(ckpt) // 2} bytes, the "
                                                  rf"file's header says {len(ckpt)}; the partial file was removed"):
            resolve_checkpoint(f"{url}/short/model.safetensors")
    assert _files(isolated) == []
    with hostile(body=ckpt, cut=5) as (url, _):
        with pytest.raises(CheckpointError, match=r"truncated: only 5 bytes, its header is incomplete; nothing"):
            resolve_checkpoint(f"{url}/short/model.safetensors")
    assert _files(isolated) == []


def test_a_bad_cached_file_names_itself_and_refresh_fetches_again(ckpt: bytes, isolated: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with hostile(body=ckpt) as (url, handler):
        spec = f"{url}/file/model.safetensors"
        cached = url_cache_path(spec)
        cached.parent.mkdir(parents=True)
        cached.write_bytes(b"\x00" * 100)  # damaged after it was kept
        with pytest.raises(CheckpointError, match=rf"it is a cached download of {spec}: load it again with "
                                                  rf"--refresh \(refresh=True\) or delete {cached}"):
            captioner.load(spec, device="cpu")
        Image.new("RGB", (8, 8)).save(isolated / "photo.png")  # inputs are read before the model
        assert main(["caption", str(isolated / "photo.png"), "-c", spec]) == 1
        assert "--refresh" in capsys.readouterr().err and handler.requests == 0
        assert captioner.load(spec, device="cpu", refresh=True).vocab is not None
        assert handler.requests == 1 and cached.read_bytes() == ckpt
        assert hashlib.sha256(cached.read_bytes()).hexdigest() == hashlib.sha256(ckpt).hexdigest()


class _Failing(http.server.BaseHTTPRequestHandler):
    def _fail(self) -> None:
        self.send_response(500)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = _fail

    def log_message(self, *args: object) -> None:
        pass


def test_a_hub_answering_500_is_named_so_in_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("huggingface_hub")
    from huggingface_hub import constants
    from huggingface_hub.utils import _http

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(_http.time, "sleep", lambda seconds: None)  # its retries' back-off
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Failing)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    caplog.set_level(logging.DEBUG)
    try:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{httpd.server_address[1]}")
        with pytest.raises(CheckpointError, match=r"^hf://org/x/model\.safetensors: the Hub answered HTTP 500 "
                                                  r"\(a server error, not a missing network\)"):
            resolve_checkpoint("hf://org/x")
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert [r for r in caplog.records if r.name.startswith(("huggingface_hub", "httpx"))] == []


def test_a_hub_file_over_the_limit_is_refused_before_it_is_fetched(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    pytest.importorskip("huggingface_hub")
    from huggingface_hub import constants
    from range_server import serve_hub

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(remote, "MAX_URL_BYTES", 100)
    with serve_hub({"org/big": {"model.safetensors": bytes(1000)}}) as (endpoint, handler):
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        with pytest.raises(CheckpointError, match=r"^hf://org/big/model\.safetensors: too large: 1000 bytes where "
                                                  r"the limit is 100 bytes; nothing was fetched$"):
            resolve_checkpoint("hf://org/big")
        assert handler.sent == 0
    assert not (tmp_path / "hf").exists() or _files(tmp_path / "hf") == []


def test_a_lying_hub_file_is_refused_at_its_header_like_a_url(ckpt: bytes, monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    """hf:// gets the check https:// has: the header is read (and the connection closed) before the Hub client
    fetches the body; a pickle or a header that is not the model's config's leaves nothing in the Hub's cache."""
    pytest.importorskip("huggingface_hub")
    from huggingface_hub import constants
    from range_server import serve_hub

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    announced = 1000 << 20
    meta, tensors = _metadata(ckpt), _tensors(ckpt)
    first = next(k for k in sorted(tensors, key=lambda k: tensors[k]["data_offsets"])
                 if tensors[k]["dtype"] == "F32" and len(tensors[k]["shape"]) == 2)
    n = tensors[first]["data_offsets"][1] - tensors[first]["data_offsets"][0]
    cases = {  # repo -> (first bytes, followed by 4 MiB of zeros; the error)
        "org/unknown_name": (_safetensors_head({"__metadata__": meta, "lm_head.weight": {
            "dtype": "F32", "shape": [announced // 4], "data_offsets": [0, announced]}}),
            r"not a checkpoint of the model its config builds \(tensor 'lm_head\.weight' is not one of the model's\)"),
        "org/shape_vs_data": (_safetensors_head({"__metadata__": meta, **{**tensors, first: {**tensors[first],
                                                                                               "shape": [7, 7]}}}),
                              rf"tensor '{first}': F32 of shape \[7, 7\] is 196 bytes, its data spans {n}\)"),
        "org/legacy_torch": (remote_magic(), r"refused: not a safetensors checkpoint \(pickle data"),
        "org/zip_data_pkl": (b"PK\x03\x04" + bytes(22) + (13).to_bytes(2, "little") + bytes(2) + b"arch/data.pkl",
                             r"refused: not a safetensors checkpoint \(a zip"),
    }
    repos = {repo: {"model.safetensors": prefix + bytes(4 << 20)} for repo, (prefix, _) in cases.items()}
    with serve_hub(repos) as (endpoint, handler):
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        for repo, (_, message) in cases.items():
            handler.log.clear()
            with pytest.raises(CheckpointError) as info:
                resolve_checkpoint(f"hf://{repo}")
            text = str(info.value)
            assert text.startswith(f"hf://{repo}/model.safetensors: ") and text.endswith("; nothing was fetched")
            assert re.search(message, text) and "\n" not in text, text
            assert len(handler.log) == 2, handler.log  # the size (HEAD) and the header (one GET), never the download
    assert not (tmp_path / "hf").exists() or _files(tmp_path / "hf") == []


def test_a_hub_file_whose_size_differs_from_its_header_is_refused(ckpt: bytes, monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    pytest.importorskip("huggingface_hub")
    from huggingface_hub import constants
    from range_server import serve_hub

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with serve_hub({"org/long": {"model.safetensors": ckpt + bytes(1 << 20)}}) as (endpoint, _):
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        with pytest.raises(CheckpointError, match=rf"^hf://org/long/model\.safetensors: the server sends "
                                                  rf"{len(ckpt) + (1 << 20)} bytes, the file's header says {len(ckpt)}; "
                                                  r"nothing was fetched$"):
            resolve_checkpoint("hf://org/long")
    assert not (tmp_path / "hf").exists() or _files(tmp_path / "hf") == []


@pytest.mark.parametrize(("progress", "tty", "drawn"), [(None, False, False), (None, True, True), (True, False, True),
                                                        (False, True, False)])
def test_progress_bar_only_on_a_terminal_unless_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str], progress: bool | None,
                                                      tty: bool, drawn: bool) -> None:
    source = tmp_path / "source.bin"
    source.write_bytes(b"x" * 5000)
    monkeypatch.setattr(dl.sys.stderr, "isatty", lambda: tty, raising=False)
    assert dl.show_progress(progress) is drawn
    dest = download(source.as_uri(), tmp_path / "copy.bin", progress=progress)
    assert dest.read_bytes() == source.read_bytes()
    bar = "copy.bin" in capsys.readouterr().err  # tqdm's bar is labelled with the file's name
    assert bar is drawn
