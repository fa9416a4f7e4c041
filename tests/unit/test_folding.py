"""MoE parallel folding: the config fields (defaults are today's layout), the expert mesh against
Megatron-Core's own rank generator, the folded layer cost against hand computations, and the folded
candidates of the search space (every one priced by the quick estimate as by the exact cost model)."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from test_cost_graph_helper import a100_cluster, gpt_graph

from autoplan import cost
from autoplan.cost import estimate_config, estimate_layer, expert_placement
from autoplan.plan.engine import Engine
from autoplan.plan.layout import divisibility_errors, expert_mesh_shape
from autoplan.plan.types import ParallelConfig, Recompute
from autoplan.search.folding import expert_layouts
from autoplan.search.space import SearchOptions, enumerate_space
from autoplan.search.surrogate import quick_estimate

MOE = gpt_graph(h=512, a=8, layers=4, seq=256, vocab=1024, experts=8, top_k=2, unfused=False)


# --- the config ------------------------------------------------------------------------------------------

def test_defaults_keep_todays_layout_and_json() -> None:
    c = ParallelConfig(tp=2, dp=4, ep=2, cp=2)
    assert not c.folded and (c.expert_tp, c.expert_ep, c.expert_dp) == (2, 2, 8)  # edp = dp * cp
    assert "etp" not in c.to_dict() and "eep" not in c.to_dict()
    assert not ParallelConfig(tp=2, ep=2, etp=2, eep=2).folded  # explicit, but the dense layout
    folded = ParallelConfig(tp=2, dp=4, cp=2, etp=1, eep=4)
    assert folded.folded and (folded.expert_tp, folded.expert_ep, folded.expert_dp) == (1, 4, 4)  # 16 / (1*4)
    assert ParallelConfig.from_dict(folded.to_dict()) == folded


@pytest.mark.parametrize("kwargs, message", [
    ({"tp": 2, "dp": 1, "etp": 1, "eep": 4}, "etp\\*eep = 1\\*4 does not divide the 2 ranks"),
    ({"etp": -1}, "etp must be a positive integer"),
    ({"eep": True}, "eep must be a positive integer"),
])
def test_bad_expert_degrees_are_one_clear_line(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs)


def test_divisibility_of_folded_layouts() -> None:
    folded = ParallelConfig(tp=2, dp=4, etp=1, eep=8)
    assert divisibility_errors(folded, num_experts=8, seq_len=256) == ()
    assert "eep=8 does not divide the 6 experts" in divisibility_errors(folded, num_experts=6)[0]
    assert "without routed experts" in divisibility_errors(folded)[0]
    # tp splits a microbatch's tokens on a cp rank: 1 x 255 tokens do not split over tp=2
    assert "does not divide them" in divisibility_errors(folded, num_experts=8, seq_len=255)[0]


# --- the expert mesh is Megatron-Core's --------------------------------------------------------------------

def megatron_groups(world: int, sizes: list[int], mask: list[bool]) -> list[list[int]]:
    """Megatron-LM megatron/core/parallel_state.py generate_masked_orthogonal_rank_groups (commit d98e8a64,
    BSD-3-Clause, Copyright (c) NVIDIA CORPORATION), as written there."""
    def prefix_product(a: list[int], init: int = 1) -> list[int]:
        r = [init]
        for v in a:
            init = init * v
            r.append(init)
        return r

    def inner_product(a: list[int], b: list[int]) -> int:
        return sum(x * y for x, y in zip(a, b))

    def decompose(index: int, shape: list[int], stride: list[int] | None = None) -> list[int]:
        if stride is None:
            stride = prefix_product(shape)
        idx = [(index // d) % s for s, d in zip(shape, stride)]
        assert sum(x * y for x, y in zip(idx, stride[:-1])) == index
        return idx

    masked_shape = [s for s, m in zip(sizes, mask) if m]
    unmasked_shape = [s for s, m in zip(sizes, mask) if not m]
    global_stride = prefix_product(sizes)
    masked_stride = [d for d, m in zip(global_stride, mask) if m]
    unmasked_stride = [d for d, m in zip(global_stride, mask) if not m]
    group_size = prefix_product(masked_shape)[-1]
    num_of_group = world // group_size
    ranks = []
    for group_index in range(num_of_group):
        decomposed_group_idx = decompose(group_index, unmasked_shape)
        rank = []
        for rank_in_group in range(group_size):
            decomposed_rank_idx = decompose(rank_in_group, masked_shape)
            rank.append(inner_product(decomposed_rank_idx, masked_stride)
                        + inner_product(decomposed_group_idx, unmasked_stride))
        ranks.append(rank)
    return ranks


def _our_groups(config: ParallelConfig, axis: str) -> list[list[int]]:
    """The groups along one axis of the expert mesh, laid out as execute/mesh.build_expert_mesh lays it."""
    names = [n for n, _ in expert_mesh_shape(config)]
    grid = np.arange(config.num_devices).reshape([s for _, s in expert_mesh_shape(config)])
    moved = np.moveaxis(grid, names.index(axis), -1).reshape(-1, grid.shape[names.index(axis)])
    return sorted(sorted(g) for g in moved.tolist())


@pytest.mark.parametrize("config", [
    ParallelConfig(pp=2, tp=2, dp=4, etp=1, eep=4), ParallelConfig(pp=1, tp=4, cp=2, dp=2, etp=2, eep=2),
    ParallelConfig(pp=3, tp=2, dp=2, cp=2, etp=1, eep=8),
])
def test_expert_mesh_groups_are_megatrons(config: ParallelConfig) -> None:
    """Megatron's expert RankGenerator: order "tp-ep-dp-pp" with sizes (etp, eep, edp, pp)."""
    sizes = [config.expert_tp, config.expert_ep, config.expert_dp, config.pp]
    for axis, k in (("etp", 0), ("eep", 1), ("edp", 2), ("pp", 3)):
        theirs = megatron_groups(config.num_devices, sizes, [i == k for i in range(4)])
        assert _our_groups(config, axis) == sorted(sorted(g) for g in theirs), axis


