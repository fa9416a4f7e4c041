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


def expert_layouts(graph: LayerGraph, options: Any, tp: int, pp: int, dp: int, cp: int,
                   ep: int) -> tuple[tuple[int, int], ...]:
    """(etp, eep) of the candidates of one dense mesh: (0, 0), the unfolded layout, first; then, for a
    model with routed experts, options.fold_experts and ep = 1 (folded, the dense ep axis would only
    relabel data parallelism), every folded layout with
    - etp among options.etp (default (1,): what autoplan's executor runs; None: the divisors of tp),
    - eep > 1 among the divisors of the experts (restricted by options.eep),
    - etp * eep dividing the dp * cp * tp ranks of a stage,
    - not the layout of an unfolded mesh: etp = tp with cp = 1 is exactly the unfolded mesh with
      ep = eep (its ep axis has stride tp as eep's has), which is enumerated on its own,
    - dividing the model as plan.layout.divisibility_errors says (the executor refuses the rest)."""
    experts = max((b.num_experts for b in graph.blocks), default=0)
    if not experts or ep != 1 or not options.fold_experts:
        return ((0, 0),)
    etps = options.etp if options.etp is not None else _divisors(tp)
    eeps = [e for e in _divisors(experts) if e > 1 and (options.eep is None or e in options.eep)]
    ranks = dp * cp * tp
    out = [(0, 0)]
    for etp in etps:
        for eep in eeps:
            if ranks % (etp * eep) or (etp == tp and cp == 1):
                continue
            config = ParallelConfig(tp=tp, pp=pp, dp=dp, cp=cp, etp=etp, eep=eep)
            if config.folded and not graph.divisibility_errors(config):
                out.append((etp, eep))
    return tuple(out)


def with_expert_layouts(rows: np.ndarray, layouts: tuple[tuple[int, int], ...]) -> list[np.ndarray]:
    """The candidate rows of one dense mesh repeated for each expert layout, etp / eep columns set."""
    out = []
    for etp, eep in layouts:
        block = rows.copy() if len(layouts) > 1 else rows
        block[:, _ETP] = etp
        block[:, _EEP] = eep
        out.append(block)
    return out
