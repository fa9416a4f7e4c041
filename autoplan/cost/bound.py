"""autoplan.cost with one engine bound: what the search receives as its cost model, so every estimate it
makes (quick, exact, per-layer) is for the engine the user plans for.
"""

from __future__ import annotations

import importlib
from typing import Any

from autoplan.plan.engine import Engine


class EngineCost:
    """Reads like the autoplan.cost module; estimate_config and estimate_layer get `engine` by default."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._module = importlib.import_module("autoplan.cost")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def estimate_config(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("engine", self.engine)
        return self._module.estimate_config(*args, **kwargs)

    def estimate_layer(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("engine", self.engine)
        return self._module.estimate_layer(*args, **kwargs)

    def layer_state_bytes(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("engine", self.engine)
        return self._module.layer_state_bytes(*args, **kwargs)

    def fixed_memory_bytes(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("engine", self.engine)
        return self._module.fixed_memory_bytes(*args, **kwargs)


def with_engine(engine: Engine) -> EngineCost:
    return EngineCost(engine)
