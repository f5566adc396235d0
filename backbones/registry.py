"""Name -> backbone class registry.

YAML recipes name backbones by import path (``class_path: backbones.MobileViTv2``),
which LightningCLI resolves; this registry is the programmatic twin used by
scripts, tests and checkpoint import: ``create_backbone("mobilevitv2", width=0.75)``.
"""
from __future__ import annotations

from typing import Callable

import torch.nn as nn

from layers.registry import Registry

#: name -> image backbone class; ``@register_backbone("name")`` adds one
BACKBONES: Registry[Callable[..., nn.Module]] = Registry("backbone")
register_backbone = BACKBONES.register
get_backbone_class = BACKBONES.get


def list_backbones() -> list[str]:
    return BACKBONES.names()


def create_backbone(name: str, **kwargs) -> nn.Module:
    """Build a registered backbone, e.g. ``create_backbone("vit", size="small", patch_size=16)``."""
    return get_backbone_class(name)(**kwargs)
