"""Hostile, foreign and truncated checkpoints; concurrent use of checkpoints and feature caches.

* A pickle that would run code (``.pt``, legacy pickle, renamed ``.safetensors``, a run folder's
  ``train_state.pt``) is refused and never runs: the marker file it would create stays absent.
* A checkpoint whose weights belong to another architecture or vocabulary is refused with a
  message that names what differs; so is a resume into another model or vocabulary.
* A truncated file is refused, at every cut point; ``captioner caption --checkpoint`` prints one
  error line and exits 1, without a traceback.
* Two processes caption with one checkpoint at once; a reader never sees a half-written
  checkpoint; a feature cache being written by one process is refused clearly or waited for by
  another, never read half-written.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from captioner.checkpoint.store import load_checkpoint, load_train_state, save_checkpoint
from captioner.cli import main
from captioner.config import get_preset
from captioner.errors import CaptionerError, CheckpointError
from captioner.models.model import build_model
from captioner.text import Vocabulary
from untrained import never_eos_first

REPO = Path(__file__).resolve().parents[1]
WORDS = "a red blue green circle square triangle star small large".split()


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def header_length(path: Path) -> int:
    return struct.unpack("<Q", path.read_bytes()[:8])[0]


def save_avoiding_sniff_bug(path: Path, model: torch.nn.Module, vocab: Vocabulary) -> int:
    """``save_checkpoint`` with metadata ``{"pad": "x" * n}`` chosen so that the file does not start
    with b"\x80" or b"PK"; returns ``n`` (the header length, hence the first bytes, depends only on
    the architecture, vocabulary and metadata, so the same ``n`` is safe for every save of them).

    Those first bytes are the safetensors header length; ``test_header_length_never_looks_like_a_pickle``
    pins the bug they trigger. Other tests here use this so they test what they are about.
    """
    for pad in range(64):
        save_checkpoint(path, model, vocab, metadata={"pad": "x" * pad})
        head = path.read_bytes()[:2]
        if head[:1] != b"\x80" and head != b"PK":
            return pad
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    return Vocabulary(WORDS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, vocab: Vocabulary) -> dict[str, Path]:
    """Untrained tiny checkpoints: SAT, SAT with a wider LSTM, Transformer, SAT over a bigger vocabulary."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    specs = {"sat": ("sat_soft_tiny", {}, vocab),
             "sat_wide": ("sat_soft_tiny", {"model.decoder.hidden_dim": 48}, vocab),
             "transformer": ("transformer_tiny", {}, vocab),
             "sat_big_vocab": ("sat_soft_tiny", {}, Vocabulary(WORDS + ["purple", "cross"]))}
    for name, (preset, overrides, v) in specs.items():
        torch.manual_seed(0)
        model = build_model(get_preset(preset, **overrides).model, len(v), load_pretrained=False).eval()
        never_eos_first(model, v)  # an empty caption is an error, not what this file tests
        out[name] = root / f"{name}.safetensors"
        save_avoiding_sniff_bug(out[name], model, v)
    return out


@pytest.fixture(scope="module")
def photo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("photo") / "photo.png"
    Image.new("RGB", (40, 30), (200, 20, 20)).save(path)
    return path


