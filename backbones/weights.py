"""Pretrained-weight import: our Lightning checkpoints, timm state dicts, apple/ml-cvnets checkpoints.

Everything is converted to one *canonical* naming first::

    backbone.<key of our backbone's state_dict>    head.fc.weight    head.fc.bias

``convert_checkpoint(path, backbone)`` returns that dict (the classification task
takes its classifier from it with :func:`classifier_state`);
``load_pretrained(backbone, pretrained)`` loads its backbone part, refusing with the
lists of missing / unexpected / misshaped keys when it does not fit. ``pretrained`` is a
checkpoint path or the name of registered weights (:mod:`backbones.pretrained`, which also
states the input each set of weights was trained on; a name's file is downloaded once into a cache by
:func:`backbones.download.fetch_weights`). :func:`preprocessing_of` says what input
a name or a file was trained on (a file by what it holds).

Foreign formats are recognised per backbone by registered converters: the file
that defines a backbone family registers its key mappings, e.g. ``backbones/vit.py``::

    @register_converter("vit", "timm", detect=lambda sd: "cls_token" in sd)
    def _vit_from_timm(state_dict, backbone):
        return {...canonical keys...}

Files are read with ``torch.load(weights_only=True)``, or as safetensors (the Hugging Face hub's format,
``.safetensors``): tensors and plain containers only, never arbitrary pickled code.
"""
from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Callable, Mapping

import torch
import torch.nn as nn

from backbones.download import fetch_weights
from backbones.pretrained import PRETRAINED, PretrainedWeights, Preprocessing, find_weights, weights_file
from backbones.registry import BACKBONES
from layers.registry import Registry

StateDict = dict[str, torch.Tensor]
Converter = Callable[[StateDict, nn.Module], StateDict]
Detector = Callable[[Mapping[str, torch.Tensor]], bool]

#: "<backbone>/<source>" -> (detect, convert); filled by :func:`register_converter`
CONVERTERS: Registry[tuple[Detector, Converter]] = Registry("checkpoint converter")

#: keys that a checkpoint may lack without harm (BatchNorm's step counter)
OPTIONAL_SUFFIXES = ("num_batches_tracked",)


def register_converter(backbone: str, source: str, detect: Detector) -> Callable[[Converter], Converter]:
    """Register ``fn(state_dict, backbone_module) -> canonical dict`` for checkpoints of
    ``source`` (e.g. "timm", "cvnets") that ``detect(state_dict)`` recognises."""

    def decorator(fn: Converter) -> Converter:
        CONVERTERS.add(f"{backbone}/{source}", (detect, fn))
        return fn

    return decorator


def converters_for(backbone: str) -> dict[str, tuple[Detector, Converter]]:
    """source -> (detect, convert) of the converters registered for ``backbone``, in registration order."""
    prefix = f"{backbone.lower()}/"
    return {key[len(prefix) :]: entry for key, entry in CONVERTERS.items() if key.startswith(prefix)}


def rename_keys(state_dict: Mapping[str, torch.Tensor], rules: list[tuple[str, str]]) -> StateDict:
    """Apply regex ``(pattern, replacement)`` rules in order to every key (all that match, in turn)."""
    out = {}
    for key, value in state_dict.items():
        for pattern, replacement in rules:
            key = re.sub(pattern, replacement, key)
        out[key] = value
    return out


def backbone_name(backbone: nn.Module) -> str:
    for name, cls in BACKBONES.items():
        if cls is type(backbone):
            return name
    valid = ", ".join(BACKBONES.names())
    raise KeyError(f"{type(backbone).__name__} is not a registered backbone; valid names: {valid}")


