"""Any timm architecture as a suite backbone: ``--model.backbone Timm --model.backbone.name convnext_atto``.

The network is ``timm.create_model(name, num_classes=0)``: timm's whole model without its classifier, so
its own names and weights are kept (``model.<timm key>``). The backbone contract (:mod:`backbones.base`)
reads it through timm's public interface:

- ``forward_pooled(x)``: ``model(x)``, timm's pre-logits embedding (global pool, and the final norm or
  ``conv_head`` where the architecture has one: what timm's classifier reads), ``(B, num_features)``;
- ``forward(x)``: ``{stride: map}`` of the feature maps timm lists in ``model.feature_info`` (each entry's
  ``reduction`` and ``num_chs``), taken with ``model.forward_intermediates``; where several maps share a
  stride (a dilated stage, a ViT's blocks) the deepest is kept, as for the suite's own backbones;
- ``output_stride`` 8 or 16 goes to timm's constructor, which dilates the stages past it (ResNet, ConvNeXt,
  EfficientNet, MobileNetV3/V4, RegNet, ...); an architecture whose constructor does not take it is refused
  by name;
- ``repeated_blocks`` and ``layer_order`` come from timm's ``group_matcher(coarse=False)``: the block
  modules it numbers are the units of regional compile, activation checkpointing and FSDP, and its layer
  ordinals (timm's ``param_groups_layer_decay``) those of layer-wise decay.

Preprocessing: ``pretrained`` names a timm tag (``convnext_atto.d2_in1k``; an architecture alone means its
default tag) or a file. A tag is an entry of :mod:`backbones.pretrained` made from the tag's
``pretrained_cfg`` (:func:`backbones.pretrained.timm_weights`), so the datamodule normalises with the tag's
mean and std exactly as for the suite's own weights, and the file is fetched once into the weights cache
(:mod:`backbones.download`), then loaded by timm's own loader (its per-architecture key filter). Without
``pretrained`` the network starts from random weights and the data keeps its defaults (ImageNet's mean and
std). A checkpoint of a task rebuilds the network with ``pretrained=None``: nothing is read or fetched.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn as nn

from backbones.base import Backbone
from backbones.registry import register_backbone
from backbones.weights import read_weights_file, register_converter, state_dict_in

class TimmRefusal(ValueError):
    """An architecture that cannot do what was asked (a task, an output stride); the message names it and why."""


class InputSizeRefusal(TimmRefusal):
    """An input size the architecture's own code rejects (a kernel larger than a valid-padded map, a grid its
    attention windows or fixed position tables do not divide); ``size``: a side it takes (the smallest its
    ``pretrained_cfg`` records, else the one it was made for)."""

    def __init__(self, message: str, size: int):
        super().__init__(message)
        self.size = size


#: the messages torch gives when a timm network meets a map of a size it cannot take (besides timm's own asserts)
_SIZE_ERRORS = re.compile(r"Kernel size can't be greater|must match the size of tensor|divisible|"
                          r"is invalid for input of size|Input (height|width|image size)")


def timm_family(name: str) -> str:
    """The module of ``timm.models`` that defines architecture ``name`` (``convnext``, ``efficientnet``)."""
    import timm.models

    arch = timm.models.get_arch_name(name)
    if not timm.models.is_model(arch):
        import difflib

        close = difflib.get_close_matches(arch, timm.list_models(), n=3)
        raise ValueError(f"timm has no architecture {arch!r} (closest: {', '.join(close) or 'none'}); "
                         "timm.list_models() lists them")
    return timm.models._registry._model_to_module[arch]


@register_backbone("timm")
class Timm(Backbone):
    """A timm architecture (see the module docstring).

    Args:
        name: timm's architecture name (``timm.list_models()``), e.g. ``convnext_atto``, ``efficientnet_b0``,
            ``mobilenetv4_conv_small``.
        pretrained: a timm tag (``convnext_atto.d2_in1k``, or the architecture for its default tag), a
            state-dict file (timm's naming, or a checkpoint of this suite), or ``None`` for random weights.
        output_stride: 32, or 16 / 8 where timm dilates the architecture (DeepLab-style segmentation).
        in_chans: input channels.
        drop_path_rate: timm's stochastic depth rate.
        img_size: the input size for architectures timm marks ``fixed_input_size`` (position embeddings of
            one grid: ViT, Swin, ...); the CLI links it to the data's ``image_size``. Ignored otherwise.
        features_only: drop what only ``forward_pooled`` reads (timm's final norm / ``conv_head``, by its
            ``prune_intermediate_layers``), for detection and segmentation under DDP, which refuses parameters
            without gradients; ``forward_pooled`` then averages the deepest map.
    """

    def __init__(self, name: str, pretrained: str | None = None, output_stride: int = 32, in_chans: int = 3,
                 drop_path_rate: float = 0.0, img_size: int | None = None, features_only: bool = False):
        super().__init__()
        try:
            import timm
            import timm.models
        except ImportError as err:
            raise ImportError("backbones.Timm needs timm: pip install -e '.[timm]'") from err

        self.family = timm_family(name)
        self.name = name
        self.in_chans = in_chans
        if output_stride not in (8, 16, 32):
            raise ValueError(f"output_stride must be 8, 16 or 32, got {output_stride}")
        kwargs = {"num_classes": 0, "in_chans": in_chans}
        if drop_path_rate:
            kwargs["drop_path_rate"] = drop_path_rate
        if output_stride != 32:
            kwargs["output_stride"] = output_stride
        default_cfg = timm.models.get_pretrained_cfg(name)
        fixed = bool(getattr(default_cfg, "fixed_input_size", False))
        if fixed and img_size is not None:
            kwargs["img_size"] = img_size
        if fixed:  # position embeddings resampled to each input's grid, where the architecture can (ViT, ...)
            kwargs["dynamic_img_size"] = True
        model_name, suite_weights = name, None
        if pretrained:
            model_name, suite_weights = self._pretrained_source(name, pretrained, kwargs)
        self.model = self._create(model_name, kwargs, output_stride)
        self.output_stride = output_stride
        self.num_features = int(getattr(self.model, "head_hidden_size", None) or self.model.num_features)
        self._fixed_input_size = fixed and not kwargs.get("dynamic_img_size")
        built = img_size if img_size is not None else getattr(default_cfg, "input_size", (3, 224, 224))[-1]
        self._built_size = tuple(built) if isinstance(built, (list, tuple)) else (built, built)
        self.fixed_size_reason = (f"timm's {name} marks itself fixed_input_size (position embeddings of one grid; "
                                  f"built for {getattr(self.model, 'img_size', img_size)})")
        self._describe_features()
        self.features_only = False
        if features_only:
            self._prune_head()
        self.repeated_blocks = self._block_types()
        if suite_weights is not None:
            Backbone.load_pretrained(self, suite_weights)

    # -- construction ----------------------------------------------------------------------------------------
    def _create(self, model_name: str, kwargs: dict, output_stride: int) -> nn.Module:
        """``timm.create_model``; without ``dynamic_img_size`` where the architecture does not take it (then it
        runs at one size), and without ``output_stride`` where its deepest map is no deeper than that anyway (a
        ViT/16 at 16). An architecture that cannot dilate to ``output_stride`` is refused by name."""
        import timm

        try:
            return timm.create_model(model_name, **kwargs)
        except TypeError as err:
            if "dynamic_img_size" in str(err) and kwargs.pop("dynamic_img_size", None):
                return self._create(model_name, kwargs, output_stride)
            if "output_stride" not in kwargs:
                raise
            refusal = err
        except (AssertionError, NotImplementedError, ValueError) as err:
            if "output_stride" not in kwargs:
                raise
            refusal = err
        kwargs.pop("output_stride")
        model = self._create(model_name, kwargs, 32)
        deepest = max((int(entry["reduction"]) for entry in getattr(model, "feature_info", None) or []), default=32)
        if deepest <= output_stride:
            return model
        raise TimmRefusal(f"timm's {self.name} ({self.family}) cannot run at output_stride {output_stride}: it "
                          f"does not dilate ({type(refusal).__name__}: {refusal}); use output_stride 32, or read "
                          f"a shallower map (segmentation heads: in_stride)")

    def _pretrained_source(self, name: str, pretrained: str, kwargs: dict) -> tuple[str, str | None]:
        """Where the weights come from: (the model name to build, a suite checkpoint to load after it). A timm
        tag or a timm-format file goes to timm's loader (``pretrained_cfg_overlay``'s ``file``: timm's key
        filter for the architecture runs, the classifier is dropped); a suite checkpoint is loaded after."""
        from backbones.download import fetch_weights
        from backbones.pretrained import timm_weights

        entry = None if Path(pretrained).expanduser().is_file() else timm_weights(pretrained)
        if entry is not None and entry.name != pretrained:
            raise ValueError(f"pretrained={pretrained} names an architecture, not weights: write pretrained="
                             f"{entry.name} (its default tag; timm.list_pretrained('{pretrained}*') lists the others)")
        if entry is not None:
            import timm.models

            if timm.models.get_arch_name(entry.name) != timm.models.get_arch_name(name):
                raise ValueError(f"pretrained={pretrained} are weights of timm's {entry.arguments['name']}, "
                                 f"not of {name}")
            kwargs.update(pretrained=True, pretrained_cfg_overlay={"file": str(fetch_weights(entry))})
            return entry.name, None
        path = Path(pretrained).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"pretrained={pretrained} is neither a timm tag of {name} (timm.list_pretrained"
                                    f"('{name}*') lists them) nor a file")
        keys = state_dict_in(read_weights_file(path, mmap=True))
        if any(k.startswith("backbone.") or k.startswith("model.") for k in keys):
            return name, str(path)  # this suite's checkpoint or bare state dict
        kwargs.update(pretrained=True, pretrained_cfg_overlay={"file": str(path)})
        return name, None

    def _describe_features(self) -> None:
        """``feature_channels`` and the ``forward_intermediates`` indices of the deepest map at each stride,
        from timm's ``feature_info`` (strides capped at the output stride: timm lists nominal reductions)."""
        info = getattr(self.model, "feature_info", None) or []
        self._dense_reason = None
        if not hasattr(self.model, "forward_intermediates"):
            self._dense_reason = "has no forward_intermediates (timm gives no feature maps of it)"
        elif not info:
            self._dense_reason = "lists no feature_info (no spatial features)"
        self._indices: list[int] = []
        self._strides: list[int] = []
        channels: dict[int, int] = {}
        deepest: dict[int, int] = {}
        for index, entry in enumerate(info):
            stride = min(int(entry["reduction"]), self.output_stride)
            channels[stride] = int(entry["num_chs"])
            deepest[stride] = index
        for stride in sorted(deepest):
            self._indices.append(deepest[stride])
            self._strides.append(stride)
        self._channels = {s: channels[s] for s in sorted(channels)}

    def _prune_head(self) -> None:
        prune = getattr(self.model, "prune_intermediate_layers", None)
        if prune is None or self._dense_reason:
            raise TimmRefusal(f"timm's {self.name} ({self.family}) cannot drop its head: it has no "
                              "prune_intermediate_layers; leave features_only false")
        prune(self._indices, prune_norm=False, prune_head=True)
        self.features_only = True

    def _group_matcher(self):
        matcher = getattr(self.model, "group_matcher", None)
        return matcher(coarse=False) if matcher is not None else None

    def _block_types(self) -> tuple[type[nn.Module], ...]:
        """The classes of the modules timm's ``group_matcher`` numbers as blocks (whole module names that one
        of its block patterns matches, outermost): ConvNeXt's ``stages.i.blocks.j``, EfficientNet's
        ``blocks.i.j``, ViT's ``blocks.i``."""
        matcher = self._group_matcher()
        if not isinstance(matcher, dict) or matcher.get("blocks") is None:
            return ()
        spec = matcher["blocks"]
        # (pattern, suffix) entries with timm's MATCH_PREV_GROUP suffix are the head parts joined to the last block
        patterns = ([re.compile(s[0]) for s in spec if s[1] is None] if isinstance(spec, (list, tuple))
                    else [re.compile(spec)])
        types: dict[type[nn.Module], None] = {}
        taken: list[str] = []
        for name, module in self.model.named_modules():
            if not name or any(name.startswith(prefix + ".") for prefix in taken):
                continue
            for pattern in patterns:
                found = pattern.match(name)
                if found and found.end() == len(name) and any(p.requires_grad for p in module.parameters()):
                    types.setdefault(type(module))
                    taken.append(name)
                    break
        # a class that also appears as a plain part elsewhere (nn.Sequential) would compile too much
        return tuple(t for t in types if t not in (nn.Sequential, nn.ModuleList, nn.Identity))

    # -- the backbone contract -------------------------------------------------------------------------------
    @property
    def feature_channels(self) -> dict[int, int]:
        if self._dense_reason:
            raise TimmRefusal(f"timm's {self.name} ({self.family}) {self._dense_reason}: it can classify, but "
                              "detection and segmentation need its feature maps")
        return dict(self._channels)

    @property
    def size_multiple(self) -> int | None:
        if self._fixed_input_size:
            return None
        return max(self._strides) if self._strides else 32

    def check_input(self, x: torch.Tensor) -> None:
        super().check_input(x)
        if self._fixed_input_size and self._built_size and tuple(x.shape[-2:]) != self._built_size:
            raise ValueError(f"timm's {self.name} ({self.family}) takes only {self._built_size[0]}x"
                             f"{self._built_size[1]} inputs (fixed-size position embeddings, no resampling), "
                             f"got {tuple(x.shape[-2:])}: set img_size (the CLI links it to data.image_size)")

    def forward(self, x: torch.Tensor) -> dict[int, torch.Tensor]:
        """(B, in_chans, H, W) -> ``{stride: (B, C_s, H/s, W/s)}`` (see ``feature_channels``)."""
        self.check_input(x)
        channels = self.feature_channels  # refuses architectures without feature maps
        maps = self._run(self.model.forward_intermediates, x, indices=self._indices, intermediates_only=True)
        if len(maps) != len(self._strides):
            raise TimmRefusal(f"timm's {self.name} ({self.family}) gave {len(maps)} maps for feature_info indices "
                              f"{self._indices}: its forward_intermediates does not index feature_info")
        features = dict(zip(self._strides, maps))
        for stride, fmap in features.items():
            if fmap.ndim != 4 or fmap.shape[1] != channels[stride]:
                raise TimmRefusal(f"timm's {self.name} ({self.family}) gave a {tuple(fmap.shape)} map at stride "
                                  f"{stride}, not (B, {channels[stride]}, H, W): no NCHW feature maps")
        return features

    def forward_pooled(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> (B, num_features): timm's pre-logits embedding (with ``features_only``, the
        average of the deepest map)."""
        self.check_input(x)
        if self.features_only:
            return super().forward_pooled(x)
        return self._run(self.model, x)

    def _run(self, call, x: torch.Tensor, **kwargs):
        """``call(x, **kwargs)``, with an input size timm's network rejects raised as :class:`InputSizeRefusal`
        naming the architecture, the size and the size it was made for (its ``pretrained_cfg``), not as an
        error from deep inside timm."""
        if torch.compiler.is_compiling():
            return call(x, **kwargs)
        try:
            return call(x, **kwargs)
        except (AssertionError, RuntimeError) as err:
            if isinstance(err, RuntimeError) and not _SIZE_ERRORS.search(str(err)):
                raise
            cfg = getattr(self.model, "pretrained_cfg", None) or {}
            made = int((cfg.get("input_size") or (3, 224, 224))[-1])
            smallest = cfg.get("min_input_size")
            at_least = f", at least {smallest[-1]}" if smallest else ""
            detail = f"{type(err).__name__}: {str(err).splitlines()[0]}" if str(err) else type(err).__name__
            raise InputSizeRefusal(
                f"timm's {self.name} ({self.family}) cannot take {x.shape[-2]}x{x.shape[-1]} inputs ({detail}); it "
                f"was made for {made}x{made}{at_least}: set data.image_size (segmentation: data.crop_size)",
                int(smallest[-1]) if smallest else made) from err

    def layer_order(self, name: str) -> tuple[int, ...] | None:
        """timm's layer id of parameter ``model.<key>`` under ``group_matcher(coarse=False)`` (what its
        ``param_groups_layer_decay`` uses); ``None`` (the head's layer) for what the matcher leaves unmatched,
        which timm puts in the classifier's layer."""
        key = name[len("model."):] if name.startswith("model.") else name
        if not self._matched(key):
            return None
        layers = self.__dict__.get("_layers")
        if layers is None:
            from timm.models import group_parameters

            layers = self.__dict__["_layers"] = group_parameters(self.model, self._group_matcher(), reverse=True)
        return (layers[key],)

    def _matched(self, key: str) -> bool:
        matcher = self._group_matcher()
        if matcher is None:
            return False
        if not isinstance(matcher, dict):  # a function gives every parameter an ordinal
            return True
        specs = [spec for spec in matcher.values() if spec is not None]
        patterns = [p for spec in specs for p in ([s[0] for s in spec] if isinstance(spec, (list, tuple)) else [spec])]
        return any(re.match(pattern, key) for pattern in patterns)


def _timm_keys(state_dict, backbone: nn.Module):
    """timm's naming -> canonical: ``<key>`` -> ``backbone.model.<key>``, the classifier to ``head.fc``."""
    classifier = (getattr(backbone.model, "pretrained_cfg", {}) or {}).get("classifier") or "classifier"
    prefixes = (classifier,) if isinstance(classifier, str) else tuple(classifier)
    out = {}
    for key, value in state_dict.items():
        head = next((p for p in prefixes if key.startswith(p + ".")), None)
        out[f"head.fc.{key[len(head) + 1:]}" if head else f"backbone.model.{key}"] = value
    return out


# a timm state dict (no ``backbone.`` prefix, no ``model.`` prefix): the whole classifier, e.g. --model.weights
register_converter("timm", "timm", detect=lambda sd: not any(k.startswith(("backbone.", "model.")) for k in sd))(
    _timm_keys)
