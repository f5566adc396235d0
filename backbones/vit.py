"""Vision Transformer (Dosovitskiy et al., "An Image is Worth 16x16 Words", 2021), timm's layout.

Patch embedding, a class token, learned absolute position embeddings (one per
patch plus one for the class token), pre-norm transformer blocks and a final
LayerNorm; the classifier reads the class token. Every module carries timm's
name, so a timm checkpoint loads with :func:`vit_timm_to_ours`.

Image size. Position embeddings exist for the ``img_size / patch_size`` grid the
model was built for, so, like timm, ``forward`` takes exactly ``img_size`` and
raises a ``ValueError`` naming that shape otherwise. Two ways to run at another
resolution:

- build the model with the new ``img_size`` and ``pretrained=<checkpoint>``:
  position embeddings made for another grid are resampled (bicubic, as timm's
  ``resample_abs_pos_embed``) by :meth:`ViT.adapt_checkpoint`, with an info log
  line, whether the checkpoint is ours or timm's (call it yourself on a state dict
  in hand before ``load_state_dict``);
- or pass ``dynamic_img_size=True`` to resample them on every forward for any
  input whose sides are multiples of ``patch_size`` (what ViTDet-style dense
  heads with varying image sizes want).

Every block is the pre-norm :class:`layers.transformer.TransformerBlock` (GELU
feed-forward, LayerNorm epsilon 1e-6 as timm); its attention is built by name
through the attention zoo (:func:`layers.attention.build_attention`), ``"mha"``
being timm's.

Distillation token (DeiT, Touvron et al. 2021, Sec. 4; timm's ``VisionTransformerDistilled``):
``distillation_token=True`` adds a second learned token after the class token (with its own position
embedding); :meth:`ViT.forward_prefix` returns both normed tokens for a classifier and a distillation head.
Off by default: the parameters and state-dict keys of every other ViT are unchanged.

Sizes (parameters with a 1000-class head at 224 px, patch 16, DeiT Table 1 / timm):
tiny 192 wide, 3 heads, 5.72M; small 384 wide, 6 heads, 22.05M; base 768 wide,
12 heads, 86.57M; large 1024 wide, 24 blocks, 16 heads, 304.3M.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from backbones.pyramid import SingleScaleBackbone
from backbones.registry import register_backbone
from backbones.weights import StateDict, register_converter, rename_keys
from layers.transformer import TransformerBlock

log = logging.getLogger(__name__)

#: size -> (embed_dim, depth, num_heads)
VIT_SIZES: dict[str, tuple[int, int, int]] = {
    "tiny": (192, 12, 3),
    "small": (384, 12, 6),
    "base": (768, 12, 12),
    "large": (1024, 24, 16),
}


def patch_grid(img_size: int | Sequence[int], patch_size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``img_size`` (an int for square images) -> ((H, W), (H // p, W // p)), refusing images smaller than a patch."""
    size = (img_size, img_size) if isinstance(img_size, int) else (int(img_size[0]), int(img_size[1]))
    grid = (size[0] // patch_size, size[1] // patch_size)
    if min(grid) < 1:
        raise ValueError(f"img_size {size} is smaller than patch_size {patch_size}")
    return size, grid


class PatchEmbed(nn.Module):
    """(B, C, H, W) -> (B, H/p * W/p, D): non-overlapping p x p patches, linearly embedded, row-major order."""

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


def resample_pos_embed(
    pos_embed: torch.Tensor,
    new_grid: Sequence[int],
    old_grid: Sequence[int] | None = None,
    num_prefix_tokens: int = 1,
) -> torch.Tensor:
    """(1, prefix + h*w, D) -> (1, prefix + H*W, D): bicubic, antialiased resampling of the patch part.

    The prefix (class token) embeddings are kept as they are. ``old_grid`` defaults
    to a square grid. Interpolation runs in float32, as timm's does.
    """
    prefix, patches = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    if old_grid is None:
        side = math.isqrt(patches.shape[1])
        if side * side != patches.shape[1]:
            raise ValueError(f"cannot infer the grid of {patches.shape[1]} position embeddings; pass old_grid")
        old_grid = (side, side)
    old_grid, new_grid = tuple(old_grid), tuple(new_grid)
    if old_grid == new_grid:
        return pos_embed
    dim = pos_embed.shape[-1]
    grid = patches.float().reshape(1, *old_grid, dim).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=new_grid, mode="bicubic", antialias=True, align_corners=False)
    patches = grid.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], dim).to(pos_embed.dtype)
    return torch.cat([prefix, patches], dim=1)


