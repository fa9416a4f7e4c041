"""Names a package loads on first use (PEP 562 module __getattr__ / __dir__), so that importing the package or
one light submodule does not import the heavy ones (torch for autoplan.models, numpy and yaml for
autoplan.cluster)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(package: str, home: Mapping[str, str], namespace: dict[str, Any]
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """(__getattr__, __dir__) for `package`: name -> its submodule in `home`, imported once and kept in
    `namespace` (the package's globals())."""

    def getattr_(name: str) -> Any:
        if name not in home:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{home[name]}"), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *home})

    return getattr_, dir_
