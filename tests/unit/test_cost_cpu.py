"""The cost model's CPU terms, by hand: a CPU rank's host time adds to its compute (one thread does
both), tensor parallelism adds DTensor's per-op host time, and idle pipeline ranks free their core
share (cost.timeline.shared_cores_pipeline_time_s)."""

from __future__ import annotations

import dataclasses
import math

from test_cost_graph_helper import gpt_graph

from autoplan.cluster.types import ClusterSpec, DeviceSpec, LinkSpec
from autoplan.cost import estimate_config
from autoplan.cost.compute import layer_compute
from autoplan.cost.layer import estimate_layer
from autoplan.graph.types import Layer, LayerRole
from autoplan.plan.types import ParallelConfig, Recompute

LINK = LinkSpec(name="loopback", bw_bytes_per_s=1e9, latency_s=1e-3, allreduce_busbw_fraction=1.0,
                alltoall_bw_fraction=1.0, p2p_bw_fraction=1.0)
CPU = DeviceSpec(name="cpu", peak_flops=(("fp32", 1e11),), mem_bytes=2**34, mem_bw_bytes_per_s=1e10,
                 matmul_efficiency=1.0, matmul_half_size_flops=0.0, attention_efficiency=1.0, mem_bw_efficiency=1.0,
                 runtime_reserve_bytes=0, op_overhead_s=1e-5, tp_op_overhead_s=1e-4, cpu_cores=2)
# one layer of pure matmul FLOPs (no recognised block shape): 1e8 FLOP forward, 10 captured ops
LAYER = Layer(name="l", kind="l", role=LayerRole.OTHER, index=0, fwd_matmul_flops=1e8, fwd_attention_flops=0.0,
              fwd_elementwise_flops=0.0, num_params=0, param_bytes=0, activation_bytes=0, num_nodes=10)


def _cluster(device: DeviceSpec) -> ClusterSpec:
    return ClusterSpec(name="cpu8", device=device, devices_per_node=8, num_nodes=1, intra_node=LINK,
                       inter_node=LINK, dtype="fp32")


def _times(device: DeviceSpec, config: ParallelConfig):
    return estimate_layer(LAYER, _cluster(device), config, Recompute.NONE, seq_len=16, graph_microbatch=1)


def test_cpu_host_time_adds_to_compute() -> None:
    cpu = _times(CPU, ParallelConfig())
    gpu = _times(dataclasses.replace(CPU, cpu_cores=0.0), ParallelConfig())
    mm = 1e8 / 1e11  # 1 ms at peak, forward; backward 2 x
    assert math.isclose(cpu.fwd_s, mm + 10 * 1e-5) and math.isclose(cpu.bwd_s, 2 * mm + 2 * 10 * 1e-5)
    assert math.isclose(gpu.fwd_s, mm) and math.isclose(gpu.bwd_s, 2 * mm)  # hidden behind the kernels


def test_tensor_parallel_adds_dtensor_host_time_per_op() -> None:
    tp2 = layer_compute(LAYER, CPU, 1e11, ParallelConfig(tp=2), Recompute.NONE, scale=1.0, seq_len=16,
                        graph_tokens=16.0, dtype_bytes=4, scores_materialised=False)
    assert math.isclose(tp2.fwd_s, 1e8 / 2 / 1e11) and math.isclose(tp2.host_fwd_s, 10 * (1e-5 + 1e-4))
    one = layer_compute(LAYER, CPU, 1e11, ParallelConfig(), Recompute.NONE, scale=1.0, seq_len=16,
                        graph_tokens=16.0, dtype_bytes=4, scores_materialised=False)
    assert math.isclose(one.host_fwd_s, 10 * 1e-5) and math.isclose(one.host_bwd_s, 2 * 10 * 1e-5)


def test_data_parallel_adds_fsdp_hook_time_per_pass() -> None:
    device = dataclasses.replace(CPU, dp_layer_overhead_s=1e-3)
    dp2 = layer_compute(LAYER, device, 1e11, ParallelConfig(dp=2), Recompute.NONE, scale=1.0, seq_len=16,
                        graph_tokens=16.0, dtype_bytes=4, scores_materialised=False)
    assert math.isclose(dp2.host_fwd_s, 10 * 1e-5 + 1e-3) and math.isclose(dp2.host_bwd_s, 2 * (10 * 1e-5 + 1e-3))


def test_idle_pipeline_ranks_free_their_share() -> None:
    # pp4 x dp2, one microbatch: each pipeline runs one stage at a time. With 8 cores for the 8 ranks the
    # pipeline is the sum of the ranks' slots X_r (1F1B, m = 1); on 2 cores the all-busy share is 1/4
    # but the one running rank per pipeline has a whole core: max(sum X_r / 4, max X_r)
    graph = gpt_graph(h=256, a=4, layers=4, seq=64, vocab=512)
    cluster = _cluster(CPU)
    config = ParallelConfig(pp=4, dp=2, microbatch=8)  # zero 0: no per-microbatch data-parallel traffic
    shared = estimate_config(graph, cluster, config, global_batch=16)
    own = estimate_config(graph, dataclasses.replace(cluster, device=dataclasses.replace(CPU, cpu_cores=8)),
                          config, global_batch=16)
    b = own.breakdown
    slowest = b.compute + b.recompute + b.tp_comm + b.cp_comm + b.ep_comm + b.pp_comm  # m = 1: max X_r
    pipe = slowest + b.pp_bubble  # sum X_r
    assert b.pp_bubble > 0.5 * slowest
    assert math.isclose(shared.step_time_s, own.step_time_s - pipe + max(pipe / 4, slowest), rel_tol=1e-9)