def caption_cli(checkpoint: Path, photo: Path, capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    code = main(["caption", str(photo), "--checkpoint", str(checkpoint), "--beam", "1", "--max-len", "4"])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error_line(code: int, out: str, err: str, command: str = "caption") -> str:
    assert code == 1 and out == "" and "Traceback" not in err, (code, out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"captioner {command}: error: "), err
    return lines[0]


# ----------------------------------------------------------------------------- code-running pickles


class _RunsCode:
    """Unpickling this executes ``open(marker, 'w')`` (the classic ``__reduce__`` payload)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def hostile_files(folder: Path, marker: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    payload = {"format": "captioner", "state_dict": {"w": torch.zeros(2)}, "x": _RunsCode(marker)}
    files = {"torch_zip.pt": folder / "evil.pt", "legacy_pickle.pt": folder / "evil_legacy.pt",
             "pickle_named_safetensors": folder / "evil.safetensors",
             "zip_named_safetensors": folder / "evil_zip.safetensors"}
    torch.save(payload, files["torch_zip.pt"])
    bare = {"format": "captioner", "x": _RunsCode(marker)}  # no tensors: exec is the first global met
    files["legacy_pickle.pt"].write_bytes(pickle.dumps(bare, protocol=2))
    files["pickle_named_safetensors"].write_bytes(pickle.dumps(bare))
    torch.save(payload, files["zip_named_safetensors"])
    return files


def test_the_hostile_payload_really_runs_code_when_unpickled(tmp_path: Path) -> None:
    """Guard for the tests below: the files they feed in are live exploits."""
    marker = tmp_path / "pwned"
    files = hostile_files(tmp_path / "files", marker)
    pickle.loads(files["legacy_pickle.pt"].read_bytes())
    assert marker.exists()


@pytest.mark.parametrize("kind", ["torch_zip.pt", "legacy_pickle.pt", "pickle_named_safetensors",
                                  "zip_named_safetensors"])
def test_code_running_pickle_is_refused_without_running(kind: str, tmp_path: Path, photo: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    marker = tmp_path / "pwned"
    path = hostile_files(tmp_path / "files", marker)[kind]
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert str(info.value).startswith(f"{path}: refused") and "\n" not in str(info.value)
    assert not marker.exists()

    if kind.endswith(".pt"):  # a training state in torch format is read with the same guard
        with pytest.raises(CheckpointError, match="refused"):
            load_train_state(path)
        assert not marker.exists()

    line = assert_one_error_line(*caption_cli(path, photo, capsys))
    assert f"{path}: refused" in line
    assert not marker.exists()


# ----------------------------------------------------------------------------- foreign checkpoints


def _transplant(tmp_path: Path, header_from: Path, weights_from: Path) -> Path:
    """A file whose config/vocabulary header comes from one checkpoint and whose tensors from another."""
    from safetensors import safe_open

    with safe_open(str(header_from), framework="pt") as f:
        meta = f.metadata()
    meta.pop("weights_crc32", None)  # put together elsewhere: no checksum of its weights (with one, it is "damaged")
    path = tmp_path / "mixed.safetensors"
    save_file(load_file(str(weights_from)), str(path), metadata=meta)
    return path


@pytest.mark.parametrize("header, weights, says", [
    ("transformer", "sat", ["missing keys decoder.", "unexpected keys decoder."]),
    ("sat_wide", "sat", ["shape mismatch for decoder.", "checkpoint (", "vs model ("]),
    ("sat_big_vocab", "sat", ["shape mismatch for decoder.", "checkpoint (14, ", "model (16, "]),
])
def test_weights_of_another_architecture_or_vocabulary_are_refused_with_the_difference(
        header: str, weights: str, says: list[str], checkpoints: dict[str, Path], tmp_path: Path, photo: Path,
        capsys: pytest.CaptureFixture) -> None:
    path = _transplant(tmp_path, checkpoints[header], checkpoints[weights])
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert message.startswith(f"{path}: weights do not match the model built from its config") and "\n" not in message
    for part in says:
        assert part in message, message
    line = assert_one_error_line(*caption_cli(path, photo, capsys))
    assert "weights do not match" in line


def test_vocabulary_size_that_disagrees_with_the_header_is_refused(checkpoints: dict[str, Path],
                                                                   tmp_path: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(checkpoints["sat"]), framework="pt") as f:
        meta = dict(f.metadata())
    meta["vocab"] = json.dumps(Vocabulary(WORDS[:5]).to_dict())
    path = tmp_path / "other_vocab.safetensors"
    save_file(load_file(str(checkpoints["sat"])), str(path), metadata=meta)
    with pytest.raises(CheckpointError, match=r"vocab size mismatch: vocabulary has 9 tokens, checkpoint says 14"):
        load_checkpoint(path)


@pytest.mark.slow  # loads in a fresh process: about 3 s
@pytest.mark.timeout(120)
def test_config_with_absurd_sizes_is_refused_not_allocated(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """A header claiming hidden_dim=10**6 would need terabytes: refuse it as a bad checkpoint.

    Loaded in a child whose address space is capped at 6 GiB, so that even where the kernel
    overcommits memory the attempt cannot exhaust the machine."""
    from safetensors import safe_open

    with safe_open(str(checkpoints["sat"]), framework="pt") as f:
        meta = dict(f.metadata())
    config = json.loads(meta["config"])
    config["decoder"]["hidden_dim"] = 10**6
    meta["config"] = json.dumps(config)
    path = tmp_path / "huge.safetensors"
    save_file(load_file(str(checkpoints["sat"])), str(path), metadata=meta)
    code = ("import resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))\n"
            "from captioner.checkpoint.store import load_checkpoint\n"
            "from captioner.errors import CheckpointError\n"
            "try:\n"
            "    load_checkpoint(sys.argv[1])\n"
            "    print('LOADED')\n"
            "except CheckpointError as exc:\n"
            "    print('CheckpointError:', exc)\n"
            "except BaseException as exc:\n"
            "    print('ESCAPED', type(exc).__name__, str(exc).splitlines()[0][:200])\n")
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=100,
                          env=_env(), cwd=tmp_path)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) == 1, proc.stdout + proc.stderr
    assert lines[0].startswith(f"CheckpointError: {path}: "), lines[0]


@pytest.mark.parametrize("first_bytes", [b"\x80", b"PK"])
def test_header_length_never_looks_like_a_pickle(first_bytes: bytes, vocab: Vocabulary, tmp_path: Path) -> None:
    """A safetensors file starts with its header length (8 bytes, little endian). When the length's
    low byte is 0x80 (one file in 256) or its low bytes spell "PK", the file must still load as
    safetensors, not be sniffed as a pickle / zip archive."""
    torch.manual_seed(0)
    model = build_model(get_preset("sat_soft_tiny").model, len(vocab), load_pretrained=False)
    path = tmp_path / "x.safetensors"
    save_checkpoint(path, model, vocab, metadata={"pad": ""})
    base = header_length(path)
    if first_bytes == b"\x80":
        targets = [base + (0x80 - base) % 256 + 256 * k for k in range(2)]
    else:
        targets = [0x4B50 + 65536 * k for k in range(2) if 0x4B50 + 65536 * k > base]
    for target in targets:
        for pad in range(target - base - 16, target - base + 16):
            save_checkpoint(path, model, vocab, metadata={"pad": "x" * pad})
            if header_length(path) == target:
                break
        assert path.read_bytes()[:len(first_bytes)] == first_bytes
        loaded = load_checkpoint(path)  # a valid checkpoint written by save_checkpoint
        assert loaded.metadata["pad"] == "x" * pad and len(loaded.vocab) == len(vocab)


# ----------------------------------------------------------------------------- truncated files


def test_truncated_checkpoint_is_refused_at_every_cut(checkpoints: dict[str, Path], tmp_path: Path, photo: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    data = checkpoints["sat"].read_bytes()
    cuts = sorted({0, 1, 4, 7, 8, 9, 100, 200, header_length(checkpoints["sat"]) + 8, len(data) // 2, len(data) - 1}
                  | set(range(0, len(data), max(1, len(data) // 40))))
    path = tmp_path / "cut.safetensors"
    for cut in cuts:
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(path)
        message = str(info.value)
        assert message.startswith(f"{path}: ") and "\n" not in message, (cut, message)
        if cut in (4, 200, len(data) // 2):
            assert "truncated" in message, (cut, message)
    path.write_bytes(data[: len(data) // 2])
    line = assert_one_error_line(*caption_cli(path, photo, capsys))
    assert "truncated" in line


def test_truncated_torch_format_checkpoint_is_refused(vocab: Vocabulary, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build_model(get_preset("sat_soft_tiny").model, len(vocab), load_pretrained=False)
    full = save_checkpoint(tmp_path / "full.pt", model, vocab)
    assert len(load_checkpoint(full).vocab) == len(vocab)
    data = full.read_bytes()
    path = tmp_path / "cut.pt"
    for cut in (1, 2, 30, 500, len(data) // 3, len(data) // 2, len(data) - 30, len(data) - 1):
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(path)
        assert str(info.value).startswith(f"{path}: ") and "\n" not in str(info.value), cut
        if cut == len(data) // 2:
            assert "truncated or corrupt" in str(info.value)


# ----------------------------------------------------------------------------- resume into a run folder


@pytest.fixture(scope="module")
def trained_run(tiny_shapes: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sat_soft_tiny run stopped by its time budget after one step (validated, checkpointed,
    resumable), copied by the tests that change it."""
    from captioner.training.loop import train

    out = tmp_path_factory.mktemp("run") / "run"
    cfg = get_preset("sat_soft_tiny", **{"data.root": str(tiny_shapes), "train.epochs": 1, "train.batch_size": 48,
                                         "train.val_max_images": 2, "train.time_budget": 1e-9})
    train(cfg, out, progress=False)
    return out


@pytest.fixture
def run_copy(trained_run: Path, tmp_path: Path) -> Path:
    import shutil

    out = tmp_path / "run"
    shutil.copytree(trained_run, out, ignore=shutil.ignore_patterns("tensorboard"))
    return out


def _files(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.suffix in (".safetensors", ".pt")}


def resume(run: Path, *extra: str) -> list[str]:
    return ["train", "--out", str(run), "--resume", "--epochs", "2", "--no-progress", *extra]


def test_resume_refuses_a_code_running_train_state(run_copy: Path, capsys: pytest.CaptureFixture) -> None:
    marker = run_copy / "pwned"
    torch.save({"format": "captioner-train-state", "model": {}, "x": _RunsCode(marker)}, run_copy / "train_state.pt")
    code = main(resume(run_copy))
    out, err = capsys.readouterr()
    line = assert_one_error_line(code, "", err, "train")
    assert f"{run_copy / 'train_state.pt'}: refused" in line
    assert not marker.exists()


def test_resume_refuses_a_truncated_train_state(run_copy: Path, capsys: pytest.CaptureFixture) -> None:
    state = run_copy / "train_state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    before = _files(run_copy)
    code = main(resume(run_copy))
    line = assert_one_error_line(code, "", capsys.readouterr().err, "train")
    assert f"{state}: truncated or corrupt" in line
    assert _files(run_copy) == before  # nothing overwritten


def test_resume_refuses_another_architecture_naming_the_settings(run_copy: Path, tiny_shapes: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    before = _files(run_copy)
    code = main(resume(run_copy, "--preset", "transformer_tiny", "--data", str(tiny_shapes),
                       "--set", "train.batch_size=48", "--set", "train.val_max_images=2"))
    line = assert_one_error_line(code, "", capsys.readouterr().err, "train")
    assert "model config differs" in line and "model.decoder." in line  # names the differing settings
    assert _files(run_copy) == before


def test_resume_refuses_another_vocabulary_saying_so(run_copy: Path, capsys: pytest.CaptureFixture) -> None:
    """The run's vocab.json replaced by one of another size: the saved weights cannot fit the model."""
    before = _files(run_copy)
    old = len(Vocabulary.load(run_copy / "vocab.json"))
    new = Vocabulary(WORDS + ["purple", "cross", "diamond"])
    new.save(run_copy / "vocab.json")
    code = main(resume(run_copy))
    line = assert_one_error_line(code, "", capsys.readouterr().err, "train")
    # what differs: a parameter and its two shapes, or the two vocabulary sizes
    shapes = "size mismatch" in line and "decoder." in line and str(old) in line and str(len(new)) in line
    sizes = "vocab" in line and str(old) in line and str(len(new)) in line
    assert shapes or sizes, line
    assert _files(run_copy) == before


# ----------------------------------------------------------------------------- concurrent use


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_processes_caption_with_one_checkpoint_at_once(checkpoints: dict[str, Path], photo: Path,
                                                           tmp_path: Path) -> None:
    other = tmp_path / "other.jpg"
    Image.new("RGB", (30, 50), (10, 200, 10)).save(other)
    argv = [sys.executable, "-m", "captioner", "caption", str(photo), str(other), "--checkpoint",
            str(checkpoints["sat"]), "--beam", "2", "--max-len", "5"]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                              env=_env()) for _ in range(2)]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=200)
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for code, out, err in results:
        assert code == 0, err
        assert [line.split("\t")[0] for line in out.splitlines()] == [str(photo), str(other)]
    assert results[0][1] == results[1][1]  # same checkpoint, same captions


