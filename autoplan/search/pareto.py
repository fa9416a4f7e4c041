"""The step-time / memory trade-off of the candidates a search estimated: the Pareto front and a PNG.

Every candidate's quick estimate (grey), the exactly estimated ones that fit (blue), their Pareto front
(no other candidate is both faster and smaller), the ranked plans (red, labelled) and the device memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from autoplan.plan.types import Plan

GIB = 2**30
MAX_GREY_POINTS = 50_000  # a deterministic subsample of the quick estimates keeps the PNG quick to draw


def pareto_front(time_s: np.ndarray, mem_bytes: np.ndarray) -> np.ndarray:
    """Indices of the points no other point dominates (as fast or faster and as small or smaller, one of
    them strictly), by increasing memory."""
    t, m = np.asarray(time_s, dtype=float), np.asarray(mem_bytes, dtype=float)
    order = np.lexsort((t, m))  # memory, then time
    front, best = [], np.inf
    for i in order.tolist():
        if t[i] < best:
            front.append(i)
            best = t[i]
    return np.array(front, dtype=np.int64)


def pareto_png(plans: Sequence[Plan], candidates: dict[str, Any] | None, path: str | Path) -> None:
    """Write the plot. `candidates` is search.search's record ("quick", "exact"); without it only the
    ranked plans are drawn. The axes frame the fitting candidates: memory up to 1.25 x the device's,
    step time from the fastest to 15 % past the slowest exact estimate (candidates beyond are counted in the
    legend)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    record = candidates or {}
    exact = record.get("exact") or []
    t = np.array([c.estimate.step_time_s for c in exact] + [p.estimate.step_time_s for p in plans])
    m = np.array([c.estimate.peak_mem_bytes for c in exact] + [p.estimate.peak_mem_bytes for p in plans], float)
    cap = plans[0].estimate.mem_capacity_bytes if plans else float(m.max(initial=1.0))
    xmax = max(1.25 * cap, 1.05 * m.max(initial=0.0)) / GIB
    ymin, ymax = (0.97 * t.min(), max(1.15 * t.max(), 1.2 * t.min())) if len(t) else (0.0, 1.0)
    quick = record.get("quick")
    if quick is not None and len(quick.step_time_s):
        inside = np.nonzero((quick.peak_mem_bytes <= xmax * GIB) & (quick.step_time_s <= ymax))[0]
        shown = inside[::max(1, len(inside) // MAX_GREY_POINTS)]
        ax.scatter(quick.peak_mem_bytes[shown] / GIB, quick.step_time_s[shown], s=3, c="0.75", linewidths=0,
                   rasterized=True, label=f"{len(quick.step_time_s):,} candidates, quick estimate "
                   f"({len(quick.step_time_s) - len(inside):,} beyond the axes)")
    if exact:
        te, me = t[:len(exact)], m[:len(exact)]
        ax.scatter(me / GIB, te, s=12, c="tab:blue", label=f"{len(exact)} fitting, exact estimate")
        front = pareto_front(te, me)
        ax.step(me[front] / GIB, te[front], where="post", c="tab:blue", lw=1, label="Pareto front")
    for p in plans:
        x, y = p.estimate.peak_mem_bytes / GIB, p.estimate.step_time_s
        ax.scatter([x], [y], s=30, c="tab:red", zorder=3)
        ax.annotate(f"#{p.rank}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8, color="tab:red")
    ax.axvline(cap / GIB, c="k", ls="--", lw=0.8, label="device memory")
    if plans:
        ax.set_title(f"{plans[0].model_name} on {plans[0].num_devices} x {plans[0].cluster_name}: step time vs memory "
                     f"(red: the ranked plans)", fontsize=10)
    ax.set_xlim(0, xmax)
    if len(t):
        ax.set_ylim(ymin, ymax)
    ax.set_xlabel("predicted peak memory per device (GiB)")
    ax.set_ylabel("predicted step time (s)")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(str(path))
