"""The weights a backbone can start from, each with the input it was trained on: one registry.

An entry (:class:`PretrainedWeights`) is one set of weights of one backbone variant, named the way timm
names its tags, ``<variant>.<tag>`` (``mobilevitv2_100.cvnets_in1k``). It says where the file comes from,
where the suite reads it, which key mapping of :mod:`backbones.weights` converts it, and how images were
prepared for it (:class:`Preprocessing`: mean, std, input size, evaluation resize and crop, interpolation):
what timm keeps in a ``pretrained_cfg`` and torchvision in a ``Weights`` enum's ``transforms`` and ``meta``.

A backbone's ``pretrained`` (and the classifier's ``weights``) is an entry's name or a checkpoint file. What
a file says about its input is read by :func:`backbones.weights.preprocessing_of`, which knows the file
formats; this module only holds the registry and reads no file, so :mod:`backbones.weights` imports it and
not the other way round. Which input a model takes, with the values a user gives, is decided once by
:func:`datamodules.input_spec.resolve_preprocessing`.

A name's file is downloaded once from the entry's ``url`` into a cache and reused offline
(:func:`backbones.download.fetch_weights`: ``$SUITE_WEIGHTS_DIR``, else torch.hub's cache; ``SUITE_OFFLINE=1``
forbids downloading). A file put by hand at the entry's ``file`` (relative to the working directory) is read
first: CVNets' model-zoo file as it is, or, for a timm tag, ``torch.save(timm.create_model(name,
pretrained=True).state_dict(), file)``. The file's path itself may be passed as ``pretrained`` too.

Adding weights: one :func:`register_weights` call below, with the source of each fact.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from layers.registry import Registry

Triple = tuple[float, float, float]

#: ImageNet's channel mean and std of pixels in [0, 1] (torchvision's and timm's IMAGENET_DEFAULT_*); the suite's
#: one copy: the datamodules normalise with it where no weights say otherwise
IMAGENET_MEAN: Triple = (0.485, 0.456, 0.406)
IMAGENET_STD: Triple = (0.229, 0.224, 0.225)
#: pixels in [0, 1] as they are: CVNets trains without normalising (its ``ToTensor`` only divides by 255)
UNNORMALISED_MEAN: Triple = (0.0, 0.0, 0.0)
UNNORMALISED_STD: Triple = (1.0, 1.0, 1.0)
#: Inception's normalisation to [-1, 1] (timm's IMAGENET_INCEPTION_*; Google's ViT and Mixer releases)
INCEPTION_MEAN: Triple = (0.5, 0.5, 0.5)
INCEPTION_STD: Triple = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class Preprocessing:
    """How images were prepared for a set of weights: pixels scaled to [0, 1], then ``(x - mean) / std``;
    evaluated at ``input_size`` squared, centre-cropped after resizing the short side to ``resize_size``
    with ``interpolation``. Sizes are ``None`` where unknown."""

    mean: Triple
    std: Triple
    input_size: int | None = None
    resize_size: int | None = None
    interpolation: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "mean", tuple(float(v) for v in self.mean))
        object.__setattr__(self, "std", tuple(float(v) for v in self.std))

    @classmethod
    def of_crop_pct(cls, mean: Triple, std: Triple, input_size: int, crop_pct: float,
                    interpolation: str) -> "Preprocessing":
        """From timm's terms: the short side resized to ``input_size / crop_pct``, rounded down as timm does."""
        return cls(mean, std, input_size, math.floor(input_size / crop_pct), interpolation)

    @classmethod
    def from_input_spec(cls, spec: Mapping[str, Any]) -> "Preprocessing":
        """From the input specification a checkpoint of this suite stores (``checkpoint["input_spec"]``, the
        plain values of :meth:`datamodules.input_spec.InputSpec.to_dict`). Only a centre-crop policy has a
        short side to resize to before the crop; the others' ``resize_size`` means something else."""
        center_crop = spec.get("resize") == "center_crop"
        return cls(spec["mean"], spec["std"], spec.get("image_size"),
                   spec.get("resize_size") if center_crop else None, spec.get("interpolation"))


@dataclass(frozen=True)
class PretrainedWeights:
    """One set of weights of one backbone variant.

    Args:
        name: ``<variant>.<tag>``, the name ``pretrained`` takes.
        backbone: the registered backbone (:mod:`backbones.registry`) and ``arguments``, the constructor
            arguments of the variant the weights fit.
        converter: the source naming :mod:`backbones.weights` converts (``"cvnets"``, ``"timm"``; ``"ours"``:
            a checkpoint of this suite).
        url: where the file is published (CVNets' model zoo; for timm, its Hugging Face hub id; for ours, the
            recipe that trains it).
        file: where a file put by hand is read, relative to the working directory (before the download cache).
        preprocessing: the input the weights were trained on.
        sha256: the published hash of the file at ``url`` (for a timm tag, of the hub's ``model.safetensors``),
            checked on download; ``None`` where none is published.
    """

    name: str
    backbone: str
    converter: str
    url: str
    file: str
    preprocessing: Preprocessing
    arguments: Mapping[str, Any] = field(default_factory=dict)
    sha256: str | None = None


