"""Time of one engine iteration on one instance: a roofline per block, from first principles.

An iteration runs `decode` tokens (one per running request, each attending to `decode_context` cached
tokens) and `prefill` prompt tokens (a chunk whose tokens attend to `prefill_context` tokens on
average) through every block of a tp-sharded instance. Per block and device:
- GEMMs hold the dense weights (QKV, output, MLP up/gate and down: 4 fused GEMMs) and take
  max(2 T W / (peak x matmul_efficiency), (W x bytes + activations) / achievable bandwidth)
  (Williams et al., "Roofline", CACM 2009): decode (small T) reads the weights once per step and is
  memory-bound; prefill (large T) is compute-bound. The weights stream at the bandwidth the engine's
  GEMM library reaches at small M (engine gemm_bw_efficiency / gemm_bw_efficiency_8bit x datasheet
  bandwidth: an fp8 GEMV reaches less of it than a bf16 one), else the device's STREAM-like
  mem_bw_efficiency; never the datasheet peak. Under 8-bit weights an engine may add activation
  quantization kernels (quant_kernels_per_block). The embedding and LM head keep their own width
  (ServeModel.ends_bytes: fp8 checkpoints leave lm_head in 16 bits).
- Routed experts (MoE): T tokens pick top_k of E experts; the step reads only the experts some token
  picked, E (1 - (1 - k/E)^T) of them in expectation under uniform routing (the occupancy of E bins
  after T k/E-probability draws per bin), so a decode step of few tokens reads a small share.
- Attention: decode reads the KV cache, B x context x 2 x kv_heads_per_rank x d x bytes per layer,
  memory-bound (Kwon et al., SOSP'23) unless its 4 B ctx a d / tp FLOPs bind: on tensor cores, or on
  CUDA cores (the fp32 peak) for engines whose decode kernel has none (TensorRT-LLM before its XQA
  kernel: docs/source/blogs/XQA-kernel.md "using tensor cores for acceleration"; vLLM's
  csrc/attention paged_attention_v1/v2 dot products); GQA groups reuse each K/V element a / g times,
  so CUDA-core kernels become compute-bound at large groups. Prefill computes 4 C ctx a d / tp FLOPs (QK^T and PV, 2 FLOPs
  per multiply-add; causal: a token attends to ctx ~ prefix + chunk / 2 keys) at attention_efficiency.
- Norms and residual adds: 10 h elements read or written per token (cost.elementwise.block_elementwise_bytes).
- Tensor parallelism: two all-reduces of T x h activations per block (row-parallel output projection
  and down projection, Shoeybi et al. 2019), one for the vocab-parallel embedding; each pays its
  per-message latency: the engine's measured custom all-reduce for small messages, else the
  cluster's NCCL alpha-beta ring (cost.comm.all_reduce_s).
- LM head: logits for the sequences that sample this iteration, vocab-parallel, then gathered.
- Kernels: each of the block's kernels (the engine's layer code: norms, GEMMs, rotary, KV write,
  attention, activation) adds a fixed launch and dependency gap, kernel_launch_s, to its roofline time.
- Host: every iteration pays the engine's exposed step overhead (scheduler, sampling, sync); an
  engine without compiled graphs (eager) is bound below by its op count x the device's op_overhead_s.
Pipeline parallelism: a request passes the pp stages in turn, so a lane's iteration is the whole model's
time plus (pp - 1) point-to-point sends of T x h activations and one of the sampled tokens back to the
first stage (blocking, so added after the eager host floor); pp lanes (micro-batches) run at once.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from autoplan.cluster.types import ClusterSpec
from autoplan.cost.comm import all_gather_s, all_reduce_s, p2p_s
from autoplan.cost.types import GroupPlacement
from autoplan.serve.memory import kv_bytes_per_token_per_gpu, kv_heads_per_rank
from autoplan.serve.types import BlockGroup, ServeEngine, ServeModel

# Dense FP8 tensor-core peaks by device (FLOP/s): "NVIDIA H100 Tensor Core GPU" datasheet (2023) and
# "NVIDIA H200" datasheet (2024): FP8 3,958 TFLOPS with sparsity -> 1,979 dense. A device without FP8
# (A100) runs fp8 weights with 16-bit math (weight-only kernels, e.g. vLLM's Marlin fp8), its bf16 peak.
FP8_PEAK_FLOPS = {"H100-SXM5-80GB": 1979e12, "H200-SXM-141GB": 1979e12}
# Achieved share of that FP8 peak by large (compute-bound) FP8 GEMMs: DeepGEMM README (first release,
# H800 = H100 SXM compute, dense M = 4096 shapes): DeepGEMM reaches 990-1358 TFLOPS, 1.0-1.2x the
# CUTLASS 3.6 kernels the engines use. For the shapes of 8B-70B projections (K and N of 4-16 k: its
# 4096 x 7168 and 7168 x 16384 rows, 1304 and 1358 TFLOPS at speedups 1.1x and 1.2x) CUTLASS reaches
# 1185 and 1132 TFLOPS = 0.57-0.60 of 1979: 0.57. Lower than bf16's profile matmul_efficiency (0.70
# of 989): fp8 tensor cores double the math rate, not the data movement and scaling around it.
FP8_MATMUL_EFFICIENCY = 0.57
_ELEMENTWISE_PER_TOKEN = 10  # x h elements: 2 norms (read + write h) and 2 residual adds (read 2h, write h)


@dataclass(frozen=True, slots=True)
class Hardware:
    """What the physics reads besides the model: the cluster, the engine and the GEMM peak in use."""

    cluster: ClusterSpec
    engine: ServeEngine
    peak_flops: float  # GEMMs (fp8 tensor cores for fp8 weights where the device has them)
    attention_peak_flops: float  # attention runs in the activation dtype
    gemm_efficiency: float = 0.0  # achieved share of peak_flops by large GEMMs; 0: the device's matmul_efficiency

    @property
    def gemm_flops(self) -> float:
        return self.peak_flops * (self.gemm_efficiency or self.cluster.device.matmul_efficiency)

    @property
    def bw(self) -> float:
        dev = self.cluster.device
        return dev.mem_bw_bytes_per_s * dev.mem_bw_efficiency

    def gemm_bw(self, weight_bytes: float) -> float:
        """Bandwidth at which decode GEMMs stream weights of `weight_bytes` bytes each: the engine's
        measured small-M GEMM efficiency for that width times the datasheet bandwidth, else bw."""
        eng = self.engine
        fraction = eng.gemm_bw_efficiency_8bit if weight_bytes < 2 else eng.gemm_bw_efficiency
        return self.cluster.device.mem_bw_bytes_per_s * fraction if fraction > 0 else self.bw

    @property
    def decode_attention_flops(self) -> float:
        """FLOP/s of decode attention: tensor cores in the activation dtype, or the CUDA cores' fp32
        peak for an engine whose decode kernel uses none; times the device's attention_efficiency."""
        dev = self.cluster.device
        peak = self.attention_peak_flops if self.engine.decode_attention_tensor_cores else dev.peak("fp32")
        return peak * dev.attention_efficiency


