"""A net that uses the ops whose CUDA kernels are often nondeterministic (for scripts/gpu_check.sh): convolution,
an embedding, interpolation and scaled-dot-product attention. Test code, not a model to train."""

import torch
import torch.nn.functional as F
from torch import nn


class MixedOpsNet(nn.Module):
    """``(B, 1, 8, 8)`` images -> conv -> bilinear upsampling to 16 x 16 -> 4 x 4 patches as tokens, plus an
    embedding of each patch's quantized mean intensity -> one SDPA self-attention block -> ``(B, num_classes)``.

    Args:
        channels: Width of the conv features and of the tokens.
        num_classes: Number of output logits.
    """

    def __init__(self, channels: int = 32, num_classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, channels, 3, padding=1)
        self.levels = nn.Embedding(16, channels)
        self.qkv = nn.Linear(channels, 3 * channels)
        self.proj = nn.Linear(channels, channels)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv(x))  # (B, C, 8, 8)
        h = F.interpolate(h, scale_factor=2, mode="bilinear", align_corners=False)  # (B, C, 16, 16)
        tokens = F.avg_pool2d(h, 4).flatten(2).transpose(1, 2)  # (B, 16, C)
        level = (F.avg_pool2d(x, 2).flatten(1).clamp(0, 1) * 15).long()  # (B, 16) in 0..15
        tokens = tokens + self.levels(level)
        q, k, v = self.qkv(tokens).unsqueeze(1).chunk(3, dim=-1)  # (B, 1, 16, C) each: one head
        tokens = tokens + self.proj(F.scaled_dot_product_attention(q, k, v).squeeze(1))
        return self.head(tokens.mean(1))  # (B, num_classes)


class TinyTransformer(nn.Module):
    """A pre-norm transformer encoder over ``(B, 1, 8, 8)`` images, one token per pixel (64 tokens: a linear
    embedding of the intensity plus a learned position), mean-pooled -> ``(B, num_classes)``. Attention through
    ``nn.TransformerEncoderLayer`` (SDPA). For scripts/gpu_check.sh's MFU figure: its FLOPs per step are about
    6 x parameters x tokens. Test code, not a model to train.

    Args:
        width: Model width (d_model); the feed-forward layers are 4 x as wide.
        depth: Number of encoder layers.
        heads: Attention heads per layer.
        num_classes: Number of output logits.
    """

    tokens = 64  # per sample

    def __init__(self, width: int = 64, depth: int = 2, heads: int = 4, num_classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Linear(1, width)
        self.position = nn.Parameter(torch.zeros(1, self.tokens, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x.flatten(1).unsqueeze(-1)) + self.position  # (B, 64, width)
        return self.head(self.norm(self.encoder(tokens)).mean(1))  # (B, num_classes)
