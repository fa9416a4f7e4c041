"""Unbatched pipeline p2p (Engine.pp_p2p_batched False, DeepSpeed's PipelineEngine) against hand computations
and against a rendezvous simulation of the engines' own schedules: DeepSpeed v0.10.0
deepspeed/runtime/pipe/schedule.py TrainSchedule.steps (each transfer a blocking send or recv of its own) and
Megatron-LM a8d172b3 megatron/schedules.py forward_backward_pipelining_without_interleaving (each slot's send
and receive one batch_isend_irecv). In the simulation every transfer takes T once both ranks have posted it
and holds both ranks' streams until it is done (an NCCL send completes when its receiver has posted the recv)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from test_cost_graph_helper import a100_cluster, every_zero_stage, gpt_graph

from autoplan import cost
from autoplan.cost import comm, estimate_config, pipeline_time_s
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig
from autoplan.search.space import SearchOptions, enumerate_space
from autoplan.search.surrogate import quick_estimate

H, S, MB, B = 1024, 1024, 1, 16
GRAPH = gpt_graph(h=H, a=16, layers=8, seq=S, vocab=8192)
CLUSTER = dataclasses.replace(a100_cluster(1), dtype="fp16")
BATCHED = every_zero_stage(dataclasses.replace(Engine.load("megatron-deepspeed"), pp_p2p_batched=True))
UNBATCHED = dataclasses.replace(BATCHED, pp_p2p_batched=False)


def _deepspeed_program(m: int, p: int, s: int) -> list[tuple]:
    """Stage s's instructions, TrainSchedule.steps (v0.10.0): a forward step SendGrad(previous microbatch),
    RecvActivation, ForwardPass; a backward step RecvGrad, SendActivation(previous), BackwardPass."""
    out, prev = [], -1
    for step in range(2 * (m + p - 1)):
        even_step, even_stage = step % 2 == 0, s % 2 == 0
        if even_step and even_stage:
            mb, fwd = step // 2 - s // 2, True
        elif not even_step and not even_stage:
            mb, fwd = (step - 1) // 2 - s // 2, True
        elif even_step:
            mb, fwd = step // 2 - p + (s + 1) // 2, False
        else:
            mb, fwd = (step - 1) // 2 - p + 1 + s // 2, False
        ok = lambda j: 0 <= j < m
        if fwd:
            out += [("G", [("send", s - 1, ("g", prev))])] if ok(prev) and s > 0 else []
            out += [("G", [("recv", s - 1, ("a", mb))])] if ok(mb) and s > 0 else []
        else:
            out += [("G", [("recv", s + 1, ("g", mb))])] if ok(mb) and s < p - 1 else []
            out += [("G", [("send", s + 1, ("a", prev))])] if ok(prev) and s < p - 1 else []
        out += [("C", "F" if fwd else "B")] if ok(mb) else []
        prev = mb
    return out


def _megatron_program(m: int, p: int, s: int) -> list[tuple]:
    """Stage s's 1F1B (a8d172b3): warm-up recv_forward / F / send_forward, steady F /
    send_forward_recv_backward / B / send_backward_recv_forward, cool-down recv_backward / B / send_backward."""
    warm = min(p - s - 1, m)
    rf = [("recv", s - 1, ("a", j)) for j in range(m)] if s > 0 else [None] * m
    sf = [("send", s + 1, ("a", j)) for j in range(m)] if s < p - 1 else [None] * m
    rb = [("recv", s + 1, ("g", j)) for j in range(m)] if s < p - 1 else [None] * m
    sb = [("send", s - 1, ("g", j)) for j in range(m)] if s > 0 else [None] * m
    out: list[tuple] = []
    group = lambda *ops: out.append(("G", [o for o in ops if o])) if any(ops) else None
    for j in range(warm):
        group(rf[j]), out.append(("C", "F")), group(sf[j])
    if m > warm:
        group(rf[warm])
    for i in range(m - warm):
        out.append(("C", "F")), group(sf[warm + i], rb[i]), out.append(("C", "B"))
        group(sb[i], rf[warm + i + 1] if i < m - warm - 1 else None)
    for j in range(m - warm, m):
        group(rb[j]), out.append(("C", "B")), group(sb[j])
    return out


def _simulate(programs: list[list[tuple]], f: float, b: float, t: float) -> float:
    """Makespan of the stages' programs: compute in order; a group of transfers starts once this rank posts it,
    each transfer ends t after both of its ranks posted it, the rank goes on when all of the group's have."""
    p = len(programs)
    pc, clock, posted, post_at = [0] * p, [0.0] * p, {}, [None] * p
    while any(pc[s] < len(programs[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pc[s] < len(programs[s]):
                item = programs[s][pc[s]]
                if item[0] == "C":
                    clock[s] += f if item[1] == "F" else b
                elif post_at[s] is None:
                    post_at[s] = clock[s]
                    posted.update({((s, q, tag) if kind == "send" else (q, s, tag), kind): clock[s]
                                   for kind, q, tag in item[1]})
                    continue
                else:
                    other = [posted.get(((s, q, tag) if kind == "send" else (q, s, tag),
                                         "recv" if kind == "send" else "send")) for kind, q, tag in item[1]]
                    if any(o is None for o in other):
                        break
                    clock[s], post_at[s] = max(max(post_at[s], o) + t for o in other), None
                pc[s], moved = pc[s] + 1, True
        assert moved, f"deadlock at {pc}"
    return max(clock)


def _charged(p: int, m: int, f: float, b: float, t: float, batched: bool) -> float:
    """pipeline_time_s with p2p.add_hop's charges for uniform stages: each cut's transfer on the sender's slot
    (the activation in its forward, the gradient in the backward), and unbatched on each receiver's too."""
    sends = [(1 if r < p - 1 else 0) + (1 if r > 0 else 0) for r in range(p)]
    steady = [0.0] * p if batched else [k * t for k in sends]  # a rank receives as often as it sends
    return pipeline_time_s("1f1b", p, 1, m, [f] * p, [b + k * t for k in sends], None, steady)


def test_the_deepspeed_schedule_exposes_four_transfers_per_slot_and_the_model_tracks_it() -> None:
    f, b, t = 1.0, 2.0, 0.05
    for p in (2, 3, 4, 8):
        for m in (2, 4, 8, 32):
            sim = _simulate([_deepspeed_program(m, p, s) for s in range(p)], f, b, t)
            exposed = 2 * m if p == 2 else 4 * m + 2 * p - 8  # transfers on the critical path
            assert math.isclose(sim, (m + p - 1) * (f + b) + exposed * t, rel_tol=1e-12), (p, m)
            model = _charged(p, m, f, b, t, batched=False)
            assert sim - 1e-9 <= model <= sim + (1 if p == 2 else 4) * t + 1e-9, (p, m, sim, model)


def test_megatron_batched_1f1b_exposes_two_per_slot_as_the_default_model() -> None:
    f, b, t = 1.0, 2.0, 0.05
    for p in (2, 3, 4, 8):
        for m in (3, 8, 32):
            sim = _simulate([_megatron_program(m, p, s) for s in range(p)], f, b, t)
            exposed = m + 1 if p == 2 else 2 * m + 2 * p - 5
            assert math.isclose(sim, (m + p - 1) * (f + b) + exposed * t, rel_tol=1e-12), (p, m)
            model = _charged(p, m, f, b, t, batched=True)
            assert sim - 1e-9 <= model <= sim + t + 1e-9, (p, m, sim, model)


def test_steady_time_lengthens_the_slots_only() -> None:
    # hand computation: X = (3, 4, 3.5), Y = X; steady (0.5, 1, 0): 4 m max(X + steady) = 5, bubble 3 + 3.5
    t = pipeline_time_s("1f1b", 3, 1, 4, [1.0, 1.5, 1.0], [2.0, 2.5, 2.5], None, [0.5, 1.0, 0.0])
    assert math.isclose(t, 4 * 5.0 + (3.0 + 4.0 + 3.5 - 4.0))


def test_unbatched_adds_each_receive_to_both_ranks_slots_on_two_stages() -> None:
    config = ParallelConfig(pp=2, dp=4, microbatch=MB)  # one cut inside the node: every slot gains one receive
    m = B // (4 * MB)
    hop = comm.p2p_s(MB * S * H * 2, False, CLUSTER)  # the fp16 activation [s, b, h]
    base = estimate_config(GRAPH, CLUSTER, config, global_batch=B, engine=BATCHED)
    est = estimate_config(GRAPH, CLUSTER, config, global_batch=B, engine=UNBATCHED)
    assert math.isclose(est.step_time_s - base.step_time_s, m * hop, rel_tol=1e-9)
    assert math.isclose(est.breakdown.pp_comm - base.breakdown.pp_comm, m * hop, rel_tol=1e-9)
    one = ParallelConfig(pp=1, dp=8, microbatch=MB)  # no pipeline, nothing to receive
    assert (estimate_config(GRAPH, CLUSTER, one, global_batch=B, engine=UNBATCHED).step_time_s
            == estimate_config(GRAPH, CLUSTER, one, global_batch=B, engine=BATCHED).step_time_s)


def test_the_quick_estimate_moves_by_the_exact_seconds() -> None:
    space = enumerate_space(GRAPH, CLUSTER, SearchOptions(global_batch=B))
    before = quick_estimate(GRAPH, CLUSTER, space, B, cost.with_engine(BATCHED)).step_time_s
    after = quick_estimate(GRAPH, CLUSTER, space, B, cost.with_engine(UNBATCHED)).step_time_s
    piped = np.flatnonzero(space.columns["pp"] > 1)
    rng = np.random.default_rng(0)
    rows = np.concatenate([rng.choice(piped, min(25, len(piped)), replace=False),
                           rng.choice(len(space), 10, replace=False)]).tolist()
    for r in rows:
        config = space.config(r)
        want = (estimate_config(GRAPH, CLUSTER, config, global_batch=B, engine=UNBATCHED).step_time_s
                - estimate_config(GRAPH, CLUSTER, config, global_batch=B, engine=BATCHED).step_time_s)
        assert math.isclose(after[r] - before[r], want, rel_tol=1e-6, abs_tol=1e-12), config


def test_only_deepspeeds_pipeline_engine_is_unbatched() -> None:
    assert Engine().pp_p2p_batched
    for name in Engine.names():
        assert Engine.load(name).pp_p2p_batched == (name not in ("megatron-deepspeed", "deepspeed", "deepspeed-2024"))
