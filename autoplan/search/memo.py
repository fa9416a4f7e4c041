"""One search's exact estimates, each made once: the cost model as the search sees it, with estimate_config
memoised on its arguments.

The search asks for the same exact estimate more than once: a shortlist candidate, again when its notes weigh
the alternatives, again for "nothing fits". estimate_config is a pure function of (graph, cluster, config,
global_batch, stages, layer_recompute, engine), so its answer is kept and handed back as it is: the very
object the first call returned. The memo lives as long as the search (search.search makes one per call).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class MemoCost:
    """Reads like the cost model it wraps; estimate_config is memoised, everything else passed through."""

    def __init__(self, cost: Any) -> None:
        self._cost = cost
        self._memo: dict[tuple, Any] = {}
        self._keep: dict[int, Any] = {}  # the graph and cluster objects a key names by id: kept alive

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cost, name)

    def estimate_config(self, graph: Any, cluster: Any, config: Any, **kwargs: Any) -> Any:
        key = self._key(graph, cluster, config, kwargs)
        if key is None:
            return self._cost.estimate_config(graph, cluster, config, **kwargs)
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = self._cost.estimate_config(graph, cluster, config, **kwargs)
        return found

    def remember(self, graph: Any, cluster: Any, config: Any, estimate: Any, **kwargs: Any) -> None:
        """Record an estimate made elsewhere (a search worker) for these arguments."""
        key = self._key(graph, cluster, config, kwargs)
        if key is not None:
            self._memo.setdefault(key, estimate)

    def _key(self, graph: Any, cluster: Any, config: Any, kwargs: dict[str, Any]) -> tuple | None:
        """The memo key, or None when an argument is not hashable (then nothing is memoised)."""
        self._keep.setdefault(id(graph), graph)
        self._keep.setdefault(id(cluster), cluster)
        parts = []
        for name, value in sorted(kwargs.items()):
            if isinstance(value, Mapping):
                value = ("mapping", tuple(value.items()))  # in its order, as the cost model reads it
            parts.append((name, value))
        key = (id(graph), id(cluster), config, tuple(parts))
        try:
            hash(key)
        except TypeError:
            return None
        return key
