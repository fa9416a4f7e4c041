"""The pipeline schedules' microbatch rules (plan.layout.schedule_errors) against torch's own schedule
constructors, and the search enumerating only configurations whose schedule the executor can build."""

from __future__ import annotations

import itertools

import pytest
import torch.distributed.pipelining.schedules as torch_schedules
from test_cost_graph_helper import a100_cluster, gpt_graph

from autoplan.plan.layout import schedule_errors, split_by_counts
from autoplan.plan.types import ParallelConfig
from autoplan.search.space import SCHEDULES, SearchOptions, enumerate_space

CASES = [(s, v) for s in ("gpipe", "1f1b") for v in (1,)] + [("interleaved", 2), ("zb", 1), ("zb", 2)]


class _FakeStage:
    """Just what the schedule constructors read before they build their action lists."""

    def __init__(self, index: int, num_stages: int, pp: int, rank: int) -> None:
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, num_stages, pp, rank
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.submod = None
        self.stage_index_to_group_rank = {}
        self.has_backward = True
        self.dw_builder = None


def _torch_accepts(schedule: str, v: int, pp: int, m: int) -> bool:
    """Whether torch's schedule class accepts m microbatches for pp ranks (rank 0's stages)."""
    from autoplan.execute.pipeline import _schedule_class

    config = ParallelConfig(pp=pp, schedule=schedule, virtual_stages=v)
    cls = _schedule_class(config)
    n = pp * v
    indices = [0] if v == 1 and cls in (torch_schedules.ScheduleGPipe, torch_schedules.Schedule1F1B) else \
        ([0, 2 * pp - 1] if schedule == "zb" and v == 2 else list(range(0, n, pp)))
    stages = [_FakeStage(i, n, pp, 0) for i in indices]
    try:
        if issubclass(cls, torch_schedules.PipelineScheduleSingle):
            cls(stages[0], n_microbatches=m)
        else:
            cls(stages, n_microbatches=m)
    except ValueError:
        return False
    except Exception:  # noqa: BLE001 - a failure past the microbatch checks: the fake stage is too thin
        return True
    return True


@pytest.mark.parametrize(("schedule", "v"), CASES)
def test_schedule_errors_match_torch(schedule: str, v: int) -> None:
    for pp, m in itertools.product((2, 3, 4), range(1, 13)):
        config = ParallelConfig(pp=pp, schedule=schedule, virtual_stages=v)
        assert (not schedule_errors(config, m)) == _torch_accepts(schedule, v, pp, m), (schedule, v, pp, m)


def test_search_space_holds_only_runnable_schedules() -> None:
    graph = gpt_graph(h=256, a=4, layers=8, seq=64)
    space = enumerate_space(graph, a100_cluster(per_node=8), SearchOptions(global_batch=12))
    assert len(space)
    for i in range(len(space)):
        config = space.config(i)
        m = config.num_microbatches(12)
        assert not schedule_errors(config, m), (config, m)
    # and 1F1B with fewer microbatches than stages was a candidate before the rule: pp 4, m 3 is excluded
    c = space.columns
    one_f = SCHEDULES.index(ParallelConfig(schedule="1f1b").schedule)
    rows = (c["pp"] == 4) & (c["schedule"] == one_f)
    assert all(12 // (c["dp"][rows] * c["ep"][rows] * c["microbatch"][rows]) >= 4)


def test_split_by_counts_with_stages_that_hold_no_block() -> None:
    """Llama 3's layout: the embedding alone in the first stage, the head alone in the last (counts 0 at both
    ends), the blocks between; by hand for emb, b0..b3, norm, head."""
    names = ["emb", "b0", "b1", "b2", "b3", "norm", "head"]
    flags = [n.startswith("b") for n in names]
    assert split_by_counts(names, flags, [0, 3, 1, 0]) == (("emb",), ("b0", "b1", "b2"), ("b3",), ("norm", "head"))
    assert split_by_counts(names, flags, [2, 2]) == (("emb", "b0", "b1"), ("b2", "b3", "norm", "head"))
