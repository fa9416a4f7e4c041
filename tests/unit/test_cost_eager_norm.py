"""An eager fp32-upcast RMSNorm (Engine.rmsnorm 'eager_fp32') priced at what that op sequence reaches on the
device (DeviceSpec.eager_norm_fwd_bw_efficiency / eager_norm_bwd_bw_efficiency), against hand computations:
the whole norm's bytes (36 forward, 92 backward per element in bf16: test_cost_torchtitan.py counts them) at
those fractions, the fused kernel's 4 / 6 bytes at mem_bw_efficiency."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from test_cost_graph_helper import a100_cluster, quick_and_exact, write_profile_variant
from test_cost_torchtitan import TITAN, H, S, _graph, llama_block

from autoplan.cluster.load import Cluster
from autoplan.cost.compute import layer_compute
from autoplan.cost.kernels import eager_norm_time_s, memory_time_s
from autoplan.plan.types import ParallelConfig, Recompute

BASE = a100_cluster()  # mem_bw 2.0 TB/s at mem_bw_efficiency 0.8, no eager-norm fractions (0)
FWD_EFF, BWD_EFF = 0.5, 0.625
SLOW = dataclasses.replace(BASE, device=dataclasses.replace(
    BASE.device, eager_norm_fwd_bw_efficiency=FWD_EFF, eager_norm_bwd_bw_efficiency=BWD_EFF))
BW = BASE.device.mem_bw_bytes_per_s


def _times(cluster, rmsnorm: str, recompute: Recompute = Recompute.NONE):
    return layer_compute(llama_block(), cluster.device, cluster.peak_flops, ParallelConfig(), recompute, scale=1.0,
                         seq_len=S, graph_tokens=float(S), dtype_bytes=2, scores_materialised=False,
                         engine=dataclasses.replace(TITAN, rmsnorm=rmsnorm))


def test_the_rate_function_divides_by_the_pass_fraction_or_falls_back_to_streaming() -> None:
    assert math.isclose(eager_norm_time_s(SLOW.device, 1e9, backward=False), 1e9 / (BW * FWD_EFF))
    assert math.isclose(eager_norm_time_s(SLOW.device, 1e9, backward=True), 1e9 / (BW * BWD_EFF))
    assert eager_norm_time_s(BASE.device, 1e9, backward=True) == memory_time_s(BASE.device, 1e9)


def test_the_whole_fp32_norm_runs_at_the_eager_rates_and_its_recompute_with_it() -> None:
    """Two norms per block, S tokens of H: eager_fp32 minus fused = 2 S H (36 / (bw 0.5) - 4 / (bw 0.8))
    forward and 2 S H (92 / (bw 0.625) - 6 / (bw 0.8)) backward; op-level selective and full recompute re-run
    the norms' forward, so their recompute moves by the forward's difference."""
    fwd = 2 * S * H * (36 / (BW * FWD_EFF) - 4 / (BW * 0.8))
    bwd = 2 * S * H * (92 / (BW * BWD_EFF) - 6 / (BW * 0.8))
    eager, fused = _times(SLOW, "eager_fp32"), _times(SLOW, "fused")
    assert math.isclose(eager.fwd_s - fused.fwd_s, fwd, rel_tol=1e-9)
    assert math.isclose(eager.bwd_s - fused.bwd_s, bwd, rel_tol=1e-9)
    for mode in (Recompute.SELECTIVE, Recompute.FULL):
        delta = _times(SLOW, "eager_fp32", mode).recompute_s - _times(SLOW, "fused", mode).recompute_s
        assert math.isclose(delta, fwd, rel_tol=1e-9)
    # the fractions touch nothing else: a fused norm, and an eager one on a profile without them
    assert (_times(SLOW, "fused").fwd_s, _times(SLOW, "fused").bwd_s) == (fused.fwd_s, _times(BASE, "fused").bwd_s)
    plain = _times(BASE, "eager_fp32")
    assert math.isclose(plain.fwd_s - _times(BASE, "fused").fwd_s, 2 * S * H * 32 / (BW * 0.8), rel_tol=1e-9)


def test_the_a100_fractions_are_the_published_liger_medians_over_the_sequences_bytes() -> None:
    """linkedin/Liger-Kernel benchmark/data/all_benchmark_data.csv, rms_norm / huggingface on NVIDIA
    A100-SXM4-80GB (2024-09-03), x bf16 [2048, H]: forward 0.98563 -> 1.91907 ms and backward 2.56963 ->
    5.01472 ms from H = 16384 to 32768. LlamaRMSNorm's kernels (fp32 weight) move 38 B per element forward
    and 114 B backward (profiles/dgx-a100-80gb.yaml lists them); over 2039 GB/s."""
    elements = 2048 * (32768 - 16384)
    fwd = 38 * elements / ((1.91907 - 0.98563) * 1e-3) / 2.039e12
    bwd = 114 * elements / ((5.01472 - 2.56963) * 1e-3) / 2.039e12
    device = Cluster.load("dgx-a100-80gb").device
    assert abs(device.eager_norm_fwd_bw_efficiency - fwd) < 0.005 and abs(device.eager_norm_bwd_bw_efficiency - bwd) < 0.005
    assert device.eager_norm_fwd_bw_efficiency < device.eager_norm_bwd_bw_efficiency < device.mem_bw_efficiency


def test_a_fraction_above_one_is_refused(tmp_path) -> None:
    path = write_profile_variant(tmp_path, lambda d: d["device"].update(eager_norm_bwd_bw_efficiency=1.3))
    with pytest.raises(ValueError, match=r"device.eager_norm_bwd_bw_efficiency.*\(0, 1\]"):
        Cluster.load(path)


def test_the_quick_estimate_moves_with_the_exact_model() -> None:
    """The quick estimate prices blocks through estimate_layer: giving the profile the eager-norm fractions
    moves its step times by what it moves the exact ones, on one GPU (no communication to hide it behind),
    every recompute mode."""
    from autoplan.search.space import SearchOptions, enumerate_space

    graph = _graph()
    out = []
    for cluster in (BASE, SLOW):
        cluster = dataclasses.replace(cluster, dtype="bf16", devices_per_node=1)
        space = enumerate_space(graph, cluster, SearchOptions(global_batch=2))
        rows = [j for j in range(len(space)) if space.config(j).pp == 1]
        out.append(quick_and_exact(graph, cluster, space, rows, 2, TITAN))
    (q0, e0), (q1, e1) = out
    assert np.all(e1 - e0 > 0)
    np.testing.assert_allclose(q1 - q0, e1 - e0, rtol=1e-6)
