"""Transformer Engine userbuffers (Megatron-Core --tp-comm-overlap): the SMs its comm-GEMM overlap takes
from the GEMMs, in place of NCCL's channels (cost/overlap.nccl_channels), overlap by overlap
(Engine.tp_overlap_margin_sms, Engine.tp_overlap_margin_sms_by_op).

What an overlap holds (TE v1.10 / v1.11, the NeMo 24.09 container's generation, and TE >= 2.0 alike):
- 'pipeline' (reduce-scatter) and 'bulk' overlaps are UbufCommOverlap (pytorch/csrc/comm_gemm_overlap.h;
  TE >= 2.0 CommOverlapBase in common/comm_gemm_overlap/comm_gemm_overlap.cpp): `_use_ce = 0`, the
  reduce-scatter / all-gather kernels run on num_sm SMs (`_ub_comm->sms = _num_comm_sm`), and the GEMM is
  launched on `_math_sms = set_sm_margin ? multiProcessorCount - num_comm_sm : multiProcessorCount` SMs
  (less NVTE_EXT_MARGIN_SM) for its whole duration, whether or not the communication still runs;
- 'ring_exchange' overlaps are UbufP2PCommOverlap (CommOverlapP2PBase): with use_ce (the default) the peer
  chunks move by copy engine (userbuffers_send / _recv); its GEMM chunks take the same `_math_sms` rule,
  and every config in TE's defaults and NVIDIA's recipes leaves set_sm_margin off there.
So an overlap's margin is num_sm where set_sm_margin is on, else 0; it narrows exactly one GEMM:
qkv_fprop / proj_fprop / fc1_fprop / fc2_fprop the forward GEMM of that linear (layernorm_linear.py,
linear.py, layernorm_mlp.py: `ub=ub_obj_lnout` / the `_fprop` ub of the forward gemm); proj_dgrad /
fc2_dgrad the input-gradient GEMM (ring-exchange all-gather of the output gradient); qkv_dgrad / fc1_dgrad
the input-gradient GEMM (bulk all-gather of the saved LayerNorm output, `ub_obj_lnout = get_ub(name +
"_dgrad")`); qkv_wgrad / fc1_wgrad the weight-gradient GEMM (bulk reduce-scatter of the input gradient,
`ub_obj_dgrad = get_ub(name + "_wgrad")`). The attention projection's and MLP output's weight gradients
have no overlap.

Engine.tp_overlap_margin_sms is TE >= 2.0's get_default_config (module/base.py initialize_ub: num_sm 16,
set_sm_margin = method != 'ring_exchange') for the six pipeline / bulk overlaps (MARGIN_OPS), the
ring-exchange ones 0; tp_overlap_margin_sms_by_op replaces it op by op (a run's ub_tp_comm_overlap_cfg).

An overlap WITHOUT a margin (set_sm_margin 0) still runs its communication in SM kernels: TE 1.x
UbufCommOverlap::bulk_overlap (pytorch/csrc/comm_gemm_overlap.h, the NeMo 24.09 / 2024 containers' generation)
launches allgather2_userbuff_inplace / reducescatter2_userbuff_inplace on _stream_comm, a grid of
`_ub_comm->sms = num_comm_sm` CTAs (userbuffers/userbuffers.cu: `int sms = comm->sms; ...
SETUP_LAUNCH_CONFIG(sms, warps * 32, stream)`), then te_gemm on the
compute stream with `_math_sms` = every SM; split_overlap_rs does the same chunk by chunk. The two streams run
concurrently, so for as long as the communication runs its num_sm CTAs hold num_sm SMs the GEMM's tiles cannot
use: the GEMM loses num_sm / num_sms of its throughput for the communication's duration (comm_contention_s),
the per-op figure Engine.tp_overlap_comm_sms_by_op gives (the recipe's num_sm), in place of NCCL's channel count
(cost/overlap.contention_fraction), which prices a collective NCCL runs, not TE's kernels. Not modelled: the
pipeline reduce-scatter's last chunk runs on UB_MAX_SM (32) SMs after the last GEMM chunk (comm_gemm_overlap.h
split_overlap_rs `_ub_comm->sms = UB_MAX_SM`), past the GEMM it overlaps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from autoplan.cluster.types import DeviceSpec
from autoplan.cost.kernels import gemm_pass_s
from autoplan.plan.engine import TE_UB_OPS, Engine

Group = tuple[float, float, float, float]  # (m, k, n, count) of compute._block_gemm_groups
# the overlaps TE >= 2.0's get_default_config gives a margin (methods 'pipeline' and 'bulk')
MARGIN_OPS = ("proj_fprop", "fc2_fprop", "qkv_dgrad", "qkv_wgrad", "fc1_dgrad", "fc1_wgrad")
FORWARD_OPS = tuple(op for op in TE_UB_OPS if op.endswith("_fprop"))


def op_margins(engine: Engine | int) -> dict[str, int]:
    """The SMs each TE userbuffers overlap keeps from its GEMM: tp_overlap_margin_sms on MARGIN_OPS, 0 on the
    ring-exchange ones, then tp_overlap_margin_sms_by_op's entries over them (an int: that uniform margin)."""
    uniform = engine if isinstance(engine, int) else engine.tp_overlap_margin_sms
    margins = {op: uniform if op in MARGIN_OPS else 0 for op in TE_UB_OPS}
    if not isinstance(engine, int):
        margins.update(engine.tp_overlap_margin_sms_by_op)
    return margins


