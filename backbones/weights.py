"""Pretrained-weight import: our Lightning checkpoints, timm state dicts, apple/ml-cvnets checkpoints.

Everything is converted to one *canonical* naming first::

    backbone.<key of our backbone's state_dict>    head.fc.weight    head.fc.bias

``convert_checkpoint(path, backbone)`` returns that dict (the classification task
takes its classifier from it with :func:`classifier_state`);
``load_pretrained(backbone, path)`` loads its backbone part, refusing with the
lists of missing / unexpected / misshaped keys when it does not fit.

Foreign formats are recognised per backbone by registered converters, so a
backbone file adds its own mapping without touching this one::

    @register_converter("vit", "timm", detect=lambda sd: "cls_token" in sd)
    def _vit_from_timm(state_dict, backbone):
        return {...canonical keys...}

Files are read with ``torch.load(weights_only=True)``: tensors and plain
containers only, never arbitrary pickled code.
"""
from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Callable, Mapping

import torch
import torch.nn as nn

from backbones.registry import get_backbone_class, list_backbones

StateDict = dict[str, torch.Tensor]
Converter = Callable[[StateDict, nn.Module], StateDict]
Detector = Callable[[Mapping[str, torch.Tensor]], bool]

_CONVERTERS: dict[str, dict[str, tuple[Detector, Converter]]] = {}

#: keys that a checkpoint may lack without harm (BatchNorm's step counter)
OPTIONAL_SUFFIXES = ("num_batches_tracked",)


def register_converter(backbone: str, source: str, detect: Detector) -> Callable[[Converter], Converter]:
    """Register ``fn(state_dict, backbone_module) -> canonical dict`` for checkpoints of
    ``source`` (e.g. "timm", "cvnets") that ``detect(state_dict)`` recognises."""

    def decorator(fn: Converter) -> Converter:
        _CONVERTERS.setdefault(backbone.lower(), {})[source] = (detect, fn)
        return fn

    return decorator


def rename_keys(state_dict: Mapping[str, torch.Tensor], rules: list[tuple[str, str]]) -> StateDict:
    """Apply regex ``(pattern, replacement)`` rules in order to every key (all that match, in turn)."""
    out = {}
    for key, value in state_dict.items():
        for pattern, replacement in rules:
            key = re.sub(pattern, replacement, key)
        out[key] = value
    return out


def backbone_name(backbone: nn.Module) -> str:
    for name in list_backbones():
        if get_backbone_class(name) is type(backbone):
            return name
    valid = ", ".join(list_backbones())
    raise KeyError(f"{type(backbone).__name__} is not a registered backbone; valid names: {valid}")


