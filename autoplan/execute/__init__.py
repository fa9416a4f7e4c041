"""Run a plan with torch.distributed: mesh, TP/SP, experts, context, recompute, FSDP2, pipeline stages.

`autoplan.execute(plan_or_config, model, steps=...)` launches the ranks (see launch.execute). The package
itself is callable, so `autoplan.execute(...)` works also after `import autoplan.execute.<module>` has
bound the name `autoplan.execute` to this package.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallablePackage(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        from autoplan.execute.launch import execute

        return execute(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
