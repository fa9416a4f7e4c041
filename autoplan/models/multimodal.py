"""Models with components: a LLaVA-style image-text model (Hugging Face transformers' LlavaForConditional-
Generation: a CLIP vision tower, a two-layer MLP projector, a Llama language model) and a policy with a
vision branch and a separate sensor branch feeding one trunk (plain PyTorch).

The LLaVA factories need transformers (the `hf` extra); they build on the current default device, so
`with torch.device("meta"): llava_1_5_7b()` costs no memory.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autoplan.models.vision import ViTBlock, ViTConfig


def llava(vision: dict[str, Any], text: dict[str, Any], **config: Any) -> nn.Module:
    """LlavaForConditionalGeneration from a CLIPVisionConfig and a LlamaConfig (keyword dicts)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    cfg = LlavaConfig(vision_config=CLIPVisionConfig(**vision), text_config=LlamaConfig(**text), **config)
    return LlavaForConditionalGeneration(cfg)


def tiny_llava() -> nn.Module:
    """CLIP tower (16x16 images, 4x4 patches: 16 image tokens, h 32, 2 layers) + projector + Llama (h 32,
    4 heads / 2 kv heads, 2 layers, vocabulary 128, the last id the image token). Every vision layer
    feeds the projector (vision_feature_layer -1), so every block gets a gradient."""
    return llava(
        {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "image_size": 16, "patch_size": 4, "projection_dim": 32},
        {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 128, "tie_word_embeddings": False},
        image_token_id=127, projector_hidden_act="gelu", vision_feature_layer=-1,
    )


def llava_1_5_7b() -> nn.Module:
    """LLaVA-1.5-7B's shapes (Liu et al. 2023, "Improved Baselines with Visual Instruction Tuning"): CLIP
    ViT-L/14 at 336 px (24 layers, hidden 1024, MLP 4096, 16 heads: 576 image tokens, the second-last
    layer's features), an MLP projector with GELU, Vicuna-7B = Llama-2-7B (32 layers, hidden 4096, 32
    heads, ffn 11008; Touvron et al. 2023) with the vocabulary of 32064 of llava-hf/llava-1.5-7b-hf's
    config (Vicuna's 32000 plus the image and padding tokens), image token 32000."""
    return llava(
        {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
         "image_size": 336, "patch_size": 14, "projection_dim": 768},
        {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
         "num_key_value_heads": 32, "vocab_size": 32064, "max_position_embeddings": 4096,
         "tie_word_embeddings": False},
        image_token_id=32000, projector_hidden_act="gelu", vision_feature_layer=-2,
    )


class SensorBlock(nn.Module):
    """Residual MLP block of the sensor branch."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class TrunkBlock(ViTBlock):
    """The policy trunk's transformer block (its own class: a family apart from the vision branch)."""


class VisionBranch(nn.Module):
    def __init__(self, c: ViTConfig) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, c.hidden_size, kernel_size=c.patch_size, stride=c.patch_size)
        self.blocks = nn.ModuleList(ViTBlock(c) for _ in range(c.num_layers))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        return x


class SensorBranch(nn.Module):
    def __init__(self, state_size: int, width: int, depth: int) -> None:
        super().__init__()
        self.proj = nn.Linear(state_size, width)
        self.blocks = nn.ModuleList(SensorBlock(width) for _ in range(depth))

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        x = self.proj(state)
        for block in self.blocks:
            x = block(x)
        return x


class SensorPolicy(nn.Module):
    """images [b, 3, H, W] -> vision branch (patch tokens); state [b, T, state_size] -> sensor branch
    (T = state_steps tokens); both token sets concatenated -> trunk -> actions from the mean token."""

    def example_inputs(self, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs of the shapes the model takes (for capture's example_inputs)."""
        return (torch.zeros(batch, 3, self.image_size, self.image_size),
                torch.zeros(batch, self.state_steps, self.sensor.proj.in_features))

    def __init__(self, *, image_size: int = 16, patch_size: int = 4, width: int = 32, state_size: int = 12,
                 vision_depth: int = 2, sensor_depth: int = 2, trunk_depth: int = 3, num_actions: int = 6,
                 state_steps: int = 5) -> None:
        super().__init__()
        self.image_size, self.state_steps = image_size, state_steps
        c = ViTConfig(image_size=image_size, patch_size=patch_size, hidden_size=width, num_layers=vision_depth,
                      num_heads=4, mlp_size=4 * width)
        self.vision = VisionBranch(c)
        self.sensor = SensorBranch(state_size, width, sensor_depth)
        self.trunk = nn.ModuleList(TrunkBlock(ViTConfig(hidden_size=width, num_heads=4, mlp_size=4 * width))
                                   for _ in range(trunk_depth))
        self.action_head = nn.Linear(width, num_actions)

    def forward(self, images: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.sensor(state), self.vision(images)], dim=1)
        for block in self.trunk:
            x = block(x)
        return self.action_head(x.mean(1))


MULTIMODAL_PRESETS = {"tiny-llava": tiny_llava, "llava-1.5-7b": llava_1_5_7b, "tiny-policy": SensorPolicy}
