"""Ranks that share a CPU's cores: a profile measured with D ranks on C cores (field
`device.cpu_cores: C`, figures per rank at devices_per_node = D) loaded for N ranks.

Processor sharing. With N >= C each rank process runs one thread (torchrun sets OMP_NUM_THREADS=1 for
more than one process per node) and gets C / N of a core, times device.cpu_oversubscribed_efficiency e
when N > C (a switched-in process refills its caches; e cancels between two oversubscribed counts). With N < C a rank's ops run on C / N cores (torch's intra-op threads), but one thread still
issues them. Measured on this kind of machine (2 cores): one or two processes each ran 512^3 fp32
matmuls at 183-196 GFLOP/s, four at once 97.7 each (2 x 195 / 4); small-gpt trained on one process at
0.094 s per step, 0.19 s of CPU. So, per rank:
- compute (peak_flops) and memory bandwidth scale by compute(N) / compute(D), compute(N) = C / N
  (x e when N > C);
- host times (op_overhead_s, tp_op_overhead_s, dp_layer_overhead_s), link latency (latency_s: a ring
  step waits for the next process to be scheduled) by host(D) / host(N), host(N) = min(1, C / N) (x e),
  and link bandwidth (gloo copies on the issuing thread) by host(N) / host(D);
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


def share(cores: float, ranks: int, oversubscribed_efficiency: float = 1.0, *, threads: bool = False) -> float:
    """Cores' worth of throughput each of `ranks` processes gets on `cores` cores: cores / ranks, at the
    oversubscribed efficiency past one process per core; capped at one core for what one thread does
    (threads=False: issuing ops, gloo), not for a process's multithreaded kernels (threads=True)."""
    if ranks > cores:
        return cores / ranks * oversubscribed_efficiency
    return cores / ranks if threads else 1.0


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
    eff = device.get("cpu_oversubscribed_efficiency", 1.0)
    if isinstance(eff, bool) or not isinstance(eff, (int, float)) or not 0 < eff <= 1:
        raise ValueError(f"{path}: device.cpu_oversubscribed_efficiency must be in (0, 1], got {eff!r}")
    f = share(cores, ranks, eff) / share(cores, measured_at, eff)
    kernels = share(cores, ranks, eff, threads=True) / share(cores, measured_at, eff, threads=True)
    if isinstance(device, dict):
        if isinstance(device.get("peak_flops"), dict):
            device["peak_flops"] = {k: _times(v, kernels) for k, v in device["peak_flops"].items()}
        _scale(device, _FASTER, kernels)
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
