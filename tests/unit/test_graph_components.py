"""Models as DAGs of components (graph/components.py, capture_components): a LLaVA-style model splits into
vision tower -> projector -> language model with the bytes that cross, a policy with a sensor branch into
a DAG with two sources, and single-chain models stay one component equal to capture()'s graph.

Expected values are computed by hand from the configs (tiny-llava: CLIP h 32, 16x16 images of 4x4 patches
= 16 patches + a class token, MLP 64; Llama h 32, 4 heads / 2 kv heads of 8, ffn 64, 24 tokens)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from autoplan.graph.capture import capture, capture_components
from autoplan.graph.types import LayerRole
from autoplan.models import preset
from autoplan.models.multimodal import SensorPolicy, tiny_llava
from autoplan.models.vision import Bottleneck, resnet_tiny, vit_tiny

pytest.importorskip("transformers")

SEQ, MB = 24, 2
VISION, PROJ, LM = "model.vision_tower", "model.multi_modal_projector", "model.language_model"


@functools.cache
def llava():
    with torch.device("meta"):
        return capture_components(tiny_llava(), seq_len=SEQ, microbatch=MB)


def test_llava_splits_into_tower_projector_and_language_model() -> None:
    g = llava()
    assert [c.name for c in g.components] == [VISION, PROJ, LM]
    assert g.component(LM).module_paths == (LM, "lm_head")  # the head joins the model that feeds it
    assert [c.connector for c in g.components] == [False, True, False]
    assert [c.graph.seq_len for c in g.components] == [17, 16, SEQ]  # patches + class token; image tokens; text
    assert [c.graph.vocab_size for c in g.components] == [0, 0, 128]  # only the LM embeds input token ids
    assert dict(g.input_shapes) == {"input_ids": (MB, SEQ), "pixel_values": (MB, 3, 16, 16)}


def test_llava_component_parameters_are_the_modules_parameters() -> None:
    model = tiny_llava()
    by_prefix = {name: sum(p.numel() for n, p in model.named_parameters()
                           if any(n.startswith(path + ".") for path in llava().component(name).module_paths))
                 for name in (VISION, PROJ, LM)}
    assert {c.name: c.graph.num_params for c in llava().components} == by_prefix
    assert sum(by_prefix.values()) == sum(p.numel() for p in model.parameters())


def test_llava_block_flops_by_hand() -> None:
    vision = llava().component(VISION).graph.blocks
    lm = llava().component(LM).graph.blocks
    assert [b.name for b in lm] == [f"{LM}.layers.0", f"{LM}.layers.1"]
    # CLIP block: q, k, v, out (32 x 32) and fc1, fc2 (32 x 64), over 17 tokens
    assert all(b.fwd_matmul_flops == 2 * MB * 17 * (4 * 32 * 32 + 2 * 32 * 64) for b in vision)
    # Llama block: q, o (32 x 32), k, v (32 x 16), gate, up, down (32 x 64), over 24 tokens
    assert all(b.fwd_matmul_flops == 2 * MB * SEQ * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64) for b in lm)
    assert [(b.num_heads, b.num_kv_heads) for b in lm] == [(4, 2)] * 2


def test_llava_edges_carry_what_crosses() -> None:
    g = llava()
    # tower -> projector: the 16 patch features (the class token is sliced off on the tower's side), bf16;
    # projector -> LM: the 16 image features (scattered into the embeddings on the LM's side)
    assert {(e.src, e.dst): e.activation_bytes for e in g.edges} == {(VISION, PROJ): MB * 16 * 32 * 2,
                                                                     (PROJ, LM): MB * 16 * 32 * 2}
    assert list(g.dag().edges(data="activation_bytes")) == [(VISION, PROJ, 2048), (PROJ, LM, 2048)]


def test_encoder_split_for_serving() -> None:
    split = llava().encoder_split()
    assert (split.encoder_components, split.decoder_component) == ((VISION, PROJ), LM)
    assert split.handoff_bytes_per_sample == 16 * 32 * 2 and split.encoder_tokens_per_sample == 16
    names = [layer.name for layer in split.encoder.layers]
    assert names[-2:] == [f"{PROJ}.linear_1", f"{PROJ}.linear_2"]
    assert [layer.role for layer in split.encoder.layers[-2:]] == [LayerRole.HEAD] * 2  # after the tower
    assert split.encoder.num_params == llava().component(VISION).graph.num_params + llava().component(PROJ).graph.num_params


@functools.cache
def policy():
    model = SensorPolicy()
    return capture_components(model, seq_len=16, example_inputs=model.example_inputs())


def test_policy_is_a_dag_with_two_sources() -> None:
    g = policy()
    assert [c.name for c in g.components] == ["sensor", "vision", "trunk"]
    assert g.component("trunk").module_paths == ("trunk", "action_head")
    # the trunk receives 5 state tokens and 16 patch tokens of width 32, bf16
    assert {(e.src, e.dst): e.activation_bytes for e in g.edges} == {("sensor", "trunk"): 5 * 32 * 2,
                                                                     ("vision", "trunk"): 16 * 32 * 2}
    assert g.component("trunk").graph.seq_len == 21
    dag = g.dag()
    assert sorted(n for n in dag if dag.in_degree(n) == 0) == ["sensor", "vision"]


class Staged(nn.Module):
    """A ResNet written with one Sequential per stage: one block class, so one chain."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, 1, 1)
        self.stage1 = nn.Sequential(Bottleneck(16, 4, 1), Bottleneck(16, 4, 1))
        self.stage2 = nn.Sequential(Bottleneck(16, 8, 2), Bottleneck(32, 8, 1))
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.stage2(self.stage1(self.stem(x))).mean((2, 3)))


@pytest.mark.parametrize("factory,seq", [(lambda: preset("tiny-gpt"), 16), (lambda: preset("tiny-moe"), 16),
                                         (vit_tiny, 64), (resnet_tiny, 64), (Staged, 64)],
                         ids=["gpt", "moe-experts-nested", "vit", "resnet", "resnet-stages"])
def test_single_chain_models_are_one_component_equal_to_capture(factory, seq: int) -> None:
    g = capture_components(factory(), seq_len=seq)
    assert len(g.components) == 1 and not g.edges
    assert g.components[0].graph == capture(factory(), seq_len=seq)


def test_component_graph_rejects_edges_against_the_order() -> None:
    from autoplan.graph.types import ComponentEdge, ComponentGraph

    c = llava().components
    with pytest.raises(ValueError, match="against the forward order"):
        ComponentGraph(model_name="x", components=c, edges=(ComponentEdge(src=LM, dst=VISION, activation_bytes=1),))
