"""Cluster descriptions: the frozen specs (types.py), shipped and user profiles (load.py), the
profiler that measures a real cluster (probe.py) and the fits it uses (fit.py)."""

from __future__ import annotations

from autoplan.cluster.load import Cluster
from autoplan.cluster.types import ClusterSpec, DeviceSpec, LinkSpec

__all__ = ["Cluster", "ClusterSpec", "DeviceSpec", "LinkSpec"]
