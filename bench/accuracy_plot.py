"""bench/accuracy.py's picture: the rows its table summarises, as one PNG of two panels.

Left: predicted against measured step time, one point per row, log-log, one colour and marker per set,
with the y = x line and a +-8 % band (issue 8's aim for the published runs kept outside the repo: median
|error| at most 8 % and no source's median signed error beyond +-8 %). Right: each set's signed errors
as a strip over a box (one column per set, the points of a column sorted left to right), its median
marked and written, with a zero line and +-5 % / +-8 % lines.

`plot_series` turns the bench's Result objects into what is drawn (no matplotlib); `write_png` draws it
and imports matplotlib (object API, Agg canvas) only when called. The PNG carries no software or date
metadata, so the same rows give the same bytes.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TITLE = "python bench/accuracy.py --plot: predicted vs measured step time, every row the table summarises"
BAND = 0.08  # issue 8's aim on the hidden set of published runs (median |error| <= 8 %, each source's median)
LINES = (-0.08, -0.05, 0.05, 0.08)  # reference lines of the right panel
MARKERS = "osD^vP*Xph<>8"
# tab10, then tab20b's darkest blue and olive, then tab20's light half: distinct for up to 20 sets
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf", "#393b79", "#637939", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896",
           "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d")


@dataclass(frozen=True)
class SetSeries:
    """One set as drawn: its rows' (measured, predicted) step times in the bench's order, its signed
    errors (predicted / measured - 1) sorted, their median, and whether the set is a target."""

    name: str
    target: bool
    points: tuple[tuple[float, float], ...]
    errors: tuple[float, ...]
    median: float

    @property
    def count(self) -> int:
        return len(self.points)


def plot_series(results: Iterable[Any], targets: Sequence[str]) -> list[SetSeries]:
    """The sets of `results` (bench Result objects: .set, .measured_s, .predicted_s, .error), targets
    first then checks, each group by median signed error (most under-predicted first, ties by name)."""
    by_set: dict[str, list[Any]] = defaultdict(list)
    for r in results:
        by_set[r.set].append(r)
    series = [SetSeries(name=name, target=name in targets,
                        points=tuple((r.measured_s, r.predicted_s) for r in rows),
                        errors=tuple(sorted(r.error for r in rows)),
                        median=statistics.median(r.error for r in rows)) for name, rows in by_set.items()]
    return sorted(series, key=lambda s: (not s.target, s.median, s.name))


def strip_x(i: int, n: int, width: float = 0.6) -> list[float]:
    """x of the n sorted points of column i: spread evenly across `width`, lowest error leftmost."""
    if n == 1:
        return [float(i)]
    return [i - width / 2 + width * k / (n - 1) for k in range(n)]


def tick_label(s: SetSeries) -> str:
    return f"{s.name}\n{s.count} rows, median {100 * s.median:+.1f} %"


def _point_style(n: int) -> dict[str, float]:
    """Large sets small and translucent (vTrain single-node's 1,440 rows), so the others show through."""
    if n > 200:
        return {"s": 5.0, "alpha": 0.3, "zorder": 2.0}
    if n > 50:
        return {"s": 12.0, "alpha": 0.6, "zorder": 2.5}
    return {"s": 30.0, "alpha": 0.9, "zorder": 3.0}


def _scatter_panel(ax: Any, series: list[SetSeries]) -> None:
    every = [v for s in series for p in s.points for v in p]
    lo, hi = min(every) / 1.5, max(every) * 1.5
    ax.fill_between([lo, hi], [lo * (1 - BAND), hi * (1 - BAND)], [lo * (1 + BAND), hi * (1 + BAND)],
                    color="0.6", alpha=0.3, lw=0, label="+-8 %: issue 8's aim on the hidden set")
    ax.plot([lo, hi], [lo, hi], color="black", lw=0.8, label="predicted = measured")
    for i, s in enumerate(series):
        ax.scatter([m for m, _ in s.points], [p for _, p in s.points], marker=MARKERS[i % len(MARKERS)],
                   color=COLOURS[i % len(COLOURS)], linewidths=0, label=f"{s.name} ({s.count})",
                   **_point_style(s.count))
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), aspect="equal",
           xlabel="measured step time, s", ylabel="predicted step time, s")
    ax.set_title("predicted vs measured step time, one point per row", fontsize=9.5)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="lower right", fontsize=7.5, markerscale=1.0, framealpha=0.9)