def test_reader_never_sees_a_half_written_checkpoint(vocab: Vocabulary, tmp_path: Path) -> None:
    """save_checkpoint replaces the file atomically while another thread keeps loading it."""
    models = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        models.append(build_model(get_preset("sat_soft_tiny").model, len(vocab), load_pretrained=False))
    path = tmp_path / "live.safetensors"
    pad = save_avoiding_sniff_bug(path, models[0], vocab)
    stop = threading.Event()
    writes = {"n": 0}

    def writer() -> None:
        while not stop.is_set():
            save_checkpoint(path, models[writes["n"] % 2], vocab, metadata={"pad": "x" * pad})
            writes["n"] += 1

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        seen = set()
        deadline = time.monotonic() + 20
        while (len(seen) < 2 or writes["n"] < 10) and time.monotonic() < deadline:
            loaded = load_checkpoint(path)  # must never raise: every read sees a complete file
            w = loaded.model.decoder.state_dict()
            seen.add(next(i for i, m in enumerate(models)
                          if all(torch.equal(v, m.decoder.state_dict()[k]) for k, v in w.items())))
    finally:
        stop.set()
        thread.join(timeout=30)
    assert seen == {0, 1} and writes["n"] >= 10
    assert not list(tmp_path.glob(".live.safetensors.*"))  # no temporary files left behind


