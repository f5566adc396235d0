"""Image and sequence encoders shared by every task.

Build by name with :func:`create_backbone` or by class (``backbones.MobileViTv2``)
in YAML. Every image backbone follows the :class:`Backbone` feature contract.
"""
from backbones.base import Backbone
from backbones.registry import create_backbone, get_backbone_class, list_backbones, register_backbone

__all__ = ["Backbone", "create_backbone", "get_backbone_class", "list_backbones", "register_backbone"]