def read_state_dict(path: str | Path) -> StateDict:
    """Tensors of a checkpoint file, unwrapping Lightning (``state_dict``), trainer
    (``model``/``state_dict_ema``-less ``state_dict``) and DDP (``module.``) wrappers."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # weights_only refuses pickled objects other than tensors/containers
        raise ValueError(
            f"cannot read {path} with torch.load(weights_only=True): {err}. "
            "Save a plain state dict (torch.save(model.state_dict(), path)) and load that."
        ) from err
    for wrapper in ("state_dict", "model"):
        if isinstance(obj, Mapping) and isinstance(obj.get(wrapper), Mapping):
            obj = obj[wrapper]
            break
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{path} holds no state dict (a mapping of names to tensors)")
    if all(k.startswith("module.") for k in obj):
        obj = {k[len("module.") :]: v for k, v in obj.items()}
    return dict(obj)


def convert_state_dict(state_dict: Mapping[str, torch.Tensor], backbone: nn.Module) -> StateDict:
    """Any supported naming -> canonical naming (``backbone.*``, ``head.fc.*``), shapes fitted to ``backbone``."""
    name = backbone_name(backbone)
    own = backbone.state_dict()
    if any(k.startswith("backbone.") for k in state_dict):  # ours (a Lightning task's state dict)
        canonical = {k: v for k, v in state_dict.items() if k.startswith(("backbone.", "head."))}
    elif set(state_dict) <= set(own):  # a bare state dict of our backbone
        canonical = {f"backbone.{k}": v for k, v in state_dict.items()}
    else:
        converters = _CONVERTERS.get(name, {})
        matches = [(src, fn) for src, (detect, fn) in converters.items() if detect(state_dict)]
        if not matches:
            sample = ", ".join(list(state_dict)[:5])
            raise ValueError(
                f"unrecognised checkpoint naming for backbone {name!r} (first keys: {sample}); "
                f"expected our keys (backbone.*) or one of: {', '.join(converters) or 'no registered converters'}"
            )
        canonical = matches[0][1](dict(state_dict), backbone)
    return _fit_shapes(canonical, own)


def convert_checkpoint(path: str | Path, backbone: nn.Module) -> StateDict:
    """Read ``path`` (ours, timm or CVNets) and return the canonical state dict for ``backbone``."""
    return convert_state_dict(read_state_dict(path), backbone)


def _fit_shapes(canonical: StateDict, own: Mapping[str, torch.Tensor]) -> StateDict:
    """1x1 convolutions of the references are Linear layers here: (O, I, 1, 1) -> (O, I)."""
    out = {}
    for key, value in canonical.items():
        target = own.get(key[len("backbone.") :]) if key.startswith("backbone.") else None
        if target is not None and value.shape != target.shape and value.numel() == target.numel():
            if [d for d in value.shape if d != 1] == [d for d in target.shape if d != 1]:
                value = value.reshape(target.shape)
        out[key] = value
    return out


def check_fit(state_dict: Mapping[str, torch.Tensor], module: nn.Module, source: str) -> None:
    """Raise a ValueError listing missing, unexpected and misshaped keys, if any."""
    own = module.state_dict()
    missing = [k for k in own if k not in state_dict and not k.endswith(OPTIONAL_SUFFIXES)]
    unexpected = [k for k in state_dict if k not in own]
    misshaped = [
        f"{k}: checkpoint {tuple(state_dict[k].shape)} vs model {tuple(own[k].shape)}"
        for k in state_dict
        if k in own and state_dict[k].shape != own[k].shape
    ]
    if missing or unexpected or misshaped:

        def show(items: list[str]) -> str:
            return ", ".join(items[:20]) + (f", ... ({len(items)} in all)" if len(items) > 20 else "") or "none"

        raise ValueError(
            f"{source} does not fit {type(module).__name__}:\n"
            f"  missing keys: {show(missing)}\n"
            f"  unexpected keys: {show(unexpected)}\n"
            f"  shape mismatches: {show(misshaped)}"
        )


def load_pretrained(backbone: nn.Module, path: str | Path) -> StateDict:
    """Load the backbone weights of checkpoint ``path`` into ``backbone`` (strictly).

    Returns the canonical head entries of the checkpoint (``head.*``, possibly
    empty), which the backbone itself ignores.
    """
    canonical = convert_checkpoint(path, backbone)
    weights = {k[len("backbone.") :]: v for k, v in canonical.items() if k.startswith("backbone.")}
    # a backbone may fit tensors to its own shapes where that is well defined before the strict
    # check (ViT resamples position embeddings made for another resolution)
    adapt = getattr(backbone, "adapt_checkpoint", None)
    if adapt is not None:
        weights = adapt(weights)
    check_fit(weights, backbone, str(path))
    backbone.load_state_dict(weights, strict=False)  # strict apart from OPTIONAL_SUFFIXES, checked above
    return {k: v for k, v in canonical.items() if k.startswith("head.")}


def classifier_state(canonical: Mapping[str, torch.Tensor], num_classes: int, prefix: str = "head.fc.") -> StateDict:
    """The classifier's ``{"weight", "bias"}`` from a canonical dict, or ``{}`` (with a
    warning) when the checkpoint has none or was trained for another class count."""
    weight, bias = canonical.get(prefix + "weight"), canonical.get(prefix + "bias")
    if weight is None:
        return {}
    if weight.shape[0] != num_classes:
        warnings.warn(
            f"checkpoint classifier has {weight.shape[0]} classes, the model {num_classes}: "
            "dropping the classifier weights (it starts from scratch)",
            stacklevel=2,
        )
        return {}
    return {"weight": weight} | ({"bias": bias} if bias is not None else {})


# --------------------------------------------------------------------------- MobileViT v1 / v2
# timm (byobnet naming) -> ours. Shared by both families; v1-only names simply never match in v2.
_TIMM_MOBILEVIT_RULES = [
    (r"^(stages\.\d+\.\d+)\.conv1_1x1\.", r"\1.expand."),
    (r"^(stages\.\d+\.\d+)\.conv2_kxk\.", r"\1.depthwise."),
    (r"^(stages\.\d+\.\d+)\.conv3_1x1\.", r"\1.project."),
    (r"^(stages\.\d+\.\d+)\.conv_kxk\.", r"\1.local_conv."),
    (r"^(stages\.\d+\.\d+)\.conv_1x1\.", r"\1.to_tokens."),
    (r"\.attn\.qkv_proj\.", ".attn.qkv."),
    (r"\.attn\.out_proj\.", ".attn.proj."),
    (r"^(stages\.\d+\.\d+)\.conv_proj\.", r"\1.proj."),
    (r"^(stages\.\d+\.\d+)\.conv_fusion\.", r"\1.fusion."),
    (r"^(?!head\.)", "backbone."),
]

# apple/ml-cvnets -> ours (cvnets/models/classification/mobilevit{,_v2}.py, cvnets/modules/*)
_CVNETS_MOBILEVIT_RULES = [
    (r"\.block\.norm\.", ".block.bn."),
    (r"^conv_1\.block\.", "stem."),
    (r"^layer_(\d)\.", lambda m: f"stages.{int(m.group(1)) - 1}."),
    (r"\.block\.exp_1x1\.block\.", ".expand."),
    (r"\.block\.conv_3x3\.block\.", ".depthwise."),
    (r"\.block\.red_1x1\.block\.", ".project."),
    (r"\.local_rep\.(0|conv_3x3)\.block\.", ".local_conv."),
    (r"\.local_rep\.(1|conv_1x1)\.block\.conv\.", ".to_tokens."),
    (r"\.global_rep\.(\d+)\.pre_norm_(attn|mha)\.0\.", r".transformer.\1.norm1."),
    (r"\.global_rep\.(\d+)\.pre_norm_(attn|mha)\.1\.qkv_proj\.(block\.conv\.)?", r".transformer.\1.attn.qkv."),
    (r"\.global_rep\.(\d+)\.pre_norm_(attn|mha)\.1\.out_proj\.(block\.conv\.)?", r".transformer.\1.attn.proj."),
    (r"\.global_rep\.(\d+)\.pre_norm_ffn\.0\.", r".transformer.\1.norm2."),
    (r"\.global_rep\.(\d+)\.pre_norm_ffn\.1\.(block\.conv\.)?", r".transformer.\1.mlp.fc1."),
    (r"\.global_rep\.(\d+)\.pre_norm_ffn\.(3|4)\.(block\.conv\.)?", r".transformer.\1.mlp.fc2."),
    (r"\.global_rep\.\d+\.(weight|bias)$", r".norm.\1"),
    (r"\.conv_proj\.block\.", ".proj."),
    (r"\.fusion\.block\.", ".fusion."),
    (r"^conv_1x1_exp\.block\.", "final_conv."),
    (r"^classifier\.(1|fc)\.", "head.fc."),
    (r"^(?!head\.)", "backbone."),
]


def _timm_mobilevit(state_dict: StateDict, backbone: nn.Module) -> StateDict:
    return rename_keys(state_dict, _TIMM_MOBILEVIT_RULES)


def _cvnets_mobilevit(state_dict: StateDict, backbone: nn.Module) -> StateDict:
    return rename_keys(state_dict, _CVNETS_MOBILEVIT_RULES)


for _name in ("mobilevit", "mobilevitv2"):
    register_converter(_name, "timm", detect=lambda sd: any(".conv1_1x1." in k for k in sd))(_timm_mobilevit)
    register_converter(_name, "cvnets", detect=lambda sd: "conv_1.block.conv.weight" in sd)(_cvnets_mobilevit)
