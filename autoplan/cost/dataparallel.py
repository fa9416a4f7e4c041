"""Data-parallel traffic of one pipeline rank as the engine runs its ZeRO layout (plan.layout.zero_layout):
weight all-gathers and gradient reductions, per microbatch or per step, overlapped with the compute
beside them or exposed, in the engine's buckets. DeepSpeed's stage 3 on a rank (deepspeed_rank,
deepspeed_step_s, layer_numels, layer_small_numels) lives in cost/deepspeedrank.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from autoplan.cluster.types import ClusterSpec
from autoplan.cost import chunksync, comm
from autoplan.cost.experts import expert_dp_placement
from autoplan.cost.fsdpunits import unit_numels
from autoplan.cost.gradpasses import (
    ddp_grad_passes_s,
    dp_wire_bytes,
    grad_buffer_passes_s,
    reduce_copy_in_s,
)
from autoplan.cost.kernels import memory_time_s
from autoplan.cost.memory import state_bytes_per_param
from autoplan.cost.overlap import contention_fraction, exposed_s, hidden_penalty_s, mixed_fraction
from autoplan.cost.pipeline import nic_shared_reduce_s
from autoplan.cost.types import GroupPlacement, LayerCost
from autoplan.graph.types import Layer
from autoplan.plan.engine import Engine
from autoplan.plan.layout import ZeroLayout
from autoplan.plan.types import DENSE_DP, ParallelConfig

__all__ = ["DpGroups", "Rank", "add_layers", "async_reduce", "async_reduce_s", "dp_fraction", "dp_groups",
           "rank_dp_times"]


@dataclass(frozen=True, slots=True)
class DpGroups:
    """The data-parallel groups: dense parameters over dp * ep * cp, experts over their expert data-parallel
    group (dp * cp unfolded; the edp axis of the expert mesh when folded: cost.experts)."""

    dense: GroupPlacement
    expert: GroupPlacement


def dp_groups(config: ParallelConfig, cluster: ClusterSpec) -> DpGroups:
    return DpGroups(dense=comm.group_placement(config, DENSE_DP, cluster.devices_per_node),
                    expert=expert_dp_placement(config, cluster.devices_per_node))


def dp_fraction(dense_s: float, expert_s: float, groups: DpGroups, cluster: ClusterSpec) -> float:
    """SM share NCCL's data-parallel collectives take from the compute beside them (overlap.mixed_fraction):
    the dense group's and the expert group's communicators (overlap.nccl_channels), weighted by their
    seconds of per-layer collectives `dense_s`, `expert_s`."""
    if expert_s <= 0 or groups.expert.size <= 1:
        return contention_fraction(cluster, groups.dense)
    return mixed_fraction(((dense_s, groups.dense), (expert_s, groups.expert)), cluster)


def _group_s(numels: Sequence[float], group: GroupPlacement, w: float, wire: float,
             reduce_fn: Callable[[float, GroupPlacement, ClusterSpec], float], cluster: ClusterSpec) -> float:
    """Seconds of one weight all-gather and one gradient reduction per layer over `group` (dp_fraction's
    weights)."""
    return sum(comm.all_gather_s(x * w, group, cluster) + reduce_fn(x * wire, group, cluster) for x in numels)


@dataclass(slots=True)
class Rank:
    """One pipeline rank's per-microbatch times and its memory, summed over its chunks."""

    compute: float = 0.0
    recompute: float = 0.0
    tp: float = 0.0
    cp: float = 0.0
    ep: float = 0.0
    pp: float = 0.0
    dp: float = 0.0  # per-microbatch exposed data-parallel traffic (and the compute it slows)
    fwd: float = 0.0
    bwd: float = 0.0
    weight: float = 0.0
    recv_wait: float = 0.0  # blocking receives of an unbatched pipeline (Engine.pp_p2p_batched False): steady state only
    p2p_hidden: float = 0.0  # overlapped p2p (Engine.pp_p2p_overlap, cost/p2p.py): in fwd / bwd for the fill and drain, off the steady state
    act_bytes: float = 0.0
    work_bytes: float = 0.0
    dense_params: float = 0.0
    expert_params: float = 0.0
    max_layer_params: float = 0.0
    max_param_numel: float = 0.0  # largest single weight matrix held (DeepSpeed gathers per parameter)
    dp_tail: float = 0.0  # gradient reduction after the last microbatch, not hidden by the backward
    param_gather: float = 0.0  # the once-per-step weight all-gather, exposed part
    async_reduce: float = 0.0  # per microbatch: the reductions an asynchronous stream runs (pipeline.reduce_stream_floor_s)
    pp_nic: float = 0.0  # per microbatch: its pipeline hops that cross nodes, on the NIC (pipeline.nic_shared_reduce_s)
    costs: list[LayerCost] = field(default_factory=list)
    layers: list[Layer] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)  # layers per model chunk, in model order (add_layers)
    index: int = 0  # the pipeline rank

    @property
    def slot(self) -> float:
        return self.fwd + self.bwd + self.steady

    @property
    def steady(self) -> float:
        """What the steady state adds to (or, overlapped p2p, takes off) fwd + bwd: pipeline_time_s's steady_s."""
        return self.recv_wait - self.p2p_hidden


