"""The activation memory the cost model prices for autoplan's executor (cost.memory.block_activation_bytes,
engine autoplan) against what autograd really keeps for one block of the executor's model: every distinct
storage the backward graph saved, found by walking it (one process, fp32, no parallelism).

The executor runs GPT blocks without dropout where the cost model prices Megatron's GPT with its two 1-byte
masks (BlockShape.dropout); the GPT check takes those out. What stays unpriced, under 2 %: the norms' mean /
rstd, FlashAttention's logsumexp and RoPE's cos / sin (per token a few elements against tens of h)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from autograd_saved import saved_tensors

from autoplan.cost.compute import BlockShape
from autoplan.cost.memory import block_activation_bytes
from autoplan.models import preset
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig, Recompute

B, S = 4, 64


def _saved_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages the backward of model.layers['0'] keeps, its input included, weights not."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    out = model.layers["0"](x)
    out = out[0] if isinstance(out, tuple) else out
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for _, _, t in saved_tensors(out)
                if t.untyped_storage().data_ptr() not in params}
    return sum(storages.values())


def _shape(name: str) -> tuple[torch.nn.Module, BlockShape]:
    torch.manual_seed(0)
    model = preset(name)
    c = model.config
    return model, BlockShape(h=c.hidden_size, a=c.num_heads, g=c.num_kv_heads or c.num_heads,
                             f=c.ffn_hidden_size, n_mlp=3 if c.family == "llama" else 2)


def _priced(shape: BlockShape, engine: Engine) -> float:
    held, _ = block_activation_bytes(shape, B, S, ParallelConfig(), Recompute.NONE, 4, False, engine=engine)
    return held


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt", "small-gpt"])
def test_priced_activations_equal_what_the_executor_saves(name: str) -> None:
    model, shape = _shape(name)
    x = torch.randn(B, S, shape.h, requires_grad=True)
    measured = _saved_bytes(model, x)
    priced = _priced(shape, Engine())
    if shape.dropout:  # the two 1-byte masks per hidden element, at the formula's dtype scaling (x 4 / 2)
        priced -= B * S * 2.0 * shape.h * 4 / 2
    assert abs(priced - measured) / measured < 0.02, (priced, measured)


def test_eager_rmsnorm_and_swiglu_extras_are_the_tensors_autograd_keeps() -> None:
    # without the two facts the Llama block is priced at Korthikanti's count, 2h + 2f elements per token short
    _, shape = _shape("tiny-llama")
    bare = dataclasses.replace(Engine(), rmsnorm_saves_normalized=False, swiglu_saves_activation=False)
    extra = _priced(shape, Engine()) - _priced(shape, bare)
    assert extra == B * S * (2 * shape.h + shape.f) * 4  # x * rstd of both norms, silu(w1 x): fp32
    _, gpt = _shape("tiny-gpt")
    assert _priced(gpt, Engine()) == _priced(gpt, bare)  # LayerNorm and GELU: neither applies
