"""The search: candidates (space), quick estimates (surrogate), the stage/recompute ILP (ilp, stages,
refine), the ranked plans (search) and the public API (api)."""

from __future__ import annotations

from autoplan.search.space import SearchOptions
from autoplan.search.search import search

__all__ = ["SearchOptions", "search"]
