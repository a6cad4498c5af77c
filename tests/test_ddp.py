"""Two-process DDP on CPU (Gloo) through ``torchrun -m captioner train``, against one process.

The two ranks see exactly the same 16 captions per step as one process does (``DistributedSampler``
interleaves one shuffled order and the global batch of 16 is split 8 + 8). DDP then averages the
ranks' gradients with equal weights, while each rank's cross-entropy is a mean over its own
tokens; the two agree exactly only when both halves hold the same number of tokens. The test
therefore cuts every training caption to 4 words (``data.max_caption_len=4``, all shapes captions
are longer): the DDP loss is then the single-process loss up to floating-point summation order,
and we accept a relative difference of 1e-4 per step (metrics.csv keeps 6 significant digits;
we measured no difference at that precision). A run whose gradients are not synchronised drifts
to about 3e-3 within the epoch (measured), so the tolerance separates correct from broken runs;
with captions of natural length even a correct run differs by 1e-4..4e-4 per step.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from captioner.config import get_preset
from captioner.training.loop import train

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # two torchrun children plus a reference run: ~10 s


def _rows(run: Path) -> list[dict[str, str]]:
    with open(run / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_two_process_gloo_run_matches_single_process(tiny_shapes: Path, tmp_path: Path) -> None:
    settings = {"train.val_max_images": 4, "train.log_every": 1, "train.epochs": 1, "train.batch_size": 16,
                "train.device": "cpu", "data.max_caption_len": 4}
    args = ["--preset", "sat_soft_tiny", "--data", str(tiny_shapes), "--no-progress"]
    args += [a for key, value in settings.items() for a in ("--set", f"{key}={value}")]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    ddp_run = tmp_path / "ddp"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "captioner", "train", *args, "--out", str(ddp_run)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("best val BLEU-4") == 1  # only rank 0 prints the summary

    single = train(get_preset("sat_soft_tiny", **{"data.root": str(tiny_shapes), **settings}), tmp_path / "one",
                   progress=False)  # one thread, as the children (conftest)

    ddp_rows, one_rows = _rows(ddp_run), _rows(tmp_path / "one")
    assert [r["kind"] for r in ddp_rows] == [r["kind"] for r in one_rows]  # rank 0 alone wrote the CSV
    ddp_steps = [float(r["loss"]) for r in ddp_rows if r["kind"] == "step"]
    one_steps = [float(r["loss"]) for r in one_rows if r["kind"] == "step"]
    assert len(ddp_steps) == 15  # 240 captions / global batch 16, not 15 steps per rank of 8
    assert ddp_steps == pytest.approx(one_steps, rel=1e-4)
    ddp_epoch = next(r for r in ddp_rows if r["kind"] == "epoch")
    assert float(ddp_epoch["loss"]) == pytest.approx(single.history[0]["loss"], rel=1e-4)
    assert int(ddp_epoch["val_images"]) == 4  # validation shards (2 + 2) gathered

    from captioner.checkpoint.store import load_checkpoint

    loaded = load_checkpoint(ddp_run / "best.safetensors")
    assert not any(k.startswith("module.") for k in loaded.model.state_dict())  # unwrapped weights saved
    assert (ddp_run / "train_state.pt").is_file()