#: name -> entry; filled by :func:`register_weights`
PRETRAINED: Registry[PretrainedWeights] = Registry("pretrained weights")


def register_weights(entry: PretrainedWeights) -> PretrainedWeights:
    return PRETRAINED.add(entry.name, entry)


def find_weights(pretrained: str | None) -> PretrainedWeights | None:
    """The entry named ``pretrained``; ``None`` for a file path (or ``None``). A value that is neither a
    registered name nor an existing file is refused, naming the closest registered names."""
    if not pretrained:
        return None
    if pretrained in PRETRAINED:
        return PRETRAINED.get(pretrained)
    if Path(pretrained).expanduser().is_file() or "/" in pretrained or "\\" in pretrained:
        return None  # a path: a missing file is reported where it is read, with what to do
    entry = timm_weights(pretrained) if "." in pretrained else None  # a tag, never a bare architecture
    if entry is not None:
        return entry
    close = difflib.get_close_matches(pretrained.lower(), PRETRAINED.names(), n=3)
    raise ValueError(f"{pretrained!r} names neither registered weights (closest: "
                     f"{', '.join(close) if close else 'none; see backbones/pretrained.py'}) nor a file")


def timm_weights(name: str) -> PretrainedWeights | None:
    """The entry of timm's pretrained tag ``name`` (``convnext_atto.d2_in1k``; an architecture alone names its
    default tag), registered on first use; ``None`` when timm has no such tag with downloadable weights.

    Every fact is the tag's ``pretrained_cfg`` in the installed timm (timm/models/<family>.py,
    ``default_cfgs``): mean, std, ``input_size``, ``crop_pct`` and ``interpolation`` give the preprocessing
    (:meth:`Preprocessing.of_crop_pct`), ``hf_hub_id`` (else ``url``) where the file is downloaded. The
    backbone is :class:`backbones.timm_backbone.Timm` of the tag's architecture."""
    if name in PRETRAINED:
        return PRETRAINED.get(name)
    try:
        import timm.models
    except ImportError:
        return None
    arch = timm.models.get_arch_name(name)
    if not timm.models.is_model(arch):
        return None
    try:
        cfg = timm.models.get_pretrained_cfg(name, allow_unregistered=False)
    except RuntimeError:  # an unknown tag of a known architecture, or an architecture without tags
        return None
    source = cfg.hf_hub_id or cfg.url
    if not source:
        return None
    full = name if "." in name else f"{arch}.{cfg.tag}" if cfg.tag else arch
    if full in PRETRAINED:
        return PRETRAINED.get(full)
    return register_weights(PretrainedWeights(
        name=full, backbone="timm", arguments={"name": arch}, converter="timm", url=source,
        file=f"checkpoints/timm/{full}.pth",
        preprocessing=Preprocessing.of_crop_pct(cfg.mean, cfg.std, cfg.input_size[-1], cfg.crop_pct,
                                                cfg.interpolation)))


def weights_file(pretrained: str) -> Path:
    """Where ``pretrained`` is placed by hand: a registered entry's ``file``, or the path itself. It reads no
    file and downloads nothing; the file an entry is read from is :func:`backbones.download.fetch_weights`'s."""
    entry = find_weights(pretrained)
    return Path(entry.file if entry is not None else pretrained).expanduser()


# -- CVNets' ImageNet-1k classifiers at 256 x 256 ----------------------------------------------------------------
# Files and URLs: CVNets docs/source/en/general/README-model-zoo.md. Preprocessing: CVNets feeds [0, 1] pixels
# (data/transforms/image_pil.py ToTensor, no normalisation); 256 x 256 crops, bicubic; the evaluation resize is
# timm's pretrained_cfg for the same weights (timm/models/mobilevit.py, crop_pct 0.9 for MobileViT, 0.888 for
# MobileViTv2: 288 -> 256, the resize of CVNets' config/classification/imagenet/mobilevit_v2.yaml).
# CVNets publishes no hash of its files (the model-zoo page lists addresses only): sha256 stays None.
CVNETS_ZOO = "https://docs-assets.developer.apple.com/ml-research/models"

