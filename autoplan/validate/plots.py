"""The validation's pictures (matplotlib, Agg backend, PNG): predicted against measured step time, and a
pipeline timeline (one row per pipeline rank, a box per action)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# action kind -> (colour, legend label); the simulation (cost.timeline) and the executor's trace
# (execute.trace) use these kinds
KIND_STYLE = {
    "F": ("#4C72B0", "forward"),
    "B": ("#DD8452", "backward"),
    "I": ("#DD8452", "backward (input grad)"),
    "W": ("#55A868", "weight gradient"),
    "C": ("#8172B3", "communication"),
    "T": ("#937860", "step tail (grad sync, optimizer)"),
}
BUBBLE_COLOUR = "#EEEEEE"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def scatter(entries: Sequence[Mapping[str, Any]], path: str, *, title: str) -> None:
    """Predicted (x) against measured (y) step time, log-log, with the y = x line and +-25 % band;
    the points numbered in the order of `entries`, with a key of their plans."""
    plt = _pyplot()
    ok = [e for e in entries if e.get("measured_step_time_s")]
    xs = [e["predicted_step_time_s"] for e in ok]
    ys = [e["measured_step_time_s"] for e in ok]
    fig, ax = plt.subplots(figsize=(8, 6.5))
    lo, hi = min(xs + ys) / 1.3, max(xs + ys) * 1.3
    ax.plot([lo, hi], [lo, hi], color="black", lw=1, label="measured = predicted")
    ax.fill_between([lo, hi], [lo / 1.25, hi / 1.25], [lo * 1.25, hi * 1.25], color="grey", alpha=0.15,
                    label="within 25 %")
    ax.scatter(xs, ys, color="#4C72B0", zorder=3)
    for i, (x, y) in enumerate(zip(xs, ys), 1):  # numbered points, the plans listed in a key
        ax.annotate(str(i), (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
    key = "\n".join(f"{i:>2}  {e.get('label', '')}" for i, e in enumerate(ok, 1))
    ax.text(0.98, 0.02, key, transform=ax.transAxes, fontsize=7, family="monospace", ha="right", va="bottom",
            multialignment="left",
            bbox={"facecolor": "white", "edgecolor": "#cccccc", "alpha": 0.9})
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="predicted step time (s)",
           ylabel="measured step time (s)", title=title)
    ax.legend(loc="upper left", fontsize=8)
    from matplotlib.ticker import FuncFormatter

    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else ""))
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


Row = list[tuple[str, float, float, str]]  # (kind, start_s, end_s, label) boxes of one rank


def timeline(panels: Sequence[tuple[str, Mapping[int, Row]]], path: str) -> None:
    """One panel per (title, {pipeline rank: boxes}), ranks top to bottom, times in ms on a shared
    axis; what no box covers is idle (bubble, or waiting on a peer)."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    span = max((end for _, rows in panels for boxes in rows.values() for _, _, end, _ in boxes), default=1.0)
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 1.2 + 0.55 * sum(len(r) for _, r in panels)),
                             squeeze=False)
    used: set[str] = set()
    for ax, (title, rows) in zip(axes[:, 0], panels):
        ranks = sorted(rows)
        for y, rank in enumerate(ranks):
            ax.broken_barh([(0, span * 1e3)], (y - 0.4, 0.8), color=BUBBLE_COLOUR)
            for kind, start, end, label in rows[rank]:
                used.add(kind)
                ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (y - 0.4, 0.8),
                               facecolor=KIND_STYLE[kind][0], edgecolor="white", linewidth=0.5)
                if label and (end - start) > span / 60:
                    ax.text((start + end) / 2 * 1e3, y, label, ha="center", va="center", fontsize=6, color="white")
        ax.set_yticks(range(len(ranks)), [f"pp rank {r}" for r in ranks])
        ax.invert_yaxis()
        ax.set_xlim(0, span * 1e3)
        ax.set_title(title, fontsize=10)
    axes[-1, 0].set_xlabel("time in the step (ms)")
    handles = [Patch(color=KIND_STYLE[k][0], label=KIND_STYLE[k][1]) for k in KIND_STYLE if k in used]
    handles.append(Patch(color=BUBBLE_COLOUR, label="idle (bubble / waiting)"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
