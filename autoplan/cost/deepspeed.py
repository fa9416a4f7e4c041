"""DeepSpeed ZeRO-3's timeline for one microbatch on one rank, from its stage-3 code (engine zero3 =
'deepspeed'; the fields cite deepspeed/runtime/zero/stage3.py and partition_parameters.py):

- every parameter of at least zero3_persistence_numel elements is partitioned and all-gathered on its own
  (partition_parameters.py _allgather_param: one torch.distributed.all_gather per parameter, over the
  whole data-parallel group) when its sub-module runs; smaller ones stay replicated;
- fetch_sub_module all-gathers what is missing, then waits for every gather in flight (and, with
  zero3_sync_per_module, synchronizes the device: the host cannot run ahead, so each sub-module's host
  time adds to its kernels'); prefetch_next_sub_modules queues the next parameters, only when nothing is
  in flight, up to zero3_prefetch_numel elements: one sub-module of prefetch;
- release_sub_module re-partitions a parameter after use unless it is needed again within
  zero3_max_reuse_numel elements (_keep_for_later): the recomputed forward and the backward gather again;
- gradients are reduced in buckets of zero3_reduce_bucket_numel elements (reduce_ipg_grads) with an
  all-reduce or a reduce-scatter, one bucket at a time on the reduction stream;
- with zero3_gather_copy_out, torch.distributed.all_gather into a list of n outputs (ProcessGroupNCCL's
  allgather of PyTorch 1.8: flatten, ncclAllGather, then outputTensors[i][j].copy_(...) for each of the
  n outputs, launched by the calling thread before it returns) costs the host n launches: the prefetch
  is issued before the sub-module's compute (pre_sub_module_forward_function: fetch, then prefetch_next,
  then the forward), so those launches delay the compute.

The sub-modules of a transformer block are its weight matmuls (QKV, projection, the MLP's), each priced
with its share of the block's FLOPs; the two-stream timeline is overlap.overlapped_s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autoplan.cost.overlap import overlapped_s
from autoplan.plan.engine import Engine


@dataclass(frozen=True, slots=True, kw_only=True)
class Module:
    """One sub-module: its parameters (elements), its share of the layer's forward / backward compute
    (device + host, seconds), and the host share separately (what a device sync exposes)."""

    numel: float
    fwd_s: float
    bwd_s: float
    host_fwd_s: float = 0.0
    host_bwd_s: float = 0.0


def block_modules(numels: Sequence[float], fwd_s: float, bwd_s: float, rec_s: float, host_s: float,
                  recompute: bool) -> tuple[list[Module], list[Module]]:
    """(forward modules, recomputed-forward modules) of one layer, its time split by parameter share
    (the weight matmuls dominate a block's time; a layer with one module takes all of it). Host time
    splits the same way over forward, recompute and backward (1 : 1 : 2, compute.BACKWARD_OPS_PER_FORWARD_OP)."""
    total = sum(numels) or 1.0
    host_f = host_s / (4.0 if recompute else 3.0)
    mods = [Module(numel=n, fwd_s=fwd_s * n / total, bwd_s=bwd_s * n / total, host_fwd_s=host_f * n / total,
                   host_bwd_s=2.0 * host_f * n / total) for n in numels]
    recs = [Module(numel=n, fwd_s=rec_s * n / total, bwd_s=0.0, host_fwd_s=host_f * n / total) for n in numels]
    return mods, recs


def microbatch_s(layers: Sequence[tuple[list[Module], list[Module]]], engine: Engine, *, recompute: bool,
                 gather_s: Callable[[float], float], reduce_s: Callable[[float], float],
                 issue_s: float = 0.0) -> tuple[float, float, float]:
    """(forward, backward, communication) seconds of one microbatch through `layers` (model order),
    each layer given as (its modules, its recomputed-forward modules). gather_s(numel) prices one
    parameter's all-gather on the communication stream, reduce_s(numel) one gradient bucket's
    reduction, issue_s the host time to issue one gather (its copy-out launches), spent on the compute
    stream's critical path. Forward and backward are makespans on two streams, host time included."""
    sync = engine.zero3_sync_per_module
    fwd = _timeline(*_forward(layers, engine, gather_s, sync), issue_s)
    compute, pre, post = _backward(layers, engine, recompute, gather_s, reduce_s, sync)
    bwd = _timeline(compute, pre, post, issue_s)
    comm_f = sum(gather_s(m.numel) for mods, _ in layers for m in mods if _partitioned(m, engine))
    return fwd, bwd, comm_f + sum(pre) + sum(post)


def _timeline(compute: list[float], pre: list[float], post: list[float], issue_s: float) -> float:
    """overlap.overlapped_s with the host cost of issuing each gather added to the compute of the module
    that issues it (module i issues module i + 1's prefetch; the first module its own)."""
    if issue_s:
        compute = list(compute)
        for i, g in enumerate(pre):
            if g:
                compute[max(i - 1, 0)] += issue_s
    return overlapped_s(compute, pre, post)


def _partitioned(m: Module, engine: Engine) -> bool:
    return m.numel >= engine.zero3_persistence_numel


def _step(m: Module, *, backward: bool, sync: bool) -> float:
    """A module's time on the compute stream: its kernels (which include the host time as
    max(device, host)), or kernels + host when a device sync before it empties the queue."""
    dev = m.bwd_s if backward else m.fwd_s
    host = m.host_bwd_s if backward else m.host_fwd_s
    return dev + host if sync else dev


def _forward(layers, engine: Engine, gather_s, sync: bool) -> tuple[list[float], list[float], list[float]]:
    compute = [_step(m, backward=False, sync=sync) for mods, _ in layers for m in mods]
    pre = [gather_s(m.numel) if _partitioned(m, engine) else 0.0 for mods, _ in layers for m in mods]
    return compute, pre, [0.0] * len(compute)


def _backward(layers, engine: Engine, recompute: bool, gather_s, reduce_s,
              sync: bool) -> tuple[list[float], list[float], list[float]]:
    """Layers in reverse: the recomputed forward (gathering again), then the backward in reverse module
    order, re-gathering a module unless fewer than zero3_max_reuse_numel elements were used since its
    last use; gradients fill buckets, each reduced when full (and the last one at the end)."""
    compute, pre, post = [], [], []
    bucket = 0.0
    for mods, recs in reversed(layers):
        used_since: list[float] = []
        if recompute:
            for m in recs:
                compute.append(_step(m, backward=False, sync=sync))
                pre.append(gather_s(m.numel) if _partitioned(m, engine) else 0.0)
                post.append(0.0)
            used_since = [sum(x.numel for x in mods[i + 1:]) for i in range(len(mods))]
        for i in reversed(range(len(mods))):
            m = mods[i]
            kept = recompute and used_since[i] < engine.zero3_max_reuse_numel
            compute.append(_step(m, backward=True, sync=sync))
            pre.append(gather_s(m.numel) if _partitioned(m, engine) and not kept else 0.0)
            bucket += m.numel
            full = bucket >= engine.zero3_reduce_bucket_numel
            post.append(reduce_s(bucket) if full else 0.0)
            bucket = 0.0 if full else bucket
    if bucket and post:
        post[-1] += reduce_s(bucket)
    return compute, pre, post
