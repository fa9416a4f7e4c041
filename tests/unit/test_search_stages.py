"""The stage problem: the DP and the ILP against brute force on tiny random inputs, and known answers."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoplan.search.balance import solve_balanced
from autoplan.search.ilp import solve_ilp
from autoplan.search.stages import StageProblem, brute_force, evaluate, fits, solve_dp


@st.composite
def problems(draw, max_blocks: int = 4, virtual: bool = False):
    num_runs = draw(st.integers(1, 2))
    run_sizes = tuple(draw(st.integers(1, 3)) for _ in range(num_runs))
    if sum(run_sizes) > max_blocks:
        run_sizes = (max_blocks,)
    n = sum(run_sizes)
    v = draw(st.integers(1, 2)) if virtual and n >= 2 else 1
    ranks = draw(st.integers(1, max(1, min(3, n // v))))
    opts = draw(st.integers(1, 3))
    times = tuple(tuple(draw(st.floats(0.1, 5.0)) for _ in range(opts)) for _ in run_sizes)
    acts = tuple(tuple(draw(st.floats(0.0, 4.0)) for _ in range(opts)) for _ in run_sizes)
    statics = tuple(draw(st.floats(0.0, 3.0)) for _ in run_sizes)
    inflight = tuple(float(draw(st.integers(1, 3))) for _ in range(ranks))
    return StageProblem(
        run_sizes=run_sizes, time_s=times, static_bytes=statics, act_bytes=acts, num_ranks=ranks,
        virtual_stages=v, inflight=inflight, mem_limit_bytes=draw(st.floats(2.0, 30.0)),
        first_time_s=draw(st.floats(0.0, 3.0)), first_static_bytes=draw(st.floats(0.0, 2.0)),
        last_time_s=draw(st.floats(0.0, 3.0)), last_static_bytes=draw(st.floats(0.0, 2.0)),
        last_act_bytes=draw(st.floats(0.0, 1.0)),
    )


@settings(max_examples=30, deadline=None)
@given(problems())
def test_dp_matches_brute_force(problem: StageProblem) -> None:
    ref = brute_force(problem)
    got = solve_dp(problem)
    if ref is None:
        assert got is None
    else:
        assert got is not None and fits(problem, got)
        assert got.time_s == pytest.approx(ref.time_s, rel=1e-9, abs=1e-12)


@settings(max_examples=30, deadline=None)
@given(problems(virtual=True))
def test_ilp_matches_brute_force(problem: StageProblem) -> None:
    ref = brute_force(problem)
    got = solve_ilp(problem)
    if ref is None:
        assert got is None
    else:
        assert got is not None and fits(problem, got)
        assert got.time_s == pytest.approx(ref.time_s, rel=1e-4, abs=1e-9)  # the chunk-balance tie-break


def _uniform(n: int, ranks: int, **kw) -> StageProblem:
    return StageProblem(run_sizes=(n,), time_s=((1.0, 1.5),), static_bytes=(1.0,), act_bytes=((2.0, 0.5),),
                        num_ranks=ranks, **kw)


def test_known_answer_even_split_when_memory_is_ample() -> None:
    # 8 identical blocks over 4 ranks, no pinned layers: 2 blocks each, no recompute: time 2.0
    sol = solve_ilp(_uniform(8, 4))
    assert sol is not None and sol.stage_sizes() == (2, 2, 2, 2) and sol.time_s == pytest.approx(2.0)


def test_known_answer_heavy_head_gets_fewer_blocks() -> None:
    # the last stage carries a head costing 2 blocks: 10 blocks over 3 ranks -> (4, 4, 2), time 4
    sol = solve_ilp(_uniform(10, 3, last_time_s=2.0))
    assert sol is not None and sol.stage_sizes() == (4, 4, 2) and sol.time_s == pytest.approx(4.0)


def test_known_answer_tight_memory_recomputes_just_enough() -> None:
    # one rank, 4 blocks: plain needs 4*(1+2)=12 bytes; limit 9: each recomputed block saves 1.5 bytes,
    # so 2 blocks must recompute (12 - 3 = 9): time 2*1.0 + 2*1.5 = 5.0
    sol = solve_ilp(_uniform(4, 1, mem_limit_bytes=9.0))
    assert sol is not None and sol.counts == (((2, 2),),) and sol.time_s == pytest.approx(5.0)
    assert solve_dp(_uniform(4, 1, mem_limit_bytes=9.0)).time_s == pytest.approx(5.0)


def test_nothing_fits_returns_none() -> None:
    # even full recompute needs 4*(1+0.5)=6 bytes
    assert solve_ilp(_uniform(4, 1, mem_limit_bytes=5.0)) is None
    assert solve_dp(_uniform(4, 1, mem_limit_bytes=5.0)) is None


def test_evaluate_rejects_out_of_order_runs() -> None:
    problem = StageProblem(run_sizes=(1, 1), time_s=((1.0,), (1.0,)), static_bytes=(0.0, 0.0),
                           act_bytes=((0.0,), (0.0,)), num_ranks=2)
    with pytest.raises(ValueError, match="model order"):
        evaluate(problem, (((0,), (1,)), ((1,), (0,))))


@st.composite
def placed_problems(draw):
    """Problems of one or two runs with a looped or V placement (the shapes solve_balanced handles), some
    on heterogeneous ranks (each rank its own block times and memory limit)."""
    base = draw(problems(max_blocks=5, virtual=True))
    v_shape = base.virtual_stages == 2 and draw(st.booleans())
    p = base.num_ranks
    ranks = tuple(q if q < p else 2 * p - 1 - q for q in range(2 * p)) if v_shape else ()
    problem = replace(base, stage_rank=ranks)
    if draw(st.booleans()):
        speed = [draw(st.sampled_from((0.5, 1.0, 2.0))) for _ in range(p)]
        limits = tuple(base.mem_limit_bytes * draw(st.sampled_from((0.7, 1.0, 1.5))) for _ in range(p))
        problem = replace(problem, rank_mem_limit_bytes=limits,
                          rank_time_s=tuple(tuple(tuple(t * x for t in run) for run in base.time_s) for x in speed))
    return problem


@settings(max_examples=60, deadline=None)
@given(placed_problems())
def test_balanced_solver_matches_brute_force(problem: StageProblem) -> None:
    ref = brute_force(problem)
    got = solve_balanced(problem)
    if ref is None:
        assert got is None
    else:
        assert got is not None and fits(problem, got)
        assert got.time_s == pytest.approx(ref.time_s, rel=1e-9, abs=1e-12)


def test_dp_and_fits_share_one_memory_tolerance() -> None:
    """Hypothesis found this: the pinned last layer leaves exactly 0 bytes of a 2-byte limit and the block
    needs 1.9e-29 more. fits() accepts the total (2.0 after rounding, within its 1e-9 slack); the DP once
    compared the block against a budget of 0 * (1 + 1e-12) and said nothing fits. Both now use
    stages.mem_slack, and the DP finds the brute force's answer."""
    problem = StageProblem(run_sizes=(1,), time_s=((1.0,),), static_bytes=(0.0,), act_bytes=((1.9212150051180538e-29,),),
                           num_ranks=1, inflight=(1.0,), mem_limit_bytes=2.0, last_static_bytes=1.0,
                           last_act_bytes=1.0)
    ref, got = brute_force(problem), solve_dp(problem)
    assert ref is not None and got is not None and fits(problem, got)
    assert got.time_s == pytest.approx(ref.time_s)
    # a block that really does not fit (a thousandth of the limit over) is still refused by both
    over = replace(problem, act_bytes=((2e-3,),))
    assert brute_force(over) is None and solve_dp(over) is None
