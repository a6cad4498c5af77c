"""The inference API: ``load(checkpoint)`` then ``Captioner.caption(images)``.

One pipeline serves every caller (the commands, the demo, user code)::

    import captioner
    model = captioner.load("runs/x/best.safetensors")
    print(model.caption(["photo.jpg"])[0].text)

Shape legend: B images, S encoder input side, N regions (g*g), D feature width, L words.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import torch
from PIL import Image

from captioner.checkpoint.remote import cached_hint, resolve_checkpoint
from captioner.models.labels import ImageNetLabels, label_head
from captioner.checkpoint.store import load_checkpoint
from captioner.models.concepts import photo_tags
from captioner.data.images import (ImageSource, ImageTransform, crop_box, image_sources, load_for_encoder, pil_image,
                                   token_ids)
from captioner.config import everyday_photos
from captioner.decoding.search import DecodeOptions, Hypothesis, decode
from captioner.device import resolve_device
from captioner.errors import CheckpointError, ConfigError, DataError, EmptyCaptionError, ImageLoadError
from captioner.language import language_model_for
from captioner.models.base import eval_mode
from captioner.models.ensemble import build_ensemble
from captioner.models.quantize import Int8Lite, int8_available, read_calibration
from captioner.pretrained import check_model_spec, int8_calibration, is_model_name, pretrained_path, unknown_model
from captioner.text import Vocabulary

__all__ = ["ENCODER_PRECISIONS", "Caption", "Captioner", "ImageInput", "caption_features", "caption_images",
           "decode_options", "empty_caption", "everyday_photos", "grid_of", "load", "search_features",
           "teacher_forced_attention", "teacher_forced_log_probs"]

# threads that read and transform image files while the encoder and the search run (PIL releases the
# GIL while it decodes and resizes); torch keeps its intra-op threads (one per core) for the encoder
LOADER_THREADS = 2
STREAM_BYTES = 1 << 30  # caption_stream: pixels and encoder activations of the photos read and encoded at once
ACTIVATION_FACTOR = 16  # an encoder's live activations per photo, in multiples of its input pixels (EfficientNet-
# Lite0 at 224 px holds about 8: its 96-channel stride-2 stage; 4096 photos at once asked for 3.2 GB in one tensor)

# load(precision=...): the encoder's arithmetic ("int8": an 8-bit EfficientNet-Lite trunk on a CPU, the
# decoder float32); the decoder's own float32/bfloat16 is a decoding option (DecodeOptions.precision)
ENCODER_PRECISIONS = ("float32", "int8")
INT8_DEFAULT = False  # whether load(precision=None) on a CPU takes int8 where a calibration ships

ImageInput = Union[str, os.PathLike, Image.Image, torch.Tensor]
"""A path, a PIL image, an already-transformed (3, S, S) tensor or a (B, 3, S, S) batch."""


@dataclass
class Caption:
    """The caption of one image.

    Attributes:
        text: the words joined by spaces; ``words``/``tokens``: one per emitted token (no ``<bos>``/``<eos>``).
        score: the search's length-normalised log-probability of the caption.
        attention: (L, g, g) float32 CPU tensor, one map per word (each sums to 1), or None unless asked for.
        all_attention: (L, layers, heads, g, g), every layer's and head's map (Transformer, ``all_heads=True``).
        image_size: (width, height) of the original image; None for a tensor input.
        box: ``(left, top, right, bottom)`` of the original image the encoder saw (right/bottom exclusive).
        finished: False when the caption was cut at ``max_len`` without ``<eos>``.
        concepts, concept_maps: a concept model's top ``(word, probability)`` and their (C, g, g) maps, else None.
        labels: with ``labels=K``, the encoder's ImageNet head's K words as ``(word, probability, (g, g) map)``.
        log_prob: the model's own log-probability of the caption (its words, and ``<eos>`` when finished) from
            a teacher-forced pass (:func:`teacher_forced_log_probs`): ``score`` without a language model, a
            veto or a fill; set by :meth:`Captioner.caption_nbest`, else None.
    """

    text: str
    words: list[str]
    tokens: list[int]
    score: float
    grid: tuple[int, int]
    attention: torch.Tensor | None = None
    all_attention: torch.Tensor | None = None
    image_size: tuple[int, int] | None = None
    box: tuple[int, int, int, int] | None = None
    finished: bool = True
    concepts: list[tuple[str, float]] | None = None
    concept_maps: torch.Tensor | None = None
    labels: list[tuple[str, float, torch.Tensor]] | None = None
    log_prob: float | None = None

    def __repr__(self) -> str:  # shapes, not the tensors' values: a result prints on one line
        def shape(t: torch.Tensor | None) -> str:
            return "None" if t is None else f"<{'x'.join(map(str, t.shape))}>"

        return (f"Caption(text={self.text!r}, score={self.score:.4f}, grid={self.grid}, "
                f"attention={shape(self.attention)}, all_attention={shape(self.all_attention)}, "
                f"image_size={self.image_size}, box={self.box}, finished={self.finished})")


def grid_of(model: torch.nn.Module, n_regions: int) -> tuple[int, int]:
    """(rows, cols) of ``n_regions`` region features: the model's encoder grid, else a square."""
    g = getattr(getattr(getattr(model, "config", None), "encoder", None), "grid", None)
    if g is not None and g * g == n_regions:
        return (g, g)
    root = math.isqrt(n_regions)
    if root * root != n_regions:
        raise ConfigError(f"cannot shape {n_regions} regions into a square grid; pass grid=(rows, cols)")
    return (root, root)


