"""Name -> backbone class registry.

YAML recipes name backbones by import path (``class_path: backbones.MobileViTv2``),
which LightningCLI resolves; this registry is the programmatic twin used by
scripts, tests and checkpoint import: ``create_backbone("mobilevitv2", width=0.75)``.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch.nn as nn

_BACKBONES: dict[str, Callable[..., nn.Module]] = {}

T = TypeVar("T")


def register_backbone(name: str) -> Callable[[T], T]:
    """Class decorator adding a backbone under ``name`` (lower case)."""

    def decorator(cls: T) -> T:
        key = name.lower()
        if key in _BACKBONES and _BACKBONES[key] is not cls:
            raise ValueError(f"backbone name {name!r} is already registered to {_BACKBONES[key]}")
        _BACKBONES[key] = cls  # type: ignore[assignment]
        return cls

    return decorator


def list_backbones() -> list[str]:
    return sorted(_BACKBONES)


def get_backbone_class(name: str) -> Callable[..., nn.Module]:
    try:
        return _BACKBONES[name.lower()]
    except KeyError:
        raise KeyError(f"unknown backbone {name!r}; valid names: {', '.join(list_backbones())}") from None


def create_backbone(name: str, **kwargs) -> nn.Module:
    """Build a registered backbone, e.g. ``create_backbone("vit", size="small", patch_size=16)``."""
    return get_backbone_class(name)(**kwargs)
