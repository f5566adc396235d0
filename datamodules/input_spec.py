"""How an image enters a trained network, stated once: :class:`InputSpec`.

A vision datamodule states it from its arguments (its ``input_spec`` property) and builds its
evaluation transform from it; the task keeps the one it was trained with in its checkpoint
(:class:`tasks.engine.predictor.Predictor`), so ``model.predict(images)`` and ``export`` prepare images as the
datamodule's ``validate`` / ``test`` / ``predict`` do, with nothing but the checkpoint.

The three evaluation policies of the suite:

- ``"center_crop"`` (classification): resize the short side to ``resize_size``, centre-crop
  ``image_size`` x ``image_size`` (:func:`datamodules.classification_transforms.eval_transform`);
- ``"square"`` (detection): resize to ``image_size`` x ``image_size``, aspect ratio not kept
  (:func:`datamodules.detection_transforms.eval_transform`);
- ``"short_side"`` (segmentation): resize the short side to ``resize_size`` (``None``: as is); the
  logits are upsampled back to the original size (:func:`datamodules.segmentation_transforms.eval_transform`).
  ``image_size`` is then the training crop, the size FLOPs are counted and graphs exported at.

Pixels are RGB, scaled to [0, 1] and normalised: ``(pixel / 255 - mean) / std``. Which mean and std (and,
where known, input size, evaluation resize and interpolation) a model takes is decided in one place,
:func:`resolve_preprocessing` (timm's ``resolve_data_config(model=...)``): from the weights the network starts
from (a name registered in :mod:`backbones.pretrained` or a file that says how it was trained) or from the
input specification a checkpoint stores; ``mean`` / ``std`` given explicitly win, and one the weights or the
checkpoint contradict is warned about. Every reader asks it: the datamodules (:func:`normalization`, told
the model's weights or the checkpoint's specification by ``tasks/cli/links.py``), a checkpoint's model
(:func:`stored_input_spec`, :class:`tasks.engine.predictor.Predictor`) and ``export``
(``tasks/export/command.py``). :meth:`InputSpec.of_weights` is the whole evaluation input a set of
registered weights was published with. The spec travels in the checkpoint as :meth:`InputSpec.to_dict`
(plain values, readable with ``weights_only=True``). What sizes a network takes besides its own is the
backbone's ``size_multiple``, not the data's.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Literal, Mapping, Sequence

import numpy as np
import torch

from lightning.pytorch.utilities import rank_zero_warn

from backbones.pretrained import IMAGENET_MEAN, IMAGENET_STD, Preprocessing

Resize = Literal["center_crop", "square", "short_side"]
RESIZES = ("center_crop", "square", "short_side")


@dataclass(frozen=True)
class InputSpec:
    """The evaluation input of an image network: see the module docstring.

    Args:
        resize: the evaluation policy, ``"center_crop"``, ``"square"`` or ``"short_side"``.
        image_size: side of the square the network is trained at (the crop, the square, or
            segmentation's training crop); the export size.
        resize_size: short side before the centre crop, or segmentation's evaluation short side
            (``None``: the image's own size).
        mean, std: per-channel normalisation of pixels scaled to [0, 1].
        interpolation: torchvision's name of the resize's interpolation (classification).
    """

    resize: Resize
    image_size: int | None
    resize_size: int | None = None
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    interpolation: str = "bilinear"

    def __post_init__(self):
        if self.resize not in RESIZES:
            raise ValueError(f"resize must be one of {', '.join(RESIZES)}, got {self.resize!r}")
        object.__setattr__(self, "mean", tuple(float(v) for v in self.mean))
        object.__setattr__(self, "std", tuple(float(v) for v in self.std))

    # -- the three policies, from a datamodule's arguments ------------------------------------------------
    @classmethod
    def center_crop(cls, image_size: int, eval_resize: int | None, mean: Sequence[float], std: Sequence[float],
                    interpolation: str = "bilinear") -> "InputSpec":
        """Classification: the short side to ``eval_resize`` (default ``image_size / 0.875``), then the centre crop."""
        resize_size = eval_resize or int(round(image_size / 0.875))
        return cls("center_crop", int(image_size), int(resize_size), tuple(mean), tuple(std), interpolation)

    @classmethod
    def square(cls, image_size: int, mean: Sequence[float], std: Sequence[float]) -> "InputSpec":
        """Detection: the whole image resized to the square input."""
        return cls("square", int(image_size), None, tuple(mean), tuple(std))

    @classmethod
    def short_side(cls, short_side: int | None, crop_size: int | None, mean: Sequence[float],
                   std: Sequence[float]) -> "InputSpec":
        """Segmentation: the short side to ``short_side`` (``None``: as is); ``crop_size`` is the training crop."""
        return cls("short_side", None if crop_size is None else int(crop_size),
                   None if short_side is None else int(short_side), tuple(mean), tuple(std))

    @classmethod
    def of_weights(cls, weights: str) -> "InputSpec":
        """The evaluation input registered ``weights`` were published with (:mod:`backbones.pretrained`): a
        centre crop of their input size after resizing the short side by their crop ratio, their
        interpolation, mean and std (timm's ``resolve_data_config``, torchvision's ``Weights.transforms()``)."""
        from backbones.pretrained import PRETRAINED

        PRETRAINED.get(weights)  # a registered name, or the error that lists them
        trained = resolve_preprocessing(weights)
        return cls("center_crop", trained.input_size, trained.resize_size, trained.mean, trained.std,
                   trained.interpolation)

    # -- in the checkpoint ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain values (lists, numbers, strings): a checkpoint entry that loads with ``weights_only=True``."""
        values = asdict(self)
        values["mean"], values["std"] = list(self.mean), list(self.std)
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "InputSpec":
        return cls(**values)

    # -- the evaluation transform ---------------------------------------------------------------------------
    def eval_transform(self):
        """The datamodule's evaluation transform for this spec, built by the same function the datamodule
        calls. Its calling convention is the pipeline's own: classification and detection take a (3, H, W)
        uint8 tensor (torchvision v2), segmentation ``transform(image=(H, W, 3) uint8 array)`` (albumentations).
        :meth:`prepare` calls it the right way."""
        if self.resize == "center_crop":
            from datamodules.classification_transforms import eval_transform

            return eval_transform(self.image_size, self.resize_size, self.mean, self.std, self.interpolation)
        if self.resize == "square":
            from datamodules.detection_transforms import eval_transform

            return eval_transform(self.image_size, self.mean, self.std)
        from datamodules.segmentation_transforms import eval_transform

        return eval_transform(self.resize_size, self.mean, self.std)

    def prepare(self, pixels: torch.Tensor, transform=None) -> torch.Tensor:
        """(3, H, W) uint8 upright pixels -> the (3, h, w) float network input, as the datamodule prepares it.
        ``transform``: :meth:`eval_transform`'s result, to build it once for many images."""
        transform = transform or self.eval_transform()
        if self.resize == "short_side":
            return transform(image=np.ascontiguousarray(pixels.permute(1, 2, 0).numpy()))["image"]
        if self.resize == "square":
            return transform(pixels).as_subclass(torch.Tensor)
        return transform(pixels)


def input_spec_of(datamodule, fallback=None) -> InputSpec | None:
    """``datamodule.input_spec``; for a datamodule that states none, ``fallback(datamodule.hparams)``
    (the task's rule for its datamodules' arguments), else ``None``."""
    spec = getattr(datamodule, "input_spec", None)
    if spec is None and fallback is not None and getattr(datamodule, "hparams", None) is not None:
        spec = fallback(dict(datamodule.hparams))
    return spec


def resolve_preprocessing(weights: str | None = None, stored: InputSpec | Mapping[str, Any] | None = None,
                          mean: Sequence[float] | None = None,
                          std: Sequence[float] | None = None) -> Preprocessing:
    """Which input a model takes: its mean and std, and its input size, evaluation resize and interpolation
    where they are known (``None`` where not). The one answer every reader asks (see the module docstring).

    What the model was trained on is ``stored``, the input specification a checkpoint of this suite carries
    (an :class:`InputSpec` or its :meth:`~InputSpec.to_dict`), else what ``weights`` were trained on (the
    model's ``weights`` or its backbone's ``pretrained``: a registered name, or a file that says,
    :func:`backbones.weights.preprocessing_of`). A checkpoint's specification comes first because its own
    weights replace those its training started from. ``mean`` / ``std`` given explicitly win; the rest
    is the trained input's, else ImageNet's (no weights, or weights that do not say).

    Warns when a given value differs from the trained one (the network would see inputs unlike its
    training), and when ``weights`` do not say their input while a value is left to the default."""
    given = {"mean": mean, "std": std}
    if stored is not None:
        trained = Preprocessing.from_input_spec(stored.to_dict() if isinstance(stored, InputSpec) else stored)
        source = "the checkpoint"
    elif weights:
        from backbones.weights import preprocessing_of

        trained, source = preprocessing_of(weights), weights
        if trained is None and None in given.values():
            rank_zero_warn(f"data.weights={weights} does not say which input it was trained on (a state dict without "
                           "the input specification our checkpoints store): normalising with ImageNet's mean and std. "
                           "Name registered weights (backbones/pretrained.py) or give data.mean and data.std")
    else:
        trained, source = None, None
    base = trained if trained is not None else Preprocessing(IMAGENET_MEAN, IMAGENET_STD)
    for key, value in given.items():
        if value is not None and trained is not None and tuple(float(v) for v in value) != getattr(base, key):
            rank_zero_warn(f"data.{key}={list(value)} differs from the {key} {list(getattr(base, key))} that {source} "
                           f"was trained with: the network sees inputs unlike its training. Leave data.{key} unset "
                           f"to use {source}'s own")
    return replace(base, mean=base.mean if mean is None else tuple(mean), std=base.std if std is None else tuple(std))


def normalization(weights: str | None = None, mean: Sequence[float] | None = None,
                  std: Sequence[float] | None = None) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(mean, std)`` an image datamodule normalises with, given its ``weights``, ``mean`` and ``std``
    arguments: :func:`resolve_preprocessing`'s."""
    resolved = resolve_preprocessing(weights, mean=mean, std=std)
    return resolved.mean, resolved.std


def stored_input_spec(checkpoint: Mapping[str, Any],
                      rule: Callable[[dict], InputSpec] | None = None) -> InputSpec | None:
    """The input a checkpoint's model takes: the specification the checkpoint stores (``input_spec``), else
    the task's ``rule`` applied to the datamodule arguments Lightning saved beside the model
    (``datamodule_hyper_parameters``, whose mean and std :func:`resolve_preprocessing` resolved when the
    datamodule was built); ``None`` when neither says."""
    if checkpoint.get("input_spec") is not None:
        return InputSpec.from_dict(checkpoint["input_spec"])
    arguments = checkpoint.get("datamodule_hyper_parameters")
    if not arguments or rule is None:
        return None
    try:
        return rule(dict(arguments))
    except KeyError:  # another datamodule's arguments: no spec to read from them
        return None


def _normalization(hparams: dict) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """A datamodule's ``mean`` and ``std`` (resolved once, when it was built), else :func:`normalization`'s."""
    mean, std = hparams.get("mean"), hparams.get("std")
    if mean is not None and std is not None:
        return tuple(mean), tuple(std)
    return normalization(hparams.get("weights"), mean, std)


def classification_spec(hparams: dict) -> InputSpec:
    """The spec of an image-folder classification datamodule's arguments (``image_size``, ``eval_resize``,
    ``weights``, ``mean``, ``std``, ``interpolation``)."""
    return InputSpec.center_crop(hparams["image_size"], hparams.get("eval_resize"), *_normalization(hparams),
                                 hparams.get("interpolation", "bilinear"))


def detection_spec(hparams: dict) -> InputSpec:
    """The spec of a detection datamodule's arguments (``image_size``, ``weights``, ``mean``, ``std``)."""
    return InputSpec.square(hparams["image_size"], *_normalization(hparams))


def segmentation_spec(hparams: dict) -> InputSpec:
    """The spec of a segmentation datamodule's arguments (``eval_short_side``, ``crop_size``, ``weights``,
    ``mean``, ``std``)."""
    return InputSpec.short_side(hparams.get("eval_short_side"), hparams.get("crop_size"), *_normalization(hparams))