def _caption(h: Hypothesis, vocab: Vocabulary, grid: tuple[int, int]) -> Caption:
    """One hypothesis as a :class:`Caption` with its attention (L, g, g)."""
    words = [vocab.itos[i] if 0 <= i < len(vocab) else "<unk>" for i in h.tokens]
    attention = h.attention.view(len(h.tokens), grid[0], grid[1])  # (L, g, g)
    return Caption(vocab.decode(h.tokens), words, list(h.tokens), float(h.score), grid, attention, finished=h.finished)


def _captions(hyps: list[list[Hypothesis]], vocab: Vocabulary, grid: tuple[int, int]) -> list[Caption]:
    """Each image's best hypothesis as a :class:`Caption` with its attention (L, g, g)."""
    return [_caption(per_image[0], vocab, grid) for per_image in hyps]


def caption_features(model: torch.nn.Module, features: torch.Tensor, vocab: Vocabulary,
                     options: DecodeOptions | None = None, grid: tuple[int, int] | None = None) -> list[Caption]:
    """Best caption per image from (B, N, D) region features: the one search every caller goes through.

    ``options`` defaults to ``DecodeOptions()`` (beam 3, 20 words); ``grid`` to :func:`grid_of`.
    """
    options = options if options is not None else DecodeOptions()
    grid = grid or grid_of(model, features.size(1))
    if grid[0] * grid[1] != features.size(1):
        raise ConfigError(f"grid {grid} does not match {features.size(1)} regions")
    with eval_mode(model):
        hyps = search_features(model.decoder, features, vocab, options)
    captions = _captions(hyps, vocab, grid)
    for caption, (words, maps) in zip(captions, photo_tags(getattr(model.decoder, "extension", None), features, vocab, grid)):
        caption.concepts, caption.concept_maps = words, maps
    return captions


def search_features(decoder: torch.nn.Module, features: torch.Tensor, vocab: Vocabulary,
                    options: DecodeOptions | None = None) -> list[list[Hypothesis]]:
    """``options.n_best`` hypotheses per image, best first, with ``decoder`` in eval mode.

    ``<pad>``/``<bos>`` (and ``<unk>`` unless ``options.allow_unk``) are never emitted.
    """
    options = options if options is not None else DecodeOptions()
    with eval_mode(decoder):
        return decode(decoder, features, vocab, options, language_model_for(options.lm, vocab) if options.lm_weight else None)


