"""Ranks that share a CPU's cores: a profile measured with D ranks on C cores (field
`device.cpu_cores: C`, figures per rank at devices_per_node = D) loaded for N ranks.

Processor sharing: each rank process gets share(N) = min(1, C / N) of a core (one thread per rank, as
torchrun and the profiler set OMP_NUM_THREADS=1). Measured on this kind of machine (2 cores): one or two
processes each ran 512^3 fp32 matmuls at 183-196 GFLOP/s, four at once 97.7 each (2 x 195 / 4). So with
f = share(N) / share(D), per rank:
- compute (peak_flops), memory bandwidth and link bandwidth scale by f (gloo over loopback copies
  through the CPU: measured `autoplan profile` bus bandwidth per rank 1.15 GB/s at 4 ranks, 0.25 at 8);
- host times (op_overhead_s, tp_op_overhead_s, dp_layer_overhead_s) and link latency (latency_s: a ring step waits for the next process
  to be scheduled) by 1 / f;
- memory (mem_bytes) is the machine's split N ways: times D / N.
The cost model then sees an ordinary per-rank profile.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

_FASTER = ("mem_bw_bytes_per_s",)
_SLOWER = ("op_overhead_s", "tp_op_overhead_s", "dp_layer_overhead_s")
_LINK_FASTER = ("bw_bytes_per_s",)
_LINK_SLOWER = ("latency_s",)


def share(cores: float, ranks: int) -> float:
    """Fraction of one core each of `ranks` single-threaded processes gets on `cores` cores."""
    return min(1.0, cores / ranks)


def rescale(data: Mapping[str, Any], ranks: int, path: str) -> dict[str, Any]:
    """The profile mapping for `ranks` ranks per node; unchanged without `cpu_cores` or at the
    profile's own devices_per_node."""
    out = copy.deepcopy(dict(data))
    device = out.get("device")
    cores = device.get("cpu_cores") if isinstance(device, dict) else None
    measured_at = out.get("devices_per_node")
    if not cores or ranks == measured_at:
        return out
    if isinstance(cores, bool) or not isinstance(cores, (int, float)) or cores < 0:
        return out  # parse_profile reports the bad value
    if isinstance(measured_at, bool) or not isinstance(measured_at, int) or measured_at < 1:
        return out  # parse_profile reports the bad devices_per_node
    f = share(cores, ranks) / share(cores, measured_at)
    if isinstance(device, dict):
        if isinstance(device.get("peak_flops"), dict):
            device["peak_flops"] = {k: _times(v, f) for k, v in device["peak_flops"].items()}
        _scale(device, _FASTER, f)
        _scale(device, _SLOWER, 1 / f)
        if "mem_bytes" in device:
            device["mem_bytes"] = int(_times(device["mem_bytes"], measured_at / ranks))
    for level in ("intra_node", "inter_node"):
        if isinstance(out.get(level), dict):
            _scale(out[level], _LINK_FASTER, f)
            _scale(out[level], _LINK_SLOWER, 1 / f)
    return out


def _times(value: Any, factor: float) -> Any:
    if isinstance(value, str):  # PyYAML reads "1e9" as a string; parse_profile accepts it
        try:
            value = float(value)
        except ValueError:
            return value
    return value * factor if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _scale(section: dict[str, Any], keys: tuple[str, ...], factor: float) -> None:
    for key in keys:
        if key in section:
            section[key] = _times(section[key], factor)
