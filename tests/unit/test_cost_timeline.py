"""cost.timeline: the per-action simulation of a pipeline schedule. Its makespan for uniform stages is
the closed form of cost.pipeline (GPipe, 1F1B, interleaved, ZB-H1), its per-rank orders are the ones
torch.distributed.pipelining builds, and a two-rank case with sends is timed by hand."""

from __future__ import annotations

import itertools
import math

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from autoplan.cost.pipeline import pipeline_time_s
from autoplan.cost.timeline import (
    StageTimes,
    makespan,
    rank_orders,
    shared_cores_makespan,
    shared_cores_pipeline_time_s,
    simulate,
)
from autoplan.plan.types import ParallelConfig

F, B, W = 1.0, 2.0, 0.7


def _uniform(n: int, v: int, hop: float = 0.0) -> StageTimes:
    return StageTimes(fwd_s=(F / v,) * n, bwd_s=(B / v,) * n, weight_s=(W / v,) * n, hop_s=(hop,) * n)


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4),
                                        ("zb", 1)])
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_uniform_makespan_is_the_closed_form(schedule: str, v: int, p: int, rounds: int) -> None:
    config = ParallelConfig(pp=p, schedule=schedule, virtual_stages=v)
    m, n = rounds * p, p * v
    actions = simulate(config, m, _uniform(n, v))
    expected = pipeline_time_s(schedule, p, v, m, [F / v] * n, [B / v] * n, [W / v] * n)
    assert math.isclose(makespan(actions), expected, rel_tol=1e-12)
    # independent: GPipe / 1F1B is (m + p - 1)(F + B) (Narayanan et al. 2021)
    if schedule in ("gpipe", "1f1b"):
        assert math.isclose(makespan(actions), (m + p - 1) * (F + B), rel_tol=1e-12)


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1), ("zb", 2)])
def test_every_action_runs_once_after_its_inputs(schedule: str, v: int) -> None:
    p, m = 4, 8
    config = ParallelConfig(pp=p, schedule=schedule, virtual_stages=v)
    actions = [a for a in simulate(config, m, _uniform(p * v, v, hop=0.1)) if a.kind != "C"]
    seen = {(a.kind, a.stage, a.microbatch): a for a in actions}
    assert len(seen) == len(actions)
    backward = "I" if schedule == "zb" else "B"
    for s in range(p * v):
        for j in range(m):
            f, b = seen[("F", s, j)], seen[(backward, s, j)]
            assert b.start_s >= f.end_s
            if s > 0:
                assert f.start_s >= seen[("F", s - 1, j)].end_s
            if schedule == "zb":
                assert seen[("W", s, j)].start_s >= b.end_s
    for r in range(p):  # a rank runs one action at a time
        mine = sorted((a for a in actions if a.rank == r), key=lambda a: a.start_s)
        assert all(x.end_s <= y.start_s + 1e-12 for x, y in itertools.pairwise(mine))


def test_two_ranks_with_sends_by_hand() -> None:
    # 1F1B, p=2, m=1, sends of h: F0 [0,1] + send [1,1+h]; F1 [1+h, 2+h]; B1 [2+h, 4+h] + send;
    # B0 [4+2h, 6+2h]
    h = 0.25
    actions = simulate(ParallelConfig(pp=2, schedule="1f1b"), 1,
                       StageTimes(fwd_s=(1.0, 1.0), bwd_s=(2.0, 2.0), weight_s=(0.0, 0.0), hop_s=(h, 0.0)))
    assert math.isclose(makespan(actions), 6 + 2 * h)
    sends = sorted((a.rank, a.start_s, a.end_s) for a in actions if a.kind == "C")
    assert sends == [(0, 1.0, 1.0 + h), (1, 4.0 + h, 4.0 + 2 * h)]


_KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def _torch_order(cls: type, p: int, v: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """The rank's actions as torch builds them (its own order functions, without stages or a group)."""
    schedule = cls.__new__(cls)
    schedule.pp_group_size, schedule._n_microbatches, schedule.n_local_stages = p, m, v
    schedule.num_stages = p * v
    schedule.number_of_rounds = max(1, m // p)
    schedule.microbatches_per_round = m // schedule.number_of_rounds
    ops = schedule._calculate_single_rank_operations(rank)
    return [(_KINDS[a.computation_type.name], a.stage_index, a.microbatch_index) for a in ops if a is not None]


@pytest.mark.parametrize("cls,schedule,v", [
    (torch_schedules.ScheduleInterleaved1F1B, "interleaved", 2),
    (torch_schedules.ScheduleInterleaved1F1B, "interleaved", 3),
    (torch_schedules.ScheduleInterleavedZeroBubble, "zb", 1),
    (torch_schedules.ScheduleZBVZeroBubble, "zb", 2),
])
def test_orders_are_torchs(cls: type, schedule: str, v: int) -> None:
    for p in (2, 4):
        for m in (1, 2, p, 2 * p, 3 * p):
            if m % max(1, m // p):
                continue  # torch refuses these
            orders = rank_orders(ParallelConfig(pp=p, schedule=schedule, virtual_stages=v), m)
            for r in range(p):
                assert orders[r] == _torch_order(cls, p, v, m, r), (p, m, r)


def test_wrong_stage_count_is_refused() -> None:
    with pytest.raises(ValueError, match="one per stage"):
        simulate(ParallelConfig(pp=2), 2, _uniform(3, 1))


def test_shared_cores_by_hand() -> None:
    # 8 ranks on 2 cores, pp4 with m=1: the two pipelines (dp2) each run one action at a time, so each
    # running rank gets a whole core: the all-busy times (share 1/4) run 4x faster, T = 4 (F + B) / 4
    config = ParallelConfig(pp=4, dp=2)
    t = _uniform(4, 1)
    assert math.isclose(shared_cores_makespan(config, 1, t, cores=2, ranks=8), 4 * (F + B) / 4)
    # as many cores as ranks: nothing is shared, the plain simulation
    for m in (1, 4, 8):
        assert math.isclose(shared_cores_makespan(config, m, t, cores=8, ranks=8), makespan(simulate(config, m, t)))


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 2)])
def test_shared_cores_between_the_work_bound_and_the_unshared_schedule(schedule: str, v: int) -> None:
    config = ParallelConfig(pp=4, schedule=schedule, virtual_stages=v)
    t = _uniform(4 * v, v)
    for m in (4, 8):
        shared = shared_cores_makespan(config, m, t, cores=2, ranks=4)
        # every rank's m (F + B) at the all-busy share must run; the bubble can only get cheaper
        assert m * (F + B) - 1e-9 <= shared <= makespan(simulate(config, m, t)) + 1e-9
        assert math.isclose(shared_cores_pipeline_time_s(config, m, [F] * 4, [B] * 4, [W] * 4, cores=2, ranks=4),
                            max(shared, m * (F + B)))
