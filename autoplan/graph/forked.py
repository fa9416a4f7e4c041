"""A piece of work (a preset's capture) run in a child forked from a process that has not imported torch, its
result sent back pickled through a pipe.

A cold plan of a preset has to import torch (0.7-0.9 s here) and torch._dynamo (another 0.7-0.9 s, made by
torch.export) and trace; done in the planning process itself, the process then holds torch's heap while it
searches (its forked search workers and its garbage collections see it: the search of gpt3-175b took 1.3-1.4 s
after a capture against 1.1 s from the cache) and pays torch's teardown at exit. In a child the parent stays
as a warm plan's: `start` forks as soon as the command knows the model and sequence length, the parent loads
the cluster and imports the search while the child captures on the other core, and `Pending.result` hands
the graph over. The child leaves with os._exit (no interpreter teardown: it owns nothing the parent needs).

Used only where it is safe and pays: os.fork exists (and is not macOS's), torch is not imported yet (a caller holding torch gains
nothing from the child and captures in process), and the process runs a single thread (forking a threaded
process can leave a lock held in the child). Anything the work raises is raised again in the parent,
the same exception (or, when it cannot be pickled, its nearest built-in base with the same message); a child
that dies without a result gives None, and the caller captures in process. A child whose result was read
is reaped once its exit is over (`reap`: the parent does not wait the ~10 ms the kernel takes to unmap
torch); children never collected are killed and reaped by `discard` (also registered with atexit).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import pickle
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

_live: dict[int, Pending] = {}  # pid -> its Pending, until collected or discarded
_exiting: set[int] = set()  # children whose result was read, not yet reaped


class Pending:
    """A forked child's result, to be collected once: result() waits for it."""

    def __init__(self, pid: int, fd: int) -> None:
        self.pid, self._fd = pid, fd

    def result(self) -> Any:
        """The work's return value; raises what the work raised; None when the child died without a result."""
        _live.pop(self.pid, None)
        chunks = []
        with os.fdopen(self._fd, "rb") as pipe:
            while chunk := pipe.read(1 << 20):
                chunks.append(chunk)
        _exiting.add(self.pid)  # reaped later (reap, discard): its exit (unmapping torch) takes ~10 ms
        _reap(block=False)
        try:
            ok, value = pickle.loads(b"".join(chunks))
        except Exception:  # noqa: BLE001 - a torn or empty payload: the child died (killed, crashed)
            return None
        if not ok:
            raise value
        return value

    def cancel(self) -> None:
        """Kill the child (if still running) and reap it; its result is dropped."""
        if _live.pop(self.pid, None) is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        with contextlib.suppress(OSError):
            os.close(self._fd)


def can_fork() -> bool:
    """Whether `start` would fork here: os.fork exists and is safe (not macOS, whose system libraries may start
    threads: Python docs, multiprocessing, "the fork start method should be considered unsafe" there), torch
    is not imported, and only this thread runs."""
    return (hasattr(os, "fork") and sys.platform != "darwin" and "torch" not in sys.modules
            and threading.active_count() == 1)


def start(work: Callable[[], Any]) -> Pending | None:
    """work() in a forked child, or None where that is not safe or gains nothing (can_fork)."""
    return run_in_child(work) if can_fork() else None


def run_in_child(work: Callable[[], Any]) -> Pending:
    """work() in a forked child, whatever this process holds (where os.fork exists)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read)
        _run_child(work, write)
    os.close(write)
    pending = Pending(pid, read)
    _live[pid] = pending
    return pending


def _run_child(work: Callable[[], Any], fd: int) -> None:
    gc.disable()  # a short life ended by os._exit: nothing to collect for
    try:
        payload = (True, work())
    except BaseException as exc:  # noqa: BLE001 - handed to the parent, which raises it
        payload = (False, _portable(exc))
    try:
        data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - an unpicklable result: say so in the parent
        data = pickle.dumps((False, RuntimeError(f"the capture's result could not be sent back: {exc}")))
    try:
        with os.fdopen(fd, "wb") as pipe:
            pipe.write(data)
    finally:
        os._exit(0)  # no interpreter teardown (torch's, dynamo's): the parent owns every resource


def _portable(exc: BaseException) -> BaseException:
    """`exc` itself when it survives a pickle round trip (the parent must import its class to read it), else
    its nearest built-in base class with the same message."""
    try:
        pickle.loads(pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL))
        return exc.with_traceback(None)
    except Exception:  # noqa: BLE001 - any failure to round-trip
        base = next(c for c in type(exc).__mro__ if c.__module__ == "builtins")
        return base(str(exc))


def discard() -> None:
    """Kill and reap every child whose result was never collected, and reap those whose result was."""
    for pending in list(_live.values()):
        pending.cancel()
    reap()


def reap() -> None:
    """Wait for the children whose result was read (gone by now, as a rule): no zombie stays behind."""
    _reap(block=True)


def _reap(*, block: bool) -> None:
    """Wait for the children in _exiting (those gone already, when not `block`)."""
    for pid in list(_exiting):
        try:
            done, _ = os.waitpid(pid, 0 if block else os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere (a caller's own os.wait)
            done = pid
        if done:
            _exiting.discard(pid)


atexit.register(discard)
