"""The reserve beside model states and activations (cost/reserve.py): cuBLAS / TE workspaces by architecture,
TE's userbuffers under --tp-comm-overlap, and their sum in the exact and quick estimates, against hand counts."""

from __future__ import annotations

import dataclasses

import numpy as np
from test_cost_graph_helper import a100_cluster, gpt_graph

from autoplan import cost
from autoplan.cluster.load import Cluster
from autoplan.cost.memory import nccl_buffer_bytes
from autoplan.cost.reserve import cublas_workspace_bytes, userbuffer_bytes
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig

MIB = 2**20
H100 = Cluster.load("dgx-h100-80gb", num_nodes=2)
A100 = Cluster.load("dgx-a100-80gb", num_nodes=1)
MCORE = Engine.load("megatron-core")


def test_cuda_context_is_the_profile_reserve() -> None:
    """The GPU profiles keep only the CUDA context (400 MiB, lazy loading) in runtime_reserve_bytes; NCCL's
    buffers and the workspaces are counted apart."""
    for cluster in (H100, A100, Cluster.load("h200", num_nodes=1), Cluster.load("jean-zay-a100-80gb", num_nodes=1)):
        assert cluster.device.runtime_reserve_bytes == 400 * MIB


def test_cublas_workspace_by_architecture() -> None:
    """PyTorch: :4096:2:16:8 (8 MiB + 128 KiB) before Hopper, 32 MiB on sm 9.x, one per GEMM stream; TE adds its
    own 32 / 4 MiB, three of them under userbuffers; a CPU profile has none."""
    autoplan = Engine()
    assert cublas_workspace_bytes(A100.device, autoplan) == 8 * MIB + 128 * 1024
    assert cublas_workspace_bytes(H100.device, autoplan) == 32 * MIB
    assert cublas_workspace_bytes(H100.device, dataclasses.replace(autoplan, gemm_streams=2)) == 64 * MIB
    assert cublas_workspace_bytes(H100.device, MCORE) == 32 * MIB + 32 * MIB
    assert cublas_workspace_bytes(H100.device, MCORE, True) == 32 * MIB + 3 * 32 * MIB
    assert cublas_workspace_bytes(A100.device, MCORE) == 8 * MIB + 128 * 1024 + 4 * MIB
    assert cublas_workspace_bytes(Cluster.load("local-cpu", num_nodes=1).device, MCORE) == 0.0


def test_userbuffers_are_ten_sequence_buffers() -> None:
    """Megatron's initialize_ub shape [s b / cp, h]: 10 buffers at 16 bits (Llama 3 405B at 8K: 2.5 GiB), 6 of
    them in uint8 under fp8, none without SP, without tp, or for an engine without TE userbuffers."""
    kw = {"tp": 8, "sp": True, "cp": 1, "microbatch": 1, "seq_len": 8192, "hidden": 16384}
    assert userbuffer_bytes(MCORE, "bf16", **kw) == 10 * 8192 * 16384 * 2 == 2.5 * 2**30
    assert userbuffer_bytes(MCORE, "bf16", **{**kw, "cp": 2, "microbatch": 2}) == 10 * 8192 * 16384 * 2
    assert userbuffer_bytes(MCORE, "fp8", **kw) == (4 * 2 + 6 * 1) * 8192 * 16384
    assert userbuffer_bytes(MCORE, "fp32", **kw) == 10 * 8192 * 16384 * 4
    assert userbuffer_bytes(MCORE, "bf16", **{**kw, "sp": False}) == 0.0
    assert userbuffer_bytes(MCORE, "bf16", **{**kw, "tp": 1}) == 0.0
    assert userbuffer_bytes(Engine.load("torchtitan"), "bf16", **kw) == 0.0
    assert userbuffer_bytes(dataclasses.replace(MCORE, tp_comm_overlap=False), "bf16", **kw) == 0.0