def _strip_column(ax: Any, i: int, s: SetSeries) -> None:
    colour = COLOURS[i % len(COLOURS)]
    errors = [100 * e for e in s.errors]
    ax.boxplot([errors], positions=[i], widths=0.7, whis=(5, 95), showfliers=False, patch_artist=True,
               boxprops={"facecolor": colour, "alpha": 0.18, "lw": 0.8}, medianprops={"color": "none"},
               whiskerprops={"lw": 0.8}, capprops={"lw": 0.8})
    ax.scatter(strip_x(i, s.count), errors, marker=MARKERS[i % len(MARKERS)], color=colour, linewidths=0,
               **_point_style(s.count))
    ax.plot([i - 0.38, i + 0.38], [100 * s.median] * 2, color="black", lw=2, zorder=4)


def _line_label(level: float) -> str | None:
    """One legend entry per pair of reference lines (the upper one's)."""
    if level < 0:
        return None
    return "+-8 %: issue 8's aim for each source's median" if level == BAND else "+-5 %"


def _strip_panel(ax: Any, series: list[SetSeries]) -> None:
    ax.axhline(0, color="black", lw=0.8)
    for level in LINES:
        ax.axhline(100 * level, color="0.35", lw=0.8, ls="--" if abs(level) == BAND else ":",
                   label=_line_label(level))
    for i, s in enumerate(series):
        _strip_column(ax, i, s)
    targets = sum(s.target for s in series)
    if 0 < targets < len(series):
        ax.axvline(targets - 0.5, color="0.5", lw=0.8)
        top = ax.get_xaxis_transform()
        ax.text(targets - 0.6, 0.98, "targets", transform=top, ha="right", va="top", fontsize=9, color="0.3")
        ax.text(targets - 0.4, 0.98, "checks (never fitted)", transform=top, va="top", fontsize=9, color="0.3")
    ax.set_xticks(range(len(series)), [tick_label(s) for s in series], rotation=40, ha="right",
                  rotation_mode="anchor", fontsize=8)
    ax.set(xlim=(-0.7, len(series) - 0.2), ylabel="signed error, % (predicted / measured - 1)")
    ax.set_title("signed error per set, one point per row (sorted within its column)", fontsize=9.5)
    ax.plot([], [], color="black", lw=2, label="median of the set (and in its label)")
    ax.fill_between([], [], color="0.6", alpha=0.3, label="box 25-75 %, whiskers 5-95 %")
    ax.legend(loc="lower right", fontsize=7.5, framealpha=0.9)
    ax.grid(True, axis="y", alpha=0.3)


def write_png(series: list[SetSeries], path: str | Path) -> None:
    """Draw the two panels (1400 x 700 px) and write a PNG without software or date metadata."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 7), dpi=100)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.7]})
    _scatter_panel(left, series)
    _strip_panel(right, series)
    rows = sum(s.count for s in series)
    fig.suptitle(f"{TITLE} ({rows} rows, {len(series)} sets)", fontsize=12)
    fig.text(0.5, 0.01, "error = predicted / measured - 1, negative: predicted too fast. Targets: vTrain, the "
             "SC'21 calibration rows, Korthikanti's per-layer times; checks: bench/data/published at their "
             "recorded settings (alternatives not drawn).", ha="center", fontsize=8.5, color="0.25")
    fig.tight_layout(rect=(0, 0.03, 1, 0.97))
    fig.savefig(path, format="png", metadata={"Software": None})
