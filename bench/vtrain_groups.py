"""Where the vTrain error sits: the signed error of the rows grouped by one configuration quantity at a time,
and how much of the MAPE the rows past a threshold carry. Pure functions of (error, row) pairs, rows as read
from bench/data/vtrain (validate_vtrain.read_rows); used by `python bench/validate_vtrain.py --groups`.

Every vTrain row runs full recompute (bench/data/vtrain/README.md), so recompute is not a grouping.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence

GPUS_PER_NODE = 8  # vTrain's validation configs: node_size 8

Row = dict[str, float]


def _microbatches(row: Row) -> float:
    """Micro-batches per data-parallel replica and step: global batch / (d x micro batch), at least one."""
    return max(row["global batch"] // (row["data parallelism"] * row["micro batch"]), 1.0)


GROUPINGS: dict[str, Callable[[Row], float]] = {
    "params(B)": lambda r: r.get("Parameters (billion)", 0.0),
    "h": lambda r: r["hidden size"],
    "t": lambda r: r["tensor parallelism"],
    "p": lambda r: r["pipeline parallelism"],
    "d": lambda r: r["data parallelism"],
    "mb": lambda r: r["micro batch"],
    "nodes": lambda r: max(r["# GPUs"] // GPUS_PER_NODE, 1.0),
    "microbatches": _microbatches,
}


def group_errors(pairs: Sequence[tuple[float, Row]],
                 key: Callable[[Row], float]) -> list[tuple[float, int, float, float]]:
    """(value, rows, median signed error, that group's share of the whole MAPE) per value of key(row), by
    value. The shares add up to 1: a group's share is its sum of |error| over the sum over every row."""
    total = sum(abs(e) for e, _ in pairs)
    groups: dict[float, list[float]] = defaultdict(list)
    for err, row in pairs:
        groups[key(row)].append(err)
    return [(value, len(errs), statistics.median(errs), sum(abs(e) for e in errs) / total if total else 0.0)
            for value, errs in sorted(groups.items())]


def share_beyond(pairs: Sequence[tuple[float, Row]], threshold: float) -> tuple[int, float, float]:
    """(rows with |error| > threshold, their share of the sum of |error|, the MAPE the other rows leave)."""
    total = sum(abs(e) for e, _ in pairs)
    big = [abs(e) for e, _ in pairs if abs(e) > threshold]
    rest = total - sum(big)
    return len(big), (sum(big) / total if total else 0.0), (rest / len(pairs) if pairs else 0.0)


def print_groups(errors: Sequence[tuple[float, float, float, Row]], threshold: float = 0.10) -> None:
    """Print group_errors for every grouping with more than one value, then share_beyond(threshold)."""
    pairs = [(e[0], e[3]) for e in errors]
    for name, key in GROUPINGS.items():
        groups = group_errors(pairs, key)
        if len(groups) < 2:
            continue
        cells = "  ".join(f"{value:g}: {100 * med:+.1f} % ({n}, {100 * share:.0f} %)"
                          for value, n, med, share in groups)
        print(f"   by {name:12s} {cells}")
    count, share, rest = share_beyond(pairs, threshold)
    print(f"   {count} rows past |e| {100 * threshold:.0f} % carry {100 * share:.0f} % of the MAPE; "
          f"the other rows alone would give {100 * rest:.1f} %  (value: median signed (rows, share of MAPE))")
