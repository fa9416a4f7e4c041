"""Engines: the loader (like cluster profiles), and each engine behaviour moving the estimate through its
own mechanism, checked against hand computations on an ideal device (efficiencies 1, no latency)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import yaml
from test_cost_graph_helper import a100_cluster, gpt_graph, unfused_attention_by_hand

from autoplan import cost
from autoplan.cost import comm, estimate_config, estimate_layer
from autoplan.cost.types import GroupPlacement
from autoplan.graph.types import LayerRole
from autoplan.plan.engine import Engine, as_engine
from autoplan.plan.types import ParallelConfig

IDEAL = a100_cluster(ideal=True)


# --- loader -------------------------------------------------------------------------------------------

def test_shipped_engines_load_and_the_default_is_autoplan() -> None:
    names = Engine.names()
    for name in ("autoplan", "torchtitan", "megatron-core", "megatron-lm", "deepspeed"):
        assert name in names
        assert Engine.load(name).name == name
    assert dataclasses.replace(Engine.load("autoplan"), source="") == Engine()
    assert Engine.load("megatron-lm").attention == "unfused" and Engine.load("megatron-core").tp_comm_overlap
    assert Engine.load("deepspeed").zero3 == "deepspeed"


def test_engines_are_frozen_and_replace_builds_variants() -> None:
    e = Engine.load("megatron-core")
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.attention = "unfused"  # type: ignore[misc]
    variant = dataclasses.replace(e, attention="unfused")
    assert variant.attention == "unfused" and variant.tp_comm_overlap == e.tp_comm_overlap
    with pytest.raises(ValueError, match="engine field 'attention' must be one of 'flash', 'unfused'"):
        dataclasses.replace(e, attention="sparse")
    assert as_engine(None) == Engine() and as_engine("torchtitan") == Engine.load("torchtitan")


def test_a_bad_engine_field_is_one_line_with_a_suggestion(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("schema_version: 1\nname: mine\natention: flash\n")
    with pytest.raises(ValueError, match=r"unknown field 'atention' \(did you mean 'attention'\?\)") as err:
        Engine.load(path)
    assert "\n" not in str(err.value)
    path.write_text("schema_version: 1\nname: mine\nzero3: deepsped\n")
    with pytest.raises(ValueError, match=r"'zero3' must be one of 'fsdp2', 'deepspeed', got 'deepsped' \(did you mean"):
        Engine.load(path)
    path.write_text("schema_version: 1\nname: mine\ncuda_graphs: 1\n")
    with pytest.raises(ValueError, match="'cuda_graphs' must be true or false"):
        Engine.load(path)
    with pytest.raises(ValueError, match=r"unknown engine 'torchtitn' \(did you mean 'torchtitan'\?\)"):
        Engine.load("torchtitn")


def test_a_user_engine_file_keeps_the_default_for_omitted_fields(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("schema_version: 1\nname: mine\nattention: unfused\nzero3_prefetch_numel: 5e7\n")
    e = Engine.load(path)
    assert (e.attention, e.zero3_prefetch_numel, e.zero3) == ("unfused", 50_000_000, "fsdp2")


def test_every_shipped_engine_file_sets_every_field_with_a_comment() -> None:
    """Each Engine field the loader reads (cluster/engines.py _FIELDS: all but source) is written in every
    shipped engine file, so no default applies silently, and each such line but name / description says
    beside it where the value comes from (or why it is not read)."""
    from autoplan.cluster.engines import _FIELDS, engine_path

    for name in Engine.names():
        text = engine_path(name).read_text(encoding="utf-8")
        data = yaml.safe_load(text)
        assert not set(_FIELDS) - set(data), (name, sorted(set(_FIELDS) - set(data)))
        lines = {line.split(":", 1)[0]: line for line in text.splitlines() if line and line[0].isalpha()}
        bare = [k for k in _FIELDS if k not in ("name", "description") and "#" not in lines[k]]
        assert not bare, (name, bare)


# --- attention -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("seq", [512, 1024, 2048, 4096])
def test_unfused_attention_costs_more_time_and_memory_as_the_sequence_grows(seq: int) -> None:
    """Megatron's unfused attention stores 5 a s bytes per token (Korthikanti et al. 2022: softmax 2,
    dropout mask 1, dropout output 2) and moves them: by hand, on an ideal device (HBM 2 TB/s, peak
    312 TFLOP/s, no SMs), the forward adds the scale-mask-softmax and dropout passes (4 x 2 + 1 bytes per
    score) and two batched GEMMs, Q K^T writing the s x s scores and P V reading them, each at
    max(FLOPs / peak, bytes / bw); FlashAttention computes half the causal square at its amortised rate."""
    block = gpt_graph(h=1024, a=16, layers=1, seq=seq, unfused=False).blocks[0]
    config = ParallelConfig(microbatch=2)
    flash, unfused = (estimate_layer(block, IDEAL, config, "none", seq_len=seq, engine=Engine(attention=kind))
                      for kind in ("flash", "unfused"))
    scores, gemm, flash_fwd = unfused_attention_by_hand(seq)  # gemm: Q K^T (and P V)
    assert unfused.act_mem_bytes - flash.act_mem_bytes == 5 * scores
    softmax_dropout = scores * (4 * 2 + 1) / 2.0e12
    assert math.isclose(unfused.fwd_s - flash.fwd_s, 2 * gemm + softmax_dropout - flash_fwd, rel_tol=1e-9)
    assert unfused.fwd_s > flash.fwd_s


def test_unfused_extra_time_grows_faster_than_the_sequence() -> None:
    extra = []
    for seq in (1024, 2048, 4096):
        block = gpt_graph(h=1024, a=16, layers=1, seq=seq, unfused=False).blocks[0]
        t = [estimate_layer(block, IDEAL, ParallelConfig(), "none", seq_len=seq, engine=Engine(attention=k)).time_s
             for k in ("flash", "unfused")]
        extra.append(t[1] - t[0])
    assert extra[1] > 2 * extra[0] and extra[2] > 2 * extra[1]  # the scores grow as s^2 per sequence


# --- tensor-parallel overlap ---------------------------------------------------------------------------

@pytest.mark.parametrize("nvlink_bw", [300e9, 3e9])
def test_tp_overlap_hides_tp_comm_up_to_the_gemm_time(nvlink_bw: float) -> None:
    """With SP each block does an all-gather + reduce-scatter of b s h before / after its GEMMs, twice per
    phase; Megatron-Core's --tp-comm-overlap hides each phase's communication behind that phase's weight
    GEMMs: exposed = max(0, comm - GEMMs). By hand on an ideal device: the GEMMs of a GPT block are
    2 T (4 h^2 + 8 h^2) / t FLOPs forward and twice that backward at peak; on fast NVLink nothing is left,
    on a slow link the excess."""
    h, a, s, b, t = 8192, 64, 2048, 4, 8
    cluster = dataclasses.replace(IDEAL, intra_node=dataclasses.replace(IDEAL.intra_node, bw_bytes_per_s=nvlink_bw))
    block = gpt_graph(h=h, a=a, layers=1, seq=s).blocks[0]
    config = ParallelConfig(tp=t, sp=True, microbatch=b)
    plain = estimate_layer(block, cluster, config, "none", seq_len=s, engine=Engine())
    over = estimate_layer(block, cluster, config, "none", seq_len=s,
                          engine=dataclasses.replace(Engine(), tp_comm_overlap=True))
    group = GroupPlacement(size=t, num_nodes=1, per_node=t)
    hidden_bytes = b * s * h * 2
    one = comm.all_gather_s(hidden_bytes, group, cluster) + comm.reduce_scatter_s(hidden_bytes, group, cluster)
    gemm_fwd = 2.0 * b * s * 12 * h * h / t / 312e12
    assert math.isclose(plain.tp_comm_s, 4 * one, rel_tol=1e-9)
    hand = max(2 * one - gemm_fwd, 0.0) + max(2 * one - 2 * gemm_fwd, 0.0)
    assert math.isclose(over.tp_comm_s, hand, rel_tol=1e-9, abs_tol=1e-15)
    assert over.tp_comm_s < plain.tp_comm_s
    if nvlink_bw == 300e9:
        assert over.tp_comm_s == 0.0


@pytest.mark.parametrize("nvlink_bw", [300e9, 3e9])
def test_async_backward_tp_allreduce_hides_behind_its_weight_gradient(nvlink_bw: float) -> None:
    """Megatron-LM's --async-tensor-model-parallel-allreduce (tp_bwd_overlap): the backward all-reduce of
    the QKV and fc1 input gradients runs beside that linear's weight-gradient GEMM (2 T h 3h / t and
    2 T h 4h / t FLOPs at peak on the ideal device): exposed = sum of max(0, AR - wgrad) + f min(AR, wgrad),
    f the SM contention share; forward unchanged."""
    from autoplan.cost.overlap import contention_fraction

    h, a, s, b, t = 8192, 64, 2048, 4, 8
    cluster = dataclasses.replace(IDEAL, intra_node=dataclasses.replace(IDEAL.intra_node, bw_bytes_per_s=nvlink_bw))
    block = gpt_graph(h=h, a=a, layers=1, seq=s).blocks[0]
    config = ParallelConfig(tp=t, microbatch=b)
    plain = estimate_layer(block, cluster, config, "none", seq_len=s, engine=Engine())
    over = estimate_layer(block, cluster, config, "none", seq_len=s,
                          engine=dataclasses.replace(Engine(), tp_bwd_overlap=True))
    ar = comm.all_reduce_s(b * s * h * 2, GroupPlacement(size=t, num_nodes=1, per_node=t), cluster)
    f = contention_fraction(cluster)
    wgrads = (2.0 * b * s * h * 3 * h / t / 312e12, 2.0 * b * s * h * 4 * h / t / 312e12)
    hand = 2 * ar + sum(max(ar - w, 0.0) + f * min(ar, w) for w in wgrads)
    assert math.isclose(plain.tp_comm_s, 4 * ar, rel_tol=1e-9)
    assert math.isclose(over.tp_comm_s, hand, rel_tol=1e-6)
    assert math.isclose(over.fwd_comm_s, plain.fwd_comm_s, rel_tol=1e-12)


# --- data-parallel overlap -----------------------------------------------------------------------------

def test_without_dp_overlap_the_gradient_reduction_is_fully_exposed() -> None:
    """dp = 16 over 2 nodes, ZeRO-0, one microbatch: without dp_comm_overlap the step adds one ring
    all-reduce of every gradient after the backward, 2 (n - 1)/n S / BW at 4 bytes per element (fp32
    reduction under bf16) with BW = min(NVLink, 8 NICs) on the ideal cluster; with overlap, the buckets
    reduce under the backward and only the last one is left."""
    graph = gpt_graph(h=2048, a=16, layers=8, seq=8192, unfused=False)
    cluster = a100_cluster(2, ideal=True)
    config = ParallelConfig(dp=16)
    eager, overlapped = (estimate_config(graph, cluster, config, global_batch=16,
                                         engine=dataclasses.replace(Engine(), dp_comm_overlap=flag))
                         for flag in (False, True))
    params = sum(layer.num_params for layer in graph.layers)
    bw = min(300e9, 8 * 25e9)
    hand = 2 * 15 / 16 * params * 4 / bw
    assert math.isclose(eager.breakdown.dp_comm, hand, rel_tol=1e-9)
    assert math.isclose(eager.step_time_s - overlapped.step_time_s, hand - overlapped.breakdown.dp_comm, rel_tol=1e-9)
    # overlapped, what is left is the last buckets: FSDP2's root group (embedding, final norm and head, one
    # all-reduce after the last backward: cost/fsdpunits.py) and at most one block's
    block = graph.blocks[0].num_params
    root = sum(layer.num_params for layer in graph.layers if layer.role is not LayerRole.BLOCK)
    last = 2 * 15 / 16 * root * 4 / bw
    assert last <= overlapped.breakdown.dp_comm <= last + 2 * 15 / 16 * block * 4 / bw


# --- DeepSpeed ZeRO-3 against FSDP2 --------------------------------------------------------------------

def test_deepspeed_zero3_costs_its_mechanism_against_fsdp2() -> None:
    """Communication-bound (a slow NIC, ZeRO-3 over 16 ranks on 2 nodes, full recompute, one microbatch):
    FSDP2 all-gathers each block's weights twice (forward; the backward's gather serves the recomputed
    forward too) and reduce-scatters its gradients; DeepSpeed's 2021 stage 3 gathers each weight matrix
    on its own three times (forward, the recomputed forward, the backward: released in between) and
    all-reduces the gradients (twice a reduce-scatter's bytes) in fp16 buckets. Nearly everything is
    exposed, so the exposed data-parallel time is in the ratio of the collectives' times, summed by hand:
    (3 AG + AR) / (2 AG + RS)."""
    graph = gpt_graph(h=4096, a=32, layers=4, seq=512, unfused=False)
    cluster = dataclasses.replace(a100_cluster(2, nic_bw=1e9, ideal=True), dtype="fp16")
    config = ParallelConfig(dp=16, zero=3, recompute="full")
    engine = dataclasses.replace(Engine.load("deepspeed"), attention="flash", zero3_gather_copy_out=False,
                                 zero3_sync_per_module=False, zero3_persistence_numel=0,
                                 zero3_reduce_bucket_numel=10**12, zero3_max_reuse_numel=0)
    fsdp = dataclasses.replace(Engine(), grad_reduce_fp32=False, gather_copy_out=False)
    ds, fs = (estimate_config(graph, cluster, config, global_batch=16, engine=e) for e in (engine, fsdp))
    group = GroupPlacement(size=16, num_nodes=2, per_node=8)
    params = sum(layer.num_params for layer in graph.layers)
    ag = comm.all_gather_s(params * 2, group, cluster)
    rs = comm.reduce_scatter_s(params * 2, group, cluster)
    ar = comm.all_reduce_s(params * 2, group, cluster)
    assert math.isclose(ar, 2 * rs, rel_tol=1e-9)  # a ring all-reduce is a reduce-scatter and an all-gather
    assert math.isclose(ds.breakdown.dp_comm / fs.breakdown.dp_comm, (3 * ag + ar) / (2 * ag + rs), rel_tol=0.1)
    assert ds.step_time_s > 1.4 * fs.step_time_s


def test_deepspeed_copy_out_costs_the_host_a_narrow_and_a_copy_per_rank() -> None:
    """torch.distributed.all_gather into a list (DeepSpeed 2021): per gathered parameter the host builds n
    output views (VIEW_OP x n ops) before the gather is enqueued and launches n copies (CXX_COPY_OP x n)
    while it runs; the communication stream zero-fills the parameter (waited for by the synchronize
    before the gather) and copies it out (two passes more). Without prefetch (the 2021 trace) each
    gather is waited for, so per gather the step grows by fill + views + max(gather + copies, launches)
    - gather, summed by hand over the forward's and the backward's gathers."""
    from autoplan.cost.kernels import memory_time_s

    graph = gpt_graph(h=2048, a=16, layers=2, seq=512, unfused=False)
    device = dataclasses.replace(IDEAL.device, op_overhead_s=1e-5)
    cluster = dataclasses.replace(a100_cluster(2, nic_bw=1e15, ideal=True), device=device, dtype="fp16")
    config = ParallelConfig(dp=16, zero=3)
    base = dataclasses.replace(Engine.load("deepspeed"), attention="flash", zero3_sync_per_module=False,
                               block_forward_ops=0, block_backward_ops=0, zero3_regather_persistent=False)
    assert not base.zero3_trace_aligned
    without, with_copy = (estimate_config(graph, cluster, config, global_batch=16,
                                          engine=dataclasses.replace(base, zero3_gather_copy_out=flag))
                          for flag in (False, True))
    numels = [n for x in graph.layers for n in cost.deepspeedrank.layer_numels(
        x, estimate_layer(x, cluster, config, "none", seq_len=512), graph, config)]
    group = GroupPlacement(size=16, num_nodes=2, per_node=8)
    before, after = 16 * cost.deepspeed.VIEW_OP * 1e-5, 16 * cost.deepspeed.CXX_COPY_OP * 1e-5
    one = 0.0
    for n in numels:
        g = comm.all_gather_s(2 * n, group, cluster)
        one += memory_time_s(device, 2 * n) + before + max(g + memory_time_s(device, 4 * n), after) - g
    # forward gathers each weight once, the backward again (no recompute)
    assert with_copy.step_time_s - without.step_time_s == pytest.approx(2 * one, rel=1e-6)


def test_deepspeed_keeps_a_recomputed_parameter_only_within_the_reuse_distance() -> None:
    """stage3.py _keep_for_later: a parameter used in the recomputed forward stays gathered for its backward
    when the sub-modules traced in between (the layer's later modules recomputed, then their backwards) hold
    fewer than stage3_max_reuse_distance elements. Modules of 4, 1, 6, 6 M elements and a 10 M distance:
    only the last module (nothing in between) is kept; the third (2 x 6 M in between) is not, so the
    backward gathers three modules again: 4 (forward) + 4 (recompute) + 3 (backward) gathers per layer,
    counted by hand."""
    ds = cost.deepspeed
    numels = [4e6, 1e6, 6e6, 6e6]
    layers = [ds.block_modules(numels, 1.0, 2.0, 1.0, 0.0, True) for _ in range(2)]
    engine = dataclasses.replace(Engine.load("deepspeed"), zero3_max_reuse_numel=10**7, zero3_sync_per_module=False,
                                 zero3_trace_aligned=True, param_gather_overlap=True)  # v0.3.13's working trace
    gathers: list[float] = []

    def gather(numel: float) -> float:
        gathers.append(numel)
        return 1e-3

    ds.microbatch_s(layers, engine, recompute=True, gather_s=gather, reduce_s=lambda n: 0.0)
    assert len(gathers) == 2 * (4 + 4 + 3)
    assert sorted(gathers[-3:]) == [1e6, 4e6, 6e6]  # the first layer's backward: all but the kept last module


def test_deepspeed_regathers_the_persistent_parameters_rank_by_rank() -> None:
    """stage3.py _post_step re-gathers the persistent parameters once per step (partition_parameters.py
    _allgather_params): a GPT block's 8 small parameters, each rebuilt from the ranks holding a piece of it
    (narrow, view, narrow, copy_ per rank). Hand count for h = 2048, n = 16 (every piece 128 elements or
    more: all 16 ranks hold one), then the step-time difference it makes on an ideal device."""
    h, n, layers = 2048, 16, 2
    ds = cost.deepspeed
    per_param = ds.REGATHER_OPS_PER_PARAM + ds.REGATHER_OPS_PER_RANK * n
    got, parts = ds.persistent_regather([float(h)] * 6 + [3.0 * h, 4.0 * h], n)
    assert got == pytest.approx(ds.GATHER_OPS_PER_RANK * n + 8 * per_param) and parts == 13 * h
    graph = gpt_graph(h=h, a=16, layers=layers, seq=512, unfused=False)
    device = dataclasses.replace(IDEAL.device, op_overhead_s=1e-5)
    cluster = dataclasses.replace(a100_cluster(2, nic_bw=1e15, ideal=True), device=device, dtype="fp16")
    base = dataclasses.replace(Engine.load("deepspeed"), attention="flash")
    off, on = (estimate_config(graph, cluster, ParallelConfig(dp=n, zero=3), global_batch=16,
                               engine=dataclasses.replace(base, zero3_regather_persistent=flag)) for flag in (False, True))
    ops = ds.GATHER_OPS_PER_RANK * n + layers * 8 * per_param
    latency = comm.all_gather_s(13 * h * layers * 2, GroupPlacement(size=n, num_nodes=2, per_node=8), cluster)
    assert on.step_time_s - off.step_time_s == pytest.approx(ops * 1e-5 + latency, rel=1e-6)


def test_the_checkpoint_wrapper_costs_its_host_ops_around_each_recomputed_block() -> None:
    """A fully recomputed block issues its forward's ops again plus the checkpoint wrapper's own
    (checkpoint_forward_ops in the forward, checkpoint_backward_ops in the backward): on a device whose
    kernels take no time the layer's host time is (2 F + B + cf + cb) x op_overhead_s, by hand."""
    block = gpt_graph(h=256, a=4, layers=1, seq=128).blocks[0]
    device = dataclasses.replace(IDEAL.device, op_overhead_s=1e-5)
    cluster = dataclasses.replace(IDEAL, device=device)
    engine = dataclasses.replace(Engine.load("megatron-lm"), checkpoint_forward_ops=6, checkpoint_backward_ops=15)
    full = estimate_layer(block, cluster, ParallelConfig(recompute="full"), "full", seq_len=128, engine=engine)
    none = estimate_layer(block, cluster, ParallelConfig(), "none", seq_len=128, engine=engine)
    f, b = engine.block_forward_ops, engine.block_backward_ops
    assert full.host_s == pytest.approx((2 * f + b + 6 + 15) * 1e-5)
    assert none.host_s == pytest.approx((f + b) * 1e-5)


def test_unfolded_experts_split_over_tp_only_where_the_engine_does() -> None:
    """plan.layout.expert_tp_split is the one home of the fact: autoplan's executor runs unfolded experts
    whole on every tp rank (1), Megatron-Core splits them over tp (ETP = TP), a folded layout over etp. The
    expert weights a device holds follow it: E n_mlp h f_e / (ep x split)."""
    from autoplan.plan.layout import expert_tp_split

    config = ParallelConfig(tp=2, ep=2, dp=2)
    assert expert_tp_split(config, unfolded_over_tp=False) == 1
    assert expert_tp_split(config, unfolded_over_tp=True) == 2
    assert expert_tp_split(ParallelConfig(tp=2, dp=4, etp=1, eep=4), unfolded_over_tp=True) == 1
    graph = gpt_graph(h=512, a=8, layers=1, seq=256, vocab=1024, experts=8, top_k=2, unfused=False)
    block = graph.blocks[0]
    held = {name: estimate_layer(block, IDEAL, config, "none", seq_len=graph.seq_len,
                                 engine=Engine.load(name)).expert_param_count for name in ("autoplan", "megatron-core")}
    assert held["autoplan"] == block.expert_params // 2 and held["megatron-core"] == block.expert_params // 4
