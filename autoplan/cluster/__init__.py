"""Cluster descriptions: the frozen specs (types.py), shipped and user profiles (load.py), the
profiler that measures a real cluster (probe.py) and the fits it uses (fit.py).

The names below are loaded on first use (PEP 562 module __getattr__), so that importing a submodule (the
specs, calibrate's field names for the command line's help) does not import numpy and yaml with load.py:
`autoplan plan` forks a cold preset's capture before it imports them (graph/named.py).
"""

from __future__ import annotations

from autoplan._lazy import lazy_names

_HOME = {"Cluster": "load", "ClusterSpec": "types", "DeviceSpec": "types", "LinkSpec": "types"}

__all__ = ["Cluster", "ClusterSpec", "DeviceSpec", "LinkSpec"]

__getattr__, __dir__ = lazy_names(__name__, _HOME, globals())
