"""Heterogeneous clusters: building them (a profile:nodes list, Cluster.combine, a profile with groups:),
pricing each pipeline rank on its own node group, the stage problem with per-rank times against brute
force, and a two-kind cluster whose faster group gets more layers, against a hand computation."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cost_graph_helper import a100_cluster, gpt_graph
from test_search_stages import problems

from autoplan.cluster import Cluster
from autoplan.cost import default_split, estimate_config, estimate_layer, rank_groups
from autoplan.plan.export import export_plan
from autoplan.plan.io import plan_from_json, plan_to_json
from autoplan.plan.types import ParallelConfig, Recompute
from autoplan.search.api import autoplan
from autoplan.search.ilp import solve_ilp
from autoplan.search.stages import brute_force, fits, solve_dp

SPEEDUP = 3.0  # the fast group's device: every rate (FLOP/s, HBM) 3x the slow one's


def two_kinds(*, per_node: int = 8, inter_bw: float | None = None):
    """One node of an ideal A100-like device (test_cost_graph_helper, with unbounded memory bandwidth so
    every kernel is compute-bound) and one node of the same device at SPEEDUP times every rate, same
    memory: block times on the fast node are exactly 1/SPEEDUP."""
    slow = a100_cluster(per_node=per_node, ideal=True)
    dev = dataclasses.replace(slow.device, mem_bw_bytes_per_s=1e18)  # compute-bound: times are FLOPs / peak
    slow = dataclasses.replace(slow, device=dev)
    fast_dev = dataclasses.replace(dev, name="fast", peak_flops=tuple((d, SPEEDUP * f) for d, f in dev.peak_flops),
                                   mem_bw_bytes_per_s=SPEEDUP * dev.mem_bw_bytes_per_s)
    fast = dataclasses.replace(slow, name="fast-test", device=fast_dev)
    link = None if inter_bw is None else dataclasses.replace(slow.inter_node, name="between", bw_bytes_per_s=inter_bw)
    return Cluster.combine([(slow, 1), (fast, 1)], inter_group=link)


# --- building heterogeneous clusters -------------------------------------------------------------------------

def test_profile_node_list_builds_groups_in_rank_order() -> None:
    c = Cluster.load("dgx-a100-80gb:4,dgx-h100-80gb:2")
    a100, h100 = Cluster.load("dgx-a100-80gb", num_nodes=4), Cluster.load("dgx-h100-80gb", num_nodes=2)
    assert [(g.name, g.spec) for g in c.groups] == [("dgx-a100-80gb", a100), ("dgx-h100-80gb", h100)]
    assert c.num_devices == 48 and c.group_of_rank(31) == 0 and c.group_of_rank(32) == 1
    assert c.total_peak_flops == 32 * 312e12 + 16 * 989e12  # each group's own datasheet peak
    # the stand-in for single-device code: the slower device, the smaller memory, the slower links
    assert c.device.peak("bf16") == 312e12 and c.device.mem_bytes == min(a100.device.mem_bytes, h100.device.mem_bytes)
    assert c.inter_group == a100.inter_node  # the slower NIC bounds traffic between groups (HDR 25 GB/s < NDR)


def test_groups_profile_reads_groups_and_link(tmp_path: Path) -> None:
    shipped = Cluster.load("dgx-a100-h100")
    assert [(g.name, g.spec.num_nodes) for g in shipped.groups] == [("dgx-a100-80gb", 4), ("dgx-h100-80gb", 2)]
    assert shipped.inter_group.bw_bytes_per_s == 25e9 and shipped.inter_group.name == "infiniband-hdr-ndr"
    (tmp_path / "mine.yaml").write_text(Cluster.path("local-cpu").read_text())
    (tmp_path / "mix.yaml").write_text("schema_version: 1\nname: mix\ngroups:\n"
                                       "  - {profile: mine.yaml, nodes: 1, devices_per_node: 2}\n"
                                       "  - {profile: local-cpu, nodes: 2, devices_per_node: 2}\n")
    mix = Cluster.load(tmp_path / "mix.yaml")
    assert mix.num_devices == 6 and [g.name for g in mix.groups] == ["local-cpu", "local-cpu#2"]


@pytest.mark.parametrize("make, message", [
    (lambda: Cluster.load("dgx-a100-80gb:4,dgx-h100-80gb:2", num_nodes=2), "drop --nodes"),
    (lambda: Cluster.load("dgx-a100-80gb:4,dgx-h10-80gb:2"), "did you mean 'dgx-h100-80gb'"),
    (lambda: Cluster.combine([("dgx-a100-80gb", 1)]), "at least two"),
    (lambda: Cluster.combine([("dgx-a100-80gb", 1), ("local-cpu", 1)]), "different dtypes"),
    (lambda: Cluster.combine([("dgx-a100-80gb", 0), ("dgx-h100-80gb", 1)]), "positive integer"),
])
def test_bad_cluster_lists_are_one_clear_line(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_bad_groups_profile_field_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("schema_version: 1\nname: bad\ngroups:\n  - {profile: local-cpu, node: 1}\n"
                    "  - {profile: local-cpu, nodes: 1}\n")
    with pytest.raises(ValueError, match=r"unknown field 'groups\[0\]\.node' \(did you mean 'nodes'\?\)"):
        Cluster.load(path)


# --- pricing each pipeline rank on its group -----------------------------------------------------------------

def test_pipeline_ranks_map_to_groups_and_must_not_straddle() -> None:
    c = Cluster.load("dgx-a100-80gb:4,dgx-h100-80gb:2")
    assert rank_groups(c, ParallelConfig(pp=3, dp=16)) == (0, 0, 1)
    assert rank_groups(c, ParallelConfig(pp=6, tp=8)) == (0, 0, 0, 0, 1, 1)
    with pytest.raises(ValueError, match="24 devices do not divide group 'dgx-a100-80gb''s 32"):
        rank_groups(c, ParallelConfig(pp=2, dp=24))  # 24 devices per pipeline rank: rank 1 straddles


def test_cross_group_hop_uses_the_inter_group_link() -> None:
    """pp=2 with one pipeline rank per node: the hop between them is priced on inter_group,
    alpha + S / (bw * p2p_fraction) with S = b s h 16-bit elements, once per microbatch on each rank (the
    sender's forward activation, the receiver's backward gradient): m of them in the step's pp_comm."""
    g = gpt_graph(h=1024, a=16, layers=4, seq=1024, vocab=1024)
    config = ParallelConfig(pp=2, dp=8)
    m = 4
    slow, fast = (estimate_config(g, two_kinds(inter_bw=bw), config, global_batch=8 * m) for bw in (1e9, 1e12))
    out_bytes = 2 * 1024 * 1024
    hop = lambda bw: out_bytes / bw
    assert slow.breakdown.pp_comm == pytest.approx(m * hop(1e9), rel=1e-12)
    assert fast.breakdown.pp_comm == pytest.approx(m * hop(1e12), rel=1e-12)