def test_expert_placement_counts_nodes_like_brute_force() -> None:
    config = ParallelConfig(tp=4, dp=4, cp=2, etp=1, eep=8)  # 32 ranks, nodes of 8
    for axis in ("etp", "eep", "edp"):
        group = next(g for g in _our_groups(config, axis) if 0 in g)
        nodes = {r // 8 for r in group}
        placed = expert_placement(config, axis, 8)
        assert (placed.size, placed.num_nodes) == (len(group), len(nodes))
        assert placed.per_node == min(sum(1 for r in group if r // 8 == n) for n in nodes)


# --- the folded layer cost -----------------------------------------------------------------------------------

def _ideal(per_node: int = 8):
    c = a100_cluster(per_node=per_node, ideal=True)
    return dataclasses.replace(c, device=dataclasses.replace(c.device, mem_bw_bytes_per_s=1e18))


def test_folded_expert_communication_by_hand() -> None:
    """tp=2, etp=1, eep=4 inside one node of the ideal cluster (no latency, fractions 1, 300 GB/s NVLink):
    each tp rank routes T_r = s / 2 tokens; per pass 2 all-to-alls of S = T_r k h 2 bytes over 4 ranks,
    3/4 S / BW each, and one all-gather of the tp group's s h 2 bytes over 2 ranks, 1/2 (s h 2) / BW.
    Forward and backward: 2 passes."""
    block = MOE.blocks[0]
    config = ParallelConfig(tp=2, dp=2, etp=1, eep=4)
    c = estimate_layer(block, _ideal(), config, Recompute.NONE, seq_len=256)
    s, h, k, bw = 256, 512, 2, 300e9
    a2a = 3 / 4 * (s / 2 * k * h * 2) / bw
    gather = 1 / 2 * (s * h * 2) / bw
    assert c.ep_comm_s == pytest.approx(2 * (2 * a2a + gather), rel=1e-12)
    assert c.fwd_comm_s - c.tp_comm_s / 2 == pytest.approx(2 * a2a + gather, rel=1e-9)
    full = estimate_layer(block, _ideal(), dataclasses.replace(config, recompute=Recompute.FULL), Recompute.FULL,
                          seq_len=256)
    assert full.ep_comm_s == pytest.approx(3 * (2 * a2a + gather), rel=1e-12)  # the recomputed forward's too


def test_folded_experts_hold_their_share_and_do_the_same_flops() -> None:
    """Expert weights per device: E 2 h f / (eep etp); under an engine that splits unfolded experts over
    tp (Megatron-Core: ETP = TP) the routed experts' FLOPs per device are the tp group's / tp, folded or
    not, so a compute-bound device takes the same forward time. autoplan's executor runs unfolded experts
    whole on every tp rank (plan.layout.expert_tp_split): E 2 h f / ep weights, tp x the expert FLOPs."""
    block = MOE.blocks[0]
    mcore = Engine.load("megatron-core")
    folded = estimate_layer(block, _ideal(), ParallelConfig(tp=2, dp=2, etp=1, eep=4), Recompute.NONE, seq_len=256,
                            engine=mcore)
    plain = estimate_layer(block, _ideal(), ParallelConfig(tp=2, ep=2), Recompute.NONE, seq_len=256, engine=mcore)
    assert folded.expert_param_count == 8 * 2 * 512 * 2048 // 4
    assert plain.expert_param_count == 8 * 2 * 512 * 2048 // (2 * 2)  # ep and, like ETP = TP, tp
    assert folded.fwd_s == pytest.approx(plain.fwd_s, rel=1e-6)
    whole = estimate_layer(block, _ideal(), ParallelConfig(tp=2, ep=2), Recompute.NONE, seq_len=256)
    assert whole.expert_param_count == 8 * 2 * 512 * 2048 // 2  # over ep only
    assert whole.fwd_s > plain.fwd_s


def test_expert_states_shard_over_the_expert_data_parallel_group() -> None:
    """ZeRO-1 divides the expert optimizer states by edp = (dp*cp*tp) / (etp*eep): 8 / 4 = 2 here, not dp*cp."""
    config = ParallelConfig(tp=2, dp=4, etp=1, eep=4, zero=1)
    est = estimate_config(MOE, _ideal(), config, global_batch=8)
    experts = sum(b.expert_params for b in MOE.blocks) // 4
    dense = sum(estimate_layer(layer, _ideal(), config, Recompute.NONE, seq_len=256).grad_param_count
                for layer in MOE.layers)
    assert est.memory.optimizer == int(12 * (dense / 4 + experts / 2))


# --- the search space ----------------------------------------------------------------------------------------

def test_expert_layouts_by_the_rules() -> None:
    opts = SearchOptions(global_batch=8)
    every = dataclasses.replace(opts, eep=(2, 4, 8))
    assert expert_layouts(MOE, every, tp=2, pp=1, dp=2, cp=1, ep=1) == ((0, 0), (1, 2), (1, 4))
    # by default only the largest in-node expert group: 4 of the 4 stage ranks (8 per node), 2 of 4 per node
    assert expert_layouts(MOE, opts, tp=2, pp=1, dp=2, cp=1, ep=1) == ((0, 0), (1, 4))
    assert expert_layouts(MOE, opts, tp=2, pp=1, dp=2, cp=1, ep=1, per_node=2) == ((0, 0), (1, 2))
    # cp > 1: etp = tp is a layout of its own (the unfolded ep axis lies outside cp)
    assert expert_layouts(MOE, every, tp=1, pp=1, dp=2, cp=2, ep=1) == ((0, 0), (1, 2), (1, 4))
    assert expert_layouts(MOE, opts, tp=1, pp=1, dp=4, cp=1, ep=1) == ((0, 0),)  # etp 1 = tp, cp 1: unfolded ep
    assert expert_layouts(MOE, opts, tp=2, pp=1, dp=2, cp=1, ep=2) == ((0, 0),)
    assert expert_layouts(MOE, dataclasses.replace(opts, fold_experts=False), tp=2, pp=1, dp=2, cp=1, ep=1) == ((0, 0),)
    dense = gpt_graph(h=512, a=8, layers=4, seq=256, vocab=1024)
    assert expert_layouts(dense, opts, tp=2, pp=1, dp=2, cp=1, ep=1) == ((0, 0),)


def test_folded_candidates_are_listed_once_and_priced_like_the_exact_model() -> None:
    cluster = a100_cluster(1, per_node=8)
    space = enumerate_space(MOE, cluster, SearchOptions(global_batch=8, pp=(1,), cp=(1,), zero=(0, 1), sp=(False,)))
    configs = [space.config(i) for i in range(len(space))]
    assert len(set(configs)) == len(configs)
    folded = [i for i, c in enumerate(configs) if c.folded]
    expected = {(tp, 8 // tp, 8) for tp in (2, 4, 8)}  # etp 1 < tp; eep: the largest in-node group
    assert {(configs[i].tp, configs[i].dp, configs[i].expert_ep) for i in folded} == expected
    quick = quick_estimate(MOE, cluster, space, 8, cost)
    for i in folded[:: max(1, len(folded) // 12)]:
        exact = estimate_config(MOE, cluster, configs[i], global_batch=8)
        assert quick.peak_mem_bytes[i] == pytest.approx(exact.peak_mem_bytes, rel=0.01)
        assert quick.step_time_s[i] == pytest.approx(exact.step_time_s, rel=0.15)  # as the unfolded ones track


def test_the_mesh_product_is_every_stage_rank_split() -> None:
    """Every folded layout the space lists divides the stage's ranks, as brute force over (etp, eep) says."""
    for tp, dp in itertools.product((1, 2, 4), (1, 2, 4)):
        got = set(expert_layouts(MOE, SearchOptions(global_batch=8, etp=None, eep=(2, 4, 8)), tp=tp, pp=1, dp=dp,
                                 cp=1, ep=1))
        brute = {(0, 0)} | {(etp, eep) for etp in (1, 2, 4) for eep in (2, 4, 8)
                            if tp % etp == 0 and (dp * tp) % (etp * eep) == 0 and etp != tp}
        assert got == brute, (tp, dp)


def test_run_refuses_expert_tensor_parallelism_before_launch(monkeypatch, capsys) -> None:
    """etp > 1 is planned and exported, not executed: `autoplan run` says so in one line, torchrun unlaunched."""
    from autoplan.cli.main import main
    from autoplan.execute import launch

    monkeypatch.setattr(launch, "run_torchrun", lambda *a, **k: pytest.fail("torchrun was launched"))
    argv = ["run", "--model", "tiny-moe", "--global-batch", "8", "--seq-len", "16", "--steps", "1",
            "--tp", "2", "--dp", "2", "--etp", "2", "--eep", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "etp=2: autoplan's executor runs folded expert layouts with etp=1" in err
