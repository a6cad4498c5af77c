"""Shared fixtures. Real-data tests use ``shared_data`` and skip cleanly where it is absent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

# One intra-op thread for the whole session, fixtures included: tiny models gain nothing from threads,
# and on a busy 2-core machine spin-waiting threads slow them down up to tenfold. Tests that compare
# bitwise with child processes rely on it too (the children run with OMP_NUM_THREADS=1).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Every test starts with one thread, and a test that changes it cannot leak the change."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` (real COCO / Flickr8k photos); skips the test when it is absent."""
    if not (SHARED_DATA / "coco2017-mini").is_dir():
        pytest.skip(f"real data not available at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_shapes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small synthetic-scenes dataset (60 images, 64 px), made once per test session. Read-only."""
    from captioner.data.shapes import make_shapes

    out = tmp_path_factory.mktemp("shapes")
    make_shapes(out, images=60, seed=0, image_size=64)
    return out


class UntrainedCheckpoints:
    """Makes tiny seeded, untrained checkpoints for the caption/attend/inference tests.

    ``make(root, preset, **overrides) -> root/<preset>.safetensors``: the preset's model (with the
    dotted config ``overrides``) over the vocabulary ``words``, the output bias of ``<pad>``,
    ``<bos>``, ``<eos>`` and ``<unk>`` set to -30 so that every caption has ``max_len`` real words.
    ``concepts=("circle", ...)`` (a SAT preset): the decoder's extension, a frozen concept head over those words, each found in
    every photo, the first most surely (probabilities from about 0.98 down), written to
    ``root/<preset>_concepts.safetensors``.
    """

    words = tuple("a red blue green circle square triangle on the left right of".split())

    def __call__(self, root: Path, preset: str, concepts: tuple[str, ...] = (), **overrides: object) -> Path:
        from captioner.checkpoint.store import save_checkpoint
        from captioner.config import get_preset
        from captioner.models.model import build_model
        from captioner.text import Vocabulary

        torch.manual_seed(0)
        vocab = Vocabulary(list(self.words))
        if concepts:
            overrides = {"model.concepts.count": len(concepts), "model.concepts.hidden": 8, **overrides}
        model = build_model(get_preset(preset, **overrides).model, len(vocab), load_pretrained=False).eval()
        with torch.no_grad():
            for module in model.decoder.modules():
                if isinstance(module, torch.nn.Linear) and module.out_features == len(vocab) and module.bias is not None:
                    module.bias[: vocab.unk_id + 1] = -30.0
            if concepts:
                model.decoder.extension.concept_ids.copy_(torch.tensor([vocab.stoi[w] for w in concepts]))
                model.decoder.extension.concept_head.net[-1].bias.copy_(torch.linspace(4.0, 0.0, len(concepts)))
        path = root / f"{preset}{'_concepts' if concepts else ''}.safetensors"
        save_checkpoint(path, model, vocab)
        return path

    @staticmethod
    def point(path: Path) -> Path:
        """Make the untrained SAT checkpoint at ``path`` point, in place: word embeddings and the attention's
        layers scaled up, so the previous word moves the hidden state and each word's map peaks somewhere
        else (max weight 0.3-0.7)."""
        import captioner
        from captioner.checkpoint.store import save_checkpoint
        from captioner.models.lstm import AdditiveAttention

        model = captioner.load(path, device="cpu")
        with torch.no_grad():
            for module in model.model.modules():
                if isinstance(module, torch.nn.Embedding):
                    module.weight.mul_(10.0)
                if isinstance(module, AdditiveAttention):
                    for layer in (module.feature_proj, module.hidden_proj, module.score):
                        layer.weight.mul_(60.0)
        save_checkpoint(path, model.model, model.vocab)
        return path


@pytest.fixture(scope="session")
def untrained_checkpoint() -> UntrainedCheckpoints:
    """``untrained_checkpoint(root, preset, **overrides) -> Path``; ``.words`` is its vocabulary."""
    return UntrainedCheckpoints()
