"""Values one section of the config takes from another before anything is built: the image size a ViT
backbone is built for, and the normalisation an image datamodule applies."""
from __future__ import annotations


def link_weights(config, checkpoint: dict | None) -> None:
    """An image datamodule's ``weights`` (whose entry gives its mean and std, ``backbones/pretrained.py``)
    are the model's: ``model.weights``, else the backbone's ``pretrained``; scoring a checkpoint, its
    mean and std are those of the input specification the checkpoint stores. A ``--data.weights`` (or
    ``--data.mean`` / ``--data.std``) given explicitly is kept (jsonargparse's ``link_arguments`` would
    drop it)."""
    data_args = getattr(config.get("data"), "init_args", None)
    model = config.get("model")
    if data_args is None or "weights" not in data_args or data_args.weights is not None or model is None:
        return
    spec = (checkpoint or {}).get("input_spec")
    if spec is not None:  # a checkpoint is scored on inputs prepared as it was trained on
        for key in ("mean", "std"):
            if key in data_args and data_args[key] is None:
                data_args[key] = list(spec[key])
        return
    backbone_args = getattr(model.get("backbone"), "init_args", None)
    data_args.weights = model.get("weights") or (backbone_args.get("pretrained") if backbone_args else None)


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