def add_layers(rank: Rank, costs: Sequence[LayerCost], layers: Sequence[Layer]) -> None:
    """Add one chunk's layers to its rank: compute, tp / cp / ep communication, memory, parameters."""
    rank.chunks.append(len(costs))
    for c, layer in zip(costs, layers):
        fwd = c.forward_s
        rank.fwd += fwd
        rank.bwd += c.time_s - fwd
        rank.compute += c.fwd_s + c.bwd_s
        rank.recompute += c.recompute_s
        rank.tp += c.tp_comm_s
        rank.cp += c.cp_comm_s
        rank.ep += c.ep_comm_s
        rank.weight += c.bwd_weight_s
        rank.act_bytes += c.act_mem_bytes
        rank.work_bytes = max(rank.work_bytes, c.work_mem_bytes)
        rank.dense_params += c.grad_param_count
        rank.expert_params += c.expert_param_count
        rank.max_layer_params = max(rank.max_layer_params, c.param_count)
        rank.costs.append(c)
        rank.layers.append(layer)


def _bucketed(values: Sequence[float], bucket_numel: int, price: Callable[[float], float]) -> list[float]:
    """Per-layer collective times with gradients grouped into buckets of `bucket_numel` elements in the
    given order (the backward's): a bucket's collective is issued at the layer that fills it, the last
    partial bucket at the last layer. bucket_numel 0: one collective per layer (FSDP's per-block units)."""
    if not bucket_numel:
        return [price(x) if x else 0.0 for x in values]
    out, pending = [], 0.0
    for x in values:
        pending += x
        if pending >= bucket_numel:
            out.append(price(pending))
            pending = 0.0
        else:
            out.append(0.0)
    if pending and out:
        out[-1] += price(pending)
    return out


def _overlap(compute: Sequence[float], pre: Sequence[float], post: Sequence[float], overlap_pre: bool,
             overlap_post: bool, cluster: ClusterSpec, frac: float | None = None) -> float:
    """Exposed seconds of the collectives beside `compute` (overlap.exposed_s for those the engine
    overlaps, the whole of the others), plus the slowdown of the compute under the hidden ones
    (overlap.hidden_penalty_s: NCCL's kernel takes `frac` of the SMs, dp_fraction)."""
    zeros = [0.0] * len(compute)
    ov_pre, ov_post = (pre if overlap_pre else zeros), (post if overlap_post else zeros)
    exposed = exposed_s(compute, ov_pre, ov_post)
    hidden = sum(ov_pre) + sum(ov_post) - exposed
    serial = (0.0 if overlap_pre else sum(pre)) + (0.0 if overlap_post else sum(post))
    return exposed + serial + hidden_penalty_s(hidden, cluster, frac)