def caption_images(model: torch.nn.Module, images: torch.Tensor, vocab: Vocabulary,
                   options: DecodeOptions | None = None) -> list[Caption]:
    """Encode transformed images (B, 3, S, S) with ``model.encode`` and caption them (:func:`caption_features`)."""
    with eval_mode(model):
        with torch.no_grad():
            features, grid = model.encode(images)  # (B, N, D), (g, g)
        return caption_features(model, features, vocab, options, grid=(int(grid[0]), int(grid[1])))


def teacher_forced_attention(model: torch.nn.Module, features: torch.Tensor, tokens: Sequence[int], bos_id: int,
                             grid: tuple[int, int]) -> torch.Tensor | None:
    """Per-layer, per-head attention (L, layers, heads, g, g) of a given caption from a teacher-forced forward.

    ``tokens`` are the caption's L word ids (no ``<bos>``/``<eos>``). None for an empty caption or a
    decoder with one map per word (the LSTM).
    """
    if not tokens:
        return None
    inputs = torch.tensor([[bos_id, *tokens[:-1]]], device=features.device)  # (1, L): step t predicts word t
    with torch.inference_mode():
        out = model.decoder(features, inputs, need_all_attention=True)
    if out.all_attention is None:
        return None
    all_att = out.all_attention[0].float().cpu()  # (L, layers, heads, N)
    return all_att.reshape(*all_att.shape[:3], *grid)  # (L, layers, heads, g, g)


def teacher_forced_log_probs(model: torch.nn.Module, features: torch.Tensor, captions: Sequence[Sequence[int]],
                             bos_id: int, eos_id: int, finished: Sequence[bool] | None = None) -> list[float]:
    """The model's own log-probability of each caption of one image, from one teacher-forced forward.

    What the decoder alone gives the caption's words, and its ``<eos>`` when ``finished`` (default: all
    are): the search's score when it ranks by the model alone, and the model's own opinion of a caption a
    language model, a veto or a fill helped choose (their terms are not in it).

    Args:
        features: (1, N, D) regions of the image (or (C, N, D), one row per caption).
        captions: C captions' word ids (no ``<bos>``/``<eos>``).
    Returns:
        C floats (0.0 for an empty, unfinished caption).
    """
    if not captions:
        return []
    finished = [True] * len(captions) if finished is None else list(finished)
    C, T = len(captions), max(len(t) for t in captions) + 1  # T: the words and the <eos> step
    inputs = torch.full((C, T), eos_id, dtype=torch.long)  # (C, T): <bos> w1 .. wn, padded
    targets = torch.full((C, T), eos_id, dtype=torch.long)  # (C, T): w1 .. wn <eos>, padded
    counted = torch.zeros(C, T, dtype=torch.bool)  # (C, T): the steps that belong to the caption
    for i, (tokens, done) in enumerate(zip(captions, finished)):
        n = len(tokens)
        inputs[i, 0] = bos_id
        inputs[i, 1:n + 1] = torch.as_tensor(list(tokens), dtype=torch.long)
        targets[i, :n] = inputs[i, 1:n + 1]
        counted[i, :n + int(done)] = True
    if features.size(0) == 1:
        features = features.expand(C, -1, -1)  # (C, N, D)
    with eval_mode(model), torch.inference_mode():
        logits = model.decoder(features, inputs.to(features.device)).logits  # (C, T, V); causal: padding unread
    log_probs = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.to(logits.device).unsqueeze(-1))
    return log_probs.squeeze(-1).cpu().masked_fill(~counted, 0.0).sum(1).tolist()  # (C,)


