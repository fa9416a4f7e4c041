"""Ties in the ranking: candidates predicted the same are one row.

A symmetric model often gives exact ties (dp32 x cp1 microbatch 1 and dp16 x cp2 microbatch 2), and ZeRO
stages that shard the same thing in the engine that runs them (ZeRO-1 and ZeRO-2 under a pipeline,
autoplan.plan.layout.zero_layout) cost the same. Candidates whose step time is within TIME_TOLERANCE and
peak memory within MEM_TOLERANCE of an earlier one in rank order are folded into it, each said by how it
differs. The tolerances are presentation choices (the cost model does not resolve differences that
small), not measured figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

TIME_TOLERANCE = 1e-3  # relative step time
MEM_TOLERANCE = 1e-2  # relative peak memory per device

C = TypeVar("C")


def same_prediction(a: Any, b: Any) -> bool:
    """Step time and peak memory of b within the tolerances of a's."""
    ta, tb = a.estimate.step_time_s, b.estimate.step_time_s
    ma, mb = a.estimate.peak_mem_bytes, b.estimate.peak_mem_bytes
    return abs(tb - ta) <= TIME_TOLERANCE * ta and abs(mb - ma) <= MEM_TOLERANCE * max(ma, 1)


def differences(a: Any, b: Any) -> str:
    """How candidate b differs from a: the config keys with b's values, then the layout."""
    ca, cb = a.config.to_dict(), b.config.to_dict()
    parts = [f"{k}={_value(v)}" for k, v in cb.items() if k not in ("etp", "eep") and ca[k] != v]
    layout = (b.config.folded, b.config.expert_tp, b.config.expert_ep)  # MoE folding (search/folding.py)
    if layout != (a.config.folded, a.config.expert_tp, a.config.expert_ep):
        parts.append(f"etp={layout[1]} eep={layout[2]}" if layout[0] else "experts on the ep axis")
    if getattr(a, "stages", ()) != getattr(b, "stages", ()):
        parts.append("another stage split")
    if dict(getattr(a, "layer_recompute", ())) != dict(getattr(b, "layer_recompute", ())):
        parts.append("other per-layer recompute")
    return " ".join(parts) or "the same configuration"


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(v)


def fold_ties(ranked: Sequence[C]) -> list[tuple[C, tuple[str, ...]]]:
    """(candidate, how each folded candidate differs from it), in the given rank order. A candidate is
    folded into the first earlier representative it ties with; representatives are never chained."""
    groups: list[tuple[C, list[str]]] = []
    for cand in ranked:
        for rep, folded in groups:
            if same_prediction(rep, cand):
                folded.append(differences(rep, cand))
                break
        else:
            groups.append((cand, []))
    return [(rep, tuple(folded)) for rep, folded in groups]