def rank_dp_times(rank: Rank, cluster: ClusterSpec, config: ParallelConfig, layout: ZeroLayout, engine: Engine,
                  groups: DpGroups) -> None:
    """The rank's data-parallel traffic under `layout` (which collective, how often) and `engine` (what
    overlaps, in which buckets). Weights travel in the training dtype, gradients at dp_wire_bytes.

    Per microbatch: ZeRO-3's forward gather of each layer (prefetched one layer ahead when
    param_gather_overlap: FSDP2, Li et al. VLDB 2020's two-stream model in overlap.py), its backward
    gather and, when gradients are reduced every microbatch, the reduce-scatter of each layer's
    gradients (overlapped with the backward of the layers before it when dp_comm_overlap, the rest
    exposed when that backward ends) or, when the engine does not wait for them (async_reduce: ZeRO-2
    with Engine.grad_reduce_async), run on beside the next microbatches' compute (async_reduce_s).
    Per step: a reduction deferred to the last microbatch runs in buckets as that backward produces
    them (the exposed part is what is left when this rank's backward ends: at least the last bucket)
    or, without dp_comm_overlap, after the schedule in full (Megatron's local DDP: one all-reduce of
    all gradients), either with the DDP's own passes over the gradients (ddp_grad_passes_s); ZeRO-1/2's weight all-gather after the sharded optimizer step (Rajbhandari
    et al. 2020, section 5) overlaps the next forward with param_gather_overlap (Megatron
    --overlap-param-gather), else is exposed."""
    if groups.dense.size <= 1 and groups.expert.size <= 1:
        # the DDP still makes its passes without peers (Megatron-LM's local DDP and DeepSpeed's
        # allreduce_gradients run at any group size: ddp_grad_passes_s's sources)
        numel = sum(c.grad_param_count + c.expert_param_count for c in rank.costs)
        rank.dp_tail += (ddp_grad_passes_s(numel, cluster, layout, engine)
                         + grad_buffer_passes_s(numel, cluster, config, layout, engine))
        return
    w, _, _ = state_bytes_per_param(cluster.dtype, engine)
    wire = dp_wire_bytes(cluster.dtype, engine)  # the reduction's wire (Engine.bf16_comm: bf16)
    reduce_fn = comm.reduce_scatter_s if layout.grad_reduction == "reduce_scatter" else comm.all_reduce_s
    dense = [c.grad_param_count for c in rank.costs]
    expert = [c.expert_param_count for c in rank.costs]
    fwd = [c.forward_s for c in rank.costs]
    bwd = [c.time_s - f for c, f in zip(rank.costs, fwd)]

    # FSDP2's groups (cost/fsdpunits.py); a rank running several chunks has one root group per chunk: not
    # modelled, each layer then moves its own
    units = unit_numels(rank.layers, dense, engine) if engine.zero3 == "fsdp2" and config.virtual_stages == 1 else None
    gather_f, gather_b, reduced = (units.fwd_gather, units.bwd_gather, units.reduce) if units else (dense, dense, dense)

    def gathers(order: Sequence[int], numels: Sequence[float]) -> list[float]:
        return [comm.all_gather_s(numels[i] * w, groups.dense, cluster)
                + comm.all_gather_s(expert[i] * w, groups.expert, cluster) for i in order]

    def reduces(order: Sequence[int]) -> list[float]:
        d = _bucketed([reduced[i] for i in order], engine.dp_bucket_numel,
                      lambda n: reduce_fn(n * wire, groups.dense, cluster))
        e = _bucketed([expert[i] for i in order], engine.dp_bucket_numel,
                      lambda n: reduce_fn(n * wire, groups.expert, cluster))
        return [a + b for a, b in zip(d, e)]

    def whole(span: range, fn: Callable[[float, GroupPlacement, ClusterSpec], float], nbytes: float) -> float:
        return fn(sum(dense[i] for i in span) * nbytes, groups.dense, cluster) + fn(  # one collective of a chunk
            sum(expert[i] for i in span) * nbytes, groups.expert, cluster)

    order, back = list(range(len(fwd))), list(reversed(range(len(fwd))))
    none = [0.0] * len(fwd)
    frac = dp_fraction(*(_group_s(numels, group, w, wire, reduce_fn, cluster) if any(expert) else 0.0
                         for numels, group in ((dense, groups.dense), (expert, groups.expert))), groups, cluster)
    # FSDP2 copies each gathered block out of the all-gather buffer into its parameters on the compute
    # stream (torch.distributed.fsdp _fsdp_param_group.wait_for_unshard -> foreach_all_gather_copy_out):
    # a read and a write of the unsharded weights per gather
    def copy_out_s(numels: Sequence[float]) -> float:
        return memory_time_s(cluster.device, 2.0 * w * (sum(numels) + sum(expert))) if engine.gather_copy_out else 0.0

    local = sum(dense) + sum(expert)
    copy_out = copy_out_s(dense)
    copy_out_b = copy_out_s(gather_b)  # the backward's gathers only (fsdpunits: a root or last block kept gathered)
    copy_in = reduce_copy_in_s(local, cluster, layout, engine)
    dp_f = dp_b = 0.0
    if async_reduce(layout, engine):
        post = reduces(back)
        dp_b, tail = async_reduce_s(fwd, bwd[::-1], post, cluster, frac)
        shared, stream = _nic_shared(rank, config, groups, sum(post), sum(fwd) + sum(bwd), cluster)
        dp_b += shared
        rank.async_reduce = sum(post) + stream
        dp_b += copy_in
        rank.dp_tail += tail
    if layout.weight_gathers_per_microbatch >= 2:
        dp_f = _overlap(fwd, gathers(order, gather_f), none, engine.param_gather_overlap, True, cluster, frac) + copy_out
    if not async_reduce(layout, engine) and (layout.weight_gathers_per_microbatch >= 1
                                             or layout.reduce_every_microbatch):
        pre = gathers(back, gather_b) if layout.weight_gathers_per_microbatch >= 1 else none
        post = reduces(back) if layout.reduce_every_microbatch else none
        dp_b = _overlap(bwd[::-1], pre, post, engine.param_gather_overlap, engine.dp_comm_overlap, cluster, frac)
        dp_b += copy_out_b if layout.weight_gathers_per_microbatch >= 1 else 0.0
        dp_b += copy_in if layout.reduce_every_microbatch else 0.0
    rank.dp += dp_f + dp_b
    rank.fwd += dp_f
    rank.bwd += dp_b
    if not layout.reduce_every_microbatch:
        rank.dp_tail += (copy_in + ddp_grad_passes_s(local, cluster, layout, engine)
                         + grad_buffer_passes_s(local, cluster, config, layout, engine))
        if engine.dp_comm_overlap and engine.grad_sync_per_chunk and chunksync.applies(
                config.pp, config.virtual_stages, rank.index):
            spans = chunksync.chunk_spans(rank.chunks)
            exposed, hidden = chunksync.rank_chunk_tail_s([sum(bwd[i] for i in s) for s in spans], [
                sum(reduces(spans[0][::-1])), *(whole(s, reduce_fn, wire) for s in spans[1:])], config.pp, rank.index)
            rank.dp_tail += exposed + hidden_penalty_s(hidden, cluster, frac)
        elif engine.dp_comm_overlap:
            rank.dp_tail += _overlap(bwd[::-1], none, reduces(back), True, True, cluster, frac)
        else:
            rank.dp_tail += whole(range(len(fwd)), reduce_fn, wire)
    if layout.weight_gathers_per_step:
        rank.param_gather += copy_out
        if (engine.param_gather_overlap and engine.param_gather_per_chunk and len(rank.chunks) > 1
                and not layout.shards_gradients):  # the distributed optimizer (ZeRO-1)
            first, *later = chunksync.chunk_spans(rank.chunks)
            shown, hidden = chunksync.later_gathers_s([sum(fwd[i] for i in s) for s in (first, *later)],
                                                      [whole(s, comm.all_gather_s, w) for s in later], config.pp)
            rank.param_gather += (_overlap([fwd[i] for i in first], gathers(first, gather_f), [0.0] * len(first), True, True,
                                           cluster, frac) + shown + hidden_penalty_s(hidden, cluster, frac))
        elif engine.param_gather_overlap:
            rank.param_gather += _overlap(fwd, gathers(order, gather_f), none, True, True, cluster, frac)
        else:
            rank.param_gather += whole(range(len(fwd)), comm.all_gather_s, w)


