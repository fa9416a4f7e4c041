"""The serving search: enumerate layouts, estimate each, rank by goodput.

Candidates: tp (powers of two up to a node, dividing the heads; kv heads divide tp or tp divides
them), pp (powers of two), ep (1, or tp for a MoE whose experts divide by it), replicas (powers of
two and the most that fit), the batch cap (the engine's max_num_seqs and smaller powers of two), and
disaggregated layouts: P prefill instances of prefill_tp and D decode instances of tp (pp 1).
A model with an encoder: every layout above runs it on its prefill devices (co-located); then the
_ENCODER_BASES best distinct layouts of that ranking are tried again with the encoder on instances of its
own (encoder_tp a power of two dividing its heads, up to max_instances of them) on the devices they leave
free (a layout that needs the encoder's share of the devices ranks among the co-located ones first,
since goodput is per GPU).
Ranking (goodput, Zhong et al., "DistServe", OSDI'24): among the plans that fit, are stable and meet
both SLOs, the most output tokens/s per GPU first (ties: fewer devices, lower TPOT); then the plans
that miss, by how far they miss (the largest ratio of a latency to its SLO).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass

from autoplan.serve.estimate import estimate_serving
from autoplan.serve.memory import check_layout
from autoplan.serve.physics import Hardware
from autoplan.serve.types import ServeConfig, ServeEstimate, ServeModel, Workload

_BATCH_CAPS = (8, 16, 32, 64, 128, 256, 512, 1024)
_ENCODER_BASES = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeSearchOptions:
    """Restrictions of the search space (None: search all). disaggregated: None both, True/False only."""

    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    ep: tuple[int, ...] | None = None
    replicas: tuple[int, ...] | None = None
    max_batch: tuple[int, ...] | None = None
    disaggregated: bool | None = None
    max_instances: int = 4  # P and D (and encoder instances) each up to this many in disaggregated layouts
    encoder_tp: tuple[int, ...] | None = None  # the encoder's own instances: tp values to try
    encoder_replicas: tuple[int, ...] | None = None  # 0: co-located with prefill; >= 1: instances of its own


@dataclass(frozen=True, slots=True)
class Scored:
    config: ServeConfig
    estimate: ServeEstimate
    meets: bool
    miss: float  # max(latency / SLO); <= 1 when the SLOs hold


def _powers(limit: int) -> list[int]:
    return [2**i for i in range(int(math.log2(max(limit, 1))) + 1)]


def _layout_ok(model: ServeModel, tp: int, pp: int) -> bool:
    try:
        check_layout(model, tp, pp)
    except ValueError:
        return False
    return True


def _tps(model: ServeModel, hw: Hardware, opts: ServeSearchOptions) -> list[int]:
    tps = opts.tp or tuple(_powers(hw.cluster.devices_per_node))
    return [t for t in tps if t <= hw.cluster.devices_per_node and _layout_ok(model, t, 1)]


def _eps(model: ServeModel, tp: int, opts: ServeSearchOptions) -> list[int]:
    experts = [b.num_experts for b in model.blocks if b.num_experts]
    if not experts:
        return [1]
    eps = opts.ep or (1, tp)
    return sorted({e for e in eps if tp % e == 0 and all(n % e == 0 for n in experts)})


def _caps(hw: Hardware, opts: ServeSearchOptions) -> list[int]:
    default, _ = hw.engine.batch_defaults(hw.cluster.device.name, hw.cluster.device.mem_bytes)
    if opts.max_batch:
        return sorted(set(opts.max_batch))
    return sorted({c for c in _BATCH_CAPS if c < default} | {default})


def _replica_counts(limit: int, opts: ServeSearchOptions) -> list[int]:
    if opts.replicas:
        return [r for r in opts.replicas if r <= limit]
    return sorted(set(_powers(limit)) | {limit}) if limit >= 1 else []


def candidates(model: ServeModel, hw: Hardware, opts: ServeSearchOptions) -> Iterator[ServeConfig]:
    """Every layout of the search space that fits the cluster's device count."""
    n = hw.cluster.num_devices
    caps = _caps(hw, opts)
    tps = _tps(model, hw, opts)
    if opts.disaggregated is not True:
        for tp in tps:
            for pp in opts.pp or _powers(n // tp):
                if tp * pp > n or not _layout_ok(model, tp, pp):
                    continue
                for ep in _eps(model, tp, opts):
                    for replicas in _replica_counts(n // (tp * pp), opts):
                        for cap in caps:
                            yield ServeConfig(tp=tp, pp=pp, ep=ep, replicas=replicas, max_batch=cap)
    if opts.disaggregated is False or n < 2:
        return
    for ptp in tps:
        for dtp in tps:
            for ep in _eps(model, dtp, opts):
                for p in range(1, opts.max_instances + 1):
                    for d in range(1, opts.max_instances + 1):
                        if p * ptp + d * dtp > n or (opts.replicas and d not in opts.replicas):
                            continue
                        for cap in caps:
                            yield ServeConfig(tp=dtp, ep=ep, replicas=d, max_batch=cap, disaggregated=True,
                                              prefill_tp=ptp, prefill_replicas=p)


def score(config: ServeConfig, est: ServeEstimate, ttft_slo_s: float | None, tpot_slo_s: float | None) -> Scored:
    ratios = [1.0]
    if ttft_slo_s:
        ratios.append(est.ttft_s / ttft_slo_s)
    if tpot_slo_s:
        ratios.append(est.tpot_s / tpot_slo_s)
    miss = max(ratios)
    ok = est.fits and est.stable and miss <= 1.0
    return Scored(config, est, ok, miss)


def rank_key(s: Scored) -> tuple:
    if s.meets:
        return (0, -s.estimate.tokens_per_s_per_gpu, s.config.num_devices, s.estimate.tpot_s)
    return (1, 0 if s.estimate.fits else 1, s.miss, -s.estimate.tokens_per_s_per_gpu)


def search(model: ServeModel, hw: Hardware, workload: Workload, *, ttft_slo_s: float | None = None,
           tpot_slo_s: float | None = None, opts: ServeSearchOptions | None = None) -> list[Scored]:
    """Every candidate scored, best first (see the module docstring for the order)."""
    opts = opts or ServeSearchOptions()
    scored = sorted((score(c, estimate_serving(model, hw, c, workload), ttft_slo_s, tpot_slo_s)
                     for c in candidates(model, hw, opts)), key=rank_key)
    if model.encoder is None or not workload.images_per_request:
        return scored
    own = [score(c, estimate_serving(model, hw, c, workload), ttft_slo_s, tpot_slo_s)
           for c in encoder_candidates(model, hw, opts, [s.config for s in scored])]
    colocated = scored if opts.encoder_replicas is None or 0 in opts.encoder_replicas else []
    return sorted(colocated + own, key=rank_key)


def encoder_candidates(model: ServeModel, hw: Hardware, opts: ServeSearchOptions,
                       ranked: list[ServeConfig]) -> Iterator[ServeConfig]:
    """The best _ENCODER_BASES distinct layouts of `ranked`, each with encoder instances of its own on
    the devices it leaves free."""
    assert model.encoder is not None
    heads, n = model.encoder.a, hw.cluster.num_devices
    tps = [t for t in (opts.encoder_tp or _powers(hw.cluster.devices_per_node))
           if t <= hw.cluster.devices_per_node and heads % t == 0]
    counts = [r for r in (opts.encoder_replicas or range(1, opts.max_instances + 1)) if r >= 1]
    bases: dict[ServeConfig, ServeConfig] = {}  # layout (batch cap aside) -> its best-ranked config
    for config in ranked:
        bases.setdefault(dataclasses.replace(config, max_batch=1), config)
        if len(bases) == _ENCODER_BASES:
            break
    for base in bases.values():
        for tp in tps:
            for replicas in counts:
                if base.num_devices + tp * replicas <= n:
                    yield dataclasses.replace(base, encoder_tp=tp, encoder_replicas=replicas)


def min_devices(scored: list[Scored], workload: Workload) -> int | None:
    """The fewest devices of a plan that fits and holds the target load: the concurrency within its
    KV pool and batch caps (closed loop), or a stable queue (open loop)."""
    ok = [s.config.num_devices for s in scored if s.estimate.fits and s.estimate.stable and
          (workload.concurrency is None or s.estimate.max_concurrency >= workload.concurrency)]
    return min(ok) if ok else None


def pareto(scored: list[Scored]) -> list[Scored]:
    """The plans no other plan beats on both tokens/s per GPU and tokens/s per user (fit and stable)."""
    pts = sorted((s for s in scored if s.estimate.fits and s.estimate.stable),
                 key=lambda s: (-s.estimate.tokens_per_s_per_user, -s.estimate.tokens_per_s_per_gpu))
    front, best = [], -1.0
    for s in pts:
        if s.estimate.tokens_per_s_per_gpu > best:
            front.append(s)
            best = s.estimate.tokens_per_s_per_gpu
    return front
