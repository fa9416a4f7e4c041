"""Work spread over cores gives the same answer as one piece: run_parts keeps order and raises a worker's
error; the quick estimates in pieces of whole layer-table keys equal the quick estimate of the whole space."""

from __future__ import annotations

import dataclasses
import importlib
import os

import numpy as np
import pytest
from test_cost_graph_helper import a100_cluster, gpt_graph

from autoplan.search import parallel
from autoplan.search.space import SearchOptions, enumerate_space
from autoplan.search.surrogate import quick_estimate, split_by_layer_key

search_module = importlib.import_module("autoplan.search.search")
cost = importlib.import_module("autoplan.cost")


def test_run_parts_keeps_order_and_uses_other_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel, "usable_cores", lambda: 2)
    out = parallel.run_parts(lambda x: (x * x, os.getpid()), [1, 2, 3, 4, 5])
    assert [v for v, _ in out] == [1, 4, 9, 16, 25]
    assert out[0][1] == os.getpid() and out[1][1] != os.getpid()  # the parent takes the first of each round


def test_run_parts_raises_the_workers_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel, "usable_cores", lambda: 2)

    def fail_on_two(x: int) -> int:
        if x == 2:
            raise ValueError("part 2 failed")
        return x

    with pytest.raises(ValueError, match="part 2 failed"):
        parallel.run_parts(fail_on_two, [1, 2])


def test_quick_estimates_in_pieces_equal_the_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    graph = gpt_graph(h=1024, a=16, layers=8, seq=2048, vocab=8192)
    cluster = a100_cluster(8, per_node=8)
    space = enumerate_space(graph, cluster, SearchOptions(global_batch=64))
    pieces = split_by_layer_key(space, 2)
    assert sorted(np.concatenate(pieces).tolist()) == list(range(len(space)))
    assert abs(len(pieces[0]) - len(pieces[1])) < 0.2 * len(space)  # balanced
    whole = quick_estimate(graph, cluster, space, 64, cost)
    monkeypatch.setattr(search_module, "QUICK_SPLIT_MIN", 0)
    monkeypatch.setattr(parallel, "usable_cores", lambda: 2)
    split = search_module._quick_estimates(graph, cluster, space, 64, cost)
    for f in dataclasses.fields(whole):
        assert np.array_equal(getattr(split, f.name), getattr(whole, f.name)), f.name


def test_the_search_hides_the_old_heap_from_the_collector_and_gives_it_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """While the search runs, what was alive before it is frozen (gc.freeze); after it, nothing stays frozen and
    the collector is as it was, also when the search raises; a caller's own freeze is left alone."""
    import gc

    seen = []
    real = search_module.enumerate_space
    monkeypatch.setattr(search_module, "enumerate_space", lambda *a: seen.append(gc.get_freeze_count()) or real(*a))
    graph, cluster = gpt_graph(h=256, a=4, layers=4, seq=64, vocab=512), a100_cluster(1)
    search_module.search(graph, cluster, SearchOptions(global_batch=8, top_k=1))
    assert seen[0] > 1000 and gc.get_freeze_count() == 0 and gc.isenabled()
    with pytest.raises(ValueError):
        search_module.search(graph, cluster, SearchOptions(global_batch=8, top_k=1, tp=3))
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        search_module.search(graph, cluster, SearchOptions(global_batch=8, top_k=1))
        # neither unfrozen (0) nor frozen again (more): frozen objects can still die by reference count while
        # the search runs, so the count may only fall (an exact == failed under load)
        assert 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


def test_a_capture_pauses_the_collector_and_restores_it() -> None:
    import gc

    from autoplan.graph.cache import gc_paused

    states = []
    with gc_paused():
        states.append(gc.isenabled())
    assert states == [False] and gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a caller's choice is kept
    finally:
        gc.enable()


def test_the_search_turns_numpy_huge_pages_off_and_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """numpy's madvise hugepage is off while the search runs (its arrays live for seconds; where the kernel's
    THP defrag is 'madvise' every new one waits for compaction) and as the caller had it afterwards."""
    core = getattr(np, "_core", None) or np.core
    get, set_ = core.multiarray._get_madvise_hugepage, core.multiarray._set_madvise_hugepage
    seen = []
    real = search_module.enumerate_space
    monkeypatch.setattr(search_module, "enumerate_space", lambda *a: seen.append(get()) or real(*a))
    graph, cluster = gpt_graph(h=256, a=4, layers=4, seq=64, vocab=512), a100_cluster(1)
    before = set_(True)
    try:
        search_module.search(graph, cluster, SearchOptions(global_batch=8, top_k=1))
        assert seen == [False] and get() is True
    finally:
        set_(before)


def test_run_parts_keeps_order_and_a_dead_worker_is_an_error(monkeypatch) -> None:
    """Parts after the first run in forked children (graph.forked.run_in_child): results come back in order
    (a worker's exception: test_run_parts_raises_the_workers_error), and a child that dies without a result is
    an error, not a None."""
    import os

    import pytest

    from autoplan.search import parallel

    monkeypatch.setattr(parallel, "usable_cores", lambda: 2)
    pid = os.getpid()
    assert parallel.run_parts(lambda x: (x * x, os.getpid() != pid), [1, 2, 3]) == [(1, False), (4, True), (9, False)]

    def dies_in_a_child(x: int) -> int:
        if os.getpid() != pid:
            os._exit(1)
        return x

    with pytest.raises(RuntimeError, match="died without a result"):
        parallel.run_parts(dies_in_a_child, [1, 2])
