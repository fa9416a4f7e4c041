"""Transformer Engine userbuffers (Megatron-Core --tp-comm-overlap): the SMs its comm-GEMM overlap takes
from the GEMMs, in place of NCCL's channels (cost/overlap.nccl_channels), for Engine.tp_overlap_margin_sms.

TE's default overlap config (transformer_engine/pytorch/module/base.py initialize_ub -> get_default_config,
used by Megatron-Core's _initialize_tp_communicators unless --tp-comm-overlap-cfg is given):
- the all-gathers beside qkv_fprop, fc1_fprop, proj_dgrad and fc2_dgrad run method "ring_exchange" with
  use_ce (peer copies on the copy engines), num_sm 1 and set_sm_margin False: those GEMMs keep every SM;
- the reduce-scatters beside proj_fprop and fc2_fprop ("pipeline") and the overlaps beside qkv_dgrad /
  qkv_wgrad and fc1_dgrad / fc1_wgrad ("bulk") use num_sm 16 with set_sm_margin True: CommOverlapCore
  (transformer_engine/common/comm_gemm_overlap/comm_gemm_overlap.cpp) launches those GEMMs on _math_sms =
  sm_count - num_comm_sm SMs, for their whole duration, whether or not the communication still runs.
"""

from __future__ import annotations

import dataclasses

from autoplan.cluster.types import DeviceSpec
from autoplan.cost.kernels import gemm_pass_s

Group = tuple[float, float, float, float]  # (m, k, n, count) of compute._block_gemm_groups


def margin_extra_s(device: DeviceSpec, peak_flops: float, groups: list[Group], n_mlp: int, dtype_bytes: int,
                   margin_sms: int, accumulate_bytes: float, separate_qkv: bool) -> tuple[float, float]:
    """(forward, backward) seconds the block's GEMMs lose when TE runs the margin-taking ones on num_sms -
    margin_sms SMs (gemm_pass_s on the narrower device: peak FLOP/s scaled by its share of the SMs, tiles in
    waves over the SMs it has; HBM bandwidth kept), minus the full one: in forward the
    attention output projection (groups[1]) and the MLP output matmul (1 of the n_mlp in groups[2]); in
    backward the input and weight gradients of QKV (groups[0], and the K / V GEMMs appended last when
    separate_qkv) and of the MLP input matmuls (n_mlp - 1 of groups[2]). Weight gradients accumulate at
    accumulate_bytes per element, as compute.compute_times prices them. Zero without a margin."""
    if margin_sms <= 0 or device.num_sms <= margin_sms:
        return 0.0, 0.0
    left = device.num_sms - margin_sms
    narrow = (dataclasses.replace(device, num_sms=left), peak_flops * left / device.num_sms)

    def extra(fn, group: Group, share: float) -> float:
        return share * (fn(*narrow, group) - fn(device, peak_flops, group))

    def fwd(d: DeviceSpec, peak: float, g: Group) -> float:
        m, k, n, c = g
        return gemm_pass_s(d, peak, m, k, n, c, dtype_bytes)

    def bwd(d: DeviceSpec, peak: float, g: Group) -> float:  # dgrad [m x n] @ [n x k], wgrad [k x m] @ [m x n]
        m, k, n, c = g
        return (gemm_pass_s(d, peak, m, n, k, c, dtype_bytes)
                + gemm_pass_s(d, peak, k, m, n, c, dtype_bytes, out_bytes=accumulate_bytes))

    qkv = [groups[0], groups[-1]] if separate_qkv else [groups[0]]
    forward = extra(fwd, groups[1], 1.0) + extra(fwd, groups[2], 1.0 / n_mlp)
    backward = sum(extra(bwd, g, 1.0) for g in qkv) + extra(bwd, groups[2], (n_mlp - 1) / n_mlp)
    return forward, backward
