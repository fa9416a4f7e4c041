"""Vision models without tokens: a ViT (Dosovitskiy et al. 2021) and a ResNet (He et al. 2016), small ones
for tests and the published shapes for planning. Plain PyTorch (torchvision does not install beside
torch 2.13 here). Their input is images [batch, 3, H, W]; autoplan's seq_len for them is the number of
patches the first convolution makes (capture's convention: (H / stride)^2), and plans report samples/s.

Both are chains of modules: an input module (the patch embedding with the class token and positions; the
ResNet stem), the blocks (the ResNet's in one flat `blocks` Sequential, downsampling inside the first block
of each stage), an output module (norm, class token and classifier; global average pool and classifier),
each applied to the previous one's output alone. autoplan's executor cuts such a chain into pipeline
stages (execute/runner.py). A ViT block keeps q, k, v and the output projection as separate Linear layers
under `attn` and the MLP under `mlp` (as CLIP and timm's attention do after unfusing): tensor parallelism
splits them by Megatron's rule and selective recompute checkpoints `attn`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True, kw_only=True)
class ViTConfig:
    image_size: int = 32
    patch_size: int = 4
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    mlp_size: int = 256
    num_classes: int = 10

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class Attention(nn.Module):
    """Multi-head self-attention, no mask (an encoder). Views use -1 heads so a tensor-parallel rank's
    local heads fit."""

    def __init__(self, c: ViTConfig) -> None:
        super().__init__()
        h = c.hidden_size
        self.head_dim = h // c.num_heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.out_proj = nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, c: ViTConfig) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(c.hidden_size, c.mlp_size), nn.Linear(c.mlp_size, c.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class ViTBlock(nn.Module):
    """Pre-norm encoder block: x + MSA(LN(x)), then x + MLP(LN(x)) (Dosovitskiy et al. 2021, eq. 2-3)."""

    def __init__(self, c: ViTConfig) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(c.hidden_size), nn.LayerNorm(c.hidden_size)
        self.attn, self.mlp = Attention(c), MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """Patches by a strided convolution, the class token in front, learned positions added."""

    def __init__(self, c: ViTConfig) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, c.hidden_size, kernel_size=c.patch_size, stride=c.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.hidden_size))
        self.pos_embed = nn.Parameter(torch.randn(1, c.num_patches + 1, c.hidden_size) * 0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.proj(images).flatten(2).transpose(1, 2)
        return torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed


class ClassTokenHead(nn.Module):
    def __init__(self, c: ViTConfig) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(c.hidden_size), nn.Linear(c.hidden_size, c.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x)[:, 0])


class ViT(nn.Module):
    """Patch embedding (a strided convolution), class token, learned positions, blocks, head on the
    class token."""

    def __init__(self, c: ViTConfig) -> None:
        super().__init__()
        self.config = c
        self.embed = PatchEmbed(c)
        self.blocks = nn.ModuleList(ViTBlock(c) for _ in range(c.num_layers))
        self.head = ClassTokenHead(c)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.embed(images)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (stride) -> 1x1 with 4x expansion and a projection shortcut where the shape changes
    (He et al. 2016, Fig. 5 right; the stride on the 3x3 as in torchvision's ResNet v1.5)."""

    def __init__(self, cin: int, width: int, stride: int, expansion: int = 4) -> None:
        super().__init__()
        cout = width * expansion
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class Stem(nn.Module):
    """Convolution, batch norm, ReLU, and a 3x3/2 max pool when deep (He et al. 2016, Table 1 conv1)."""

    def __init__(self, width: int, *, deep: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, width, 7 if deep else 3, 2 if deep else 1, 3 if deep else 1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.pool = nn.MaxPool2d(3, 2, 1) if deep else nn.Identity()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.pool(F.relu(self.bn(self.conv(images))))


class PooledHead(nn.Module):
    """Global average pool, then the classifier."""

    def __init__(self, width: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean((2, 3)))


class ResNet(nn.Module):
    """Stem (7x7/2 convolution, 3x3/2 max pool when `deep_stem`), bottleneck stages, global average pool,
    classifier."""

    def __init__(self, stages: tuple[int, ...], widths: tuple[int, ...], *, num_classes: int = 1000,
                 stem_width: int = 64, deep_stem: bool = True) -> None:
        super().__init__()
        self.stem = Stem(stem_width, deep=deep_stem)
        blocks, cin = [], stem_width
        for i, (count, width) in enumerate(zip(stages, widths)):
            for j in range(count):
                blocks.append(Bottleneck(cin, width, 2 if j == 0 and i > 0 else 1))
                cin = width * 4
        self.blocks = nn.Sequential(*blocks)
        self.head = PooledHead(cin, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(images)))


def vit_tiny() -> ViT:
    """32x32 images, 4x4 patches (64 patches), h 64, 4 layers: for tests and CPU runs."""
    return ViT(ViTConfig())


def vit_b16() -> ViT:
    """ViT-Base/16 (Dosovitskiy et al. 2021, Table 1: 12 layers, hidden 768, MLP 3072, 12 heads) at
    224x224 (196 patches), 1000 classes."""
    return ViT(ViTConfig(image_size=224, patch_size=16, hidden_size=768, num_layers=12, num_heads=12,
                         mlp_size=3072, num_classes=1000))


def resnet_tiny() -> ResNet:
    """Two stages of two bottleneck blocks, widths 8 and 16, 3x3 stride-1 stem: for tests."""
    return ResNet((2, 2), (8, 16), num_classes=10, stem_width=16, deep_stem=False)


def resnet50() -> ResNet:
    """ResNet-50 (He et al. 2016, Table 1: stages of 3, 4, 6, 3 bottleneck blocks, widths 64-512)."""
    return ResNet((3, 4, 6, 3), (64, 128, 256, 512))


VISION_PRESETS = {"vit-tiny": vit_tiny, "vit-b16": vit_b16, "resnet-tiny": resnet_tiny, "resnet50": resnet50}