@register_backbone("vit")
class ViT(SingleScaleBackbone):
    """ViT-Ti/S/B/L with any patch and image size.

    ``forward``: (B, in_chans, H, W) -> ``{patch_size: (B, D, H/p, W/p)}``, the patch
    tokens after the final norm laid out as a map, or the pyramid's maps when
    ``pyramid_strides`` is given (e.g. ``[8, 16, 32, 64]`` with patch 16).
    ``forward_pooled``: (B, D), the normed class token (with ``class_token=False``:
    the normed mean of the patch tokens, timm's ``global_pool="avg"``).

    ``distillation_token``: DeiT's second prefix token (see the module docstring); ``forward_pooled`` then
    averages the two normed tokens (timm's ``pre_logits``) and :meth:`forward_prefix` gives each.

    ``attention`` names any variant of the attention zoo; ``attention_kwargs`` go to
    it (Linformer and the Synthesizers need ``max_len`` = number of tokens,
    ``(H/p)*(W/p) + 1``). ``depth`` overrides the size's number of blocks.
    """

    repeated_blocks = (TransformerBlock,)  # the units of --model.compile regional
    # layer 0 of layer-wise lr decay, as timm's group_matcher (deit.py adds dist_token to the stem)
    stem_parameters = ("patch_embed.", "cls_token", "dist_token", "pos_embed")

    fixed_size_reason = "ViT's position embeddings are built for one grid"

    def __init__(
        self,
        size: str = "small",
        patch_size: int = 16,
        img_size: int | Sequence[int] = 224,
        in_chans: int = 3,
        attention: str = "mha",
        attention_kwargs: dict[str, Any] | None = None,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
        attn_dropout: float = 0.0,
        drop_path_rate: float = 0.0,
        class_token: bool = True,
        distillation_token: bool = False,
        dynamic_img_size: bool = False,
        depth: int | None = None,
        pyramid_strides: Sequence[int] | None = None,
        pyramid_channels: int = 256,
        pyramid_norm: str = "layernorm",
        pretrained: str | None = None,
    ):
        super().__init__()
        if size not in VIT_SIZES:
            raise ValueError(f"unknown ViT size {size!r}; valid sizes: {', '.join(VIT_SIZES)}")
        embed_dim, size_depth, num_heads = VIT_SIZES[size]
        depth = size_depth if depth is None else depth
        self.img_size, self.grid_size = patch_grid(img_size, patch_size)
        self.patch_size = patch_size
        self.in_chans = in_chans
        self.num_features = embed_dim
        self.dynamic_img_size = dynamic_img_size
        if distillation_token and not class_token:
            raise ValueError("distillation_token=True needs class_token=True (DeiT reads both tokens)")
        self.num_prefix_tokens = int(class_token) + int(distillation_token)

        self.patch_embed = PatchEmbed(patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if distillation_token else None
        num_tokens = self.num_prefix_tokens + self.grid_size[0] * self.grid_size[1]
        self.pos_embed = nn.Parameter(torch.zeros(1, num_tokens, embed_dim))
        self.pos_drop = nn.Dropout(dropout)
        # stochastic depth grows linearly from 0 at the first block to drop_path_rate at the last
        drop_path_rates = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]
        self.blocks = nn.Sequential(
            *[
                TransformerBlock(
                    embed_dim,
                    int(embed_dim * mlp_ratio),
                    attention,
                    num_heads,
                    dropout=dropout,
                    attn_dropout=attn_dropout,
                    drop_path=rate,
                    attention_kwargs=attention_kwargs,
                    act_layer=nn.GELU,
                    norm_eps=1e-6,
                )
                for rate in drop_path_rates
            ]
        )
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self._init_weights()
        self._finish_init(patch_size, embed_dim, pyramid_strides, pyramid_channels, pyramid_norm, pretrained)

    @torch.no_grad()
    def _init_weights(self) -> None:
        """timm's ViT init: truncated normal (std .02) Linears and position embeddings, near-zero class token."""
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        if self.dist_token is not None:
            nn.init.trunc_normal_(self.dist_token, std=0.02)  # timm's VisionTransformerDistilled.init_weights
        for module in self.blocks.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def _grid_of(self, x: torch.Tensor) -> tuple[int, int]:
        """The patch grid of input ``x``, or a ValueError naming the shape this model takes."""
        self.check_input(x)
        height, width = x.shape[-2:]
        if not self.dynamic_img_size:
            if (height, width) != self.img_size:
                raise ValueError(
                    f"ViT(img_size={self.img_size}, patch_size={self.patch_size}) expects input of shape "
                    f"(B, {self.in_chans}, {self.img_size[0]}, {self.img_size[1]}), got {tuple(x.shape)}; build it "
                    f"with img_size=({height}, {width}) (loaded position embeddings are resampled) or pass "
                    f"dynamic_img_size=True"
                )
            return self.grid_size
        if height % self.patch_size or width % self.patch_size:
            raise ValueError(
                f"ViT with dynamic_img_size expects (B, {self.in_chans}, H, W) with H and W multiples of "
                f"patch_size={self.patch_size}, got {tuple(x.shape)}"
            )
        return height // self.patch_size, width // self.patch_size

    def forward_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> (B, prefix + N, D), the tokens out of the last block (before the final norm)."""
        grid = self._grid_of(x)
        tokens = self.patch_embed(x)
        prefix = [token.expand(tokens.shape[0], -1, -1) for token in (self.cls_token, self.dist_token)
                  if token is not None]
        if prefix:
            tokens = torch.cat([*prefix, tokens], dim=1)
        pos_embed = self.pos_embed
        if grid != self.grid_size:
            pos_embed = resample_pos_embed(pos_embed, grid, self.grid_size, self.num_prefix_tokens)
        return self.blocks(self.pos_drop(tokens + pos_embed))

    def forward_map(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> (B, D, H/p, W/p): the normed patch tokens as a map."""
        patches = self.norm(self.forward_tokens(x)[:, self.num_prefix_tokens :])
        grid = (x.shape[-2] // self.patch_size, x.shape[-1] // self.patch_size)  # forward_tokens checked the size
        return patches.transpose(1, 2).reshape(x.shape[0], self.num_features, *grid)

    def forward_pooled(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> (B, D): the normed class token (or normed token mean without one; with a
        distillation token, the mean of the two normed tokens, timm's ``pre_logits``)."""
        if self.dist_token is not None:
            return self.forward_prefix(x).mean(dim=1)
        tokens = self.forward_tokens(x)
        if self.cls_token is not None:
            # every token normed, as timm: the class token alone is a strided slice, which CUDA's layer
            # norm would copy before and after (one more kernel each way than norming the whole block)
            return self.norm(tokens)[:, 0]
        return self.norm(tokens.mean(dim=1))

    def forward_prefix(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> (B, num_prefix_tokens, D): the normed class token and, with
        ``distillation_token``, the normed distillation token (what DeiT's two heads read)."""
        if not self.num_prefix_tokens:
            raise ValueError("this ViT has no class token (class_token=False): it has no prefix tokens to return")
        return self.norm(self.forward_tokens(x))[:, : self.num_prefix_tokens]

    def adapt_checkpoint(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Resample the position embeddings of a checkpoint made for another grid to this model's.

        The checkpoint's grid is taken to be square (as timm does). Embeddings of
        another width are left for the strict load to report.
        """
        pos_embed = weights.get("pos_embed")
        if pos_embed is None or pos_embed.shape == self.pos_embed.shape or pos_embed.shape[-1] != self.num_features:
            return weights
        log.info(
            "resampling position embeddings from %d to %dx%d patches",
            pos_embed.shape[1] - self.num_prefix_tokens,
            *self.grid_size,
        )
        return {**weights, "pos_embed": resample_pos_embed(pos_embed, self.grid_size, None, self.num_prefix_tokens)}


@register_converter("vit", "timm", detect=lambda sd: "patch_embed.proj.weight" in sd and "pos_embed" in sd)
def vit_timm_to_ours(state_dict: StateDict, backbone: nn.Module | None = None) -> StateDict:
    """timm ``vit_*`` / ``deit_*`` state dict -> canonical keys (``backbone.*`` of :class:`ViT`, ``head.fc.*``,
    and a distilled DeiT's ``head_dist.fc.*``).

    The names are timm's already; only ``fc_norm`` (the norm after average pooling
    of ``global_pool="avg"`` models) becomes ``norm``. Position embeddings for another
    grid are resampled when loading (:meth:`ViT.adapt_checkpoint`).
    """
    rules = [(r"^fc_norm\.", "norm."), (r"^head\.", "head.fc."), (r"^head_dist\.", "head_dist.fc."),
             (r"^(?!head\.|head_dist\.)", "backbone.")]
    return rename_keys(state_dict, rules)
