"""The search: candidates (space), quick estimates (surrogate), the stage/recompute ILP (ilp, stages,
refine), the ranked plans (search) and the public API (api)."""

from __future__ import annotations

from autoplan.search.search import search
from autoplan.search.space import SearchOptions

__all__ = ["SearchOptions", "search"]
