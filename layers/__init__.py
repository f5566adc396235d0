"""Building blocks that backbones and heads share; the bottom floor, importing neither.

- :mod:`layers.registry`: :class:`~layers.registry.Registry`, the name -> object table
  behind the backbone, attention and checkpoint-converter registries;
- :mod:`layers.attention`: the attention zoo (``build_attention("mha", dim, heads)``);
- :mod:`layers.conv`: :class:`~layers.conv.ConvNormAct`, conv -> BatchNorm -> activation, and
  :class:`~layers.conv.DepthwiseConv2d` (large kernels: a faster CPU weight gradient);
- :mod:`layers.feedforward`: :class:`~layers.feedforward.FeedForward`, the token-wise MLP;
- :mod:`layers.transformer`: the pre-norm :class:`~layers.transformer.TransformerBlock`
  and the pieces of the translation encoder/decoder.
"""
from layers.attention import KVCache, build_attention, list_attention, register_attention
from layers.conv import ConvNormAct, DepthwiseConv2d
from layers.feedforward import FeedForward
from layers.registry import Registry
from layers.transformer import TransformerBlock

__all__ = [
    "ConvNormAct",
    "DepthwiseConv2d",
    "FeedForward",
    "KVCache",
    "Registry",
    "TransformerBlock",
    "build_attention",
    "list_attention",
    "register_attention",
]
