"""Plain networks, free of Lightning: pick one with ``model.net.class_path`` in a config."""

from collections.abc import Sequence

import torch
from torch import nn


class MLP(nn.Module):
    """Flattens the image and applies ``Linear -> ReLU -> Dropout`` blocks, then a linear classifier.

    Args:
        in_features: Pixels per image (8 x 8 = 64 for the digits).
        hidden_sizes: Width of each hidden layer.
        num_classes: Number of output logits.
        dropout: Dropout probability after each hidden layer.
    """

    def __init__(
        self,
        in_features: int = 64,
        hidden_sizes: Sequence[int] = (256, 256),
        num_classes: int = 10,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for hidden in hidden_sizes:
            layers += [nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(dropout)]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, num_classes)
        return self.layers(x)


class CNN(nn.Module):
    """Two 3x3 conv blocks and a linear classifier, for small images such as the 8 x 8 digits.

    GroupNorm rather than BatchNorm: it has no running buffers, so DDP has nothing to broadcast in forward and
    ranks may run different numbers of validation batches without a collective getting out of step.

    Args:
        in_channels: Channels of the input image.
        channels: Channels of the first conv block; the second has twice as many.
        num_classes: Number of output logits.
        dropout: Dropout probability before the classifier.
    """

    def __init__(self, in_channels: int = 1, channels: int = 32, num_classes: int = 10, dropout: float = 0.1) -> None:
        super().__init__()

        def block(c_in: int, c_out: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.GroupNorm(8, c_out), nn.ReLU())

        self.features = nn.Sequential(
            block(in_channels, channels),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
            block(channels, 2 * channels),
            nn.AdaptiveMaxPool2d(2),  # (B, 2C, 2, 2): keeps where in the image a stroke is
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(8 * channels, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, num_classes)
        return self.head(self.features(x))
