"""Expert parallelism on gloo against the single-process tiny-moe: outputs and gradients under ep2 / ep4 (the
expert gradients check the 1/ep scale: the all-to-all backward already sums over the ep group), and plans
combining ep with dp (FSDP2, replicate), cp and pp trained over several steps."""

from __future__ import annotations

import time

import pytest
import torch
import torch._dynamo  # (DTensor imports it on first use: ~5 s per forked rank unless done here)
import torch.distributed as dist
import torch.nn.functional as F
from harness import assert_matches_reference, reference, run_plan, run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from autoplan.execute.experts import ExpertParallel, apply_experts, expert_parallel_modules
from autoplan.models import preset
from autoplan.plan.types import ParallelConfig

pytestmark = pytest.mark.dist

MODEL, SEED, BATCH, SEQ = "tiny-moe", 0, 8, 16


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 128, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(SEED * 1000 + step))


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)), logits


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _reference_grads() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(SEED)
    model = preset(MODEL)
    _, logits = _loss(model, _batch(0))
    _loss(model, _batch(0))[0].backward()
    return logits.detach(), {n: p.grad if p.grad is not None else torch.zeros_like(p)
                             for n, p in model.named_parameters()}


def _ep_grads(rank: int, world_size: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], float]:
    start = time.perf_counter()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    torch.manual_seed(SEED)
    model = preset(MODEL)
    apply_experts(model, ep_mesh=mesh["ep"])
    assert len(expert_parallel_modules(model)) == model.config.num_layers - model.config.num_dense_layers
    loss, logits = _loss(model, _batch(0).chunk(world_size)[rank])
    loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        if isinstance(param.grad, DTensor):  # expert shards: the full gradient, no averaging
            grads[name] = param.grad.full_tensor()
        else:  # dense: average over the replicas, as data parallelism would
            grads[name] = param.grad.clone()
            dist.all_reduce(grads[name], op=dist.ReduceOp.AVG)
    return logits.detach(), grads, time.perf_counter() - start


@pytest.mark.parametrize("ep", [2, 4])
def test_ep_outputs_and_gradients_equal_reference(ep: int) -> None:
    ref_logits, ref_grads = _reference_grads()
    results = run_ranks(_ep_grads, ep)
    for rank, (logits, grads, _) in enumerate(results):
        torch.testing.assert_close(logits, ref_logits.chunk(ep)[rank])
        assert grads.keys() == ref_grads.keys()  # expert weights keep their FQNs
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], msg=lambda m, n=name: f"{n}: {m}")
    print(f"ep{ep}: {max(r[2] for r in results):.2f} s per rank")


def _skewed_routing(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """ExpertParallel alone with routing that leaves rank 1's experts without any token (zero splits both
    ways, an expert run on zero rows) and sends rank 0's tokens unevenly."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    experts, x, topk_idx, topk_weight, probe = _skewed_inputs()
    layer = ExpertParallel(experts, mesh["ep"])
    x = x[rank].requires_grad_()
    out = layer(x, topk_idx[rank], topk_weight[rank])
    (out * probe[rank]).sum().backward()
    return out.detach(), x.grad, {n: p.grad.full_tensor() for n, p in layer.named_parameters()}


def _skewed_inputs() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(SEED)
    experts = preset(MODEL).layers["1"].mlp.experts  # 4 experts; ep2: rank 0 owns 0, 1 and rank 1 owns 2, 3
    for weight in (experts.w1, experts.w2, experts.w3):
        torch.nn.init.normal_(weight, std=0.2)
    x = torch.randn(2, 5, experts.w1.shape[2])
    topk_idx = torch.tensor([[[0, 1], [1, 0], [0, 1], [1, 0], [0, 1]],  # rank 0: nothing for rank 1's experts
                             [[0, 1], [1, 0], [0, 1], [1, 0], [1, 0]]])  # rank 1: likewise
    topk_weight = torch.softmax(torch.randn(2, 5, 2), dim=-1)
    return experts, x, topk_idx, topk_weight, torch.randn(2, 5, x.shape[-1])  # probe: loss = sum(out * probe)


def test_ep_with_zero_splits_equals_reference() -> None:
    experts, x, topk_idx, topk_weight, probe = _skewed_inputs()
    x = x.requires_grad_()
    outs = [experts(x[r], topk_idx[r], topk_weight[r]) for r in range(2)]
    # the loss of both ranks together; expert weights are scaled by 1/ep like any data-parallel mean
    sum((out * probe[r]).sum() for r, out in enumerate(outs)).backward()
    results = run_ranks(_skewed_routing, 2)
    for rank, (out, x_grad, grads) in enumerate(results):
        torch.testing.assert_close(out, outs[rank].detach())
        torch.testing.assert_close(x_grad, x.grad[rank])
        for name, grad in grads.items():
            ref = getattr(experts, name).grad
            torch.testing.assert_close(grad, (torch.zeros_like(ref) if ref is None else ref) / 2, msg=name)
        assert grads["w1"][2:].abs().sum() == 0  # rank 1's experts saw no token: zero, not missing, gradients


@pytest.mark.parametrize("config", [
    ParallelConfig(ep=2, dp=2, zero=3),
    ParallelConfig(ep=2, dp=2, zero=0),
    ParallelConfig(pp=2, ep=2, cp=2, zero=2, microbatch=2),
], ids=["ep2xdp2-fsdp", "ep2xdp2-replicate", "pp2xep2xcp2-zero2"])
def test_moe_plans_train_like_the_reference(config: ParallelConfig) -> None:
    """Through apply_plan and the training loop (3 AdamW steps): experts FSDP-sharded / replicated over dp
    (and cp) only, dense weights over dp*ep*cp; and with pipeline stages holding some MoE blocks."""
    assert_matches_reference(run_plan(MODEL, config, steps=3), reference(MODEL, steps=3))


def test_ep_degree_must_divide_experts() -> None:
    def build(rank: int, world_size: int) -> str:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
        torch.manual_seed(SEED)
        model = preset(MODEL, num_experts=6)  # 6 experts, ep 4
        with pytest.raises(ValueError, match="ep=4 does not divide the 6 experts"):
            apply_experts(model, ep_mesh=mesh["ep"])
        return "raised"

    assert run_ranks(build, 4) == ["raised"] * 4
    assert ExpertParallel.__doc__  # documented module
