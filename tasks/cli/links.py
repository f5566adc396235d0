"""Values one section of the config takes from another before anything is built: the image size a ViT
backbone is built for, and the normalisation an image datamodule applies."""
from __future__ import annotations

from datamodules.input_spec import resolve_preprocessing


def link_weights(config, checkpoint: dict | None) -> None:
    """Tell an image datamodule which input the model takes, as
    :func:`datamodules.input_spec.resolve_preprocessing` decides it. On fit its ``weights`` are the model's
    (``model.weights``, else the backbone's ``pretrained``), which its constructor resolves; scoring a
    checkpoint, its ``mean`` and ``std`` are resolved here from the input specification the checkpoint stores
    (its weights replace those its training started from, so their name is no longer the model's). A
    ``--data.weights``, ``--data.mean`` or ``--data.std`` given explicitly is kept (jsonargparse's
    ``link_arguments`` would drop it); a mean or std that contradicts the weights or the checkpoint is warned
    about by the resolver."""
    data_args = getattr(config.get("data"), "init_args", None)
    model = config.get("model")
    if data_args is None or "weights" not in data_args or data_args.weights is not None or model is None:
        return
    stored = (checkpoint or {}).get("input_spec")
    if stored is not None:
        resolved = resolve_preprocessing(stored=stored, mean=data_args.get("mean"), std=data_args.get("std"))
        for key in ("mean", "std"):
            if key in data_args:
                data_args[key] = list(getattr(resolved, key))
        return
    data_args.weights = model_weights(model)


def model_weights(model) -> str | None:
    """The weights a model section starts from: ``weights`` (a whole classifier), else the backbone's
    ``pretrained``; ``None`` for random weights."""
    backbone_args = getattr(model.get("backbone"), "init_args", None)
    return model.get("weights") or (backbone_args.get("pretrained") if backbone_args else None)


def link_image_size(config, given_keys: set[str]) -> None:
    """A backbone with an ``img_size`` argument (ViT) gets the data's ``image_size``: one value, not
    two copies. An ``img_size`` set explicitly (flag or recipe, ``given_keys``) that differs is refused.
    With a checkpoint the saved ``img_size`` is the one its weights were trained with: not called then."""
    backbone = config.model.get("backbone") if "model" in config else None
    backbone_args = getattr(backbone, "init_args", None)
    data_args = getattr(config.get("data"), "init_args", None)
    if backbone_args is None or "img_size" not in backbone_args or data_args is None:
        return
    size = data_args.get("image_size")
    if size is None:
        return
    if "model.backbone.img_size" not in given_keys:
        backbone_args.img_size = size
    elif _pair(backbone_args.img_size) != _pair(size):
        raise ValueError(
            f"--model.backbone.img_size {backbone_args.img_size} differs from --data.image_size {size}: the "
            f"backbone takes the data's image size; drop --model.backbone.img_size (or set both alike)")


def _pair(size) -> tuple:
    return tuple(size) if isinstance(size, (list, tuple)) else (size, size)
