"""search / autoplan() through the public API on analytic graphs (no capture): each result is checked
against an independent computation, an exhaustive sweep of estimate_config over every configuration."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from test_cost_graph_helper import a100_cluster, gpt_graph

import autoplan
from autoplan.cost import estimate_config
from autoplan.plan.types import ParallelConfig, Recompute, Schedule

GIB = 2**30
# 4 blocks, h 512, 8 heads: small enough for an exhaustive sweep
GRAPH = gpt_graph(h=512, a=8, layers=4, seq=512, vocab=4096)


def _with_memory(cluster, mem_bytes: int):
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, mem_bytes=mem_bytes))


def _sweep(graph, cluster, global_batch: int) -> list[tuple[ParallelConfig, object]]:
    """Every uniform config of 1F1B / GPipe (v = 1): (config, estimate); the reference for the search."""
    n = cluster.num_devices
    out = []
    divs = [d for d in range(1, n + 1) if n % d == 0]
    for tp, pp, cp in itertools.product(divs, divs, divs):
        if n % (tp * pp * cp) or tp > cluster.devices_per_node or pp > 4 or graph.seq_len % cp or 8 % tp:
            continue
        dp = n // (tp * pp * cp)
        if global_batch % dp:
            continue
        for mb in [b for b in range(1, global_batch // dp + 1) if (global_batch // dp) % b == 0]:
            for zero, rec, sp in itertools.product(range(4) if dp > 1 else (0,), Recompute, (False, True)):
                if sp and tp == 1:
                    continue
                config = ParallelConfig(tp=tp, pp=pp, dp=dp, cp=cp, sp=sp, zero=zero, microbatch=mb, recompute=rec,
                                        schedule=Schedule.ONE_F_ONE_B)
                out.append((config, estimate_config(graph, cluster, config, global_batch=global_batch)))
    return out


def test_single_device_gives_the_trivial_plan() -> None:
    cluster = a100_cluster(1, per_node=1)
    plans = autoplan.autoplan(GRAPH, cluster, global_batch=4, seq_len=512, top_k=3)
    c = plans[0].config
    assert (c.tp, c.pp, c.dp, c.cp, c.ep, c.zero) == (1, 1, 1, 1, 1, 0)
    assert c.recompute is Recompute.NONE and not plans[0].layer_recompute  # memory is ample on 80 GiB


def test_ample_memory_no_sharding_no_recompute_and_best_matches_sweep() -> None:
    cluster = a100_cluster(1, per_node=4)
    plans = autoplan.autoplan(GRAPH, cluster, global_batch=8, seq_len=512, top_k=3,
                              schedules=("1f1b", "gpipe"))
    best = plans[0]
    assert best.config.recompute is Recompute.NONE and not best.layer_recompute
    # nothing forces the model apart: splitting layers (tp) or the model (pp) would only add communication
    assert best.config.tp == 1 and best.config.pp == 1
    reference = min(e.step_time_s for _, e in _sweep(GRAPH, cluster, 8) if e.fits)
    # the search covers the sweep (and may do better with an uneven split): never slower than its best
    assert best.estimate.step_time_s <= reference * (1 + 1e-9)
    assert [p.estimate.step_time_s for p in plans] == sorted(p.estimate.step_time_s for p in plans)


def test_tight_memory_forces_sharding_or_recompute_and_every_plan_fits() -> None:
    base = a100_cluster(1, per_node=4)
    plain = estimate_config(GRAPH, base, ParallelConfig(dp=4, microbatch=2), global_batch=8)
    reserve = base.device.runtime_reserve_bytes
    # room for 60 % of what plain data parallelism needs beyond the runtime reserve: it no longer fits
    cluster = _with_memory(base, int(reserve + 0.6 * (plain.peak_mem_bytes - reserve)))
    plans = autoplan.autoplan(GRAPH, cluster, global_batch=8, seq_len=512, top_k=5, schedules=("1f1b",))
    for p in plans:
        c = p.config
        forced = c.tp > 1 or c.pp > 1 or c.cp > 1 or c.zero > 0 or c.recompute is not Recompute.NONE \
            or bool(p.layer_recompute)
        assert forced, p.config
        # re-estimate independently from the plan's own layout: it fits the device
        again = estimate_config(GRAPH, cluster, c, global_batch=8,
                                stages=tuple(s.layer_names for s in p.stages) if c.pp > 1 else None,
                                layer_recompute=dict(p.layer_recompute) or None)
        assert again.fits and again.peak_mem_bytes <= cluster.device.mem_bytes
        assert again.step_time_s == pytest.approx(p.estimate.step_time_s)


def test_nothing_fits_error_states_the_overflow() -> None:
    base = a100_cluster(1, per_node=2)
    reserve = base.device.runtime_reserve_bytes
    least = min(e.peak_mem_bytes for _, e in _sweep(GRAPH, base, 4))
    cluster = _with_memory(base, int(reserve + 0.5 * (least - reserve)))  # half the least need beyond the reserve
    with pytest.raises(ValueError, match=r"nothing fits in .* GiB.*needs ([0-9.]+) GiB.*over.*more devices") as err:
        autoplan.autoplan(GRAPH, cluster, global_batch=4, seq_len=512, schedules=("1f1b",))
    import re

    need = float(re.search(r"needs ([0-9.]+) GiB", str(err.value)).group(1)) * GIB
    assert need >= least - 0.06 * GIB  # never claims less than the true minimum (to the printed precision)


def test_more_memory_never_gives_a_slower_best_plan() -> None:
    base = a100_cluster(1, per_node=4)
    small = _with_memory(base, 5 * 2**30)
    t_small = autoplan.autoplan(GRAPH, small, global_batch=8, seq_len=512, top_k=1)[0].estimate.step_time_s
    t_big = autoplan.autoplan(GRAPH, base, global_batch=8, seq_len=512, top_k=1)[0].estimate.step_time_s
    assert t_big <= t_small * (1 + 1e-9)


def test_per_layer_recompute_beats_every_uniform_config_when_memory_is_between() -> None:
    graph = gpt_graph(h=1024, a=8, layers=8, seq=2048, vocab=4096)
    base = a100_cluster(1, per_node=1)
    peak = {r: estimate_config(graph, base, ParallelConfig(recompute=r), global_batch=4).peak_mem_bytes
            for r in Recompute}
    cluster = _with_memory(base, (peak[Recompute.NONE] + peak[Recompute.FULL]) // 2)
    uniform = min(e.step_time_s for _, e in _sweep(graph, cluster, 4) if e.fits)
    best = autoplan.autoplan(graph, cluster, global_batch=4, seq_len=2048, top_k=1)[0]
    assert best.layer_recompute  # a mix of recompute modes ...
    assert best.estimate.step_time_s < uniform  # ... strictly faster than any single mode that fits
    again = estimate_config(graph, cluster, best.config, global_batch=4, layer_recompute=dict(best.layer_recompute))
    assert again.fits and again.step_time_s == pytest.approx(best.estimate.step_time_s)


def test_an_uneven_stage_split_fits_where_the_balanced_one_does_not() -> None:
    # a heavy head (vocab 65536): with the balanced 4 + 4 blocks the last stage overflows by a little
    graph = gpt_graph(h=1024, a=8, layers=8, seq=1024, vocab=65536)
    base = a100_cluster(1, per_node=2)
    config = ParallelConfig(pp=2, microbatch=1, recompute=Recompute.FULL)
    balanced = estimate_config(graph, base, config, global_batch=8).peak_mem_bytes
    cluster = _with_memory(base, balanced - 2**26)  # 64 MiB short of what the balanced split needs
    fixed = {"pp": 2, "tp": 1, "cp": 1, "microbatch": 1, "recompute": "full", "schedules": "1f1b"}
    plan = autoplan.autoplan(graph, cluster, global_batch=8, seq_len=1024, top_k=1, **fixed)[0]
    assert not estimate_config(graph, cluster, config, global_batch=8).fits  # the reference: balanced overflows
    sizes = [sum(n.startswith("layers.") for n in s.layer_names) for s in plan.stages]
    assert sum(sizes) == 8 and sizes != [4, 4]
    again = estimate_config(graph, cluster, plan.config, global_batch=8,
                            stages=tuple(s.layer_names for s in plan.stages))
    assert again.fits and again.peak_mem_bytes <= cluster.device.mem_bytes
