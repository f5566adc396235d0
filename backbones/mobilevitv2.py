"""MobileViTv2 (Mehta & Rastegari, "Separable Self-attention for Mobile Vision Transformers", 2022).

The architecture of the paper's Table 5, built like apple/ml-cvnets and timm's
``mobilevitv2_*``, so that their checkpoints load (see ``backbones.weights``)::

    stem      3x3 conv, stride 2                             32w           stride 2
    stage 1   MV2                                            64w           stride 2
    stage 2   MV2 (stride 2), MV2                            128w          stride 4
    stage 3   MV2 (stride 2), MobileViTv2 block, 2 layers    256w  d=128w  stride 8
    stage 4   MV2 (stride 2), MobileViTv2 block, 4 layers    384w  d=192w  stride 16
    stage 5   MV2 (stride 2), MobileViTv2 block, 3 layers    512w  d=256w  stride 32

(w: width multiplier, channels rounded to multiples of 8; MV2 expansion 2; 2x2
patches; FFN ratio 2; GroupNorm with one group over (C, P, N) as the reference code.)

Implementation note (speed). The reference unfolds the map into (B, C, P, N)
patches and folds it back in every block (two copies) and runs 1x1 convolutions.
Here the transformer works on the channels-last map (B, H, W, D) itself: linear
layers act on the last dim (one GEMM with its bias each), the one-group GroupNorm
runs as layer norm over (H, W, D) (``ChannelsLastGroupNorm``), and the separable
attention reduces over the patch-index axes of the free view (B, H/2, 2, W/2, 2, D),
its softmax one fused kernel over the tokens of each patch position. Every output
equals the reference's (tested to 1e-5 against timm). The backbone converts its
input to ``torch.channels_last`` once, so the block's NCHW <-> NHWC permutes are
views, not copies. Per training step on a GPU this launches fewer kernels and moves
fewer bytes than timm's ``mobilevitv2_*`` (``benchmarks/results_kernels.md``).
That grid view has rank 6, more than Core ML holds: within
``backbones.mobilevit_common.coreml_layout(model)`` (which Core ML conversion uses) the blocks
unfold the map into (B, P, N, D) sequences with rank-5 ops instead, equal in value; it stays a
switch because it copies the map twice more each way (slower in training on CPU too).

Input sizes: any H, W. Where a MobileViTv2 block's input is not a multiple of
the patch size, it is resized (bilinear, align_corners=True) up to the next
multiple and the block's output keeps that size, as the reference does; for
multiples of 32 (e.g. 256x256) nothing is ever resized.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from backbones.mobilevit_common import (
    Stage,
    StagedBackbone,
    fold_patches,
    make_divisible,
    register_mobilevit_converters,
    resize_to_multiple,
    unfold_patches,
)
from backbones.registry import register_backbone
from layers.conv import ConvNormAct
from layers.transformer import ChannelsLastGroupNorm, TransformerBlock

# per stage at width 1: (out channels, MV2 blocks, stride, transformer depth, attention dim; 0 for pure MV2 stages)
STAGES_V2 = ((64, 1, 1, 0, 0), (128, 2, 2, 0, 0), (256, 1, 2, 2, 128), (384, 1, 2, 4, 192), (512, 1, 2, 3, 256))


class MobileViTv2Block(nn.Module):
    """Local 3x3 depthwise conv -> 1x1 to ``attn_dim`` -> transformer layers on
    2x2 patches -> GroupNorm -> 1x1 conv + BN back to ``channels``.

    (B, C, H, W) -> (B, C, H', W'), H' = H rounded up to the patch size.
    """

    def __init__(
        self,
        channels: int,
        attn_dim: int,
        depth: int,
        patch_size: int = 2,
        mlp_ratio: float = 2.0,
        dilation: int = 1,
        attention: str = "separable",
        dropout: float = 0.0,
        attn_dropout: float = 0.0,
        drop_path: float | list[float] = 0.0,
        num_heads: int = 1,
        attention_kwargs: dict | None = None,
    ):
        super().__init__()
        self.patch_size = (patch_size, patch_size)
        rates = drop_path if isinstance(drop_path, (list, tuple)) else [drop_path] * depth
        self.local_conv = ConvNormAct(channels, channels, 3, groups=channels, dilation=dilation)
        self.to_tokens = nn.Linear(channels, attn_dim, bias=False)
        self.transformer = nn.Sequential(
            *[
                TransformerBlock(
                    attn_dim,
                    int(attn_dim * mlp_ratio) // 16 * 16,  # CVNets rounds the FFN width down to 16
                    attention,
                    num_heads,
                    norm="group",
                    patch_size=self.patch_size,
                    dropout=dropout,
                    attn_dropout=attn_dropout,
                    drop_path=rate,
                    attention_kwargs=attention_kwargs,
                )
                for rate in rates
            ]
        )
        self.norm = ChannelsLastGroupNorm(1, attn_dim)
        self.proj = ConvNormAct(attn_dim, channels, 1, act=None)
        # False: the transformer mixes the rank-6 patch grid of the map (no unfold copy; the fast path);
        # True: it runs on unfolded (B, P, N, D) sequences, rank <= 5 throughout, as Core ML requires
        # (set by ``backbones.mobilevit_common.coreml_layout``)
        self.coreml_layout = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = resize_to_multiple(x, self.patch_size, align_corners=True)
        x = self.local_conv(x)
        x = self.to_tokens(x.permute(0, 2, 3, 1))  # (B, H, W, D)
        if self.coreml_layout:
            sequences = self._transform_unfolded(unfold_patches(x, self.patch_size))
            x = fold_patches(sequences, self.patch_size, x.shape[1:3])
        else:
            x = self.norm(self.transformer(x))
        return self.proj(x.permute(0, 3, 1, 2))

    def _transform_unfolded(self, x: torch.Tensor) -> torch.Tensor:
        """``norm(transformer(.))`` on the unfolded sequences (B, P, N, D), every tensor of rank <= 4.

        Each layer is its :class:`TransformerBlock`'s training-mode forward (dropout and stochastic
        depth are identities in eval) with the attention on the (B*P, N, D) sequences; the one-group
        norms of (B, P, N, D) take the same per-image statistics as on the (B, H, W, D) map."""
        for layer in self.transformer:
            attended = layer.attn(layer.norm1(x).flatten(0, 1)).view_as(x)
            x = x + layer.drop_path(layer.proj_drop(attended))
            x = x + layer.drop_path(layer.mlp(layer.norm2(x)))
        return self.norm(x)


@register_backbone("mobilevitv2")
class MobileViTv2(StagedBackbone):
    """MobileViTv2 with width multiplier ``width`` (paper: 0.5 to 2.0).

    ``forward(x)``: (B, in_chans, H, W) -> ``{2: .., 4: .., 8: .., 16: .., 32: ..}``,
    the output of each stage (channels in ``feature_channels``). With
    ``output_stride`` 16 or 8 the stages beyond it keep the resolution and dilate
    their depthwise convolutions instead (as CVNets does for segmentation); the
    dict then stops at ``output_stride``, whose entry is the deepest map.
    ``stage_info`` describes stages 1..5 (CVNets' ``layer_1`` .. ``layer_5``: index,
    stride after dilation, channels) and ``forward_stages(x, [4])`` returns the dict
    together with stage 4's map, e.g. at output stride 8 the stride-8 map of stage 4
    that the dict's stride-8 entry (stage 5) hides.

    ``forward_pooled(x)``: (B, num_features) global average of the last map, the
    input of the paper's linear classifier. ``pretrained``: registered weights
    (``"mobilevitv2_100.cvnets_in1k"``, :mod:`backbones.pretrained`) or a checkpoint path (ours, timm or
    CVNets; see ``backbones.weights``), loaded at construction.

    Regularisation (all off by default, as the paper's recipe): ``drop_path_rate``
    stochastic depth on the transformer layers' residual branches, rising linearly
    with depth; ``dropout`` after attention and in the FFN; ``attn_dropout`` on the
    context scores.

    ``attention`` swaps the token mixer for any variant of ``layers.attention``
    (``num_heads`` and ``attention_kwargs``, e.g. ``{"max_len": 256}``, go to it);
    the paper's model is the default, "separable".
    """

    repeated_blocks = (TransformerBlock,)  # the units of --model.compile regional

    def __init__(
        self,
        width: float = 1.0,
        in_chans: int = 3,
        output_stride: int = 32,
        attention: str = "separable",
        num_heads: int = 1,
        attention_kwargs: dict | None = None,
        drop_path_rate: float = 0.0,
        dropout: float = 0.0,
        attn_dropout: float = 0.0,
        pretrained: str | None = None,
    ):
        super().__init__()
        self.in_chans = in_chans
        self.width = width
        stem_chs = make_divisible(min(max(32 * width, 16), 64), 8, min_value=16)
        self.stem = ConvNormAct(in_chans, stem_chs, 3, stride=2)

        stages = [
            Stage(make_divisible(chs * width), n_mv2, stride, depth, make_divisible(attn * width) if attn else 0)
            for chs, n_mv2, stride, depth, attn in STAGES_V2
        ]
        in_chs = self._build_stages(
            stem_chs, stages, 2.0, output_stride, drop_path_rate, MobileViTv2Block, attention=attention,
            num_heads=num_heads, attention_kwargs=attention_kwargs, dropout=dropout, attn_dropout=attn_dropout,
        )
        self.num_features = in_chs

        if pretrained:
            self.load_pretrained(pretrained)


register_mobilevit_converters("mobilevitv2")
