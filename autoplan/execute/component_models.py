"""How to run a model with components one component at a time: a Program of stages (one per component of
the ComponentGraph, named alike), its seeded data and its loss.

A stage holds the model's own submodules (parameters are the same objects), so training the stages is
training the model; `original_name` maps a stage's parameter names back to the model's. Programs exist
for the LLaVA family (transformers' LlavaForConditionalGeneration: the vision tower's selected hidden
state, the projector, the language model with the image features scattered into the image tokens'
embeddings, as LlavaModel.forward does) and for models/multimodal.SensorPolicy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from autoplan.execute.recompute import original_fqn
from autoplan.execute.train import step_generator

IGNORE = -100  # cross-entropy targets that do not count (image positions)


@dataclass
class Stage:
    """One component as a runnable module: module(*batch[fields], *outputs of `needs`) -> its output."""

    name: str
    module: nn.Module
    fields: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    block_lists: tuple[str, ...] = ()  # attribute paths (in module) of the ModuleLists of repeated blocks
    prefixes: dict[str, str] = field(default_factory=dict)  # first name part -> the model's prefix; "" = all

    def original_name(self, name: str) -> str:
        name = original_fqn(name)
        if "" in self.prefixes:
            return f"{self.prefixes['']}.{name}"
        head, _, rest = name.partition(".")
        return f"{self.prefixes.get(head, head)}.{rest}" if rest else self.prefixes.get(head, head)


@dataclass
class Program:
    """The stages in forward order (the last one's output goes to `loss`), the data and the loss."""

    stages: tuple[Stage, ...]
    make_batch: Callable[[int, int, int], dict[str, torch.Tensor]]  # (seed, step, global_batch) -> fields
    loss: Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]  # mean over the rows given

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise ValueError(f"the model has no component {name!r}: it has {[s.name for s in self.stages]}")


# --- LLaVA (transformers) ----------------------------------------------------------------------------

class LlavaVision(nn.Module):
    """The vision tower's hidden state at vision_feature_layer, without the class token under 'default'
    (transformers' LlavaModel.get_image_features)."""

    def __init__(self, tower: nn.Module, layer: int, strategy: str) -> None:
        super().__init__()
        self.vision_tower, self.layer, self.strategy = tower, layer, strategy

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.vision_tower(pixel_values, output_hidden_states=True, return_dict=True)
        features = out.hidden_states[self.layer]
        return (features[:, 1:] if self.strategy == "default" else features).contiguous()


class LlavaText(nn.Module):
    """Token embeddings with the image features in the image tokens' places, the language model, lm_head."""

    def __init__(self, language_model: nn.Module, lm_head: nn.Module, image_token_id: int) -> None:
        super().__init__()
        self.language_model, self.lm_head, self.image_token_id = language_model, lm_head, image_token_id

    def forward(self, input_ids: torch.Tensor, image_features: torch.Tensor) -> torch.Tensor:
        embeds = self.language_model.get_input_embeddings()(input_ids)
        mask = (input_ids == self.image_token_id).unsqueeze(-1)
        embeds = embeds.masked_scatter(mask, image_features.to(embeds.dtype))
        hidden = self.language_model(inputs_embeds=embeds, use_cache=False).last_hidden_state
        return self.lm_head(hidden)


def llava_batch(config, seed: int, step: int, global_batch: int, seq_len: int) -> dict[str, torch.Tensor]:
    """pixel_values [B, C, H, W] ~ N(0, 1); input_ids [B, seq_len]: the image's tokens first, then text
    ids drawn uniformly below image_token_id; labels: the next token, IGNORE where it is an image token
    (every row has the same number of counted targets, so per-row means average exactly)."""
    from autoplan.graph.components import num_image_tokens

    g = step_generator(seed, step)
    vision = config.vision_config
    pixels = torch.randn(global_batch, int(getattr(vision, "num_channels", 3)), vision.image_size,
                         vision.image_size, generator=g)
    n = num_image_tokens(config)
    if seq_len <= n:
        raise ValueError(f"seq_len {seq_len} leaves no text after the {n} image tokens: use seq_len > {n}")
    text = torch.randint(0, config.image_token_id, (global_batch, seq_len + 1 - n), generator=g)
    ids = torch.cat([torch.full((global_batch, n), config.image_token_id), text], dim=1)
    labels = ids[:, 1:].masked_fill(ids[:, 1:] == config.image_token_id, IGNORE)
    return {"pixel_values": pixels, "input_ids": ids[:, :-1].contiguous(), "labels": labels.contiguous()}


