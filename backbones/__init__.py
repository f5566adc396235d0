"""Image and sequence encoders shared by every task.

Build by name with :func:`create_backbone` or by class (``backbones.MobileViTv2``)
in YAML. Every image backbone follows the :class:`Backbone` feature contract. The
blocks they are built from (attention zoo, conv-norm-activation, transformer
block) live in :mod:`layers`, which the heads share.
"""
from backbones.base import Backbone
from backbones.registry import create_backbone, get_backbone_class, list_backbones, register_backbone

__all__ = ["Backbone", "create_backbone", "get_backbone_class", "list_backbones", "register_backbone"]

# single-scale backbones (+ the ViTDet-style pyramid that gives them several strides)
from backbones.convmixer import ConvMixer  # noqa: E402
from backbones.mlp_mixer import MlpMixer  # noqa: E402
from backbones.pyramid import SimpleFeaturePyramid  # noqa: E402
from backbones.vit import ViT  # noqa: E402

__all__ += ["ConvMixer", "MlpMixer", "SimpleFeaturePyramid", "ViT"]

# MobileViT v1/v2 (+ checkpoint import)
from backbones.mobilevit import MobileViT  # noqa: E402
from backbones.mobilevitv2 import MobileViTv2  # noqa: E402
from backbones.weights import convert_checkpoint, load_pretrained  # noqa: E402

__all__ += ["MobileViT", "MobileViTv2", "convert_checkpoint", "load_pretrained"]

# any timm architecture (its feature maps, pooled embedding, tags and preprocessing)
from backbones.timm_backbone import Timm  # noqa: E402

__all__ += ["Timm"]

# the sequence encoder of the translation task
from backbones.transformer import TransformerEncoder  # noqa: E402

__all__ += ["TransformerEncoder"]