for _size in ("xxs", "xs", "s"):
    register_weights(PretrainedWeights(
        name=f"mobilevit_{_size}.cvnets_in1k", backbone="mobilevit", arguments={"size": _size}, converter="cvnets",
        url=f"{CVNETS_ZOO}/cvnets/classification/mobilevit_{_size}.pt",
        file=f"checkpoints/imagenet1k_256/mobilevit_{_size}.pt",
        preprocessing=Preprocessing.of_crop_pct(UNNORMALISED_MEAN, UNNORMALISED_STD, 256, 0.9, "bicubic")))

for _width in (0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0):
    register_weights(PretrainedWeights(
        name=f"mobilevitv2_{round(_width * 100):03d}.cvnets_in1k", backbone="mobilevitv2",
        arguments={"width": _width}, converter="cvnets",
        url=f"{CVNETS_ZOO}/cvnets-v2/classification/mobilevitv2/imagenet1k/256x256/mobilevitv2-{_width}.pt",
        file=f"checkpoints/imagenet1k_256/mobilevitv2-{_width}.pt",
        preprocessing=Preprocessing.of_crop_pct(UNNORMALISED_MEAN, UNNORMALISED_STD, 256, 0.888, "bicubic")))

# -- made by this suite's recipes (their EMA checkpoints, copied to ``file``) -------------------------------------
# Never downloaded: ``url`` names the recipe that makes them.
# ImageNet-21k-P pre-training and its ImageNet-1k fine-tuning: the recipes' own inputs (no normalisation,
# 256 x 256 bicubic crops, evaluation resize 288), which the checkpoints also store.
for _width in (1.5, 1.75, 2.0):
    _variant = f"mobilevitv2_{round(_width * 100):03d}"
    for _tag, _folder, _recipe in (("suite_in21k_p", "imagenet21k_p", "imagenet21kp"),
                                   ("suite_in21k_p_ft_in1k", "imagenet21k_p_ft1k_256", "imagenet21kp_ft1k")):
        register_weights(PretrainedWeights(
            name=f"{_variant}.{_tag}", backbone="mobilevitv2", arguments={"width": _width}, converter="ours",
            url=f"configs/classify/{_recipe}_{_variant}.yaml",
            file=f"checkpoints/{_folder}/mobilevitv2-{_width}.ckpt",
            preprocessing=Preprocessing(UNNORMALISED_MEAN, UNNORMALISED_STD, 256, 288, "bicubic")))

# -- timm tags of the other families -----------------------------------------------------------------------------
# Every value is the tag's pretrained_cfg in timm 1.0 (timm/models/{convmixer,vision_transformer,mlp_mixer}.py).
# Downloaded from the Hugging Face hub repo ``url`` names (timm's hf_hub_id), model.safetensors as timm's loader
# prefers it. The hub publishes each file's sha256 (its LFS object id); it is not recorded here yet (it cannot be
# read without the network), so the download is checked for completeness only until ``sha256=`` is filled in.
for _name, _backbone, _arguments, _preprocessing in (
    ("convmixer_768_32.in1k", "convmixer",
     {"dim": 768, "depth": 32, "kernel_size": 7, "patch_size": 7, "act": "relu"},
     Preprocessing.of_crop_pct(IMAGENET_MEAN, IMAGENET_STD, 224, 0.96, "bicubic")),
    ("deit_tiny_patch16_224.fb_in1k", "vit", {"size": "tiny", "patch_size": 16, "img_size": 224},
     Preprocessing.of_crop_pct(IMAGENET_MEAN, IMAGENET_STD, 224, 0.9, "bicubic")),
    ("deit_small_patch16_224.fb_in1k", "vit", {"size": "small", "patch_size": 16, "img_size": 224},
     Preprocessing.of_crop_pct(IMAGENET_MEAN, IMAGENET_STD, 224, 0.9, "bicubic")),
    ("vit_small_patch16_224.augreg_in21k_ft_in1k", "vit", {"size": "small", "patch_size": 16, "img_size": 224},
     Preprocessing.of_crop_pct(INCEPTION_MEAN, INCEPTION_STD, 224, 0.9, "bicubic")),
    ("mixer_b16_224.goog_in21k_ft_in1k", "mlp_mixer", {"size": "base", "patch_size": 16, "img_size": 224},
     Preprocessing.of_crop_pct(INCEPTION_MEAN, INCEPTION_STD, 224, 0.875, "bicubic")),
):
    register_weights(PretrainedWeights(name=_name, backbone=_backbone, arguments=_arguments, converter="timm",
                                       url=f"timm/{_name}", file=f"checkpoints/timm/{_name}.pth",
                                       preprocessing=_preprocessing))
