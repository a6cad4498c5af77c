"""Checkpoints by URL and by Hub id (``captioner.checkpoint.remote``), against servers on 127.0.0.1 only.

URL path: a local Range server (``tests/range_server.py``). Hub path: the same module's fake Hub,
reached through ``HF_ENDPOINT``; the Hub's cache and offline switch are pointed at the test's own
folder. Nothing here touches the internet.
"""

from __future__ import annotations

import hashlib
import re
import socket
from pathlib import Path

import pytest
import torch
from PIL import Image

from captioner.checkpoint import remote
from captioner.checkpoint.remote import parse_hub, resolve_checkpoint, split_sha256, url_cache_path
from captioner.cli import main
from captioner.errors import CheckpointError, ConfigError
from range_server import serve, serve_hub


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory, untrained_checkpoint) -> tuple[Path, bytes, str]:
    path = untrained_checkpoint(tmp_path_factory.mktemp("ckpt"), "sat_soft_tiny")
    data = path.read_bytes()
    return path, data, hashlib.sha256(data).hexdigest()


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh checkpoint cache per test; offline switches off unless a test turns them on."""
    monkeypatch.setenv("CAPTIONER_CACHE", str(tmp_path / "cache"))
    for name in ("CAPTIONER_OFFLINE", "HF_HUB_OFFLINE", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "cache"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _same_caption(a: Path, b: Path) -> None:
    import captioner

    image = torch.rand(3, 64, 64)
    first, second = captioner.load(a, device="cpu"), captioner.load(b, device="cpu")
    assert first.caption(image)[0].text == second.caption(image)[0].text


# ------------------------------------------------------------------------------ specs


def test_spec_parsing() -> None:
    h = "ab" * 32
    assert split_sha256(f"https://x/m.safetensors#sha256={h.upper()}") == ("https://x/m.safetensors", h)
    assert split_sha256("https://x/m.safetensors", h) == ("https://x/m.safetensors", h)
    assert split_sha256("https://x/m.safetensors") == ("https://x/m.safetensors", None)
    with pytest.raises(ConfigError, match="64 hex digits"):
        split_sha256("https://x/m#sha256=abc")
    with pytest.raises(ConfigError, match="but sha256="):
        split_sha256(f"https://x/m#sha256={h}", "cd" * 32)
    assert parse_hub("hf://org/repo") == remote.HubSpec("org/repo", "model.safetensors", None)
    assert parse_hub("hf://org/repo@v1/sub/b.safetensors") == remote.HubSpec("org/repo", "sub/b.safetensors", "v1")
    for bad in ("hf://org", "hf://org//x", "hf://org/repo/../x"):
        with pytest.raises(CheckpointError, match="hf://ORG/REPO"):
            parse_hub(bad)
    with pytest.raises(CheckpointError, match="unsupported scheme ftp://"):
        resolve_checkpoint("ftp://host/m.safetensors")


def test_cache_location_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CAPTIONER_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert remote.cache_root() == tmp_path / "xdg" / "captioner"
    monkeypatch.setenv("CAPTIONER_CACHE", str(tmp_path / "mine"))
    path = url_cache_path("https://host/a/b/model.safetensors?x=1")
    assert path.parent.parent == tmp_path / "mine" / "urls" and path.name == "model.safetensors"
    assert url_cache_path("https://other/model.safetensors") != path  # same name, other URL: no clash


def test_run_folder_and_local_hash(ckpt, tmp_path: Path) -> None:
    path, data, digest = ckpt
    run = tmp_path / "run"
    run.mkdir()
    (run / "latest.safetensors").write_bytes(data)
    assert resolve_checkpoint(run) == run / "latest.safetensors"
    (run / "best.safetensors").write_bytes(data)
    assert resolve_checkpoint(str(run)) == run / "best.safetensors"  # best wins
    assert resolve_checkpoint(path, sha256=digest) == path
    with pytest.raises(CheckpointError, match="does not match"):
        resolve_checkpoint(path, sha256="0" * 64)
    assert path.read_bytes() == data  # a local file is never deleted
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="empty: a folder, and it holds no checkpoint"):
        resolve_checkpoint(tmp_path / "empty")


# ------------------------------------------------------------------------------ URLs


def test_url_download_then_cache_hit_and_same_captions(ckpt, isolated: Path) -> None:
    path, data, digest = ckpt
    with serve({"model.safetensors": data}, "files") as (base, handler):
        url = f"{base}/model.safetensors#sha256={digest}"
        got = resolve_checkpoint(url, progress=False)
        assert got.read_bytes() == data and isolated in got.parents
        assert not list(got.parent.glob("*.part"))
        assert resolve_checkpoint(url, progress=False) == got  # cache hit: no second request
        assert len(handler.log) == 1
        _same_caption(path, url)


def test_resume_after_a_cut_connection(ckpt) -> None:
    _, data, digest = ckpt
    with serve({"m.safetensors": data}, "f", cut_after=len(data) // 3, cuts=1) as (base, handler):
        got = resolve_checkpoint(f"{base}/m.safetensors", sha256=digest, progress=False)
        assert got.read_bytes() == data
        assert handler.log == [("m.safetensors", None), ("m.safetensors", f"bytes={len(data) // 3}-")]
        assert handler.sent == len(data)  # nothing fetched twice


def test_connection_cut_every_time_keeps_the_part_and_a_later_run_resumes(ckpt, monkeypatch) -> None:
    _, data, digest = ckpt
    monkeypatch.setattr(remote, "URL_RETRIES", 0)
    with serve({"m.safetensors": data}, "f", cut_after=1000, cuts=1) as (base, handler):
        url = f"{base}/m.safetensors#sha256={digest}"
        with pytest.raises(CheckpointError, match=r"connection lost after 1000 bytes.*run again to resume"):
            resolve_checkpoint(url, progress=False)
        part = url_cache_path(f"{base}/m.safetensors").with_name("m.safetensors.part")
        assert part.stat().st_size == 1000
        assert resolve_checkpoint(url, progress=False).read_bytes() == data
        assert handler.log[-1] == ("m.safetensors", "bytes=1000-")


def test_hash_mismatch_deletes_the_file_and_says_so(ckpt) -> None:
    _, data, _ = ckpt
    with serve({"m.safetensors": data}, "f") as (base, _):
        url = f"{base}/m.safetensors"
        with pytest.raises(CheckpointError, match="SHA256 .* does not match 0{64}; the file was removed"):
            resolve_checkpoint(url + "#sha256=" + "0" * 64, progress=False)
        folder = url_cache_path(url).parent
        assert not folder.exists()  # no file, no lock, no empty folder left behind


def test_a_changed_cached_file_is_fetched_again(ckpt) -> None:
    _, data, digest = ckpt
    with serve({"m.safetensors": data}, "f") as (base, handler):
        url = f"{base}/m.safetensors"
        cached = resolve_checkpoint(url, progress=False)
        cached.write_bytes(b"tampered")
        assert resolve_checkpoint(url, sha256=digest, progress=False).read_bytes() == data
        assert len(handler.log) == 2


def test_404_and_refused_connection_are_one_line_errors(ckpt) -> None:
    with serve({}, "f") as (base, _):
        with pytest.raises(CheckpointError, match=r"/f/missing.safetensors: download failed \(HTTP 404"):
            resolve_checkpoint(f"{base}/missing.safetensors", progress=False)
    url = f"http://127.0.0.1:{_free_port()}/m.safetensors"
    with pytest.raises(CheckpointError) as info:
        resolve_checkpoint(url, progress=False)
    message = str(info.value)
    assert "download failed" in message and "refused" in message.lower() and "nothing is cached at" in message
    assert "\n" not in message


def test_offline_uses_the_cache_and_says_what_to_fetch_without_it(ckpt, monkeypatch) -> None:
    _, data, digest = ckpt
    with serve({"m.safetensors": data}, "f") as (base, handler):
        url = f"{base}/m.safetensors#sha256={digest}"
        cached = resolve_checkpoint(url, progress=False)
        monkeypatch.setenv("CAPTIONER_OFFLINE", "1")
        assert resolve_checkpoint(url, progress=False) == cached
        with pytest.raises(CheckpointError, match=r"not in the cache and offline mode is on.*curl -L -o"):
            resolve_checkpoint(f"{base}/other.safetensors", progress=False)
        assert len(handler.log) == 1


def test_downloaded_pickle_is_refused_like_a_local_one(tmp_path: Path, capsys) -> None:
    import pickle

    class Evil:
        def __reduce__(self):
            return (print, ("ran",))

    data = pickle.dumps({"x": Evil()}, protocol=2)
    Image.new("RGB", (8, 8)).save(tmp_path / "x.png")  # a photo that exists: inputs are read before the model
    with serve({"evil.pt": data}, "f") as (base, _):
        code = main(["caption", str(tmp_path / "x.png"), "-c", f"{base}/evil.pt"])
    assert code == 1
    err = capsys.readouterr().err
    assert "evil.pt: refused" in err and "ran" not in capsys.readouterr().out


def test_cli_reports_a_bad_url_in_one_line(capsys, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_free_port()}/m.safetensors"
    Image.new("RGB", (8, 8)).save(tmp_path / "x.jpg")  # a photo that exists: inputs are read before the model
    assert main(["caption", str(tmp_path / "x.jpg"), "-c", url]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("captioner caption: error: ") and url in err and len(err.splitlines()) == 1


def test_evaluate_by_url_needs_an_output_folder(capsys, tmp_path: Path) -> None:
    url = "https://example.invalid/model.safetensors"
    assert main(["evaluate", url, "--data", str(tmp_path)]) == 1
    assert "give an output folder (--out) for a checkpoint loaded from a URL" in capsys.readouterr().err


# ------------------------------------------------------------------------------ the Hub


@pytest.fixture()
def hub_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    hf = pytest.importorskip("huggingface_hub")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    return hf, constants


def test_hub_download_cache_and_offline(ckpt, hub_env, monkeypatch, tmp_path: Path) -> None:
    path, data, digest = ckpt
    _, constants = hub_env
    with serve_hub({"org/tiny": {"model.safetensors": data}}) as (endpoint, handler):
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        got = resolve_checkpoint(f"hf://org/tiny#sha256={digest}")
        assert got.read_bytes() == data and str(tmp_path / "hf") in str(got)
        _same_caption(path, "hf://org/tiny")
        requests = len(handler.log)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # the Hub client's own offline switch
        assert resolve_checkpoint("hf://org/tiny") == got
        assert len(handler.log) == requests
        with pytest.raises(CheckpointError, match=r"not in the Hugging Face cache.*hf download org/other"):
            resolve_checkpoint("hf://org/other/model.safetensors")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setenv("CAPTIONER_OFFLINE", "1")  # ours works for the Hub too
        assert resolve_checkpoint("hf://org/tiny") == got
        assert len(handler.log) == requests


def test_hub_errors_are_one_line(ckpt, hub_env, monkeypatch) -> None:
    _, data, _ = ckpt
    with serve_hub({"org/tiny": {"model.safetensors": data}}) as (endpoint, _):
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        with pytest.raises(CheckpointError, match="repository org/nope not found"):
            resolve_checkpoint("hf://org/nope")
        with pytest.raises(CheckpointError, match="no file best.safetensors in org/tiny"):
            resolve_checkpoint("hf://org/tiny/best.safetensors")
        with pytest.raises(CheckpointError, match="does not match"):
            resolve_checkpoint("hf://org/tiny", sha256="0" * 64)


@pytest.mark.slow
def test_hub_unreachable_without_cache_says_what_to_download(hub_env, monkeypatch) -> None:
    # the Hub client retries a refused connection with back-off (about 23 s of sleeping) before giving up;
    # its retries still run, their waits do not
    import huggingface_hub.utils._http as hub_http

    slept = []
    monkeypatch.setattr(hub_http.time, "sleep", slept.append)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_free_port()}")
    with pytest.raises(CheckpointError, match=r"hf://org/gone/model.safetensors: not in the Hugging Face cache"):
        resolve_checkpoint("hf://org/gone")
    assert slept, "the client gave up without retrying"


def test_one_module_does_http_downloads_and_no_module_locks_with_fcntl() -> None:
    package = Path(__file__).resolve().parents[1] / "captioner"
    http = sorted(str(p.relative_to(package)) for p in package.rglob("*.py")
                  if re.search(r"^\s*(import|from) (urllib\.request|http\.client)\b", p.read_text(), re.M))
    assert http == ["network.py"]
    assert not [p for p in package.rglob("*.py") if re.search(r"^\s*(import|from) fcntl\b", p.read_text(), re.M)]
    assert not (package.parent / "scripts" / "download_common.py").exists()

