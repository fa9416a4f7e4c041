"""DeepSpeed ZeRO-3's timeline for one microbatch on one rank, from its stage-3 code (engine zero3 =
'deepspeed'; the fields cite deepspeed/runtime/zero/stage3.py and partition_parameters.py):

- every parameter of at least zero3_persistence_numel elements is partitioned and all-gathered on its own
  (partition_parameters.py _allgather_param: one torch.distributed.all_gather per parameter, over the
  whole data-parallel group) when its sub-module runs; smaller ones stay replicated;
- fetch_sub_module all-gathers what is missing, then waits for every gather in flight (and, with
  zero3_sync_per_module, synchronizes the device: the host cannot run ahead, so each sub-module's host
  time adds to its kernels'); prefetch_next_sub_modules queues the next parameters, only when nothing is
  in flight and fewer than zero3_max_live_numel elements are gathered (stage3_max_live_parameters), up
  to zero3_prefetch_numel elements: at most one sub-module of prefetch (param_gather_overlap). The
  code's get_params_to_prefetch appends the following sub-modules' parameters until zero3_prefetch_numel is
  reached (at least one): one sub-module when the next parameter alone reaches it, several for smaller
  ones; _simulate issues the next sub-module's only, so Engine.zero3_prefetch_numel is not read (moot for
  the 2021 engine, whose misaligned trace prefetches nothing; an under-prefetch for aligned engines whose
  weights are under 5e7 elements);
- release_sub_module re-partitions a parameter after use unless it is needed again within
  zero3_max_reuse_numel elements (_keep_for_later): the recomputed forward and the backward gather again;
- both look the sub-module up in the trace recorded in the first step (PrefetchCoordinator
  get_params_to_prefetch, get_reuse_distance_in_numel: `if sub_module.id != trace[step_id]`, "Tracing
  failed"); without zero3_trace_aligned every lookup misses, so nothing is prefetched and nothing kept:
  from v0.3.14 (commit 7b46d11fa, 2021-04-07) setup_zero_stage3_hooks registers the step reset
  (_pre_forward_hook) after _register_hooks_recursively has given the top module its own pre-forward
  hook, which counts a step first, so step_id trails the trace by one (the off-by-one DeepSpeed PR #1170,
  2021-06, names: "Fix hook registration problem that created off-by-one tracing issue", for "significant
  zero-3 slowdown compared to zero-2", issue #1069; the hooks were reordered in PR #1453, 2022-01);
- gradients are reduced in buckets of zero3_reduce_bucket_numel elements (reduce_ipg_grads) with an
  all-reduce or a reduce-scatter, one bucket at a time on the reduction stream: the hook of the gradient
  that would overflow the bucket reduces it (reduce_independent_p_g_buckets_and_remove_grads), so it runs
  beside that gradient's sub-module's backward, and the next fetch's device synchronize waits for it;
  with zero3_small_grad_hooks the small parameters' gradients fill the buckets too (every parameter is
  hooked), in autograd's order (cost/zero3_grads.py gpt_grad_hooks): a bias or LayerNorm gradient that
  arrives just before a fetch flushes the bucket there, and its reduction runs while that gather waits;
- with zero3_gather_copy_out, each gather costs the host a narrow and a copy per rank (GATHER_OPS_PER_RANK;
  PyTorch 1.8 and DeepSpeed read at 29b444b6c):
  _allgather_param builds the list of n output views in Python (`for i in range(world_size):
  partitions.append(flat_tensor.narrow(...))`: VIEW_OP per rank, before the collective), and
  torch.distributed.all_gather into that list (ProcessGroupNCCL's allgather of PyTorch 1.8: flatten,
  ncclAllGather, then in collective()'s post hook outputTensors[i][j].copy_(outputFlattened[i][j], true)
  for each of the n outputs) launches n copies from the calling thread before it returns: CXX_COPY_OP per
  rank, issued once the all-gather is enqueued (collective(): fn inside the NCCL group, then post), so
  that loop runs while the all-gather moves data; the copies themselves wait for it on its stream, and
  beyond PENDING_LAUNCHES queued ones the host waits too (those launches start as the gather ends). The
  prefetch is issued before the sub-module's compute (pre_sub_module_forward_function: fetch, then
  prefetch_next, then the forward), so those ops delay the compute. The gathered parameter is first
  zero-filled (torch.zeros(aligned_param_size)) and copied out once: three passes over its bytes on the
  communication stream;
- with zero3_serial_grad_checks, the step first checks every gradient partition for overflow and sums
  their norms one parameter at a time, reading each result on the host (serial_grad_checks);
- with zero3_regather_persistent, the step ends by gathering the persistent parameters again
  (persistent_regather: stage3.py _post_step after _partition_all_parameters released them at the end of
  the backward), a host loop over the ranks per parameter.

The sub-modules of a transformer block are its weight matmuls (QKV, projection, the MLP's), each priced
with its share of the block's FLOPs, on a compute and a communication stream (_simulate).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from autoplan.cost.compute import BACKWARD_OPS_PER_FORWARD_OP
from autoplan.cost.zero3_grads import Bucket, block_hooks
from autoplan.plan.engine import Engine

# Host cost of the small ops in DeepSpeed's per-rank loops, in eager ops (device.op_overhead_s: Python,
# dispatcher and a kernel launch, about 10 us). A Python view op (narrow, view) launches nothing: about a
# third of that (split: 3.3 us in PyTorch's operator microbenchmarks, pytorch/pytorch PR #32194, 2020;
# "approx half of it is python parsing overhead", pytorch/pytorch#41383). A copy_ issued from C++
# (ProcessGroupNCCL's copy-out) skips the Python parsing: the other two thirds.
VIEW_OP = 1.0 / 3.0
CXX_COPY_OP = 2.0 / 3.0
# One gathered parameter, per rank (zero3_gather_copy_out): the Python narrow that builds the output list
# (partition_parameters.py _allgather_param) and the copy_ of ProcessGroupNCCL's copy-out.
GATHER_OPS_PER_RANK = VIEW_OP + CXX_COPY_OP
# One persistent parameter copied out of the flat all-gather, per rank (partition_parameters.py v0.3.16
# _allgather_params: `part_to_copy = partitions[i].narrow(...)`,
# `replicated_tensor.view(-1).narrow(...).copy_(part_to_copy)`): three Python views and a Python copy_.
REGATHER_OPS_PER_RANK = 3.0 * VIEW_OP + 1.0
# ... and outside the rank loop: torch.empty of its replica in _allgather_params, and its release after
# the backward (_partition_param: param.data = torch.ones(1, dtype).to(device)): three eager ops.
REGATHER_OPS_PER_PARAM = 3.0
# How many operations a CUDA stream holds queued before the next launch blocks the host until one of them
# completes: "about 1000" (a public measurement, NVIDIA developer forum "CUDA stream are blocked when
# launching lots of kernels (>1000)", 2018, also StackOverflow question 53970187: launches take 4-5 us for
# the first ~1000, then each waits for a queued kernel to finish). The copy-outs of a list all-gather queue
# behind the gather on its stream, so past this many the host launches them only as the gather ends.
PENDING_LAUNCHES = 1000
# stage3.py step (v0.3.13-v0.5.x), per gradient partition (averaged_gradients: one per parameter tensor of
# the rank), in eager ops: has_overflow_partitioned_grads_serial -> _has_inf_or_nan `float(x.float().sum())`
# (a cast, a sum, the scalar read), then get_grad_norm_direct `g.data.double().norm(2)` and
# `param_norm.item()` (a cast, a norm, the scalar read). Each read (aten _local_scalar_dense: a device-to-host
# copy the host waits for) is counted as one eager op: the kernels before it are single-partition
# reductions, microseconds each.
GRAD_CHECK_OPS_PER_PARAM = 6.0
# ... and after each of the two loops one all-reduce of a one-element tensor over the data-parallel group,
# read back with `.item()`: has_overflow `torch.cuda.ByteTensor([overflow])` (ReduceOp.MAX, 1 byte),
# get_grad_norm_direct `torch.cuda.FloatTensor([float(total_norm)])` (ReduceOp.SUM, 4 bytes).
GRAD_CHECK_MESSAGES = (1.0, 4.0)
GRAD_CHECK_READS = 2.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Module:
    """One sub-module: its parameters (elements), its share of the layer's forward / backward compute
    (device + host, seconds), and the host share separately (what a device sync exposes)."""

    numel: float
    fwd_s: float
    bwd_s: float
    host_fwd_s: float = 0.0
    host_bwd_s: float = 0.0
    grads_before: tuple[float, ...] = ()  # small gradients whose hooks fire before its backward fetch
    grads_with: tuple[float, ...] = ()  # ... from its own backward node, after its weight's
    grads_after: tuple[float, ...] = ()  # ... after its backward, before the next module's fetch


def block_modules(numels: Sequence[float], fwd_s: float, bwd_s: float, rec_s: float, host_s: float,
                  recompute: bool, small: Sequence[float] = ()) -> tuple[list[Module], list[Module]]:
    """(forward modules, recomputed-forward modules) of one layer, its time split by parameter share
    (the weight matmuls dominate a block's time; a layer with one module takes all of it). Host time
    splits over forward, recompute and backward as host_shares does, and over the modules the same way.
    `small`: the block's other parameters whose gradient hooks join the buckets (gpt_grad_hooks), or none."""
    total = sum(numels) or 1.0
    host_f, _, host_b = host_shares(host_s, recompute)
    hooks = block_hooks(numels, small) or [((), (), ())] * len(numels)
    mods = [Module(numel=n, fwd_s=fwd_s * n / total, bwd_s=bwd_s * n / total, host_fwd_s=host_f * n / total,
                   host_bwd_s=host_b * n / total, grads_before=b, grads_with=w, grads_after=a)
            for n, (b, w, a) in zip(numels, hooks)]
    recs = [Module(numel=n, fwd_s=rec_s * n / total, bwd_s=0.0, host_fwd_s=host_f * n / total) for n in numels]
    return mods, recs


def host_shares(host_s: Any, recompute: Any) -> tuple[Any, Any, Any]:
    """(forward, recomputed forward, backward) shares of a layer's host seconds `host_s` (floats, or numpy
    arrays alike: the quick estimate's, search/deepspeed_terms.py; `recompute` a bool or a bool array):
    1 : 1 : BACKWARD_OPS_PER_FORWARD_OP, the recomputed forward launching the forward's ops again and the
    backward compute.BACKWARD_OPS_PER_FORWARD_OP per forward op (autograd's two gradient kernels per matmul)."""
    fwd = host_s / (1.0 + recompute + BACKWARD_OPS_PER_FORWARD_OP)
    return fwd, fwd * recompute, BACKWARD_OPS_PER_FORWARD_OP * fwd


def microbatch_s(layers: Sequence[tuple[list[Module], list[Module]]], engine: Engine, *, recompute: bool,
                 gather_s: Callable[[float], float], reduce_s: Callable[[float], float],
                 issue_s: float = 0.0, fill_s: Callable[[float], float] | None = None,
                 launch_s: float = 0.0, blocked_s: float = 0.0,
                 single_s: Callable[[float], float] | None = None) -> tuple[float, float, float]:
    """(forward, backward, hidden communication) seconds of one microbatch through `layers` (model order),
    each layer given as (its modules, its recomputed-forward modules). gather_s(numel) prices one
    parameter's all-gather on the communication stream, reduce_s(numel) one gradient bucket's
    reduction, issue_s the host time before a gather is enqueued (building its output views), fill_s(numel)
    the zero fill of its output buffer that the device synchronize before the gather waits for, both on
    the compute stream's critical path, and launch_s the host time after it is enqueued (the copy-out
    launches), which runs while the gather moves data, but for blocked_s of it (the launches past the
    stream's queue, PENDING_LAUNCHES), which follow the gather's end; single_s(numel), if given, prices a
    bucket holding one gradient instead of reduce_s. Forward and backward are makespans
    of _simulate, host time included; the hidden communication is the time collectives ran beside the compute."""
    sync = sync_adds_host(engine)
    fwd_steps = [_Step(key=(li, mi), numel=m.numel, compute=_step(m, backward=False, sync=sync),
                       partitioned=_partitioned(m, engine), keep=False)
                 for li, (mods, _) in enumerate(layers) for mi, m in enumerate(mods)]
    host = _Issue(before=issue_s, after=launch_s, blocked=blocked_s, fill=fill_s)
    fwd, hidden_f = _simulate(fwd_steps, engine, gather_s, host)
    bucket = Bucket(limit=engine.zero3_reduce_bucket_numel, reduce_s=reduce_s, single_s=single_s)
    bwd, hidden_b = _simulate(_backward_steps(layers, engine, recompute, bucket, sync), engine, gather_s, host)
    return fwd, bwd, hidden_f + hidden_b


@dataclass(frozen=True, slots=True)
class _Issue:
    """The host's part of one gather: seconds before it is enqueued, seconds after (overlapping it, but
    for the `blocked` share, which cannot start before the gather ends), and the zero fill of its output
    (numel -> seconds) that the synchronize before it waits for."""

    before: float = 0.0
    after: float = 0.0
    blocked: float = 0.0
    fill: Callable[[float], float] | None = None


@dataclass(frozen=True, slots=True)
class _Step:
    """One sub-module's use: which parameter (key), its size, its compute, whether it is partitioned,
    whether it stays gathered after (reuse within zero3_max_reuse_numel), and the bucket reductions that
    gradient hooks issue before its fetch (pre), as its compute runs (reduce: its own gradients' hooks,
    run once its backward kernels are launched) and after it (post; the last bucket)."""

    key: tuple[int, int]
    numel: float
    compute: float
    partitioned: bool
    keep: bool
    pre: tuple[float, ...] = ()
    reduce: tuple[float, ...] = ()
    post: tuple[float, ...] = ()


def _simulate(steps: list[_Step], engine: Engine, gather_s: Callable[[float], float],
              host: _Issue) -> tuple[float, float]:
    """stage3.py's fetch / prefetch / release on a compute and a communication stream (the makespan, and
    how long communication ran beside compute): fetch_sub_module gathers the module's parameter unless it
    is held or in flight and waits for it; prefetch_next_sub_modules then issues the next module's gather,
    only if the engine prefetches at all (param_gather_overlap and zero3_trace_aligned), no prefetch is in
    flight and the gathered parameters (total_available_parameter_numel, prefetched ones included) are
    below zero3_max_live_numel (stage3_max_live_parameters); with zero3_sync_per_module the wait for a
    gathered parameter is a device synchronize (_synchronize_communication: torch.cuda.synchronize()), so
    it also waits for any reduction in flight; release_sub_module re-partitions the parameter unless it is
    kept. Gathers and reductions are priced by _Lines."""
    held: dict[tuple[int, int], float] = {}
    inflight: dict[tuple[int, int], float] = {}  # key -> time its gather completes
    prefetch = engine.param_gather_overlap and engine.zero3_trace_aligned
    t = _Lines(engine=engine, host=host, gather_s=gather_s)
    for k, st in enumerate(steps):
        for r in st.pre:  # queued on the communication line before this module's gather
            t.now = t.reduce(t.now, r)
        ready = t.now
        if st.key in inflight:  # prefetched: wait for it (and, synchronizing the device, for the rest)
            ready = max(t.now, inflight.pop(st.key), t.comm_free if engine.zero3_sync_per_module else 0.0)
        elif st.partitioned and st.key not in held:
            ready = t.gather(st.numel)
            held[st.key] = st.numel
        nxt = steps[k + 1] if k + 1 < len(steps) else None
        if (prefetch and nxt is not None and nxt.partitioned and nxt.key not in held and not inflight
                and sum(held.values()) < engine.zero3_max_live_numel):
            inflight[nxt.key] = t.gather(nxt.numel)
            held[nxt.key] = nxt.numel  # counted as available once prefetched (_increment_available_parameter_numel)
        start = issued = max(t.now, ready)
        for i, r in enumerate(st.reduce):  # each hook first waits for the previous bucket's reduction
            issued = t.reduce(issued, r)
            start = issued if i == 0 else start
        t.now = max(start + st.compute, issued)
        t.computing.append((start, start + st.compute))
        if not st.keep:
            held.pop(st.key, None)
        for r in st.post:
            t.now = t.reduce(t.now, r)
    return max(t.now, t.comm_free), _intersection(t.busy, t.computing)


@dataclass(slots=True, kw_only=True)
class _Lines:
    """The host's clock (now), the communication line's (comm_free: gathers and reductions share the
    process group's NCCL stream) and what each line was busy with."""

    engine: Engine
    host: _Issue
    gather_s: Callable[[float], float]
    now: float = 0.0
    comm_free: float = 0.0
    last_reduce: float = 0.0
    busy: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    computing: list[tuple[float, float]] = dataclasses.field(default_factory=list)

    def gather(self, numel: float) -> float:
        """One parameter's all-gather; returns when its copy-out is done. partition_parameters.py
        _allgather_param: the zero-filled output buffer, torch.cuda.synchronize() (which waits for the fill
        and for both streams), the host's output views, the enqueued gather, then its copy-out launches
        beside it (host.after), those past the stream's queue (host.blocked) after it."""
        h = self.host
        self.now = max(self.now, self.comm_free) + (h.fill(numel) if h.fill else 0.0) + h.before
        g = self.gather_s(numel)
        done = max(g + h.blocked, h.after)
        self.comm_free = self.now + done
        self.busy.append((self.now, self.now + g))
        self.now += done if h.blocked > 0 else h.after
        return self.comm_free

    def reduce(self, at: float, seconds: float) -> float:
        """A gradient bucket's reduction issued from the host at `at`; returns when the host may go on. On
        the reduction stream once the host has waited for the previous bucket's (stage3.py reduce_ipg_grads:
        `if self.overlap_comm: self.reduction_stream.synchronize()`); without dp_comm_overlap on the
        compute stream, first."""
        if not self.engine.dp_comm_overlap:
            self.comm_free = max(self.comm_free, at) + seconds
            return self.comm_free
        at = max(at, self.last_reduce)
        self.comm_free = self.last_reduce = max(self.comm_free, at) + seconds
        self.busy.append((self.comm_free - seconds, self.comm_free))
        return at


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length shared by two lists of disjoint intervals, each in time order."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _partitioned(m: Module, engine: Engine) -> bool:
    return m.numel >= engine.zero3_persistence_numel


def sync_adds_host(engine: Engine) -> bool:
    """Whether a sub-module's host time adds to its kernels here: after zero3_sync_per_module's device sync
    the queue is empty, so the host cannot run ahead; under launch_blocking the layer costs already add them
    (cost/layer.py _with_host), so adding again would count the host twice."""
    return engine.zero3_sync_per_module and not engine.launch_blocking


def _step(m: Module, *, backward: bool, sync: bool) -> float:
    """A module's time on the compute stream: its kernels (which include the host time as
    max(device, host)), or kernels + host when a device sync before it empties the queue."""
    dev = m.bwd_s if backward else m.fwd_s
    host = m.host_bwd_s if backward else m.host_fwd_s
    return dev + host if sync else dev


def _backward_steps(layers, engine: Engine, recompute: bool, bucket: Bucket, sync: bool) -> list[_Step]:
    """Layers in reverse: the recomputed forward (gathering again; a module stays gathered if fewer than
    zero3_max_reuse_numel elements are used between its recomputed forward and its backward: stage3.py
    _keep_for_later -> get_reuse_distance_in_numel sums the parameters of the traced sub-modules in
    between, here the layer's later modules twice, recomputed and then backward; never without
    zero3_trace_aligned: the lookup misses and returns its 1e12 default), then the backward in reverse
    module order (released after). Gradients fill buckets as stage3.py
    reduce_independent_p_g_buckets_and_remove_grads does: when a gradient would overflow the bucket
    (`elements_in_ipg_bucket + param.ds_numel > reduce_bucket_size`), its hook first reduces the bucket so
    far (reduce_ipg_grads), then starts the next with it; the last bucket is reduced after the backward
    (independent_gradient_partition_epilogue); zero3_grads.Bucket.layer_backward walks a layer's modules. A
    module's small gradients (Module.grads_before / with / after, gpt_grad_hooks) fill the buckets too, at
    their hooks: a bucket that one of them flushes before a fetch is reduced while the host waits for that
    gather, beside no compute."""
    steps: list[_Step] = []
    for li in reversed(range(len(layers))):
        mods, recs = layers[li]
        if recompute:
            for mi, m in enumerate(recs):
                # the trace between this recomputed use and the module's backward: the recomputed modules
                # after it, then their backwards (stage3.py _distance_in_numel over sub_module_trace)
                used_since = 2.0 * sum(x.numel for x in mods[mi + 1:])
                steps.append(_Step(key=(li, mi), numel=m.numel, compute=_step(m, backward=False, sync=sync),
                                   partitioned=_partitioned(m, engine),
                                   keep=engine.zero3_trace_aligned and used_since < engine.zero3_max_reuse_numel))
        walk = bucket.layer_backward([(m.numel, (m.grads_before, m.grads_with, m.grads_after)) for m in mods])
        for mi, (pre, reduce, post) in walk:
            m = mods[mi]
            steps.append(_Step(key=(li, mi), numel=m.numel, compute=_step(m, backward=True, sync=sync),
                               partitioned=_partitioned(m, engine), keep=False, pre=pre, reduce=reduce, post=post))
    if bucket.numel and steps:
        steps[-1] = dataclasses.replace(steps[-1], post=(*steps[-1].post, bucket.flush()))
    return steps


def persistent_regather(numels: Sequence[float], n: int) -> tuple[float, float]:
    """(host ops, gathered elements) of stage3.py _post_step's `persistent_parameters[0].all_gather(...)`
    over the persistent parameters `numels` on a data-parallel group of n (DeepSpeed v0.3.16,
    partition_parameters.py _allgather_params): the flat output's n partitions are narrowed in Python and
    the list all-gather copies each out (GATHER_OPS_PER_RANK per rank), then each parameter is rebuilt
    from the ranks that hold a piece of it, ceil(numel / ceil(numel / n)) of them (its partition is
    ceil(numel / n) elements), REGATHER_OPS_PER_RANK ops each, plus REGATHER_OPS_PER_PARAM. The gather
    moves n x the summed partitions."""
    if n <= 1 or not numels:
        return 0.0, 0.0
    ops, parts = regather_list_ops(n), 0.0
    for numel in numels:
        part = math.ceil(numel / n)
        ops += REGATHER_OPS_PER_PARAM + REGATHER_OPS_PER_RANK * math.ceil(numel / part)
        parts += part
    return ops, parts * n


def serial_grad_checks(param_count: int) -> tuple[float, tuple[float, ...]]:
    """(host ops, bytes of each all-reduce) of stage3.py step's overflow check and gradient norm over a
    rank's `param_count` gradient partitions (zero3_serial_grad_checks): GRAD_CHECK_OPS_PER_PARAM each,
    then after each of the two loops one all-reduce of a single element over the data-parallel group
    (GRAD_CHECK_MESSAGES), each read back with `.item()` (GRAD_CHECK_READS)."""
    if param_count <= 0:
        return 0.0, ()
    return GRAD_CHECK_OPS_PER_PARAM * param_count + GRAD_CHECK_READS, GRAD_CHECK_MESSAGES


def regather_list_ops(n: int) -> float:
    """The host ops of persistent_regather's one list all-gather over n ranks, whatever it gathers: the
    n output views and copies (GATHER_OPS_PER_RANK per rank)."""
    return float(GATHER_OPS_PER_RANK * n) if n > 1 else 0.0
