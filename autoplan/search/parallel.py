"""Independent pieces of the search spread over the cores this process may use.

`run_parts(fn, parts)` returns [fn(p) for p in parts], in order: parts after the first run in forked children
(graph.forked.run_in_child: they inherit the parent's imports and data, so nothing but the results crosses a
pipe) while the parent runs the first. The pieces are fixed by the caller, never by the core count, so the results are the same
whatever the machine and its load; with one usable core (or when forking is unavailable) they run in turn.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from autoplan.graph import forked

T = TypeVar("T")
R = TypeVar("R")


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and taskset restrict)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


def run_parts(fn: Callable[[T], R], parts: Sequence[T]) -> list[R]:
    """[fn(p) for p in parts], the later parts in forked children when more than one core is usable."""
    workers = min(usable_cores(), len(parts))
    if workers < 2 or not hasattr(os, "fork"):
        return [fn(p) for p in parts]
    out: list[Any] = [None] * len(parts)
    for start in range(0, len(parts), workers):  # rounds of `workers` parts: the parent takes the first
        batch = list(range(start, min(start + workers, len(parts))))
        children = [(i, forked.run_in_child(lambda part=parts[i]: (fn(part),))) for i in batch[1:]]
        try:
            out[batch[0]] = fn(parts[batch[0]])
        finally:  # every child collected (its exception raised here), also when the parent's own part raised
            results = [(i, _collect(child)) for i, child in children]
        for i, (ok, got) in results:
            if not ok:
                raise got
            if got is None:
                raise RuntimeError("a search worker died without a result")
            out[i] = got[0]
    return out


def _collect(child: forked.Pending) -> tuple[bool, Any]:
    """(True, the child's result: its return value in a 1-tuple, None if it died) or (False, what it raised),
    so that every child of a round is collected before any exception goes on."""
    try:
        return True, child.result()
    except BaseException as exc:  # noqa: BLE001 - raised by the caller once all are collected
        return False, exc