def test_faster_group_gets_more_layers_by_hand() -> None:
    """16 equal blocks on pp=2, rank 0 on the slow node, rank 1 on the 3x node. Hand computation: a block
    takes t = 3 F / P on the slow device (forward + backward of its F = matmul FLOPs + half the attention
    square, fused causal, at peak P: the ideal device) and t / 3 on the fast one; the head (on rank 1)
    h = 3 F_head / (3 P); the embedding has no matmul. The split minimises max(k t, (16 - k) t / 3 + h)."""
    g = gpt_graph(h=1024, a=16, layers=16, seq=1024, vocab=1024, unfused=False)
    cluster = two_kinds(inter_bw=1e18)  # a free hop between the groups, to keep the hand sum short
    P, m = 312e12, 8
    block, head = g.blocks[0], g.layers[-1]
    # fused causal attention computes half the square (Dao 2023; cost.compute.FUSED_CAUSAL_FRACTION)
    flops_t = 3 * (block.fwd_matmul_flops + 0.5 * block.fwd_attention_flops) / P
    priced = estimate_layer(block, cluster.groups[0].spec, ParallelConfig(dp=8), Recompute.NONE, seq_len=1024)
    fast = estimate_layer(block, cluster.groups[1].spec, ParallelConfig(dp=8), Recompute.NONE, seq_len=1024)
    # the priced block time is its FLOPs at peak up to the kernel models' own factors (FlashAttention's
    # backward FLOPs, tile waves: cost.kernels), and exactly a third of it on the 3x device
    t = priced.time_s
    assert t == pytest.approx(flops_t, rel=0.06) and fast.time_s == pytest.approx(t / SPEEDUP, rel=1e-9)
    h = estimate_layer(head, cluster.groups[1].spec, ParallelConfig(dp=8), Recompute.NONE, seq_len=1024).time_s
    k_hand = min(range(1, 16), key=lambda k: max(k * t, (16 - k) * t / SPEEDUP + h))
    assert k_hand == 4  # 4 blocks on the slow node, 12 on the fast: 4 t either way (+ the small head)
    plans = autoplan(g, cluster, global_batch=8 * m, seq_len=1024, pp=(2,), dp=(8,), zero=(0,), sp=(False,),
                     schedules=("1f1b",), recompute=("none",), microbatch=(1,), top_k=1)
    best = plans[0]
    blocks = [sum(1 for n in s.layer_names if n.startswith("layers.")) for s in best.stages]
    assert blocks == [k_hand, 16 - k_hand]
    assert [s.group for s in best.stages] == ["a100-test", "fast-test"]
    assert plan_from_json(plan_to_json(best)) == best  # the groups survive the JSON round trip
    assert "Node groups: pipeline rank 0 on a100-test (4 blocks); pipeline rank 1 on fast-test (12" in best.notes[-1]
    assert any("node groups a100-test, fast-test" in n for n in export_plan(best, "megatron").notes)

    def one_f_one_b(x: list[float]) -> float:  # Narayanan et al. 2021 for unequal ranks: m max X + fill / drain
        return m * max(x) + sum(x) - max(x)

    even = estimate_config(g, cluster, best.config, global_batch=8 * m, stages=_split(g, 8))
    for est, k in ((best.estimate, k_hand), (even, 8)):
        pipe = est.breakdown.compute + est.breakdown.pp_bubble + est.breakdown.pp_comm
        assert pipe == pytest.approx(one_f_one_b([k * t, (16 - k) * t / SPEEDUP + h]), rel=1e-5)
    assert best.estimate.mfu == pytest.approx(best.estimate.model_flops / (
        best.estimate.step_time_s * 8 * P * (1 + SPEEDUP)), rel=1e-12)