def decode_options(options: DecodeOptions | None = None, **overrides: object) -> DecodeOptions:
    """``options`` (default ``DecodeOptions()``) with ``overrides`` applied; ``beam`` is short for ``beam_size``.

    Raises:
        ConfigError: not a ``DecodeOptions``, an unknown override, or a value out of range.
    """
    if options is None:
        options = DecodeOptions()
    elif not isinstance(options, DecodeOptions):
        raise ConfigError(f"options must be a DecodeOptions, got {type(options).__name__}")
    if "beam" in overrides:
        if "beam_size" in overrides:
            raise ConfigError("give beam or beam_size, not both")
        overrides["beam_size"] = overrides.pop("beam")
    fields = [f.name for f in dataclasses.fields(DecodeOptions)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ConfigError(f"unknown decoding option(s) {', '.join(unknown)}; the options are: beam, {', '.join(fields)}")
    return dataclasses.replace(options, **overrides)


def empty_caption(name: str, options: DecodeOptions) -> EmptyCaptionError:
    """The error for an image the model wrote no word for, naming it (its path) and the beam size."""
    return EmptyCaptionError(f"{name}: the model wrote an empty caption (no word before <eos>) at beam "
                             f"{options.beam_size}; a smaller beam, or a model trained longer, may say something")


class Captioner:
    """A trained captioning model ready for inference: network, vocabulary, transform and device."""

    def __init__(self, model: torch.nn.Module, vocab: Vocabulary, device: str | torch.device | None = None) -> None:
        self.model = model
        self.vocab = vocab
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.config = model.config  # ModelConfig
        self.transform = ImageTransform(self.config.encoder)
        self._label_head: ImageNetLabels | None = None  # built on the first request for labels
        self.precision = "float32"  # the encoder's arithmetic (:meth:`use_int8`)

    def __repr__(self) -> str:
        names = getattr(self.model.decoder, "member_names", None)  # an ensemble (load([a, b])): its members'
        decoder = f"ensemble={' + '.join(names)!r}" if names else f"decoder={self.config.decoder.name!r}"
        precision = ", precision='int8'" if self.precision == "int8" else ""
        return (f"Captioner({decoder}, encoder={self.config.encoder.name!r}, "
                f"vocab={len(self.vocab)}, device={str(self.device)!r}{precision})")

    def use_int8(self, calibration: str | os.PathLike) -> None:
        """Encode in 8-bit integers from now on: the EfficientNet-Lite trunk quantized with the activation
        ranges of ``calibration`` (a file of ``scripts/calibrate_int8.py``); regions, attention maps and
        labels are computed from its output as before, the decoder stays float32.

        Raises ``ConfigError`` (not on a CPU, not a Lite encoder, no quantized engine) or ``CheckpointError``
        (a bad calibration file).
        """
        if self.device.type != "cpu":
            raise ConfigError(f"precision int8: the 8-bit encoder runs on a CPU, not {self.device}; use float32 there")
        encoder = self.model.encoder
        encoders = getattr(encoder, "encoders", [encoder])  # an ensemble's distinct encoders
        measured = read_calibration(Path(calibration))
        for each in encoders:
            each.use_int8(Int8Lite(each.trunk, measured))
        self.precision = "int8"

    def crop_box(self, image: Image.Image) -> tuple[int, int, int, int]:
        """``(left, top, right, bottom)`` of ``image`` (original pixels) that the encoder sees."""
        return crop_box(image.width, image.height, self.config.encoder)

    def caption(self, images: ImageInput | Sequence[ImageInput], options: DecodeOptions | None = None, *,
                attention: bool = False, all_heads: bool = False, batch_size: int = 8, labels: int = 0,
                allow_empty: bool = False, **decoding: object) -> list[Caption]:
        """Caption one image or several: one :class:`Caption` per image, in input order.

        Args:
            images: a path, PIL image or transformed (3, S, S) tensor, a (B, 3, S, S) batch, or a list of these.
            options: search options; default ``DecodeOptions()`` (beam 3, 20 words, ``<unk>`` banned).
            attention: keep each word's map; ``all_heads``: also every layer's and head's (Transformer).
            labels: also the K most probable words of the encoder's ImageNet head; 0: none.
            allow_empty: return a wordless caption instead of raising ``EmptyCaptionError``.
            **decoding: ``DecodeOptions`` fields replacing those of ``options``, e.g. ``beam=5, max_len=16``.

        Raises ``ImageLoadError``/``ImageInputError`` for the first bad input, ``ConfigError`` for bad
        options, ``EmptyCaptionError`` naming an image the model wrote no word for.
        """
        options = decode_options(options, **decoding)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        for flag, value in (("attention", attention), ("all_heads", all_heads), ("allow_empty", allow_empty)):
            if not isinstance(value, bool):
                raise ConfigError(f"{flag} must be True or False, got {value!r}")
        sources = self._flatten(images)
        out: list[Caption] = []
        for result in self.caption_stream(sources, options, attention=attention, all_heads=all_heads,
                                          batch_size=batch_size, labels=labels, allow_empty=allow_empty):
            if isinstance(result, Exception):
                raise result
            out.append(result)
        return out

    def caption_stream(self, sources: Sequence[ImageSource], options: DecodeOptions, *, attention: bool = False,
                       all_heads: bool = False, batch_size: int = 8, labels: int = 0, allow_empty: bool = False
                       ) -> Iterator[Caption | ImageLoadError | EmptyCaptionError]:
        """:meth:`caption` as a pipeline over checked sources, one result per source in input order.

        Each result is a :class:`Caption`, or the ``ImageLoadError``/``EmptyCaptionError`` of that image
        (the others are still captioned). The next chunk is read and encoded while this one is searched;
        the arithmetic is that of one chunk at a time, so the captions are the same.
        """
        head = self.label_head() if self._check_labels(labels) else None
        keep = attention or all_heads
        batch_size = self.stream_chunk(batch_size)  # priced: a batch of 4096 photos is read and encoded in parts
        starts = range(0, len(sources), batch_size)
        if not starts:
            return
        with eval_mode(self.model), ThreadPoolExecutor(LOADER_THREADS) as loaders, \
                ThreadPoolExecutor(1) as encoder:
            def read(source: ImageSource) -> tuple[torch.Tensor, tuple[int, int] | None] | ImageLoadError:
                try:
                    return self._prepare(source)
                except ImageLoadError as exc:
                    return exc

            def encode(start: int) -> tuple[list, torch.Tensor | None, tuple[int, int]]:
                prepared = [f.result() for f in [loaders.submit(read, s) for s in sources[start:start + batch_size]]]
                good = [p for p in prepared if not isinstance(p, ImageLoadError)]
                if not good:
                    return prepared, None, (0, 0)
                pixels = torch.stack([x for x, _ in good]).to(self.device, non_blocking=True)  # (b, 3, S, S)
                with torch.no_grad():  # grad mode is per thread
                    features, grid = self.model.encode(pixels)  # (b, N, D), (g, g)
                return prepared, features, (int(grid[0]), int(grid[1]))

            pending = encoder.submit(encode, starts[0])
            for k in range(len(starts)):
                prepared, features, grid = pending.result()
                if k + 1 < len(starts):
                    pending = encoder.submit(encode, starts[k + 1])
                found = iter(self._search(prepared, features, grid, options, keep, all_heads, head, labels))
                for i, item in enumerate(prepared, start=starts[k]):
                    if isinstance(item, ImageLoadError):
                        yield item
                        continue
                    result = next(found)
                    if result.words or allow_empty:
                        yield result
                    else:
                        source = sources[i]
                        yield empty_caption(str(source) if isinstance(source, Path) else f"image {i} of the input",
                                            options)

    def stream_chunk(self, batch_size: int) -> int:
        """The photos :meth:`caption_stream` reads and encodes at once: ``batch_size``, or fewer when their
        pixels and the encoder's activations would pass :data:`STREAM_BYTES` (two chunks are held: one is
        read ahead). ``ConfigError`` for a batch size below 1."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be a whole number >= 1, got {batch_size!r}")
        side = int(self.transform.size or 224)
        per_image = 3 * side * side * 4 * (2 + ACTIVATION_FACTOR)  # float32 pixels, twice, and the activations
        return max(1, min(batch_size, STREAM_BYTES // per_image))

    def label_head(self) -> ImageNetLabels:
        """The encoder's ImageNet head as a detector of caption words, built on the first call and kept."""
        if self._label_head is None:
            self._label_head = label_head(self.config.encoder).to(self.device)
        return self._label_head

    @staticmethod
    def _check_labels(labels: object) -> bool:
        if isinstance(labels, bool) or not isinstance(labels, int) or labels < 0:
            raise ConfigError(f"labels must be an integer >= 0 (how many per photo), got {labels!r}")
        return labels > 0

    def encode(self, images: ImageInput | Sequence[ImageInput]) -> tuple[torch.Tensor, tuple[int, int]]:
        """The encoder's regions of one image or several as one batch: ((B, N, D), grid (g, g))."""
        sources = self._flatten(images)
        if not sources:
            raise DataError("encode needs at least one image")
        with ThreadPoolExecutor(LOADER_THREADS) as loaders:
            pixels = torch.stack([x for x, _ in loaders.map(self._prepare, sources)]).to(self.device)  # (B, 3, S, S)
        with eval_mode(self.model), torch.no_grad():
            features, grid = self.model.encode(pixels)  # (B, N, D)
        return features, (int(grid[0]), int(grid[1]))

    def teacher_forced(self, image: ImageInput, tokens: Sequence[int]) -> torch.Tensor | None:
        """Every layer's and head's attention of a given caption of one image (:func:`teacher_forced_attention`)."""
        sources = self._flatten(image)
        if len(sources) != 1:
            raise DataError(f"teacher_forced takes one image, got {len(sources)}")
        tokens = token_ids(tokens, len(self.vocab))
        pixels, _ = self._prepare(sources[0])
        with eval_mode(self.model):
            with torch.no_grad():
                features, grid = self.model.encode(pixels.unsqueeze(0).to(self.device))  # (1, N, D)
            return teacher_forced_attention(self.model, features, list(tokens), self.vocab.bos_id,
                                            (int(grid[0]), int(grid[1])))

    def caption_nbest(self, image: ImageInput, n_best: int = 3, options: DecodeOptions | None = None, *,
                      all_heads: bool = False, labels: int = 0, allow_empty: bool = False,
                      **decoding: object) -> list[Caption]:
        """The ``n_best`` best captions of one image (best first), each with its per-word attention.

        ``options``, ``**decoding``, ``all_heads`` and ``labels`` are as in :meth:`caption`. ``allow_empty``:
        keep hypotheses with no words; by default a lower-ranked empty one is dropped and an empty best one
        raises ``EmptyCaptionError`` naming the image and the beam, as :meth:`caption` does.
        """
        options = decode_options(options, **decoding, n_best=n_best)
        head = self.label_head() if self._check_labels(labels) else None
        sources = self._flatten(image)
        if len(sources) != 1:
            raise DataError(f"caption_nbest takes one image, got {len(sources)}")
        pixels, size = self._prepare(sources[0])
        box = crop_box(size[0], size[1], self.config.encoder) if size is not None else None
        with eval_mode(self.model):
            with torch.no_grad():
                features, grid = self.model.encode(pixels.unsqueeze(0).to(self.device))  # (1, N, D)
            grid = (int(grid[0]), int(grid[1]))
            concepts, concept_maps = photo_tags(getattr(self.model.decoder, "extension", None), features, self.vocab,
                                                  grid)[0]  # the photo's
            seen = head.top(features, grid, k=labels)[0] if head is not None else None
            out = []
            for rank, h in enumerate(search_features(self.model.decoder, features, self.vocab, options)[0]):
                c = _caption(h, self.vocab, grid)
                if not c.words and not allow_empty:
                    if rank == 0:  # the model's best answer is no caption: as caption() says at this beam
                        raise empty_caption(str(sources[0]) if isinstance(sources[0], Path) else "the image", options)
                    continue  # a lower-ranked empty hypothesis is no caption: dropped
                c.image_size, c.box = size, box
                c.concepts, c.concept_maps = concepts, concept_maps
                c.labels = None if seen is None else list(seen)
                if all_heads:
                    c.all_attention = teacher_forced_attention(self.model, features, c.tokens, self.vocab.bos_id, grid)
                out.append(c)
            own = teacher_forced_log_probs(self.model, features, [c.tokens for c in out], self.vocab.bos_id,
                                           self.vocab.eos_id, [c.finished for c in out])
        for c, log_prob in zip(out, own):
            c.log_prob = log_prob
        return out

    # ------------------------------------------------------------------------- internals

    def _search(self, prepared: list, features: torch.Tensor | None, grid: tuple[int, int], options: DecodeOptions,
                keep_attention: bool, all_heads: bool, head: ImageNetLabels | None = None,
                labels: int = 0) -> list[Caption]:
        """Captions of one encoded chunk (errors in ``prepared`` skipped), with ``labels`` words of ``head``."""
        if features is None:
            return []
        sizes = [p[1] for p in prepared if not isinstance(p, ImageLoadError)]
        found = caption_features(self.model, features, self.vocab, options, grid=grid)
        if head is not None:
            for result, seen in zip(found, head.top(features, grid, k=labels)):
                result.labels = seen
        for i, (size, result) in enumerate(zip(sizes, found)):
            if all_heads:
                result.all_attention = teacher_forced_attention(self.model, features[i:i + 1], result.tokens,
                                                                self.vocab.bos_id, grid)
            if not keep_attention:
                result.attention = None
            if size is not None:
                result.image_size, result.box = size, crop_box(size[0], size[1], self.config.encoder)
        return found

    def _flatten(self, images: ImageInput | Sequence[ImageInput]) -> list[ImageSource]:
        """Inputs -> one checked source per image."""
        return image_sources(images, self.transform.size)

    def _prepare(self, source: ImageSource) -> tuple[torch.Tensor, tuple[int, int] | None]:
        """A checked source -> (pixels (3, S, S), original (width, height) or None for a tensor)."""
        if isinstance(source, Path):
            image, size = load_for_encoder(source, self.transform.size)
            return self.transform(pil_image(image, str(source))), size
        if isinstance(source, Image.Image):
            return self.transform(source), source.size
        return source, None


def load(checkpoint: str | os.PathLike | Sequence[str | os.PathLike], device: str | torch.device = "auto",
         sha256: str | None = None, progress: bool | None = None, refresh: bool = False,
         precision: str | None = None) -> Captioner:
    """Load a trained checkpoint for inference: a :class:`Captioner` in eval mode on ``device``.

    ``checkpoint``: a shipped model's name (``"flickr8k"``), a file, a run folder, an ``https://`` URL
    (``#sha256=HEX`` checks it) or ``hf://org/repo[/file]``; a list: an ensemble averaging their
    next-word probabilities. ``device``: ``"auto"``, ``"cpu"``, ``"cuda:1"``... ``refresh`` downloads
    again. ``precision``: the encoder's arithmetic, ``"float32"`` or ``"int8"`` (a CPU, a model whose
    int8 calibration ships with it or lies beside its file as ``<name>.int8.json``; the decoder stays
    float32); None: :func:`default_precision`. Raises ``CheckpointError`` (bad file, download or hash)
    or ``ConfigError`` (device, hash, precision).
    """
    if precision is not None and precision not in ENCODER_PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(ENCODER_PRECISIONS)} (the encoder's arithmetic; "
                          f"the decoder's bfloat16 is a decoding option), got {precision!r}")
    if isinstance(checkpoint, (list, tuple)):
        return _load_ensemble(list(checkpoint), device, sha256, progress, refresh, precision)
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise CheckpointError(f"checkpoint must be a path or a list of paths, got {type(checkpoint).__name__}")
    if not isinstance(device, (str, torch.device)):
        raise ConfigError(f"device must be a name such as 'cpu' or 'cuda:0', got {type(device).__name__}")
    dev = resolve_device(device)
    path = checkpoint_path(checkpoint, sha256, progress, refresh)
    try:
        loaded = load_checkpoint(path, device=str(dev))
    except CheckpointError as exc:
        raise CheckpointError(f"{exc}{cached_hint(checkpoint, path)}") from None
    model = Captioner(loaded.model.to(dev).eval(), loaded.vocab, dev)
    calibration = calibration_path(checkpoint, path)
    if precision is None:
        precision = default_precision(dev, calibration)
    if precision == "int8":
        if calibration is None:
            raise ConfigError(f"{checkpoint}: precision int8 needs the encoder's calibration ({path.stem}.int8.json "
                              "beside the checkpoint, written by scripts/calibrate_int8.py); use float32")
        model.use_int8(calibration)
    return model