def read_weights_file(path: str | Path, mmap: bool = False) -> Mapping:
    """The object a weights file holds (ours, timm's or CVNets'), read with ``torch.load(weights_only=True)``;
    ``mmap`` maps the tensors instead of reading them (for a look at the keys or the stored input
    specification). A checkpoint this suite evaluates or resumes is read by
    :func:`tasks.engine.checkpoints.read_checkpoint` instead, which checks what a task needs of it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint not found: {path}. A file path is read as it is; a name registered in "
            "backbones/pretrained.py (model.weights for a whole classifier, model.backbone.init_args.pretrained "
            "for a backbone, as the paper recipes give them) is downloaded once into the weights cache instead. "
            "Pass an existing file or a registered name, or null to start from random weights.")
    if path.suffix == ".safetensors":
        return _read_safetensors(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except RuntimeError as err:
        if mmap and "mmap" in str(err):  # a file in torch's legacy (non-zip) format cannot be mapped
            return read_weights_file(path)
        raise _unreadable(path, err) from err
    except Exception as err:  # weights_only refuses pickled objects other than tensors/containers
        raise _unreadable(path, err) from err


def _read_safetensors(path: Path) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)  # maps the file; tensors only by construction of the format
    except (SafetensorError, OSError) as err:
        raise ValueError(f"cannot read {path} as safetensors: {err}. "
                         "Is it truncated, or not a safetensors file?") from None


def _unreadable(path: Path, err: Exception) -> ValueError:
    return ValueError(f"cannot read {path} with torch.load(weights_only=True): {err}. "
                      "Save a plain state dict (torch.save(model.state_dict(), path)) and load that.")


def state_dict_in(obj: Mapping) -> StateDict:
    """The tensors of a loaded checkpoint, unwrapping Lightning (``state_dict``), trainer (``model``)
    and DDP (``module.``) wrappers; ``{}`` when it holds no state dict."""
    for wrapper in ("state_dict", "model"):
        if isinstance(obj, Mapping) and isinstance(obj.get(wrapper), Mapping):
            obj = obj[wrapper]
            break
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        return {}
    if all(k.startswith("module.") for k in obj):
        obj = {k[len("module.") :]: v for k, v in obj.items()}
    return dict(obj)


def preprocessing_of(pretrained: str | None) -> Preprocessing | None:
    """How images were prepared for the weights ``pretrained`` (a registered name or a checkpoint file);
    ``None`` without weights or where the file does not tell (a bare state dict of ours, a checkpoint
    written without an input specification, timm weights whose tags disagree)."""
    entry = find_weights(pretrained)
    if entry is not None:
        return entry.preprocessing
    if not pretrained:
        return None
    return preprocessing_in(read_weights_file(Path(pretrained).expanduser(), mmap=True))


def preprocessing_in(checkpoint: Mapping) -> Preprocessing | None:
    """What a loaded checkpoint file says about its input: the input specification our tasks store
    (``checkpoint["input_spec"]``), else the preprocessing every registered entry of the naming its keys
    have (CVNets', timm's) agrees on."""
    spec = checkpoint.get("input_spec") if isinstance(checkpoint, Mapping) else None
    if isinstance(spec, Mapping):
        return Preprocessing.from_input_spec(spec)
    # CONVERTERS is complete here: importing this module ran backbones/__init__.py, which imports every family
    state_dict = state_dict_in(checkpoint)
    naming = {tuple(key.split("/")) for key, (detect, _) in CONVERTERS.items() if detect(state_dict)}
    # the Timm backbone's naming fits any timm file, so it tells nothing where a family's own naming fits too
    naming = {n for n in naming if n[0] != "timm"} or naming
    known = {entry.preprocessing for _, entry in PRETRAINED.items() if (entry.backbone, entry.converter) in naming}
    if len(known) == 1:
        return known.pop()
    normalisations = {(p.mean, p.std) for p in known}
    return Preprocessing(*normalisations.pop()) if len(normalisations) == 1 else None


def read_state_dict(path: str | Path) -> StateDict:
    """Tensors of a checkpoint file (:func:`read_weights_file`, :func:`state_dict_in`)."""
    state_dict = state_dict_in(read_weights_file(path))
    if not state_dict:
        raise ValueError(f"{path} holds no state dict (a mapping of names to tensors)")
    return state_dict


def convert_state_dict(state_dict: Mapping[str, torch.Tensor], backbone: nn.Module) -> StateDict:
    """Any supported naming -> canonical naming (``backbone.*``, ``head.fc.*``), shapes fitted to ``backbone``."""
    name = backbone_name(backbone)
    own = backbone.state_dict()
    if any(k.startswith("backbone.") for k in state_dict):  # ours (a Lightning task's state dict)
        canonical = {k: v for k, v in state_dict.items() if k.startswith(("backbone.", "head."))}
    elif set(state_dict) <= set(own):  # a bare state dict of our backbone
        canonical = {f"backbone.{k}": v for k, v in state_dict.items()}
    else:
        converters = converters_for(name)
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


def load_pretrained(backbone: nn.Module, pretrained: str | Path) -> StateDict:
    """Load the weights ``pretrained`` names (an entry of :mod:`backbones.pretrained`, its file put by hand
    or downloaded once into the cache, :func:`backbones.download.fetch_weights`; or a checkpoint path) into
    ``backbone``, strictly. Registered weights that are not here and cannot be downloaded raise
    :class:`backbones.download.WeightsUnavailable`, whose one-line message names the entry, the URL and the
    cache path.

    Returns the canonical head entries of the checkpoint (``head.*``, possibly
    empty), which the backbone itself ignores.
    """
    entry = find_weights(str(pretrained))
    if entry is not None:
        check_family(entry, backbone)  # before any download: weights of another family would be refused after it
        path = fetch_weights(entry)
    else:
        path = weights_file(str(pretrained))
    source = f"{entry.name} ({path})" if entry is not None else str(path)
    checkpoint = read_weights_file(path)
    state_dict = state_dict_in(checkpoint)
    if not state_dict:
        raise ValueError(f"{source} holds no state dict (a mapping of names to tensors)")
    if entry is not None:
        check_preprocessing(entry, preprocessing_in(checkpoint), source)
    canonical = convert_state_dict(state_dict, backbone)
    weights = {k[len("backbone.") :]: v for k, v in canonical.items() if k.startswith("backbone.")}
    # a backbone may fit tensors to its own shapes where that is well defined before the strict
    # check (ViT resamples position embeddings made for another resolution)
    adapt = getattr(backbone, "adapt_checkpoint", None)
    if adapt is not None:
        weights = adapt(weights)
    check_fit(weights, backbone, source if entry is None else f"{source}, for {entry.backbone} {dict(entry.arguments)},")
    backbone.load_state_dict(weights, strict=False)  # strict apart from OPTIONAL_SUFFIXES, checked above
    return {k: v for k, v in canonical.items() if k.startswith("head.")}


def check_family(entry: PretrainedWeights, backbone: nn.Module) -> None:
    name = backbone_name(backbone)
    if entry.backbone != name:
        raise ValueError(f"pretrained={entry.name} are weights of a {entry.backbone} backbone "
                         f"{dict(entry.arguments)}, not of this {name}")


def check_preprocessing(entry: PretrainedWeights, found: Preprocessing | None, source: str) -> None:
    """The file at the entry's place was trained on the input the entry states, where the file tells (the
    datamodules normalise as the entry says)."""
    stated = (entry.preprocessing.mean, entry.preprocessing.std)
    if found is not None and (found.mean, found.std) != stated:
        raise ValueError(
            f"{source} was trained on inputs normalised with mean {list(found.mean)}, std {list(found.std)}, but "
            f"{entry.name} states mean {list(stated[0])}, std {list(stated[1])}: put the weights of {entry.url} there, "
            "or pass this file's path as pretrained (its own normalisation is then used)")


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
