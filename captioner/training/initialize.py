"""Start a run from a trained checkpoint's weights (``captioner train --init CKPT``, ``train.init``).

This is how a training recipe is split into stages that share weights but not optimizer state:
the SAT fine-tune (stage 1 with a frozen encoder on cached features, stage 2 with
``encoder.fine_tune=true`` on pixels), and later stages such as self-critical training. Only the
weights and the vocabulary are taken; the optimizer, schedule, early-stopping counters and random
streams start fresh.

The checkpoint's model config must equal the run's except for the settings in :data:`INIT_FREE`,
which change how the same weights are trained or used, never their shapes or their inputs. The run
uses the checkpoint's vocabulary (the output layer's rows are its words), whatever its own data
would have built.

Typical use (what ``captioner.training.loop`` does)::

    init = load_init_checkpoint(cfg.train.init, cfg.model)   # refuses a different architecture
    model = build_model(cfg.model, len(init.vocab), load_pretrained=False)
    apply_init(model, init, init.vocab)                       # refuses a different vocabulary
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from captioner.checkpoint.store import load_checkpoint
from captioner.config import ModelConfig
from captioner.config.parse import MAX_CONFIG_BYTES
from captioner.errors import CaptionerError, CheckpointError, ConfigError
from captioner.files import read_text
from captioner.text import Vocabulary
from captioner.training.state import config_diff

log = logging.getLogger(__name__)

# Model settings a run may change from its --init checkpoint: training switches and test-time
# behaviour. Everything else (sizes, names, the encoder's input geometry and normalisation) must match.
INIT_FREE = frozenset({
    "model.encoder.fine_tune", "model.encoder.fine_tune_stages", "model.encoder.pretrained",
    "model.encoder.weights", "model.decoder.dropout", "model.decoder.hard_test_mode",
    "model.decoder.hard_soft_prob",
})


@dataclass
class InitWeights:
    """What a run takes from its ``--init`` checkpoint.

    Attributes:
        path: the checkpoint file.
        state: its model ``state_dict`` (CPU tensors).
        vocab: its vocabulary (the run must use it).
        config: its model config.
        metadata: its training metadata (epoch, step, validation scores, ...).
    """

    path: Path
    state: dict[str, torch.Tensor]
    vocab: Vocabulary
    config: ModelConfig
    metadata: dict[str, Any]


def _show(value: Any) -> str:
    return repr(list(value) if isinstance(value, tuple) else value)


def check_init_config(path: str | Path, saved: ModelConfig, wanted: ModelConfig) -> None:
    """Refuse, in one line, a run whose model differs from the checkpoint's beyond :data:`INIT_FREE`."""
    a = {"model": dataclasses.asdict(saved)}
    b = {"model": dataclasses.asdict(wanted)}
    diff = [k for k in config_diff(a, b) if k not in INIT_FREE]
    if not diff:
        return
    diff.sort(key=lambda k: not k.endswith(".name"))  # a different encoder or decoder explains the rest
    key = diff[0]
    first = _lookup(a, key), _lookup(b, key)
    more = f" (and {len(diff) - 1} more: {', '.join(diff[1:4])})" if len(diff) > 1 else ""
    raise ConfigError(f"--init {path}: {key} is {_show(first[0])} in the checkpoint but {_show(first[1])} in this "
                      f"run{more}; the architecture must match (only {', '.join(sorted(k[6:] for k in INIT_FREE))} "
                      "may change)")


def check_init_vocab(path: str | Path, saved: Vocabulary, wanted: Vocabulary) -> None:
    """Refuse, in one line, a vocabulary other than the checkpoint's (size, or the first differing token)."""
    if saved == wanted:
        return
    if len(saved) != len(wanted):
        raise ConfigError(f"--init {path}: the checkpoint's vocabulary has {len(saved)} tokens but this run's has "
                          f"{len(wanted)}; an --init run uses the checkpoint's vocabulary")
    index = next(i for i, (x, y) in enumerate(zip(saved.itos, wanted.itos)) if x != y)
    raise ConfigError(f"--init {path}: vocabulary token {index} is {saved.itos[index]!r} in the checkpoint but "
                      f"{wanted.itos[index]!r} in this run; an --init run uses the checkpoint's vocabulary")


