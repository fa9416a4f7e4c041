"""search(graph, cluster, options): enumerate -> quick estimate -> exact estimate of a shortlist ->
refine stages and per-layer recompute (ILP) -> rank -> explain. Nothing here reads argv or files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from autoplan.cluster.types import ClusterSpec
from autoplan.graph.types import LayerGraph
from autoplan.plan.types import Estimate, ParallelConfig, Plan, Recompute
from autoplan.search.hetero import group_notes, plan_stages
from autoplan.search.memo import MemoCost
from autoplan.search.notes import ALTERNATIVE_AXES, alternative_rows, nothing_fits_message, plan_notes
from autoplan.search.parallel import run_parts
from autoplan.search.refine import refine
from autoplan.search.space import RECOMPUTES, SearchOptions, Space, enumerate_space, token_free_restriction
from autoplan.search.surrogate import Quick, quick_estimate, split_by_layer_key
from autoplan.search.ties import fold_ties

QUICK_MEM_SLACK = 1.05  # the quick memory estimate mirrors the exact one (checked to 0.1 %); the exact one decides
SHORTLIST = 32  # candidates per round of exact estimates
MAX_EXACT = 160  # at most this many exact estimates of candidates that fit by the quick estimate (and half as many just over)
STOP_MARGIN = 1.02  # stop once the next quick estimate is this much slower than the k-th exact time
# Spaces of at least QUICK_SPLIT_MIN candidates get their quick estimates in QUICK_PARTS pieces of whole
# layer-table keys, run side by side on the usable cores (parallel.run_parts). Both are fixed numbers, so the
# pieces, and every figure, are the same on any machine (and bitwise equal to one piece: a test).
QUICK_PARTS = 2
QUICK_SPLIT_MIN = 20_000
PARALLEL_MIN_ITEMS = 4  # exact estimates and refinements in two fixed halves from this many on


@dataclass(frozen=True, slots=True)
class Candidate:
    config: ParallelConfig
    estimate: Estimate
    stages: tuple[tuple[str, ...], ...] = ()
    layer_recompute: tuple[tuple[str, Recompute], ...] = ()
    row: int = -1  # row in the Space


def _rank_key(cand: Any) -> tuple:
    """Fastest first; among equally fast plans (a symmetric model often gives exact ties, e.g. dp32 x cp8
    mb1 and dp8 x cp32 mb4), the one with smaller cp, ep, tp, pp degrees (fewer and smaller collectives
    on the critical path, simpler to run), then the one with the least memory."""
    c, est = cand.config, cand.estimate
    return (float(f"{est.step_time_s:.9g}"), c.cp, c.ep, c.tp, c.pp, est.peak_mem_bytes)


def search(graph: LayerGraph, cluster: ClusterSpec, options: SearchOptions, *, cost_model: Any = None,
           record: dict[str, Any] | None = None) -> tuple[Plan, ...]:
    """The top_k fitting plans, fastest first, ties folded (search.ties); ValueError (with the overflow and
    the remedies) if none fits. `record`, when given, receives the candidates: "quick" (the quick estimate
    of every candidate) and "exact" (the exactly estimated, fitting ones), for a Pareto plot."""
    cost = MemoCost(cost_model or importlib.import_module("autoplan.cost"))  # each exact estimate made once
    options, restricted = token_free_restriction(graph, options)
    with _status(options.progress) as status, _frozen_heap(), _small_pages():
        status(f"enumerating configurations for {cluster.num_devices} devices")
        space = enumerate_space(graph, cluster, options)
        if not len(space):
            raise ValueError(_empty_space_message(graph, cluster, options, space))
        status(f"quick estimates of {len(space):,} candidates")
        quick = _quick_estimates(graph, cluster, space, options.global_batch, cost)
        found = _exact_rounds(graph, cluster, space, quick, options, cost, status)
        if options.use_ilp:
            found = _refine_best(graph, cluster, space, quick, found, options, cost, status)
        if record is not None:
            record.update(quick=quick, exact=list(found))
        if not found:
            raise ValueError(nothing_fits_message(graph, cluster, space, quick, options, cost))
    ranked = fold_ties(sorted(found, key=_rank_key))[:options.top_k]
    plans = [_to_plan(graph, cluster, options, cand, rank=i + 1, cost=cost, folded=folded)
             for i, (cand, folded) in enumerate(ranked)]
    pairs = list(zip(plans, ranked))

    def noted(part: list) -> list[Plan]:
        return [replace(p, notes=plan_notes(p, plans, graph, cluster, space, quick, cand.row, cost)
                        + group_notes(p, graph, cluster) + ((restricted,) if restricted else ()))
                for p, (cand, _) in part]

    # the best plan's notes weigh the alternatives: their exact estimates first, over the cores
    _estimate_alternatives(graph, cluster, space, quick, plans[0], ranked[0][0].row, options, cost)
    return tuple(noted(pairs))


def _estimate_alternatives(graph, cluster, space: Space, quick: Quick, best: Plan, row: int, options, cost) -> None:
    """The exact estimates the best plan's notes will ask for (notes.alternative_rows), made in two halves
    side by side and kept in the search's memo (cost: a MemoCost)."""
    if row < 0:
        return
    rows = list(dict.fromkeys(r for axis in ALTERNATIVE_AXES
                              for _, some in alternative_rows(axis, space, quick, row, best.estimate.mem_capacity_bytes)
                              for r in some))

    def exact(part: list[int]) -> list[tuple[int, Estimate]]:
        return [(r, cost.estimate_config(graph, cluster, space.config(r), global_batch=options.global_batch))
                for r in part]

    for r, est in (pair for part in run_parts(exact, _halves(rows)) for pair in part):
        cost.remember(graph, cluster, space.config(r), est, global_batch=options.global_batch)


