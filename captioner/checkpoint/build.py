"""Rebuild a model from a checkpoint's config and weights, on the meta device first.

Used by :func:`captioner.checkpoint.store.load_checkpoint`.

The model is built on the meta device (no storage, random initialisation skipped), every tensor
name and shape is checked against the file, and only then is real, uninitialised storage
allocated and the weights copied in: a header with absurd sizes is refused before anything big is
allocated, and no time is spent on a random initialisation that would be overwritten.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from captioner.checkpoint.format import describe
from captioner.config import ModelConfig
from captioner.errors import CheckpointError
from captioner.models.base import CaptionDecoder
from captioner.models.model import build_model

__all__ = ["MAX_DERIVED_BYTES", "as_checkpoint_error", "build_model_from_state"]

MAX_DERIVED_BYTES = 1 << 30  # tensors rebuilt from the config (not stored), e.g. position tables


@contextlib.contextmanager
def as_checkpoint_error(path: Path, what: str) -> Iterator[None]:
    """Turn whatever a config from a file makes the model code raise into a one-line CheckpointError."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - ConfigError, TypeError, RuntimeError, MemoryError ...
        raise CheckpointError(f"{path}: {what} ({describe(exc)[:200]})") from None


@contextlib.contextmanager
def _tensor_budget(path: Path, stored: int) -> Iterator[None]:
    """Stop a model build (in this thread) that registers far more parameters and buffers than the
    file stores: an absurd layer count would otherwise take hours even on the meta device."""
    from torch.nn.modules import module as nn_module

    me, limit, count = threading.get_ident(), 4 * stored + 1000, 0

    def hook(module: torch.nn.Module, name: str, value: Any) -> None:
        nonlocal count
        if threading.get_ident() == me:
            count += 1
            if count > limit:
                raise CheckpointError(f"{path}: the model built from its config has far more tensors than the "
                                      f"{stored} in the file (e.g. an absurd decoder.num_layers)")

    handles = [nn_module.register_module_parameter_registration_hook(hook),
               nn_module.register_module_buffer_registration_hook(hook)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _check_weights(path: Path, model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Names and shapes of the file's tensors against the model's state dict (a meta model is fine)."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [k for k in expected if k in state and tuple(state[k].shape) != tuple(expected[k].shape)]
    problems = []
    for label, keys in (("missing keys", missing), ("unexpected keys", unexpected)):
        if keys:
            more = f" (+{len(keys) - 3} more)" if len(keys) > 3 else ""
            problems.append(f"{label} {', '.join(k[:120] for k in keys[:3])}{more}")
    for k in shapes[:3]:
        got, want = tuple(state[k].shape), tuple(expected[k].shape)
        problems.append(f"shape mismatch for {k}: checkpoint {got} vs model {want}")
    if problems:
        raise CheckpointError(f"{path}: weights do not match the model built from its config: {'; '.join(problems)}")


def _derived_tensors(model: torch.nn.Module) -> dict[str, Callable[[torch.Tensor], torch.Tensor]] | None:
    """How to recompute each non-persistent buffer of a meta-device model from its (meta) value.

    None when the model holds tensors that ``to_empty`` + ``load_state_dict`` would leave wrong
    and that we cannot recompute: a non-persistent buffer its decoder does not list in
    ``derived_buffers()``, a buffer shared under two names, or a tensor kept as a plain module attribute.
    """
    persistent = set(model.state_dict())
    recipes: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        if any(isinstance(v, torch.Tensor) for v in vars(module).values()):
            return None
        known = module.derived_buffers() if isinstance(module, CaptionDecoder) else {}
        for attr, buf in module.named_buffers(recurse=False):
            name = f"{prefix}.{attr}" if prefix else attr
            if buf is None or name in persistent:
                continue
            recipe = known.get(attr)
            if recipe is None or id(buf) in seen:
                return None
            seen.add(id(buf))
            recipes[name] = recipe
    return recipes


def _to_empty(model: torch.nn.Module, device: torch.device) -> None:
    """Like ``Module.to_empty`` but with plain ``torch.empty``: ``empty_like`` on meta tensors pulls
    in torch's symbolic-shape machinery (sympy), about a second of a cold start."""
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None:
                fresh = torch.empty(param.shape, dtype=param.dtype, device=device)
                module._parameters[key] = torch.nn.Parameter(fresh, requires_grad=param.requires_grad)
        for key, buf in module._buffers.items():
            if buf is not None:
                module._buffers[key] = torch.empty(buf.shape, dtype=buf.dtype, device=device)


class _SkipMetaInit(torch.overrides.TorchFunctionMode):
    """Random initialisation is pointless on the meta device, and running it there imports
    torch._dynamo (about two seconds of a cold start): in-place fills of meta tensors are no-ops."""

    _OPS = frozenset({"normal_", "uniform_", "fill_", "zero_", "erfinv_", "mul_", "add_", "clamp_", "copy_",
                      "exponential_", "bernoulli_", "random_", "div_", "sub_"})

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))  # nn.init passes tensor=
        if isinstance(target, torch.Tensor) and target.is_meta and getattr(func, "__name__", "") in self._OPS:
            return target
        return func(*args, **kwargs)


def _materialise(model: torch.nn.Module, device: torch.device) -> bool:
    """Give a meta-device model real, uninitialised storage on ``device`` (no random init), keeping
    tied parameters tied and recomputing derived buffers. False (model untouched) when it cannot."""
    recipes = _derived_tensors(model)
    if recipes is None:
        return False
    ties: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        ties.setdefault(id(param), []).append(name)
    derived = {name: model.get_buffer(name) for name in recipes}
    _to_empty(model, device)
    for names in ties.values():  # to_empty gives every module its own copy of a shared parameter
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, first)
    for name, meta in derived.items():
        owner, _, attr = name.rpartition(".")
        value = recipes[name](meta).to(dtype=meta.dtype)  # computed on the CPU, as a normal build does
        setattr(model.get_submodule(owner), attr, value.to(device))
    return True


def build_model_from_state(path: Path, config: ModelConfig, vocab_size: int, state: Mapping[str, torch.Tensor],
                           device: torch.device) -> torch.nn.Module:
    """The model with the file's weights. Built on the meta device first: nothing is allocated until
    the file's tensors are known to match, so an absurd config cannot exhaust memory, and the real
    tensors are never randomly initialised only to be overwritten.

    Args:
        path: the checkpoint file (named in every error).
        config: its model config.
        vocab_size: rows of the output layer.
        state: every tensor the model's ``state_dict`` holds (aliases already resolved).
        device: where the model goes.

    Returns:
        The model in eval mode.

    Raises:
        CheckpointError: a config the model code refuses or that asks for absurd sizes, or tensor
            names and shapes that differ from the model's.
    """
    with (as_checkpoint_error(path, "cannot build the model from its config"), torch.device("meta"),
          _SkipMetaInit(), _tensor_budget(path, len(state))):
        model = build_model(config, vocab_size=vocab_size, load_pretrained=False)
    _check_weights(path, model, state)
    derived = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n not in state)
    if derived > MAX_DERIVED_BYTES:
        raise CheckpointError(f"{path}: config asks for {derived / 2**30:.1f} GiB of tables that are not stored "
                              "in the file (e.g. an absurd decoder.max_len)")
    with as_checkpoint_error(path, f"cannot build the model on {device}"):
        if not _materialise(model, device):  # an unknown derived tensor: a normal build, then the weights
            model = build_model(config, vocab_size=vocab_size, load_pretrained=False).to(device)
        model.load_state_dict(state, strict=True)
    return model.eval()