def gemm_peak_flops(cluster: ClusterSpec, weight_dtype_bytes: float, act_dtype: str) -> float:
    """FP8 tensor-core peak for 1-byte weights on a device that has one, else the activation dtype's."""
    if weight_dtype_bytes == 1.0 and cluster.device.name in FP8_PEAK_FLOPS:
        return FP8_PEAK_FLOPS[cluster.device.name]
    return cluster.device.peak(act_dtype)


def gemm_efficiency(cluster: ClusterSpec, weight_dtype_bytes: float) -> float:
    """FP8_MATMUL_EFFICIENCY where fp8 tensor cores run the GEMMs, else 0 (the device's matmul_efficiency)."""
    return FP8_MATMUL_EFFICIENCY if weight_dtype_bytes == 1.0 and cluster.device.name in FP8_PEAK_FLOPS else 0.0


def tp_group(tp: int, cluster: ClusterSpec) -> GroupPlacement:
    per_node = min(tp, cluster.devices_per_node)
    return GroupPlacement(size=tp, num_nodes=math.ceil(tp / per_node), per_node=per_node)


def allreduce_s(nbytes: float, tp: int, hw: Hardware) -> float:
    """One all-reduce of `nbytes` over the tp group: the engine's measured custom all-reduce (linear
    interpolation in its table) for messages up to custom_allreduce_max_bytes inside a node, else
    NCCL's ring on the cluster's links. Past the table's largest message the custom kernels switch to
    their bandwidth-bound two-shot form (vLLM custom_all_reduce.cuh cross_device_reduce_2stage,
    TensorRT-LLM twoShotAllReduceKernel): the ring's bandwidth term with the table's last latency as
    a floor, never the steeper one-shot slope of the table's small messages extrapolated."""
    if tp <= 1 or nbytes <= 0:
        return 0.0
    group = tp_group(tp, hw.cluster)
    ring = all_reduce_s(nbytes, group, hw.cluster)
    table = dict(hw.engine.allreduce_table).get(tp)
    if table and not group.crosses_nodes and nbytes <= hw.engine.custom_allreduce_max_bytes:
        if nbytes <= table[-1][0]:
            return _interpolate(table, nbytes)
        return min(_interpolate(table, nbytes), max(table[-1][1], ring))
    return ring