def _quick_estimates(graph: LayerGraph, cluster: ClusterSpec, space: Space, global_batch: int, cost: Any) -> Quick:
    """quick_estimate of every candidate; large spaces in QUICK_PARTS pieces side by side (each candidate's
    estimate depends on its own row only, so the pieces put together are the whole)."""
    if len(space) < QUICK_SPLIT_MIN:
        return quick_estimate(graph, cluster, space, global_batch, cost)
    pieces = split_by_layer_key(space, QUICK_PARTS)
    parts = run_parts(lambda rows: quick_estimate(graph, cluster, space.take(rows), global_batch, cost), pieces)
    merged = {}
    for f in dataclasses.fields(Quick):
        column = np.empty(len(space), dtype=np.asarray(getattr(parts[0], f.name)).dtype)
        for rows, part in zip(pieces, parts):
            column[rows] = getattr(part, f.name)
        merged[f.name] = column
    return Quick(**merged)


def _exact_rounds(graph, cluster, space: Space, quick: Quick, options, cost, status) -> list[Candidate]:
    """Exact estimates of the quickest plausible candidates, in rounds, until top_k fit and the next
    candidate's quick estimate is clearly slower than the k-th best exact time: first those the quick
    estimate says fit, then those it puts just over the memory (within QUICK_MEM_SLACK) that could still
    beat the k-th best, so that candidates which cannot fit never use up the budget."""
    cap = cluster.device.mem_bytes
    sure = np.nonzero(quick.peak_mem_bytes <= cap)[0]
    found = _rounds(graph, cluster, space, quick, options, cost, status, _quickest(quick, sure, MAX_EXACT), [])
    marginal = np.nonzero((quick.peak_mem_bytes > cap) & (quick.peak_mem_bytes <= cap * QUICK_MEM_SLACK))[0]
    if len(found) >= options.top_k:
        kth = sorted(c.estimate.step_time_s for c in found)[options.top_k - 1]
        marginal = marginal[quick.step_time_s[marginal] < kth * STOP_MARGIN]
    return _rounds(graph, cluster, space, quick, options, cost, status, _quickest(quick, marginal, MAX_EXACT // 2),
                   found)


def _quickest(quick: Quick, rows: np.ndarray, limit: int) -> np.ndarray:
    """At most `limit` of `rows`, the quickest first (ties in row order)."""
    if len(rows) > limit:
        rows = rows[np.argpartition(quick.step_time_s[rows], limit)[:limit]]
    return rows[np.lexsort((rows, quick.step_time_s[rows]))]


def _rounds(graph, cluster, space: Space, quick: Quick, options, cost, status, order: np.ndarray,
            found: list[Candidate]) -> list[Candidate]:
    found, done = list(found), 0
    while done < len(order):
        if len(found) >= options.top_k:
            kth = sorted(c.estimate.step_time_s for c in found)[options.top_k - 1]
            if quick.step_time_s[order[done]] > kth * STOP_MARGIN:
                break
        batch = order[done:done + SHORTLIST].tolist()
        status(f"exact estimates {done + 1}-{done + len(batch)} of {len(order):,} plausible candidates")

        def exact(rows: list[int]) -> list[Candidate]:
            return [Candidate(config=space.config(r), estimate=cost.estimate_config(
                graph, cluster, space.config(r), global_batch=options.global_batch), row=r) for r in rows]

        for cand in (c for part in run_parts(exact, _halves(batch)) for c in part):
            cost.remember(graph, cluster, cand.config, cand.estimate, global_batch=options.global_batch)
            found += [cand] if cand.estimate.fits else []
        done += len(batch)
    return found


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    """Everything alive before the search (torch and the user's model, when a capture ran in this process) moved
    out of the garbage collector's sight while it runs, and back after (gc.freeze / gc.unfreeze: "if a
    process will fork() without exec(), avoiding unnecessary copy-on-write in child processes ... and
    ignoring them in all future collections", Python docs, gc.freeze). The search allocates millions of
    short-lived objects; without this every full collection rescans torch's modules (the search took 0.4 s
    longer after a capture than from the cache on this machine), and each forked worker dirties those
    pages. Left alone when the caller froze objects already."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def _small_pages() -> Iterator[None]:
    """numpy's madvise(MADV_HUGEPAGE) on its large arrays off while the search runs, as it was after. Where the
    kernel's transparent-hugepage defrag is "madvise" (a common default; /sys/kernel/mm/transparent_hugepage/
    defrag), each new madvised region waits for direct compaction: on this 2-core VM a fresh 249 MB array took
    1.4-3 s instead of 0.1 s, and the search of deepseek-v3 allocates several (its candidate table, layer
    table and cumulative sums). numpy documents the switch (NUMPY_MADVISE_HUGEPAGE=0, "Global state",
    numpy.org/doc; numpy 1.20 release notes); the search's arrays live for seconds, too short to gain from
    huge pages. A numpy without the private setter is left as it is."""
    core = getattr(np, "_core", None) or np.core  # numpy 2 / numpy 1
    setter = getattr(core.multiarray, "_set_madvise_hugepage", None)
    if setter is None:
        yield
        return
    was = setter(False)
    try:
        yield
    finally:
        setter(was)


def _halves(items: list) -> list[list]:
    """Two fixed pieces (first half, second half) for run_parts, or one when there is little to split."""
    if len(items) < PARALLEL_MIN_ITEMS:
        return [items]
    half = (len(items) + 1) // 2
    return [items[:half], items[half:]]


def _refine_best(graph, cluster, space: Space, quick: Quick, found: list[Candidate], options, cost,
                 status) -> list[Candidate]:
    """Per-layer recompute and the stage split of the best candidates, of the fastest ones that only
    fail for memory without recompute (a mix of recompute modes may fit them), and, when nothing fit
    at all, of the least memory-hungry pipelined ones (an uneven split may fit them)."""
    found = sorted(found, key=lambda c: c.estimate.step_time_s)
    cap = cluster.device.mem_bytes
    if found:
        todo = [c.row for c in found[:options.top_k + 2]]
        tight = np.nonzero((space.columns["recompute"] == RECOMPUTES.index(Recompute.NONE))
                           & (quick.peak_mem_bytes > cap) & (quick.peak_mem_bytes <= 3 * cap)
                           & (quick.step_time_s < found[0].estimate.step_time_s))[0]
        todo += tight[np.argsort(quick.step_time_s[tight])][:options.top_k].tolist()
    else:
        piped = np.nonzero(space.columns["pp"] > 1)[0]
        todo = piped[np.argsort(quick.peak_mem_bytes[piped])][:2 * options.top_k].tolist()
    todo = list(dict.fromkeys(todo))  # a fixed amount of work: every one of them
    status(f"stage split and per-layer recompute of {len(todo)} candidates")

    def refined(rows: list[int]) -> list[Candidate]:
        out = []
        for row in rows:
            layout = refine(graph, cluster, space.config(row), global_batch=options.global_batch,
                            modes=options.recompute, cost_model=cost)
            if layout is not None:
                est = cost.estimate_config(graph, cluster, layout.config, global_batch=options.global_batch,
                                           stages=layout.stages, layer_recompute=dict(layout.layer_recompute))
                out.append(Candidate(config=layout.config, estimate=est, stages=layout.stages,
                                     layer_recompute=layout.layer_recompute, row=row))
        return out

    seen = {(c.config, c.stages, c.layer_recompute) for c in found}
    for cand in (c for part in run_parts(refined, _halves(todo)) for c in part):  # in todo's order
        if (cand.config, cand.stages, cand.layer_recompute) not in seen:
            seen.add((cand.config, cand.stages, cand.layer_recompute))
            found += [cand] if cand.estimate.fits else []
    return _dedupe(found)


def _dedupe(found: list[Candidate]) -> list[Candidate]:
    """One entry per config: the fastest of its layouts."""
    best: dict[ParallelConfig, Candidate] = {}
    for c in found:
        key = replace(c.config, recompute=Recompute.NONE) if c.layer_recompute else c.config
        if key not in best or c.estimate.step_time_s < best[key].estimate.step_time_s:
            best[key] = c
    return list(best.values())


def _to_plan(graph: LayerGraph, cluster: ClusterSpec, options: SearchOptions, cand: Candidate, *, rank: int,
             cost: Any, folded: tuple[str, ...] = ()) -> Plan:
    # the split that was priced, with each stage's node group (search/hetero.py)
    stages = plan_stages(graph, cluster, cand.config, cand.stages, cost, options.global_batch)
    return Plan(config=cand.config, estimate=cand.estimate, model_name=graph.model_name, cluster_name=cluster.name,
                num_devices=cluster.num_devices, global_batch=options.global_batch, seq_len=graph.seq_len,
                stages=stages,
                layer_recompute=cand.layer_recompute, rank=rank, folded=folded,
                sample_shape=() if graph.vocab_size else getattr(graph, "input_shape", ()))


def _empty_space_message(graph: LayerGraph, cluster: ClusterSpec, options: SearchOptions, space: Space) -> str:
    """Why the enumeration is empty: zero 0 refused beside the fixed degrees (SearchOptions.zero0_1d_only,
    the only cause when the same space without it has rows), else the divisibility rules."""
    n = cluster.num_devices
    if options.zero0_1d_only and len(enumerate_space(graph, cluster, replace(options, zero0_1d_only=False))):
        return ("every configuration the fixed degrees allow runs zero 0 beside data parallelism and another "
                "dimension (tp, pp, cp or ep > 1), which zero0_1d_only refuses (the engine's, or --zero0-1d-only: "
                "zero 0 only as the only parallel dimension): add a ZeRO stage among 1, 2, 3 to --zero / zero=, or relax the fixed "
                "degrees")
    return (f"no parallel configuration of {n} devices divides global batch {options.global_batch} "
            f"(dp*ep replicas must divide it; pp <= {len(graph.blocks)} blocks; tp must divide a node of "
            f"{cluster.devices_per_node}, the heads, the FFN width and the vocabulary of {graph.vocab_size}; "
            f"2*cp must divide seq_len {graph.seq_len}): use a global batch that is a multiple of a divisor of {n}, "
            f"or relax the fixed degrees")


@contextlib.contextmanager
def _status(enabled: bool) -> Iterator[Any]:
    """A rich status line on stderr while searching (when enabled); yields a function to update it."""
    if not enabled:
        yield lambda message: None
        return
    from rich.console import Console

    with Console(stderr=True).status("autoplan: searching") as live:
        yield lambda message: live.update(f"autoplan: {message}")
