"""Plan a small CNN (no tokens): the planner reports samples/s and the input shape it assumed.

A model whose first layer is a Conv2d is captured on a square image: seq_len is the number of pixel
positions the first convolution sees (side^2), so seq_len=1024 means 3 x 32 x 32 images here. Pass
`example_inputs` to autoplan.capture for another shape.

    python examples/plan_cnn.py
    autoplan plan --model examples/plan_cnn.py:make --cluster local-cpu --global-batch 64 --seq-len 1024
"""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """conv 3x3 -> ReLU -> conv 3x3, plus the input (a ResNet basic block without normalisation)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(torch.relu(self.conv1(x)))


class TinyCNN(nn.Module):
    def __init__(self, channels: int = 32, num_blocks: int = 4, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList(Block(channels) for _ in range(num_blocks))
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def make() -> nn.Module:
    return TinyCNN()


if __name__ == "__main__":
    import autoplan

    with torch.device("meta"):
        model = make()
    plans = autoplan.autoplan(model, "local-cpu", global_batch=64, seq_len=1024, top_k=3)
    print(plans)
    print(plans[0].explain())