def _interpolate(points: tuple[tuple[float, float], ...], x: float) -> float:
    xs = [p[0] for p in points]
    i = min(max(bisect.bisect_left(xs, x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    if x <= x0:
        return y0
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _roofline_s(flops: float, nbytes: float, hw: Hardware, bw: float | None = None) -> float:
    """max(FLOPs at the large-GEMM efficiency, bytes at achievable bandwidth). The training cost model's
    size curve (cost.compute.matmul_efficiency) is not applied: it reads a small FLOP count as a GEMM
    that under-fills the SMs, but a decode GEMM is small only in M and its kernels split N and K over
    every SM (its fixed per-kernel cost is kernel_launch_s)."""
    if flops <= 0 and nbytes <= 0:
        return 0.0
    return max(flops / hw.gemm_flops, nbytes / (bw or hw.bw))


def touched_experts(num_experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts picked by `tokens` tokens choosing top_k of E uniformly."""
    if num_experts <= 0 or tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


@dataclass(frozen=True, slots=True, kw_only=True)
class Iteration:
    """What one iteration of one lane runs."""

    decode: float = 0.0  # decode tokens (running requests)
    decode_context: float = 0.0  # mean cached tokens each decode token attends to
    prefill: float = 0.0  # prompt tokens in this iteration's chunk(s)
    prefill_context: float = 0.0  # mean keys a prefill token attends to (prefix + chunk / 2)
    sampled: float = 0.0  # sequences whose logits are computed (decode + prompts finishing)


def block_s(group: BlockGroup, model: ServeModel, it: Iteration, *, tp: int, ep: int,
            hw: Hardware) -> dict[str, float]:
    """Seconds of ONE block of `group` on one device, by cause."""
    t = it.decode + it.prefill
    if t <= 0:
        return {}
    act, wb = model.act_bytes, model.weight_bytes
    w_dense = group.dense_params / tp
    act_traffic = t * act * (4 * group.h + ((2 * group.a + 2 * group.g) * group.d + group.n_mlp * group.f) / tp)
    flops = 2.0 * t * w_dense
    out = {"gemm": _roofline_s(flops, w_dense * wb + act_traffic, hw, hw.gemm_bw(wb))}
    if group.num_experts:
        out["experts"] = _experts_s(group, model, t, tp=tp, ep=ep, hw=hw)
    kv_per_token = 2.0 * kv_heads_per_rank(group.g, tp) * group.d * model.kv_bytes
    heads = group.a / tp
    dev = hw.cluster.device
    dec_flops = 4.0 * it.decode * it.decode_context * heads * group.d
    out["kv_read"] = max(dec_flops / hw.decode_attention_flops,
                         it.decode * it.decode_context * kv_per_token / hw.bw)
    pre_flops = 4.0 * it.prefill * it.prefill_context * heads * group.d
    out["attention"] = pre_flops / (hw.attention_peak_flops * dev.attention_efficiency) + \
        it.prefill * kv_per_token / hw.bw
    out["elementwise"] = t * _ELEMENTWISE_PER_TOKEN * group.h * act / hw.bw
    out["allreduce"] = 2.0 * allreduce_s(t * group.h * act, tp, hw)
    kernels = hw.engine.kernels_per_block + (hw.engine.quant_kernels_per_block if wb < 2 else 0)
    out["launch"] = kernels * hw.engine.kernel_launch_s
    return out


def _experts_s(group: BlockGroup, model: ServeModel, tokens: float, *, tp: int, ep: int, hw: Hardware) -> float:
    """Routed experts of one block on one device: the touched experts' weights (their 1/tp share per
    device: E/ep experts each split tp/ep ways) at T k x 2 x params_per_expert / tp FLOPs."""
    touched = touched_experts(group.num_experts, group.top_k, tokens)
    routed = tokens * group.top_k
    per_expert = group.params_per_expert / tp
    flops = 2.0 * routed * per_expert
    nbytes = touched * per_expert * model.weight_bytes + 3.0 * routed * group.h * model.act_bytes / max(ep, 1)
    return _roofline_s(flops, nbytes, hw, hw.gemm_bw(model.weight_bytes))


def ends_s(model: ServeModel, it: Iteration, *, tp: int, hw: Hardware) -> dict[str, float]:
    """Embedding (a vocab-parallel lookup: one all-reduce of T x h) and LM head (logits of the sampled
    sequences, h x V / tp weights read, then all-gathered as fp32 to the sampler)."""
    t = it.decode + it.prefill
    h, v = model.hidden_size, model.vocab_size
    head_w = model.head_params / tp
    flops = 2.0 * it.sampled * head_w
    wb = model.ends_weight_bytes
    head = _roofline_s(flops, head_w * wb + it.sampled * v / tp * 4.0, hw, hw.gemm_bw(wb))
    gather = all_gather_s(it.sampled * v * 4.0, tp_group(tp, hw.cluster), hw.cluster) if tp > 1 else 0.0
    return {"lm_head": head + gather, "allreduce": allreduce_s(t * h * model.act_bytes, tp, hw)}


def lane_step_s(model: ServeModel, it: Iteration, *, tp: int, pp: int, ep: int,
                hw: Hardware) -> tuple[float, dict[str, float]]:
    """(seconds, breakdown) of one iteration of one lane: every block, the ends, the pipeline sends
    and the host: max(device time, eager op floor) + the engine's step overhead."""
    parts: dict[str, float] = {}
    ops = 0
    for group in model.blocks:
        for key, value in block_s(group, model, it, tp=tp, ep=ep, hw=hw).items():
            parts[key] = parts.get(key, 0.0) + group.count * value
        ops += group.count * group.ops_per_block
    for key, value in ends_s(model, it, tp=tp, hw=hw).items():
        parts[key] = parts.get(key, 0.0) + value
    device = sum(parts.values())
    host = ops * hw.cluster.device.op_overhead_s if hw.engine.cuda_graph_max_batch == 0 else 0.0
    if host > device:
        parts["host_ops"] = host - device
    if pp > 1:  # blocking sends between the stages: on top of each stage's own time, never hidden by it
        parts["pipeline"] = pipeline_s(model, it, tp=tp, pp=pp, hw=hw)
    seqs = it.decode + (1.0 if it.prefill > 0 else 0.0)
    parts["step_overhead"] = hw.engine.step_overhead_s + hw.engine.step_overhead_per_seq_s * seqs
    return sum(parts.values()), parts


def pipeline_s(model: ServeModel, it: Iteration, *, tp: int, pp: int, hw: Hardware) -> float:
    """A lane's point-to-point traffic per iteration: (pp - 1) sends of the T x h residual stream
    between consecutive stages, and one of the sampled token ids (8 bytes each) from the last stage
    back to the first, which builds the next iteration's input (vLLM's last pipeline rank samples and
    broadcasts the tokens to the driver; autoplan.execute.serve sends them back)."""
    crosses = tp * pp > hw.cluster.devices_per_node
    hidden = (it.decode + it.prefill) * model.hidden_size * model.act_bytes
    return (pp - 1) * p2p_s(hidden, crosses, hw.cluster) + p2p_s(max(it.sampled, 1.0) * 8.0, crosses, hw.cluster)


def kv_transfer_s(model: ServeModel, tokens: float, *, sender: tuple[int, int], receiver: tuple[int, int],
                  crosses_nodes: bool, hw: Hardware) -> float:
    """Disaggregation's hand-off of a prompt's KV cache from the prefill instance to a decode instance:
    every device sends its share at once, so the time is the larger per-device share (tp x pp ranks
    on each side, kv heads replicated past tp = kv_heads) over the link between the groups (NVLink
    inside a node, the NIC across nodes): alpha + bytes / (bw x p2p_bw_fraction) (cost.comm.p2p_s).
    Charged whole after the prefill (engines that stream it layer by layer hide part of it)."""
    per_device = max(kv_bytes_per_token_per_gpu(model, tp, pp) for tp, pp in (sender, receiver))
    return p2p_s(tokens * per_device, crosses_nodes, hw.cluster)
