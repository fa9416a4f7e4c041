"""search/schedules.py: candidates equal but for the schedule are assembled once (surrogate.quick_estimate);
their figures must be bit for bit those of assembling each candidate on its own."""

from __future__ import annotations

import numpy as np
import pytest
from test_cost_graph_helper import a100_cluster, gpt_graph

from autoplan import cost
from autoplan.plan.engine import Engine
from autoplan.search import surrogate
from autoplan.search.space import SearchOptions, enumerate_space

GRAPH = gpt_graph(h=1024, a=16, layers=8, seq=1024, vocab=8192)
CLUSTER = a100_cluster(2, per_node=4)


@pytest.mark.parametrize("engine", ["autoplan", "deepspeed", "megatron-core"])
def test_shared_rows_give_each_schedule_its_own_figures(engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The space with schedules sharing their assembly against the same space with every row assembled on
    its own (the sharing switched off), and the sharing does happen (rows assembled: fewer than candidates)."""
    eng = cost.with_engine(Engine.load(engine))
    space = enumerate_space(GRAPH, CLUSTER, SearchOptions(global_batch=16))
    real, assembled = surrogate._unique_but_schedule, []

    def counted(cols):
        first, of = real(cols)
        assembled.append(len(first))
        return first, of

    monkeypatch.setattr(surrogate, "_unique_but_schedule", counted)
    shared = surrogate.quick_estimate(GRAPH, CLUSTER, space, 16, eng)
    assert sum(assembled) < 0.8 * len(space)
    monkeypatch.setattr(surrogate, "_unique_but_schedule", lambda cols: (np.arange(len(cols["tp"])), None))
    alone = surrogate.quick_estimate(GRAPH, CLUSTER, space, 16, eng)
    for name in ("step_time_s", "peak_mem_bytes", "act_mem_bytes"):
        assert getattr(shared, name).tobytes() == getattr(alone, name).tobytes(), name
