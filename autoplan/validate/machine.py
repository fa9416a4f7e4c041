"""How busy the machine is while a plan runs: the 1-minute load average, and the CPU that processes
other than the run itself used during it (other users' work on a shared box makes a measurement noisy).

Linux only (/proc/stat); elsewhere the figures are None."""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass


def load_1min() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _busy_s() -> float | None:
    """Seconds all CPUs spent not idle since boot (/proc/stat: user nice system irq softirq steal)."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_s() -> float:
    """CPU seconds of this process and of its reaped children (the ranks, through torchrun)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@dataclass
class CpuMeter:
    """Start before a run, `other_cores()` after it: the average number of cores busy with work that
    was not this process or its children over the interval."""

    busy: float | None = None
    own: float = 0.0
    wall: float = 0.0

    def start(self) -> CpuMeter:
        self.busy, self.own, self.wall = _busy_s(), _own_s(), time.monotonic()
        return self

    def other_cores(self) -> float | None:
        busy, wall = _busy_s(), time.monotonic() - self.wall
        if busy is None or self.busy is None or wall <= 0:
            return None
        return max(0.0, (busy - self.busy - (_own_s() - self.own)) / wall)


def other_cores_now(window_s: float = 2.0) -> float | None:
    """Cores other processes keep busy, averaged over the next `window_s` seconds."""
    meter = CpuMeter().start()
    time.sleep(window_s)
    return meter.other_cores()


def wait_quiet(max_cores: float, *, timeout_s: float, window_s: float = 2.0) -> float | None:
    """Wait until other processes use at most `max_cores` cores (over a `window_s` window) or until
    `timeout_s` passes; the last figure measured (None where it cannot be measured)."""
    deadline = time.monotonic() + timeout_s
    while True:
        cores = other_cores_now(window_s)
        if cores is None or cores <= max_cores or time.monotonic() >= deadline:
            return cores
