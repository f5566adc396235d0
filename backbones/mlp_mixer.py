"""MLP-Mixer (Tolstikhin et al., "MLP-Mixer: An all-MLP Architecture for Vision", 2021).

Patches are embedded by a strided conv, then each block mixes across tokens (an
MLP over the token axis, per channel) and across channels (an MLP per token),
both pre-norm and residual. The classifier reads the token mean after the final
LayerNorm.

The token-mixing MLPs are sized for ``(img_size / patch_size)**2`` tokens, so a
Mixer only takes the image size it was built for (as in the reference); the error
names that shape. Build it with another ``img_size`` for another resolution: the
weights of the token MLPs do not carry over.

Sizes (paper Table 1; parameters with a 1000-class head at 224 px, patch 16):
small (S/16) 512 wide, 8 blocks, 18.5M; base (B/16) 768 wide, 12 blocks, 59.9M;
large (L/16) 1024 wide, 24 blocks, 208.2M.

The patch embedding is the ViT's; the MLPs are the transformers' feed-forward
(:class:`layers.feedforward.FeedForward`).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn as nn
from torchvision.ops import StochasticDepth

from backbones.pyramid import SingleScaleBackbone
from backbones.registry import register_backbone
from backbones.vit import PatchEmbed, patch_grid
from backbones.weights import StateDict, register_converter, rename_keys
from layers.feedforward import FeedForward

#: size -> (embed_dim, depth)
MIXER_SIZES: dict[str, tuple[int, int]] = {"small": (512, 8), "base": (768, 12), "large": (1024, 24)}


class MixerBlock(nn.Module):
    """(B, N, D) -> (B, N, D): token-mixing MLP over N, then channel-mixing MLP over D, both pre-norm residual."""

    def __init__(
        self,
        dim: int,
        num_tokens: int,
        mlp_ratio: tuple[float, float] = (0.5, 4.0),
        dropout: float = 0.0,
        drop_path: float = 0.0,
    ):
        super().__init__()
        tokens_hidden, channels_hidden = int(mlp_ratio[0] * dim), int(mlp_ratio[1] * dim)
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp_tokens = FeedForward(num_tokens, tokens_hidden, nn.GELU, dropout)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp_channels = FeedForward(dim, channels_hidden, nn.GELU, dropout)
        self.drop_path = StochasticDepth(drop_path, mode="row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the token MLP's output is (B, D, N): one add turns it back into a contiguous (B, N, D) stream
        # (riding the add on its Linear would copy the transposed residual in, and the norm and
        # the channel MLP would each copy the transposed result out again)
        x = x + self.drop_path(self.mlp_tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2))
        if self.training:
            return x + self.drop_path(self.mlp_channels(self.norm2(x)))
        # eval: no dropout, so the channel MLP's residual add rides on its second Linear
        return self.mlp_channels(self.norm2(x), residual=x)


@register_backbone("mlp_mixer")
class MlpMixer(SingleScaleBackbone):
    """Mixer-S/B/L with any patch size, for one image size.

    ``forward``: (B, in_chans, img_size, img_size) -> ``{patch_size: (B, D, H/p, W/p)}``
    (the normed tokens as a map), or the pyramid's maps when ``pyramid_strides`` is
    given. ``forward_pooled``: (B, D), the token mean after the final norm.
    ``depth`` overrides the size's number of blocks.
    """

    repeated_blocks = (MixerBlock,)  # the units of --model.compile regional

    fixed_size_reason = "MLP-Mixer's token-mixing MLPs are sized for one grid"

    def __init__(
        self,
        size: str = "small",
        patch_size: int = 16,
        img_size: int | Sequence[int] = 224,
        in_chans: int = 3,
        mlp_ratio: tuple[float, float] = (0.5, 4.0),
        dropout: float = 0.0,
        drop_path_rate: float = 0.0,
        depth: int | None = None,
        pyramid_strides: Sequence[int] | None = None,
        pyramid_channels: int = 256,
        pyramid_norm: str = "layernorm",
        pretrained: str | None = None,
    ):
        super().__init__()
        if size not in MIXER_SIZES:
            raise ValueError(f"unknown MLP-Mixer size {size!r}; valid sizes: {', '.join(MIXER_SIZES)}")
        embed_dim, size_depth = MIXER_SIZES[size]
        depth = size_depth if depth is None else depth
        self.img_size, self.grid_size = patch_grid(img_size, patch_size)
        self.patch_size = patch_size
        self.in_chans = in_chans
        self.num_features = embed_dim
        self.patch_embed = PatchEmbed(patch_size, in_chans, embed_dim)
        num_tokens = self.grid_size[0] * self.grid_size[1]
        # the reference (timm) gives every block the same drop-path rate, not a linear ramp
        self.blocks = nn.Sequential(
            *[MixerBlock(embed_dim, num_tokens, mlp_ratio, dropout, drop_path_rate) for _ in range(depth)]
        )
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self._init_weights()
        self._finish_init(patch_size, embed_dim, pyramid_strides, pyramid_channels, pyramid_norm, pretrained)

    @torch.no_grad()
    def _init_weights(self) -> None:
        """The reference's init: xavier-uniform Linear (MLP biases ~N(0, 1e-6)), lecun-normal patch conv."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.normal_(module.bias, std=1e-6)
            elif isinstance(module, nn.Conv2d):
                std = math.sqrt(1.0 / (module.in_channels * module.kernel_size[0] * module.kernel_size[1]))
                std /= 0.87962566103423978  # std of a unit normal truncated to [-2, 2]
                nn.init.trunc_normal_(module.weight, std=std, a=-2 * std, b=2 * std)
                nn.init.zeros_(module.bias)

    def forward_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> (B, N, D), the tokens after the final norm."""
        self.check_input(x)
        if tuple(x.shape[-2:]) != self.img_size:
            raise ValueError(
                f"MlpMixer(img_size={self.img_size}, patch_size={self.patch_size}) expects input of shape "
                f"(B, {self.in_chans}, {self.img_size[0]}, {self.img_size[1]}), got {tuple(x.shape)}: its token-mixing "
                f"MLPs are sized for {self.grid_size[0]}x{self.grid_size[1]} patches; build it with another img_size"
            )
        return self.norm(self.blocks(self.patch_embed(x)))

    def forward_map(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> (B, D, H/p, W/p)."""
        tokens = self.forward_tokens(x)
        return tokens.transpose(1, 2).reshape(x.shape[0], self.num_features, *self.grid_size)

    def forward_pooled(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> (B, D), the token mean after the final norm."""
        return self.forward_tokens(x).mean(dim=1)


@register_converter("mlp_mixer", "timm", detect=lambda sd: "stem.proj.weight" in sd)
def mixer_timm_to_ours(state_dict: StateDict, backbone: nn.Module | None = None) -> StateDict:
    """timm ``mixer_*`` state dict -> canonical keys (``backbone.*`` of :class:`MlpMixer`, ``head.fc.*``).

    Only the stem differs (``stem.proj`` is our ``patch_embed.proj``).
    """
    rules = [(r"^stem\.", "patch_embed."), (r"^head\.", "head.fc."), (r"^(?!head\.)", "backbone.")]
    return rename_keys(state_dict, rules)
