"""What MobileViT v1 and v2 share: the MobileNetv2 block, the staged trunk and its
stage builder (with DeepLab-style dilation), the resize of odd-sized maps, and the
key mappings of timm and apple/ml-cvnets checkpoints, which name both versions alike.
"""
from __future__ import annotations

import math
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.ops import StochasticDepth

from backbones.base import Backbone, StageInfo
from backbones.weights import StateDict, register_converter, rename_keys
from layers.conv import ConvNormAct


def make_divisible(value: float, divisor: int = 8, min_value: int | None = None, round_limit: float = 0.9) -> int:
    """Round ``value`` to a multiple of ``divisor`` without losing more than 10%
    (the MobileNet/CVNets rule that fixes every channel count of MobileViT)."""
    min_value = min_value or divisor
    rounded = max(min_value, int(value + divisor / 2) // divisor * divisor)
    if rounded < round_limit * value:
        rounded += divisor
    return rounded


class InvertedResidual(nn.Module):
    """MobileNetv2 block (MV2): 1x1 expand -> 3x3 depthwise (stride, dilation) -> 1x1 linear project.

    (B, in_chs, H, W) -> (B, out_chs, H/stride, W/stride); residual only when the
    shapes allow it (stride 1 and in_chs == out_chs), as in MobileNetv2/CVNets.
    """

    def __init__(
        self,
        in_chs: int,
        out_chs: int,
        stride: int = 1,
        expand_ratio: float = 2.0,
        dilation: int = 1,
        drop_path: float = 0.0,
    ):
        super().__init__()
        mid_chs = make_divisible(in_chs * expand_ratio)
        self.expand = ConvNormAct(in_chs, mid_chs, 1)
        self.depthwise = ConvNormAct(mid_chs, mid_chs, 3, stride=stride, groups=mid_chs, dilation=dilation)
        self.project = ConvNormAct(mid_chs, out_chs, 1, act=None)
        self.has_residual = stride == 1 and in_chs == out_chs
        self.drop_path = StochasticDepth(drop_path, "row") if self.has_residual and drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.project(self.depthwise(self.expand(x)))
        return x + self.drop_path(out) if self.has_residual else out


def resize_to_multiple(x: torch.Tensor, multiple: tuple[int, int], align_corners: bool) -> torch.Tensor:
    """Bilinear resize (B, C, H, W) up to the next multiple of ``multiple`` (the MobileViT
    references do this instead of padding); a no-op, without a copy, when it already fits."""
    h, w = x.shape[-2:]
    new_h, new_w = -(-h // multiple[0]) * multiple[0], -(-w // multiple[1]) * multiple[1]
    if (new_h, new_w) == (h, w):
        return x
    return F.interpolate(x, size=(new_h, new_w), mode="bilinear", align_corners=align_corners)


def unfold_patches(x: torch.Tensor, patch_size: tuple[int, int]) -> torch.Tensor:
    """Channels-last map (B, H, W, D) -> (B, P, N, D): the N = (H/ph)(W/pw) pixels at each of the
    P = ph*pw positions inside the patches, i.e. MobileViT's sequences (CVNets' ``unfolding``).

    Written with tensors of rank <= 5 (Core ML's limit): the one rank-6 permute
    (B, H/ph, ph, W/pw, pw, D) -> (B, ph, pw, H/ph, W/pw, D) is two rank-5 transposes, each a copy."""
    b, h, w, d = x.shape
    (ph, pw), nh, nw = patch_size, h // patch_size[0], w // patch_size[1]
    x = x.reshape(b * nh, ph, nw, pw, d).transpose(2, 3)  # (B*nh, ph, pw, nw, D)
    x = x.reshape(b, nh, ph * pw, nw, d).transpose(1, 2)  # (B, P, nh, nw, D)
    return x.reshape(b, ph * pw, nh * nw, d)


def fold_patches(x: torch.Tensor, patch_size: tuple[int, int], size: tuple[int, int]) -> torch.Tensor:
    """(B, P, N, D) -> channels-last (B, H, W, D) of ``size`` (H, W): the inverse of
    :func:`unfold_patches`, also with tensors of rank <= 5."""
    b, _, _, d = x.shape
    (ph, pw), (h, w) = patch_size, size
    nh, nw = h // ph, w // pw
    x = x.reshape(b, ph * pw, nh, nw, d).transpose(1, 2)  # (B, nh, P, nw, D)
    x = x.reshape(b * nh, ph, pw, nw, d).transpose(2, 3)  # (B*nh, ph, nw, pw, D)
    return x.reshape(b, h, w, d)


@contextmanager
def coreml_layout(module: nn.Module) -> Iterator[nn.Module]:
    """Within the ``with``, every MobileViTv2 block in ``module`` runs its transformer on unfolded
    (B, P, N, D) sequences (:func:`unfold_patches`), so that no tensor has rank > 5: Core ML's limit,
    which the blocks' rank-6 patch grid exceeds. Values are equal to the grid path's (to float
    rounding); the grid path is restored on exit. (MobileViT v1's rank-6 view is one coremltools'
    own passes rewrite, so v1 converts as it is.)"""
    blocks = [m for m in module.modules() if hasattr(m, "coreml_layout")]
    previous = [block.coreml_layout for block in blocks]
    for block in blocks:
        block.coreml_layout = True
    try:
        yield module
    finally:
        for block, value in zip(blocks, previous):
            block.coreml_layout = value


def dilated_stage_plan(
    stage_strides: list[int], output_stride: int, stem_stride: int = 2
) -> list[tuple[int, int, int, int]]:
    """Per stage ``(stride, first_dilation, dilation, output stride)``: once the
    network reaches ``output_stride``, a stage that would downsample keeps its
    resolution and doubles the dilation instead (DeepLab-style; the first block of
    that stage still uses the previous dilation, as CVNets and timm do)."""
    if output_stride not in (8, 16, 32):
        raise ValueError(f"output_stride must be 8, 16 or 32, got {output_stride}")
    plan, total, dilation = [], stem_stride, 1
    for stride in stage_strides:
        first_dilation = dilation
        if stride > 1 and total >= output_stride:
            dilation *= stride
            stride = 1
        total *= stride
        plan.append((stride, first_dilation, dilation, total))
    return plan


@dataclass(frozen=True)
class Stage:
    """One stage of the trunk: ``mv2_blocks`` MV2 blocks to ``channels`` (the first with
    ``stride``), then, if ``depth`` > 0, a MobileViT block of ``depth`` transformer
    layers of width ``attn_dim``."""

    channels: int
    mv2_blocks: int
    stride: int
    depth: int = 0
    attn_dim: int = 0


class StagedBackbone(Backbone):
    """A stem and a list of stages; the output of each stage is the feature map at
    its stride (``stage_strides``), and stage ``i`` (1-based, ``stage_info``) is
    CVNets' ``layer_i``. Subclasses build ``stem`` and ``num_features`` and call
    :meth:`_build_stages` for the rest."""

    stem: nn.Module
    stages: nn.ModuleList
    stage_strides: list[int]

    @property
    def size_multiple(self) -> int:
        """No block resizes its input when the map at each block's stride splits into whole patches and
        the deepest stride divides the image: 64 at output stride 32 with 2x2 patches, 32 at 16, 16 at 8."""
        multiple = max(self.stage_strides)
        for stride, stage in zip(self.stage_strides, self.stages):
            for block in stage:
                patch = getattr(block, "patch_size", None)
                if patch is not None:
                    multiple = math.lcm(multiple, stride * patch[0], stride * patch[1])
        return multiple

    def _build_stages(
        self,
        in_chs: int,
        stages: Sequence[Stage],
        expand_ratio: float,
        output_stride: int,
        drop_path_rate: float,
        vit_block: Callable[..., nn.Module],
        **block_kwargs,
    ) -> int:
        """Build ``stages``, ``stage_strides``, ``stage_info`` and ``feature_channels`` from the stem's
        ``in_chs`` channels; return the channels of the last stage.

        Stages past ``output_stride`` are dilated (:func:`dilated_stage_plan`). The
        MobileViT block of a stage is ``vit_block(channels, attn_dim, depth, dilation=...,
        drop_path=[rate per layer], **block_kwargs)``; the stochastic-depth rate rises
        linearly from 0 to ``drop_path_rate`` over all transformer layers of the trunk.
        """
        rates = torch.linspace(0, drop_path_rate, sum(stage.depth for stage in stages)).tolist()
        plan = dilated_stage_plan([stage.stride for stage in stages], output_stride)
        self.stages = nn.ModuleList()
        self.stage_strides = [total for *_, total in plan]
        self.feature_channels: dict[int, int] = {}
        for stage, (stride, first_dilation, dilation, total) in zip(stages, plan):
            blocks: list[nn.Module] = []
            for i in range(stage.mv2_blocks):
                block_stride, block_dilation = (stride, first_dilation) if i == 0 else (1, dilation)
                blocks.append(InvertedResidual(in_chs, stage.channels, block_stride, expand_ratio, block_dilation))
                in_chs = stage.channels
            if stage.depth:
                blocks.append(
                    vit_block(
                        stage.channels, stage.attn_dim, stage.depth, dilation=dilation, drop_path=rates[: stage.depth],
                        **block_kwargs,
                    )
                )
                rates = rates[stage.depth :]
            self.stages.append(nn.Sequential(*blocks))
            self.feature_channels[total] = stage.channels  # a dilated stage overwrites its stride's entry
        self.stage_info = tuple(
            StageInfo(index, total, stage.channels, f"stages.{index - 1}")
            for index, (stage, total) in enumerate(zip(stages, self.stage_strides), start=1)
        )
        return in_chs

    def forward(self, x: torch.Tensor) -> dict[int, torch.Tensor]:
        return self.forward_stages(x)[0]

    def layer_order(self, name: str) -> tuple[int, ...] | None:
        """Layer-wise decay layers as timm's byobnet ``group_matcher``: the stem, then every block of
        every stage in order (``stages.i.j``: an MV2 block, a MobileViT block); v1's ``final_conv`` shares
        the last block's layer (timm's ``MATCH_PREV_GROUP``)."""
        if name.startswith("stem."):
            return (0,)
        match = re.match(r"stages\.(\d+)\.(\d+)\.", name)
        if match:
            return (1, int(match.group(1)), int(match.group(2)))
        return (1, len(self.stages) - 1, len(self.stages[-1]) - 1)  # final_conv (v1)

    def forward_stages(
        self, x: torch.Tensor, stages: Sequence[int] = ()
    ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """(B, in_chans, H, W) -> (``{stride: deepest map at that stride}``, ``{stage index: its map}``
        for each of ``stages``), from one pass through the trunk."""
        self.check_input(x)
        self.check_stages(stages)
        # channels-last once, here: every convolution then runs its channels-last
        # kernel and the transformers' (B, H, W, C) views of the maps are free
        x = self.stem(x.contiguous(memory_format=torch.channels_last))
        features, stage_maps = {}, {}
        for info, stage in zip(self.stage_info, self.stages):
            x = stage(x)
            features[info.stride] = x
            if info.index in stages:
                stage_maps[info.index] = x
        return features, stage_maps


# --------------------------------------------------------------------------- checkpoint key mappings
# timm (byobnet naming) -> ours. Shared by both versions; v1-only names simply never match in v2.
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


def register_mobilevit_converters(backbone: str) -> None:
    """Register the timm and CVNets key mappings for the registered backbone ``backbone``
    (``backbones/mobilevit.py`` and ``mobilevitv2.py`` each call it for their version)."""
    register_converter(backbone, "timm", detect=lambda sd: any(".conv1_1x1." in k for k in sd))(_timm_mobilevit)
    register_converter(backbone, "cvnets", detect=lambda sd: "conv_1.block.conv.weight" in sd)(_cvnets_mobilevit)
