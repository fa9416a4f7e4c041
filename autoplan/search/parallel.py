"""Independent pieces of the search spread over the cores this process may use.

`run_parts(fn, parts)` returns [fn(p) for p in parts], in order: parts after the first run in forked children
(which inherit the parent's imports and data, so nothing but the results crosses a pipe) while the parent
runs the first. The pieces are fixed by the caller, never by the core count, so the results are the same
whatever the machine and its load; with one usable core (or when forking is unavailable) they run in turn.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and taskset restrict)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


def _child(conn: Any, fn: Callable[[Any], Any], part: Any) -> None:
    try:
        payload = (True, fn(part))
    except BaseException as exc:  # noqa: BLE001 - handed to the parent, which raises it
        payload = (False, exc)
    try:
        conn.send_bytes(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))
    finally:
        conn.close()
        os._exit(0)  # no interpreter teardown in the fork: the parent owns every resource


def run_parts(fn: Callable[[T], R], parts: Sequence[T]) -> list[R]:
    """[fn(p) for p in parts], the later parts in forked children when more than one core is usable."""
    workers = min(usable_cores(), len(parts))
    if workers < 2 or "fork" not in multiprocessing.get_all_start_methods():
        return [fn(p) for p in parts]
    ctx = multiprocessing.get_context("fork")
    out: list[Any] = [None] * len(parts)
    for start in range(0, len(parts), workers):  # rounds of `workers` parts: the parent takes the first
        batch = list(range(start, min(start + workers, len(parts))))
        children = []
        for i in batch[1:]:
            receive, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(send, fn, parts[i]), daemon=True)
            proc.start()
            send.close()
            children.append((i, proc, receive))
        try:
            out[batch[0]] = fn(parts[batch[0]])
        finally:
            results = [(i, _receive(proc, receive)) for i, proc, receive in children]
        for i, (ok, value) in results:
            if not ok:
                raise value
            out[i] = value
    return out


def _receive(proc: Any, receive: Any) -> tuple[bool, Any]:
    try:
        payload = pickle.loads(receive.recv_bytes())
    except EOFError:
        payload = (False, RuntimeError("a search worker died without a result"))
    proc.join()
    return payload