def calibration_path(spec: str | os.PathLike, path: Path) -> Path | None:
    """The int8 calibration of checkpoint ``spec`` (read from ``path``): a shipped model's (its SHA-256
    checked), else ``<stem>.int8.json`` beside the file; None when there is none."""
    if is_model_name(spec):
        return int8_calibration(str(spec))
    beside = path.with_name(f"{path.stem}.int8.json")
    return beside if beside.is_file() else None


def default_precision(device: torch.device, calibration: Path | None) -> str:
    """The encoder's arithmetic when none is asked for: int8 on a CPU where a calibration exists and
    :data:`INT8_DEFAULT` says int8 held the quality bounds (docs/benchmarks.md), else float32."""
    if INT8_DEFAULT and device.type == "cpu" and calibration is not None and int8_available():
        return "int8"
    return "float32"


def checkpoint_path(spec: str | os.PathLike, sha256: str | None = None, progress: bool | None = None,
                    refresh: bool = False) -> Path:
    """The local file behind a checkpoint spec, as ``-c`` and ``--init`` take it: a shipped model's name
    (its SHA-256 checked), a file, a run folder (its best, else latest checkpoint), an ``https://`` URL or
    ``hf://`` id (fetched into the cache). Not yet read: loading checks the content.

    Raises:
        CheckpointError: as :func:`captioner.pretrained.pretrained_path` and
            :func:`captioner.checkpoint.remote.resolve_checkpoint`.
    """
    check_model_spec(spec)  # '' is not the current folder
    if is_model_name(spec):  # a model shipped with the package
        return pretrained_path(str(spec))
    path = resolve_checkpoint(spec, sha256=sha256, progress=progress, refresh=refresh)
    if isinstance(spec, str) and "/" not in spec and os.sep not in spec and not os.path.lexists(path):
        raise unknown_model(spec)  # a bare name: the shipped models, and the nearest
    return path


