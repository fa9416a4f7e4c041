"""Per-rank action timestamps of the pipeline schedule, for `autoplan timeline --report`: each local
PipelineStage's forward_one_chunk (F), backward_one_chunk (B, or I when it computes only the input
gradient under zero bubble) and backward_weight_one_chunk (W) is wrapped on the instance (nothing
process-wide) to record (kind, stage, microbatch, start, end) with time.perf_counter, which on Linux is
CLOCK_MONOTONIC: one clock for every process on a machine, so the ranks' records line up."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any


class ActionTrace:
    """Records of the current step: (step, kind, stage, microbatch, start_s, end_s)."""

    def __init__(self) -> None:
        self.records: list[tuple[int, str, int, int, float, float]] = []
        self.step = -1

    def _timed(self, fn: Callable[..., Any], stage: int, kind: Callable[..., str]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(chunk: int, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = fn(chunk, *args, **kwargs)
            self.records.append((self.step, kind(*args, **kwargs), stage, int(chunk), start, time.perf_counter()))
            return out

        return wrapper

    def instrument(self, schedule: Any) -> None:
        """Wrap the schedule's local stages and its step (which starts a new step's records)."""
        stages: Sequence[Any] = getattr(schedule, "_stages", None) or [schedule._stage]
        for stage in stages:
            index = stage.stage_index
            stage.forward_one_chunk = self._timed(stage.forward_one_chunk, index, lambda *a, **k: "F")
            stage.backward_one_chunk = self._timed(stage.backward_one_chunk, index, _backward_kind)
            stage.backward_weight_one_chunk = self._timed(stage.backward_weight_one_chunk, index,
                                                          lambda *a, **k: "W")
        step = schedule.step

        @functools.wraps(step)
        def stepped(*args: Any, **kwargs: Any) -> Any:
            self.step += 1
            return step(*args, **kwargs)

        schedule.step = stepped

    def last_step(self) -> list[list[Any]]:
        """The records of the last step, as JSON-ready lists [kind, stage, microbatch, start_s, end_s]."""
        return [[k, s, j, t0, t1] for step, k, s, j, t0, t1 in self.records if step == self.step]


def _backward_kind(loss: Any = None, full_backward: bool = True, last_backward: bool = False) -> str:
    return "B" if full_backward else "I"


def timeline_report(per_rank: Sequence[Sequence[Sequence[Any]]]) -> dict[str, Any]:
    """The run report's "timeline": every global rank's last-step actions [kind, stage, microbatch,
    start_s, end_s], times from the earliest start on any rank."""
    starts = [a[3] for actions in per_rank for a in actions]
    t0 = min(starts, default=0.0)
    return {"clock": "time.perf_counter (CLOCK_MONOTONIC), from the step's first action on any rank",
            "ranks": {str(r): [[k, s, j, a - t0, b - t0] for k, s, j, a, b in actions]
                      for r, actions in enumerate(per_rank)}}
