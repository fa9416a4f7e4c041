"""A cold preset's capture in a forked child (graph/forked.py, graph/named.py): the child's graph equals an
in-process capture, what the work raises is raised again in the parent (the same class and line), a child
that dies gives None, and no child outlives its use (cancelled, discarded or collected: reaped)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from autoplan.graph import cache, forked, named
from autoplan.graph.errors import CaptureError


def _reaped(pid: int) -> bool:
    """After discard() (which the command calls when it is done), the child is gone and was waited for (no
    zombie left), and nothing is left to reap."""
    forked.discard()
    assert forked._live == {} and forked._exiting == set()
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    return not Path(f"/proc/{pid}").exists()


def test_the_childs_graph_equals_an_in_process_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", "off")  # both capture for real
    in_process = named.captured_preset("tiny-moe", 32)  # first: the child inherits torch's imports
    pending = forked.run_in_child(lambda: named.captured_preset("tiny-moe", 32))
    assert pending.result() == in_process
    assert _reaped(pending.pid)


def test_errors_come_back_as_the_same_one_line_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", "off")
    with pytest.raises(ValueError) as in_process:
        named.captured_preset("no-such-model", 32)
    with pytest.raises(ValueError) as from_child:
        forked.run_in_child(lambda: named.captured_preset("no-such-model", 32)).result()
    assert str(from_child.value) == str(in_process.value) and "\n" not in str(from_child.value)

    def fails() -> None:
        raise CaptureError("cannot trace Block.forward: `x.item()` (model.py:3); make it a tensor op")

    with pytest.raises(CaptureError, match=r"^cannot trace Block.forward: `x.item\(\)`"):
        forked.run_in_child(fails).result()


class _Unpicklable(ValueError):
    def __init__(self, a: int, b: int) -> None:  # pickling rebuilds it from args=(message,): TypeError
        super().__init__(f"{a} and {b} do not divide")


def test_an_unpicklable_exception_comes_back_as_its_builtin_base() -> None:
    def fails() -> None:
        raise _Unpicklable(3, 4)

    with pytest.raises(ValueError, match="^3 and 4 do not divide$") as got:
        forked.run_in_child(fails).result()
    assert type(got.value) is ValueError


def test_a_child_that_dies_gives_none_and_is_reaped() -> None:
    pending = forked.run_in_child(lambda: os.kill(os.getpid(), signal.SIGKILL))
    assert pending.result() is None and _reaped(pending.pid)


def test_cancel_and_discard_kill_and_reap_the_children() -> None:
    first = forked.run_in_child(lambda: signal.pause())
    second = forked.run_in_child(lambda: signal.pause())
    first.cancel()
    assert forked._live == {second.pid: second} and not Path(f"/proc/{first.pid}").exists()
    assert _reaped(second.pid) and _reaped(first.pid)


def test_prefetch_forks_only_for_an_uncached_preset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """prefetch then preset_graph: the graph and fingerprint come from the child and are on disk after; a
    second prefetch of the now cached preset, and a prefetch of a file spec, fork nothing."""
    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(forked, "can_fork", lambda: True)  # this test process holds torch
    monkeypatch.setattr(named, "_fingerprints", {})
    named.prefetch("tiny-gpt", 16)
    (pending,) = named._prefetched.values()
    graph = named.preset_graph("tiny-gpt", 16)
    assert named._prefetched == {} and _reaped(pending.pid)
    assert cache.load(cache.preset_key("tiny-gpt", seq_len=16)) == graph and graph.model_name == "tiny-gpt"
    fingerprint = named._fingerprints["tiny-gpt"]
    monkeypatch.setattr(named, "_fingerprints", {})
    assert named.preset_fingerprint("tiny-gpt") == fingerprint  # stored by the child
    named.prefetch("tiny-gpt", 16)
    named.prefetch("model.py:build", 16)
    named.prefetch("tiny-gpt", 0)
    assert named._prefetched == {}