_CACHE_WRITER = """
import sys, time, torch
from pathlib import Path
from captioner.config import get_preset
from captioner.data.coco import load_caption_set
from captioner.data.images import ImageTransform
from captioner.models.registry import resolve_encoder
from captioner.features.cache import get_feature_cache
from captioner.models.encoder import build_encoder

root, cache_dir, started = sys.argv[1:4]
cfg = get_preset("sat_soft_tiny").model
torch.manual_seed(0)
encoder = build_encoder(cfg.encoder, load_pretrained=False)
transform = ImageTransform(resolve_encoder(cfg.encoder))

def slow(image):  # a slow disk: the build takes a few seconds, and says when it has begun
    Path(started).touch()
    time.sleep(0.06)
    return transform(image)

cache = get_feature_cache(cfg, encoder, load_caption_set(root, "train"), slow, cache_dir, batch_size=4,
                          progress=False)
print(cache.path)
"""


@pytest.mark.slow  # a writer process builds a cache: about 4 s
@pytest.mark.timeout(240)
def test_feature_cache_being_written_is_refused_or_waited_for(tiny_shapes: Path, tmp_path: Path) -> None:
    from captioner.data.coco import load_caption_set
    from captioner.data.images import ImageTransform
    from captioner.models.registry import resolve_encoder
    from captioner.features.cache import FeatureCache, cache_key, cache_path, get_feature_cache
    from captioner.models.encoder import build_encoder

    cfg = get_preset("sat_soft_tiny").model
    torch.manual_seed(0)
    encoder = build_encoder(cfg.encoder, load_pretrained=False)  # the same weights as the writer's
    cs = load_caption_set(tiny_shapes, "train")
    cache_dir, started = tmp_path / "cache", tmp_path / "started"
    path = cache_path(cache_dir, cs, cache_key(cfg, cs, encoder))

    writer = subprocess.Popen([sys.executable, "-c", _CACHE_WRITER, str(tiny_shapes), str(cache_dir), str(started)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=_env())
    try:
        deadline = time.monotonic() + 150
        while not started.exists():
            assert writer.poll() is None, writer.communicate()[1]
            assert time.monotonic() < deadline, "the writer never started encoding"
            time.sleep(0.02)
        assert not path.exists()  # being written: only the .partial file exists so far

        with pytest.raises(CaptionerError, match="being written by another process"):
            FeatureCache.open(path, key=None, lock_timeout=0)
        with pytest.raises(CaptionerError, match="being written by another process"):
            get_feature_cache(cfg, encoder, cs, ImageTransform(resolve_encoder(cfg.encoder)), cache_dir, progress=False)
        still_writing = writer.poll() is None

        cache = get_feature_cache(cfg, encoder, cs, ImageTransform(resolve_encoder(cfg.encoder)), cache_dir, lock_timeout=150,
                                  progress=False)  # waits for the writer, then opens its file
        out, err = writer.communicate(timeout=150)
    finally:
        if writer.poll() is None:
            writer.kill()
    assert writer.returncode == 0, err
    assert still_writing, "the writer finished before the second process could test waiting"
    assert Path(out.strip()) == path == cache.path and cache.count == len(cs)
    reference = FeatureCache.build(encoder, cs, ImageTransform(resolve_encoder(cfg.encoder)), tmp_path / "ref.feats",
                                   progress=False)
    assert torch.equal(cache[0], reference[0]) and torch.equal(cache[len(cs) - 1], reference[len(cs) - 1])
    assert not list(cache_dir.glob("*.partial"))
