"""The candidate space against an independent itertools enumeration, and the table of ranked plans."""

from __future__ import annotations

import itertools

import pytest
from test_cost_graph_helper import a100_cluster, gpt_graph

import autoplan
from autoplan.search.space import SearchOptions, enumerate_space, schedule_choices


def _reference(n: int, per_node: int, heads: int, blocks: int, seq: int, batch: int, experts: int,
               vocab: int) -> set:
    out = set()
    for tp, pp, dp, cp, ep in itertools.product(range(1, n + 1), repeat=5):
        if tp * pp * dp * cp * ep != n or per_node % tp or heads % tp or (4 * 64 * heads) % tp or vocab % tp:
            continue
        # cp > 1: the load-balanced causal split cuts the sequence into 2*cp chunks
        if (cp > 1 and seq % (2 * cp)) or pp > blocks or batch % (dp * ep) or (ep > 1 and (not experts or experts % ep)):
            continue
        per = batch // (dp * ep)
        for mb in (b for b in range(1, per + 1) if per % b == 0):
            scheds = [("1f1b", 1)] if pp == 1 else [("gpipe", 1), ("1f1b", 1)] + [
                ("interleaved", v) for v in range(2, 9) if (blocks // pp) % v == 0] + [
                ("zb", v) for v in (1, 2) if pp * v <= blocks]
            m = per // mb  # torch's schedules: 1F1B needs m >= pp, looped ones m % max(1, m // pp) == 0
            scheds = [(s, v) for s, v in scheds if not (
                pp > 1 and ((s == "1f1b" and m < pp)
                            or ((s == "interleaved" or (s == "zb" and v == 1)) and m % max(1, m // pp))))]
            for (s, v), r, z, sp in itertools.product(scheds, ("none", "selective", "full"), range(4), (0, 1)):
                if (z and dp * ep * cp == 1) or (sp and tp == 1):
                    continue
                out.add((tp, pp, dp, cp, ep, sp, z, mb, s, v, r))
    return out


# seq 24: cp=8 would need 16 | 24, so only cp in 1, 2, 4; vocab 514 = 2 x 257: no tp=4 (the executor's
# vocab-parallel embedding needs tp | vocab)
@pytest.mark.parametrize("seq,vocab", [(128, 512), (24, 512), (128, 514)])
def test_space_is_every_legal_combination_and_nothing_else(seq: int, vocab: int) -> None:
    graph = gpt_graph(h=256, a=4, layers=4, seq=seq, vocab=vocab)
    cluster = a100_cluster(2, per_node=4)
    space = enumerate_space(graph, cluster, SearchOptions(global_batch=8))
    got = set()
    for i in range(len(space)):
        c = space.config(i)
        got.add((c.tp, c.pp, c.dp, c.cp, c.ep, int(c.sp), c.zero, c.microbatch, c.schedule.value,
                 c.virtual_stages, c.recompute.value))
    assert len(got) == len(space)  # no duplicates
    assert got == _reference(8, 4, 4, 4, seq, 8, 0, vocab)
    assert (4 in {c[0] for c in got}) is (vocab % 4 == 0)


def test_restricting_options_restricts_the_space() -> None:
    graph = gpt_graph(h=256, a=4, layers=4, seq=128, vocab=512)
    space = enumerate_space(graph, a100_cluster(2, per_node=4), SearchOptions(global_batch=8, tp=2, zero=(0,)))
    assert set(space.columns["tp"].tolist()) == {2} and set(space.columns["zero"].tolist()) == {0}
    assert schedule_choices(1, 4, SearchOptions(global_batch=8)) == (("1f1b", 1),)


def test_plans_print_as_a_ranked_table() -> None:
    graph = gpt_graph(h=256, a=4, layers=4, seq=128, vocab=512)
    plans = autoplan.autoplan(graph, a100_cluster(1, per_node=4), global_batch=8, seq_len=128, top_k=3)
    text = str(plans)
    for column in ("tp", "pp", "dp", "ZeRO", "micro-batch", "schedule", "recompute", "step s", "tokens/s", "MFU",
                   "GiB/device"):
        assert column in text
    assert [p.rank for p in plans] == [1, 2, 3] and plans.best is plans[0]
    step = plans[0].estimate.step_time_s
    assert (f"{step:.3f}" if step >= 0.01 else f"{step:.3g}") in text
