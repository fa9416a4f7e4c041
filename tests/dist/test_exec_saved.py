"""What autograd keeps for the backward in autoplan's executor, on gloo, against the engine facts the cost
model prices them by (plan.engine.Engine; cost/memory.block_activation_bytes): with sequence parallelism
the column-parallel linears keep their all-gathered input (sp_saves_gathered_input), grouped-query K / V
are kept repeated to the query heads (attention_saves_repeated_kv), and the all-gather context-parallel
core keeps the gathered K / V of the keys it attends (cp_saves_gathered_kv)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # (DTensor imports it on first use: ~5 s per forked rank unless done here)
from autograd_saved import saved_tensors
from harness import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from autoplan.plan.engine import Engine

pytestmark = pytest.mark.dist

B, S = 2, 32  # tiny-llama: h 64, 8 heads of 8 over 4 kv heads, SwiGLU 128


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _storage(t: torch.Tensor) -> int:
    return _local(t).untyped_storage().data_ptr()


def _saved(out: torch.Tensor, params: set[int]) -> list[tuple[object, str, torch.Tensor]]:
    """(node, attribute, tensor) of every tensor the autograd graph behind `out` saved, parameters left out."""
    return [(node, name, _local(t)) for node, name, t in saved_tensors(out) if _storage(t) not in params]


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _block_saved(rank: int, world_size: int, mode: str) -> dict[str, object]:
    from autoplan.execute.context import apply_context_parallel, zigzag_positions
    from autoplan.execute.tensor_parallel import _parallelize_block
    from autoplan.models import preset

    torch.manual_seed(0)
    model = preset("tiny-llama")
    block, h = model.layers["0"], model.config.hidden_size
    x = torch.randn(B, S, h)
    if mode == "tp_sp":
        _parallelize_block(block, init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))["tp"], sp=True)
        x = x.chunk(world_size, dim=1)[rank].clone()
    else:
        apply_context_parallel(model, cp_mesh=init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))["cp"])
        block.attn.positions = zigzag_positions(S, world_size, rank)
        x = x[:, :S // world_size].clone()
    params = {_storage(p) for p in block.parameters()}
    rows = _saved(_local(block(x.requires_grad_())), params)
    # the inputs of the column-parallel projections: the matmuls whose other operand is wq / wk / wv / w1 / w3
    column = {_storage(m.weight) for m in (block.attn.wq, block.attn.wk, block.attn.wv, block.mlp.w1, block.mlp.w3)}
    linear_inputs = [t for node, name, t in rows if type(node).__name__ == "MmBackward0" and name == "_saved_self"
                     and _storage(node._saved_mat2) in column]
    kv = [t for node, name, t in rows
          if "ScaledDotProduct" in type(node).__name__ and name in ("_saved_key", "_saved_value")]
    return {"linear_input_bytes": _storage_bytes(linear_inputs), "kv_bytes": _storage_bytes(kv),
            "kv_heads": sorted({t.shape[1] for t in kv}), "kv_keys": sorted({t.shape[2] for t in kv})}


def test_sequence_parallel_linears_keep_their_gathered_input() -> None:
    """tp 2 with SP: the QKV and the MLP input projections keep B x S x h each (the whole sequence, fp32),
    as the autoplan engine says, not Megatron's B x S/tp x h shard; K / V are kept at the local query heads
    (8 / 2 = 4, repeated from 2 kv heads)."""
    assert Engine.load("autoplan").sp_saves_gathered_input and Engine.load("autoplan").attention_saves_repeated_kv
    h = 64
    for result in run_ranks(_block_saved, 2, "tp_sp"):
        assert result["linear_input_bytes"] == 2 * B * S * h * 4
        assert result["kv_heads"] == [4]


def test_allgather_context_parallel_keeps_the_gathered_kv() -> None:
    """cp 2 (zig-zag, chunks of 8): cp rank 0's late chunk attends all 32 keys, rank 1's 24, and SDPA keeps
    that K and V (8 query heads x 8, fp32) as the autoplan engine says: on rank 0, 2 x B x S x h x 4 bytes,
    the whole sequence the cost model prices on the busiest cp rank."""
    assert Engine.load("autoplan").cp_saves_gathered_kv
    h, c = 64, S // 4
    results = run_ranks(_block_saved, 2, "cp")
    for rank, result in enumerate(results):
        assert result["kv_keys"][-1] == (4 - rank) * c
        assert result["kv_bytes"] == 2 * B * (4 - rank) * c * h * 4
    assert results[0]["kv_bytes"] == 2 * B * S * h * 4