def _split(g, k: int) -> tuple[tuple[str, ...], ...]:
    names = [layer.name for layer in g.layers]
    return tuple(names[:k + 1]), tuple(names[k + 1:])  # embed + k blocks, the rest


def test_each_rank_fits_its_own_memory() -> None:
    """The same split fits when the small-memory group holds few layers and not when it holds many."""
    g = gpt_graph(h=1024, a=16, layers=16, seq=1024, vocab=1024)
    small = two_kinds()
    tiny_mem = dataclasses.replace(small.groups[0].spec.device, mem_bytes=4 * 2**30)  # slow node: 4 GiB
    groups = (dataclasses.replace(small.groups[0], spec=dataclasses.replace(small.groups[0].spec, device=tiny_mem)),
              small.groups[1])
    cluster = Cluster.combine([(gr.spec, 1) for gr in groups])
    few, many = _split(g, 2), _split(g, 14)  # 2 or 14 blocks on the 4 GiB node
    config = ParallelConfig(pp=2, dp=8)
    assert estimate_config(g, cluster, config, global_batch=8, stages=few).fits
    crowded = estimate_config(g, cluster, config, global_batch=8, stages=many)
    assert not crowded.fits and crowded.mem_capacity_bytes == 4 * 2**30


# --- the stage problem with per-rank times -------------------------------------------------------------------

