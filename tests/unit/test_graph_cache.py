"""The on-disk graph cache: an exact JSON round trip, a second plan of the same structure skips capture (a
preset without importing torch), any change of structure or settings is a different key, concurrent writers
never leave a torn entry, and an unreadable entry is a miss."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_cost_graph_helper import gpt_graph

from autoplan.graph import cache
from autoplan.models import preset
from autoplan.search import api

GRAPH = gpt_graph(h=256, a=4, layers=3, seq=64, vocab=512, experts=4, top_k=2)


@pytest.fixture()
def tmp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", str(tmp_path))
    api._named_graph.cache_clear()
    return tmp_path / "graphs"


def test_json_round_trip_is_exact() -> None:
    assert cache.graph_from_dict(cache.graph_to_dict(GRAPH)) == GRAPH


def test_a_second_identical_module_skips_capture(tmp_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = api._capture
    monkeypatch.setattr(api, "_capture", lambda *a: calls.append(1) or real(*a))
    with torch.device("meta"):
        first = api.model_graph(preset("tiny-gpt"), 16)
        second = api.model_graph(preset("tiny-gpt"), 16)  # a new object of the same structure
    assert len(calls) == 1 and second == first and len(list(tmp_cache.glob("*.json"))) == 1


def test_the_key_follows_the_structure() -> None:
    with torch.device("meta"):
        base = preset("tiny-gpt")
        fewer_heads = preset("tiny-gpt", num_heads=2, num_kv_heads=2)  # same parameter shapes, a different attention
        deeper = preset("tiny-gpt", num_layers=5)
    fingerprint = cache.module_fingerprint
    key = lambda m, **kw: cache.key_of({"module": fingerprint(m), "seq_len": 16, **kw})
    assert key(base) == key(base)
    assert len({key(base), key(fewer_heads), key(deeper), key(base.to(torch.float16)), key(base, seq_len=32)}) == 5
    assert cache.preset_key("tiny-gpt", seq_len=16) != cache.preset_key("tiny-llama", seq_len=16)


def test_a_warm_preset_plan_does_not_import_torch(tmp_cache: Path) -> None:
    cache.store(cache.preset_key("tiny-gpt", seq_len=64), GRAPH, tmp_cache)
    code = ("import sys; from autoplan.search.api import model_graph; g = model_graph('tiny-gpt', 64); "
            "print(len(g.layers), g.model_name, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "AUTOPLAN_CACHE_DIR": str(tmp_cache.parent)})
    assert out.stdout.split() == [str(len(GRAPH.layers)), "tiny-gpt", "False"]


_CLI = """
import os, sys
from autoplan.cli.main import main
rc = main(["plan", "--model", {model!r}, "--cluster", {cluster!r}, "--global-batch", "8", "--seq-len", "32", "--quiet"])
try:
    os.waitpid(-1, os.WNOHANG)  # raises when this process has no child at all, running or unreaped
    children = "left"
except ChildProcessError:
    children = "none"
print("TORCH", rc, "torch" in sys.modules, children)
"""


def _cli(cluster: str, env: dict, model: str = "tiny-gpt", stderr: list | None = None) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _CLI.format(cluster=cluster, model=model)], capture_output=True,
                         text=True, check=True, env=env)
    if stderr is not None:
        stderr.append(out.stderr)
    return out.stdout.split("TORCH")[-1].split()


def test_a_preset_plan_from_the_command_line_does_not_import_torch(tmp_path: Path) -> None:
    """The `autoplan plan` path (the components check, the fingerprint a plan carries) needs no torch once the
    preset's graph and fingerprint are cached, and a cold plan captures in a forked child (graph/named.py),
    which is collected: the first run stores both, neither run imports torch or leaves a child behind."""
    env = {**__import__("os").environ, "AUTOPLAN_CACHE_DIR": str(tmp_path)}
    cold, warm = _cli("local-cpu", env), _cli("local-cpu", env)
    assert cold == warm == ["0", "False", "none"]
    assert len(list((tmp_path / "graphs").glob("*.json"))) == len(list((tmp_path / "graphs").glob("*.txt"))) == 1


def test_a_command_that_fails_before_its_search_kills_the_capture_child(tmp_path: Path) -> None:
    env = {**__import__("os").environ, "AUTOPLAN_CACHE_DIR": str(tmp_path)}
    assert _cli("no-such-cluster", env) == ["2", "False", "none"]


def test_an_error_in_the_capture_child_is_the_one_line_error(tmp_path: Path) -> None:
    """An unknown preset fails in the child (load_model), and the command prints that ValueError's one line."""
    env, stderr = {**__import__("os").environ, "AUTOPLAN_CACHE_DIR": str(tmp_path)}, []
    assert _cli("local-cpu", env, model="no-such-model", stderr=stderr) == ["2", "False", "none"]
    assert stderr[0].startswith("autoplan: error: unknown model 'no-such-model': choose a preset (")
    assert stderr[0].count("\n") == 1


def _writer(directory: str, n: int) -> None:
    for _ in range(n):
        cache.store("k", GRAPH, Path(directory))


def test_concurrent_writers_never_leave_a_torn_entry(tmp_path: Path) -> None:
    cache.store("k", GRAPH, tmp_path)
    ctx = multiprocessing.get_context("fork")
    writers = [ctx.Process(target=_writer, args=(str(tmp_path), 40)) for _ in range(2)]
    for w in writers:
        w.start()
    reads = [cache.load("k", tmp_path) for _ in range(200)]
    for w in writers:
        w.join()
    assert all(r == GRAPH for r in reads)
    assert [p.name for p in tmp_path.iterdir()] == ["k.json"]  # no temporary file left behind


def test_an_unreadable_entry_is_a_miss_and_is_rewritten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", str(tmp_path))
    (tmp_path / "graphs").mkdir()
    (tmp_path / "graphs" / "k.json").write_text('{"format": 1, "graph": {"model_na')
    assert cache.load("k") is None
    assert cache.cached("k", lambda: GRAPH, model_name="renamed").model_name == "renamed"
    assert cache.load("k") == GRAPH
    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", "off")
    assert cache.cache_dir() is None and cache.load("k") is None