def replay_warning(init: InitWeights, train: Any) -> str | None:
    """The warning for an ``--init`` run that would replay its checkpoint's batches and dropout masks, or None.

    A run's caption order is fixed by ``train.seed + epoch`` and its dropout (and sampling) stream
    by ``train.seed``; the batch size cuts both the same way. A second stage with the seed and batch
    size of the run that wrote its checkpoint therefore sees every caption again under the very
    dropout mask it was trained with: the model has fitted those pairs, so the training loss reads
    low and then "jumps" when the replay runs out. Measured on the Flickr8k subset: continued
    cross-entropy logged 1.13-1.2 nats for 9 epochs, then 1.72 from epoch 10; the same weights
    scored 1.72 on those very batches with another dropout stream, or in another order.

    ``train`` is the new run's ``TrainConfig`` (seed, batch size, objective). Self-critical training
    runs with its dropout layers off, so only cross-entropy stages warn. The seed is read from the
    checkpoint's metadata (``train_seed``, written since 2026-11-26) or
    from the ``config.json`` beside it (a run folder's checkpoint); without either, None.
    """
    if train.objective != "xe":
        return None
    seed, batch_size = train.seed, train.batch_size
    seed_then, batch_then = init.metadata.get("train_seed"), init.metadata.get("train_batch_size")
    if seed_then is None:
        config_file = init.path.parent / "config.json"
        try:
            then = json.loads(read_text(config_file, MAX_CONFIG_BYTES)).get("train", {})
            seed_then, batch_then = then.get("seed"), then.get("batch_size")
        except (CaptionerError, ValueError, AttributeError, RecursionError):
            return None
    if seed_then != seed or batch_then != batch_size:
        return None
    return (f"--init {init.path}: this run has the train.seed ({seed}) and batch size ({batch_size}) of the run "
            "that wrote the checkpoint, so it replays that run's caption order and dropout masks: its training "
            "loss will read low until the replay ends. Set train.seed to another value (e.g. --set "
            f"train.seed={seed + 1}) for a fresh stream")


def load_init_checkpoint(path: str | Path, model_config: ModelConfig) -> InitWeights:
    """Read a checkpoint to start a run from and check that its architecture is the run's.

    Args:
        path: a checkpoint written by training (``best.safetensors``, ``latest.safetensors``).
        model_config: the new run's model config.

    Returns:
        Its weights, vocabulary, config and metadata.

    Raises:
        CheckpointError: the file is missing or not a readable checkpoint.
        ConfigError: the model config differs beyond :data:`INIT_FREE` (one line naming the key).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"--init {path}: checkpoint not found")
    try:
        loaded = load_checkpoint(path)  # never downloads; refuses unsafe or broken files in one line
    except CheckpointError as exc:
        raise CheckpointError(f"--init {exc}") from None
    check_init_config(path, loaded.config, model_config)
    state = {k: v.detach() for k, v in loaded.model.state_dict().items()}
    return InitWeights(path, state, loaded.vocab, loaded.config, dict(loaded.metadata))


def apply_init(model: torch.nn.Module, init: InitWeights, vocab: Vocabulary) -> None:
    """Copy the checkpoint's weights into ``model`` (built from the run's config with ``len(vocab)`` words).

    Raises:
        ConfigError: ``vocab`` is not the checkpoint's vocabulary.
        CheckpointError: the weights do not fit the model (cannot happen after the config check,
            unless the model was built from another config).
    """
    check_init_vocab(init.path, init.vocab, vocab)
    own = model.state_dict()
    wrong = [k for k in own if k not in init.state or own[k].shape != init.state[k].shape]
    extra = [k for k in init.state if k not in own]
    if wrong or extra:
        name = (wrong or extra)[0]
        raise CheckpointError(f"--init {init.path}: its weights do not fit this model ({len(wrong)} missing or "
                              f"reshaped, {len(extra)} unexpected, e.g. {name})")
    with torch.no_grad():
        model.load_state_dict(init.state, strict=True)
    log.info("initialised the model from %s (epoch %s, step %s)", init.path, init.metadata.get("epoch", "?"),
             init.metadata.get("step", "?"))


def _lookup(data: dict[str, Any], dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node