def _load_ensemble(checkpoints: list, device: str | torch.device, sha256: str | None, progress: bool | None,
                   refresh: bool, precision: str | None = None) -> Captioner:
    """:func:`load` of several checkpoints: one :class:`Captioner` decoding them as an ensemble."""
    if not checkpoints:
        raise CheckpointError("an ensemble needs at least one checkpoint, got an empty list")
    if len(checkpoints) == 1:
        return load(checkpoints[0], device, sha256, progress, refresh, precision)
    if sha256 is not None:
        raise ConfigError("sha256= checks one file; for an ensemble put #sha256=HEX on each URL")
    members = [load(c, device, None, progress, refresh, precision) for c in checkpoints]
    names = [str(c) for c in checkpoints]
    for member, name in zip(members[1:], names[1:]):
        differs = member.vocab.first_difference(members[0].vocab)
        if differs is not None:
            raise ConfigError(f"{name}: its vocabulary ({len(member.vocab)} words) differs from that of {names[0]} "
                              f"({len(members[0].vocab)} words): {differs}; the models of an ensemble must be "
                              "trained with one vocabulary (the same data and data.min_freq)")
    model = build_ensemble([m.model for m in members], names)
    out = Captioner(model, members[0].vocab, members[0].device)
    out.precision = members[0].precision  # each member's encoder as it was loaded
    return out