def margin_phases(engine: Engine) -> tuple[bool, bool]:
    """Whether any forward / any backward overlap takes a margin: that phase's TP communication is then
    priced as TE's (the narrowed GEMMs' loss, cost/layer.py), else by NCCL's channels over its hidden time."""
    margins = op_margins(engine)
    return (any(margins[op] for op in FORWARD_OPS),
            any(n for op, n in margins.items() if op not in FORWARD_OPS))


# the overlaps whose communication is a reduce-scatter (pipeline RS of the row-parallel outputs, bulk RS of the
# column-parallel input gradients); the others all-gather (module/base.py initialize_ub: is_reduce_scatter)
RS_OPS = ("proj_fprop", "fc2_fprop", "qkv_wgrad", "fc1_wgrad")


def comm_contention_s(engine: Engine, num_sms: int, all_gather_s: float, reduce_scatter_s: float,
                      skip: tuple[str, ...] = ()) -> tuple[float, float]:
    """(forward, backward) GEMM seconds lost to TE userbuffers' communication kernels beside full-width GEMMs:
    each op in tp_overlap_comm_sms_by_op without a margin (op_margins 0) holds its num_sm of the num_sms SMs for
    its collective's duration (reduce_scatter_s for RS_OPS, else all_gather_s), num_sm / num_sms x that. An op
    with a margin holds none beyond it (its comm runs on the margin SMs margin_extra_s prices); ops in `skip`
    do not run (an early-stopping recompute's fc2_fprop)."""
    if num_sms <= 0:
        return 0.0, 0.0
    margins = op_margins(engine)
    forward = backward = 0.0
    for op, sms in engine.tp_overlap_comm_sms_by_op:
        if margins[op] > 0 or sms <= 0 or op in skip:
            continue
        lost = min(sms / num_sms, 1.0) * (reduce_scatter_s if op in RS_OPS else all_gather_s)
        if op in FORWARD_OPS:
            forward += lost
        else:
            backward += lost
    return forward, backward


def margin_extra_s(device: DeviceSpec, peak_flops: float, groups: list[Group], n_mlp: int, dtype_bytes: int,
                   margins: Mapping[str, int] | int, accumulate_bytes: float,
                   separate_qkv: bool) -> tuple[float, float]:
    """(forward, backward) seconds the block's GEMMs lose when TE runs each one beside an overlap with a
    margin on num_sms - margin SMs (gemm_pass_s on the narrower device: peak FLOP/s scaled by its share of
    the SMs, tiles in waves over the SMs it has; HBM bandwidth kept), minus the full one. `margins`: SMs per
    overlap (op_margins; an int: that margin on MARGIN_OPS). GEMMs: QKV groups[0] (and the K / V GEMMs
    appended last when separate_qkv), the attention output projection groups[1], the MLP groups[2] (fc1:
    n_mlp - 1 of its n_mlp, fc2: 1). Weight gradients accumulate at accumulate_bytes per element, as
    compute.compute_times prices them. Zero without a margin."""
    margins = op_margins(margins) if isinstance(margins, int) else margins
    qkv = [groups[0], groups[-1]] if separate_qkv else [groups[0]]
    linears = {"qkv": [(g, 1.0) for g in qkv], "proj": [(groups[1], 1.0)],
               "fc1": [(groups[2], (n_mlp - 1) / n_mlp)], "fc2": [(groups[2], 1.0 / n_mlp)]}
    passes = {"fprop": lambda m, k, n: (m, k, n, None), "dgrad": lambda m, k, n: (m, n, k, None),
              "wgrad": lambda m, k, n: (k, m, n, accumulate_bytes)}  # dgrad [m x n] @ [n x k], wgrad [k x m] @ [m x n]
    forward = backward = 0.0
    for op in TE_UB_OPS:
        sms = margins.get(op, 0)
        if sms <= 0 or device.num_sms <= sms:
            continue
        name, kind = op.split("_")
        narrow = dataclasses.replace(device, num_sms=device.num_sms - sms)
        lost = sum(share * (_pass_s(narrow, peak_flops * narrow.num_sms / device.num_sms, passes[kind](*g[:3]),
                                    g[3], dtype_bytes)
                            - _pass_s(device, peak_flops, passes[kind](*g[:3]), g[3], dtype_bytes))
                   for g, share in linears[name])
        if kind == "fprop":
            forward += lost
        else:
            backward += lost
    return forward, backward


def _pass_s(device: DeviceSpec, peak: float, mkn: tuple, count: float, dtype_bytes: int) -> float:
    m, k, n, out_bytes = mkn
    return gemm_pass_s(device, peak, m, k, n, count, dtype_bytes, out_bytes=out_bytes)
