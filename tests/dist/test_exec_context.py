"""Context parallelism on gloo against the single-process model: cp2 (and cp4) with causal attention on the
zig-zag split (rank r holds chunks r and 2cp-1-r of 2*cp), on tiny-gpt (learned positions) and tiny-llama
(RoPE, grouped-query attention) over several SGD steps, with the all-gather and the ring core, and a
cp2 x dp2 FSDP plan through apply_plan (cp with ep and pp: test_exec_experts.py)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # (DTensor imports it on first use: ~5 s per forked rank unless done here)
import torch.distributed as dist
import torch.nn.functional as F
from harness import assert_matches_reference, reference, run_plan, run_ranks
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autoplan.execute.context import CP_VARIANTS, apply_context_parallel
from autoplan.models import preset
from autoplan.plan.types import ParallelConfig

pytestmark = pytest.mark.dist

SEED, BATCH, SEQ, STEPS, LR = 0, 4, 32, 3, 0.5


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 128, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(SEED * 1000 + step))


def _train(model: torch.nn.Module, *, replica: int = 0, num_replicas: int = 1, cp_rank: int = 0, cp: int = 1,
           grad_mesh: DeviceMesh | None = None) -> list[float]:
    """SGD steps; rank (replica, cp_rank) takes its batch rows and its zig-zag sequence positions.
    grad_mesh: average plain-tensor gradients over it by hand (no data-parallel wrapper)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):
        tokens = _batch(step).chunk(num_replicas)[replica]
        chunks = tokens[:, :-1].chunk(2 * cp, dim=1), tokens[:, 1:].chunk(2 * cp, dim=1)
        inputs, targets = (torch.cat([part[cp_rank], part[2 * cp - 1 - cp_rank]], dim=1) for part in chunks)
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        if grad_mesh is not None:
            for param in model.parameters():
                dist.all_reduce(param.grad, op=dist.ReduceOp.AVG, group=grad_mesh.get_group())
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        if num_replicas * cp > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    return losses


def _reference(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(SEED)
    model = preset(name)
    losses = _train(model)
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _cp_run(rank: int, world_size: int, name: str, variant: str
            ) -> tuple[list[float], dict[str, torch.Tensor], list[list[int]]]:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    torch.manual_seed(SEED)
    model = preset(name)
    apply_context_parallel(model, cp_mesh=mesh["cp"], variant=variant)
    assert all(isinstance(block.attn.core, CP_VARIANTS[variant]) for block in model.layers.values())
    losses = _train(model, cp_rank=rank, cp=world_size, grad_mesh=mesh["cp"])
    modules = [model.embed, *(block.attn for block in model.layers.values())]
    return losses, {n: p.detach() for n, p in model.named_parameters()}, [m.positions.tolist() for m in modules]


def _check(results: list, ref_losses: list[float], ref_params: dict[str, torch.Tensor]) -> None:
    for losses, params, *_ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        assert params.keys() == ref_params.keys()
        for name, param in params.items():
            torch.testing.assert_close(param, ref_params[name], msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("name,cp,variant", [
    ("tiny-gpt", 2, "allgather"), ("tiny-llama", 2, "allgather"), ("tiny-llama", 4, "allgather"),
    ("tiny-gpt", 4, "allgather"), ("tiny-llama", 2, "ring"), ("tiny-gpt", 4, "ring"), ("tiny-llama", 4, "ring"),
])
def test_cp_training_equals_reference(name: str, cp: int, variant: str) -> None:
    ref_losses, ref_params = _reference(name)
    results = run_ranks(_cp_run, cp, name, variant)
    _check(results, ref_losses, ref_params)
    chunk = SEQ // (2 * cp)
    for rank, (*_, positions) in enumerate(results):  # chunks rank and 2cp-1-rank of 2*cp
        expected = [*range(rank * chunk, (rank + 1) * chunk), *range((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)]
        assert all(p == expected for p in positions)


def test_cp2_dp2_fsdp_plan_trains_like_the_reference() -> None:
    """Through apply_plan and the training loop: dense weights FSDP-sharded over the flattened dp*cp ranks."""
    assert_matches_reference(run_plan("tiny-llama", ParallelConfig(cp=2, dp=2, zero=3), steps=3),
                             reference("tiny-llama", steps=3))


def test_cp_rejects_a_second_application() -> None:
    def twice(rank: int, world_size: int) -> str:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
        model = preset("tiny-gpt")
        apply_context_parallel(model, cp_mesh=mesh["cp"])
        with pytest.raises(ValueError, match="already ContextParallelCore"):
            apply_context_parallel(model, cp_mesh=mesh["cp"])
        return "raised"

    assert run_ranks(twice, 2) == ["raised", "raised"]
