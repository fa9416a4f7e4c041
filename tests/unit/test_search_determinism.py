"""The search does a fixed amount of work: the same inputs give identical Plans on an idle machine and
beside processes that keep every core busy; and no search module reads a clock or sets a time limit."""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

from test_cost_graph_helper import a100_cluster, gpt_graph

import autoplan
import autoplan.search

GRAPH = gpt_graph(h=1024, a=8, layers=8, seq=1024, vocab=4096)


def _plans() -> tuple:
    # 4 devices with 6 GiB each: per-layer recompute and uneven splits get refined; every schedule
    base = a100_cluster(1, per_node=4)
    cluster = dataclasses.replace(base, device=dataclasses.replace(base.device, mem_bytes=6 * 2**30))
    return tuple(autoplan.autoplan(GRAPH, cluster, global_batch=8, seq_len=1024, top_k=5))


def test_the_same_plans_idle_and_beside_processes_that_keep_every_core_busy() -> None:
    idle = _plans()
    spin = "import sys; sys.stdout.write('go\\n'); sys.stdout.flush()\nwhile True: pass"
    busy = [subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True)
            for _ in range(max(2, os.cpu_count() or 2))]
    try:
        for proc in busy:
            assert proc.stdout.readline() == "go\n"  # spinning before the second search starts
        loaded = _plans()
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    assert len(idle) == 5 and loaded == idle  # every field: configs, estimates, stages, recompute, notes


def test_no_search_module_reads_a_clock_or_sets_a_time_limit() -> None:
    clocks = {"perf_counter", "monotonic", "process_time", "time_limit", "time_limit_s", "datetime"}
    for path in sorted(Path(autoplan.search.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        used |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        used |= {k.value for n in ast.walk(tree) if isinstance(n, ast.Dict) for k in n.keys
                 if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        assert not used & clocks, f"{path.name} uses {sorted(used & clocks)}"
        modules = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        modules |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not modules & {"time", "datetime"}, f"{path.name} imports a clock"