@st.composite
def hetero_problems(draw, virtual: bool = False):
    problem = draw(problems(virtual=virtual))
    speeds = [draw(st.floats(0.25, 4.0)) for _ in range(problem.num_ranks)]
    limits = tuple(problem.mem_limit_bytes * draw(st.floats(0.5, 1.5)) for _ in range(problem.num_ranks))
    rank_time = tuple(tuple(tuple(t / s for t in row) for row in problem.time_s) for s in speeds)
    return dataclasses.replace(problem, rank_time_s=rank_time, rank_mem_limit_bytes=limits)


@settings(max_examples=30, deadline=None)
@given(hetero_problems())
def test_dp_with_per_rank_times_matches_brute_force(problem) -> None:
    ref, got = brute_force(problem), solve_dp(problem)
    assert (ref is None) == (got is None)
    if ref is not None:
        assert fits(problem, got) and got.time_s == pytest.approx(ref.time_s, rel=1e-9, abs=1e-12)


@settings(max_examples=30, deadline=None)
@given(hetero_problems(virtual=True))
def test_ilp_with_per_rank_times_matches_brute_force(problem) -> None:
    ref, got = brute_force(problem), solve_ilp(problem)
    assert (ref is None) == (got is None)
    if ref is not None:
        assert fits(problem, got) and got.time_s == pytest.approx(ref.time_s, rel=1e-4, abs=1e-9)


def test_homogeneous_estimates_are_unchanged_by_the_group_machinery() -> None:
    """A heterogeneous cluster of two identical groups prices exactly as the homogeneous one (hop on the
    inter-node link in both), and its default split is the balanced one."""
    g = gpt_graph(h=1024, a=16, layers=8, seq=1024, vocab=1024)
    one = a100_cluster(num_nodes=2, ideal=True)
    both = Cluster.combine([(a100_cluster(ideal=True), 1), (a100_cluster(ideal=True), 1)])
    config = ParallelConfig(pp=2, dp=8, zero=1)
    a, b = (estimate_config(g, c, config, global_batch=16) for c in (one, both))
    assert math.isclose(a.step_time_s, b.step_time_s, rel_tol=1e-12) and a.peak_mem_bytes == b.peak_mem_bytes


def test_default_split_gives_a_small_fast_group_what_its_memory_holds() -> None:
    """The 3x node with only 2 GiB: by speed it would take 12 of 16 blocks (3.6 GiB); the default split
    stops at what its memory holds, 6, where 7 already overflows it, and the slow node takes the rest."""
    g = gpt_graph(h=1024, a=16, layers=16, seq=1024, vocab=1024)
    slow, fast = (gr.spec for gr in two_kinds().groups)
    small = dataclasses.replace(fast, device=dataclasses.replace(fast.device, mem_bytes=2 * 2**30))
    cluster = Cluster.combine([(small, 1), (slow, 1)])
    config = ParallelConfig(pp=2, dp=8)
    by_speed = default_split(g, cluster, config)  # no batch given: speed alone
    split = default_split(g, cluster, config, global_batch=8)
    count = lambda s: sum(1 for n in s[0] if n.startswith("layers."))
    assert (count(by_speed), count(split)) == (12, 6)
    fits = [estimate_config(g, cluster, config, global_batch=8, stages=_split(g, k)).fits for k in (6, 7, 12)]
    assert fits == [True, False, False]
    assert estimate_config(g, cluster, config, global_batch=8).fits  # the default estimate uses this split