def test_estimate_reserve_is_the_sum_of_its_parts() -> None:
    """estimate_config's memory.reserve = context + NCCL buffers + PyTorch's and TE's workspaces + userbuffers,
    counted by hand for a GPT of h 1024 at s 2048, microbatch 2, tp 8 with SP on two DGX H100."""
    graph = gpt_graph(h=1024, a=16, layers=2, seq=2048, vocab=4096, unfused=False)
    config = ParallelConfig(tp=8, dp=2, sp=True, microbatch=2)
    est = cost.with_engine(MCORE).estimate_config(graph, H100, config, global_batch=8)
    by_hand = 400 * MIB + nccl_buffer_bytes(config, H100) + (32 + 3 * 32) * MIB + 10 * 2048 * 2 * 1024 * 2
    assert est.memory.reserve == int(by_hand)
    no_sp = cost.with_engine(MCORE).estimate_config(graph, H100, dataclasses.replace(config, sp=False), global_batch=8)
    assert no_sp.memory.reserve == int(400 * MIB + nccl_buffer_bytes(config, H100) + 64 * MIB)


def test_quick_estimate_reserve_matches_the_exact_one() -> None:
    """The quick estimate's peak carries the same workspaces and userbuffers: with the engine's userbuffers on
    and off, its peak moves by what the exact peak moves, candidate by candidate."""
    from autoplan.search.space import SearchOptions, enumerate_space
    from autoplan.search.surrogate import quick_estimate

    graph = gpt_graph(h=1024, a=16, layers=4, seq=1024, vocab=4096, unfused=False)
    base = a100_cluster(1, per_node=8)
    cluster = dataclasses.replace(base, device=dataclasses.replace(base.device, compute_capability=90))
    space = enumerate_space(graph, cluster, SearchOptions(global_batch=16))
    rows = [r for r in range(len(space)) if space.config(r).tp > 1 and space.config(r).sp][:12]
    assert rows
    peaks = {}
    for on in (False, True):
        eng = cost.with_engine(dataclasses.replace(MCORE, te_userbuffers=on))
        quick = quick_estimate(graph, cluster, space, 16, eng).peak_mem_bytes[rows]
        exact = np.array([eng.estimate_config(graph, cluster, space.config(r), global_batch=16).peak_mem_bytes
                          for r in rows])
        peaks[on] = quick, exact
    (q_off, e_off), (q_on, e_on) = peaks[False], peaks[True]
    # 10 buffers of [s b / cp, h] in bf16, and TE's 32 MiB workspace twice more (x3 under userbuffers)
    by_hand = np.array([10 * 1024 * c.microbatch / c.cp * 1024 * 2 + 2 * 32 * MIB
                        for c in (space.config(r) for r in rows)])
    assert np.allclose(e_on - e_off, by_hand, rtol=0, atol=2.0)
    assert np.allclose(q_on - q_off, e_on - e_off, rtol=0, atol=2.0)


def test_nccl_buffer_per_side_from_nccls_constants() -> None:
    """NCCL_BUFFER_BYTES from NCCL's own sizes (init.cc DEFAULT_BUFFSIZE, DEFAULT_LL128_BUFFSIZE,
    DEFAULT_LL_BUFFSIZE) split as p2p.cc splits them under P2P read, each side ALIGN_SIZE'd to 2 MiB."""
    from autoplan.cost.memory import NCCL_BUFFER_BYTES

    def align(n: int) -> int:
        return -(-n // (2 * MIB)) * 2 * MIB

    header = 4096  # ncclSendMem / ncclRecvMem: a few KiB, under the 2 MiB alignment
    simple, ll128, ll = 1 << 22, 120 * 640 * 8 * 8, 8 * 512 * 8 * 16
    assert align(simple + header) == align(ll128 + ll + header) == NCCL_BUFFER_BYTES
    assert align(simple + ll128 + ll + header) + align(header) == 2 * NCCL_BUFFER_BYTES  # write mode: same pair
