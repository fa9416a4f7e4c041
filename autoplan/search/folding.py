"""MoE parallel folding in the search: the expert layouts (etp, eep) considered beside each dense mesh.

Megatron-Core lets the expert layers take their own tensor- and expert-parallel degrees over the ranks of
a pipeline stage (Liu et al. 2025, "MoE Parallel Folding", arXiv 2504.14960; parallel_state.py's expert
RankGenerator). The search lists, for every dense mesh, the unfolded layout (etp = eep = 0: experts on
the dense mesh's ep axis) and the folded ones stated in expert_layouts.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from autoplan.graph.types import LayerGraph
from autoplan.plan.types import ParallelConfig

_ETP, _EEP = 11, 12  # their columns in search.space.COLUMNS


def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def expert_layouts(graph: LayerGraph, options: Any, tp: int, pp: int, dp: int, cp: int, ep: int,
                   per_node: int = 8) -> tuple[tuple[int, int], ...]:
    """(etp, eep) of the candidates of one dense mesh: (0, 0), the unfolded layout, first; then, for a
    model with routed experts, options.fold_experts and ep = 1 (folded, the dense ep axis would only
    relabel data parallelism), every folded layout with
    - etp among options.etp (default (1,): what autoplan's executor runs; None: the divisors of tp),
    - eep > 1 dividing the experts: options.eep, or by default the largest in-node group (_eeps),
    - etp * eep dividing the dp * cp * tp ranks of a stage,
    - not the layout of an unfolded mesh: etp = tp with cp = 1 is exactly the unfolded mesh with
      ep = eep (its ep axis has stride tp as eep's has), which is enumerated on its own,
    - dividing the model as plan.layout.divisibility_errors says (the executor refuses the rest)."""
    experts = max((b.num_experts for b in graph.blocks), default=0)
    if not experts or ep != 1 or not options.fold_experts:
        return ((0, 0),)
    etps = options.etp if options.etp is not None else _divisors(tp)
    ranks = dp * cp * tp
    out = [(0, 0)]
    for etp in etps:
        for eep in _eeps(experts, ranks, etp, per_node, options.eep):
            if ranks % (etp * eep) or (etp == tp and cp == 1):
                continue
            config = ParallelConfig(tp=tp, pp=pp, dp=dp, cp=cp, etp=etp, eep=eep)
            if config.folded and not graph.divisibility_errors(config):
                out.append((etp, eep))
    return tuple(out)


def _eeps(experts: int, ranks: int, etp: int, per_node: int, allowed: tuple[int, ...] | None) -> list[int]:
    """eep values to try: `allowed` (options.eep) when given; by default the one largest expert-parallel
    group that stays inside a node (eep * etp <= devices per node, eep dividing the experts and the
    stage's ranks over etp). Why one: folding's gain over the dense ep axis is where its all-to-all runs
    (Liu et al. 2025, section 3: EP folded over the TP / CP ranks of a node keeps the dispatch on NVLink);
    a smaller group spreads the experts over fewer devices at the same in-node bandwidth, and across nodes
    the all-to-all runs at the NICs' bandwidth either way. Each value multiplies the candidates of every
    dense mesh with ep = 1 (deepseek-v3's 256 experts on 2,048 GPUs: 1.8 M candidates with all eight,
    against 0.65 M unfolded), so the rest are searched only on request (options.eep, `--eep`)."""
    if allowed is not None:
        return [e for e in allowed if e > 1 and experts % e == 0]
    inside = [e for e in _divisors(experts) if e > 1 and e * etp <= per_node and ranks % (e * etp) == 0]
    return inside[-1:]


def with_expert_layouts(rows: np.ndarray, layouts: tuple[tuple[int, int], ...]) -> list[np.ndarray]:
    """The candidate rows of one dense mesh repeated for each expert layout, etp / eep columns set."""
    out = []
    for etp, eep in layouts:
        block = rows.copy() if len(layouts) > 1 else rows
        block[:, _ETP] = etp
        block[:, _EEP] = eep
        out.append(block)
    return out
