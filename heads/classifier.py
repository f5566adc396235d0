"""Image classification head."""
from __future__ import annotations

import torch
import torch.nn as nn


class ClassifierHead(nn.Module):
    """Dropout then a linear layer: (B, in_features) -> (B, num_classes).

    Pooling is the backbone's ``forward_pooled`` (global average for convnets and
    MobileViT, the class token for ViT), because it is part of each reference
    architecture. The layer is named ``fc`` as in timm, so checkpoints map 1:1.
    """

    def __init__(self, in_features: int, num_classes: int, dropout: float = 0.0):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(in_features, num_classes)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.fc(self.dropout(pooled))