def async_reduce(layout: ZeroLayout, engine: Engine) -> bool:
    """Whether the engine's every-microbatch gradient reductions run asynchronously across microbatches
    (Engine.grad_reduce_async, with dp_comm_overlap): only for a layout that reduces every microbatch and
    gathers no weights per microbatch (ZeRO-2), whose backward waits for nothing else on that stream."""
    return (engine.grad_reduce_async and engine.dp_comm_overlap and layout.reduce_every_microbatch
            and layout.weight_gathers_per_microbatch == 0)


def async_reduce_s(fwd: Sequence[float], bwd_order: Sequence[float], post: Sequence[float],
                   cluster: ClusterSpec, frac: float | None = None) -> tuple[float, float]:
    """(per microbatch, once at the step's end) exposed seconds of gradient reductions issued every
    microbatch that the backward does not wait for (Engine.grad_reduce_async; Llama 3's FSDP, Dubey et al.
    2024, section 3.3.2: DP "can tolerate longer network latency by asynchronously prefetching sharded
    model weights and reducing gradients"). The communication stream runs them back to back beside the
    compute of this and the following microbatch, so a microbatch of compute C = sum(fwd) + sum(bwd) and
    reductions R = sum(post) costs max(C, R): R - C exposed when R > C, the hidden part slowing the compute
    by SM contention (overlap.hidden_penalty_s at `frac`, dp_fraction). The last microbatch has no compute after it: it pays what
    a backward that waits pays (its own backward, `bwd_order` in the order `post` is issued, hiding what it
    can: _overlap), the difference to the per-microbatch figure being the tail; with one microbatch the
    step is the waiting engine's."""
    compute, total = sum(fwd) + sum(bwd_order), sum(post)
    exposed = max(total - compute, 0.0)
    per_microbatch = exposed + hidden_penalty_s(total - exposed, cluster, frac)
    waited = _overlap(bwd_order, [0.0] * len(post), post, True, True, cluster, frac)
    return per_microbatch, max(waited - per_microbatch, 0.0)


def _nic_shared(rank: Rank, config: ParallelConfig, groups: DpGroups, reduce: float, compute: float,
                cluster: ClusterSpec) -> tuple[float, float]:
    """pipeline.nic_shared_reduce_s for a rank whose asynchronous reductions cross nodes: beside them on its
    NIC, the CP exchange when the cp group crosses nodes too, and the pipeline hops that do (Rank.pp_nic)."""
    if not groups.dense.crosses_nodes:
        return 0.0, 0.0
    cp_nic = comm.group_placement(config, ("cp",), cluster.devices_per_node).crosses_nodes
    nic_in = sum(c.cp_comm_s for c in rank.costs) if cp_nic else 0.0
    shared, stream = nic_shared_reduce_s(reduce, compute, nic_in, rank.pp_nic)
    return float(shared), float(stream)