def token_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=IGNORE)


def llava_program(model: nn.Module, seq_len: int) -> Program:
    c = model.config
    vision = Stage(name="model.vision_tower", fields=("pixel_values",), block_lists=("vision_tower.encoder.layers",),
                   module=LlavaVision(model.model.vision_tower, c.vision_feature_layer, c.vision_feature_select_strategy),
                   prefixes={"vision_tower": "model.vision_tower"})
    projector = Stage(name="model.multi_modal_projector", module=model.model.multi_modal_projector,
                      needs=("model.vision_tower",), prefixes={"": "model.multi_modal_projector"})
    text = Stage(name="model.language_model", fields=("input_ids",), needs=("model.multi_modal_projector",),
                 module=LlavaText(model.model.language_model, model.lm_head, c.image_token_id),
                 block_lists=("language_model.layers",),
                 prefixes={"language_model": "model.language_model", "lm_head": "lm_head"})
    return Program(stages=(vision, projector, text), loss=token_loss,
                   make_batch=lambda seed, step, b: llava_batch(c, seed, step, b, seq_len))


# --- the sensor-branch policy --------------------------------------------------------------------------

class PolicyTrunk(nn.Module):
    def __init__(self, trunk: nn.ModuleList, head: nn.Module) -> None:
        super().__init__()
        self.trunk, self.action_head = trunk, head

    def forward(self, sensor: torch.Tensor, vision: torch.Tensor) -> torch.Tensor:
        x = torch.cat([sensor, vision], dim=1)
        for block in self.trunk:
            x = block(x)
        return self.action_head(x.mean(1))


def policy_batch(model: nn.Module, seed: int, step: int, global_batch: int) -> dict[str, torch.Tensor]:
    """images, state [B, state_steps, state_size] and target actions, all ~ N(0, 1)."""
    g = step_generator(seed, step)
    images = torch.randn(global_batch, 3, model.image_size, model.image_size, generator=g)
    state = torch.randn(global_batch, model.state_steps, model.sensor.proj.in_features, generator=g)
    actions = torch.randn(global_batch, model.action_head.out_features, generator=g)
    return {"images": images, "state": state, "actions": actions}


def policy_program(model: nn.Module) -> Program:
    stages = (Stage(name="sensor", module=model.sensor, fields=("state",), block_lists=("blocks",),
                    prefixes={"": "sensor"}),
              Stage(name="vision", module=model.vision, fields=("images",), block_lists=("blocks",),
                    prefixes={"": "vision"}),
              Stage(name="trunk", module=PolicyTrunk(model.trunk, model.action_head), needs=("sensor", "vision"),
                    block_lists=("trunk",), prefixes={}))
    return Program(stages=stages, loss=lambda out, batch: F.mse_loss(out, batch["actions"]),
                   make_batch=lambda seed, step, b: policy_batch(model, seed, step, b))


def program_for(model: nn.Module, seq_len: int) -> Program:
    """The Program of a supported model (seq_len: the LLaVA text length, image tokens included);
    ValueError naming what is supported otherwise."""
    from autoplan.models.multimodal import SensorPolicy

    if isinstance(model, SensorPolicy):
        return policy_program(model)
    if type(model).__name__ == "LlavaForConditionalGeneration":
        return llava_program(model, seq_len)
    raise ValueError(f"no component program for {type(model).__name__}: components run for transformers' "
                     f"LlavaForConditionalGeneration and autoplan.models.multimodal.SensorPolicy")
