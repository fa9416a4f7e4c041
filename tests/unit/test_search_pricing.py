"""Pricing the quick estimate's collectives once per distinct question (search/pricing.py) answers every
candidate exactly as pricing it on its own does: checked against cost.comm called element by element, with
classes that hold rows asking other questions, and against the quick estimate without classes or chunks."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from test_cost_graph_helper import a100_cluster, gpt_graph

from autoplan import cost
from autoplan.cost import comm
from autoplan.cost.experts import expert_dp_placement
from autoplan.search import assemble, collectives, surrogate
from autoplan.search.pricing import Mesh, Pricing, int_codes
from autoplan.search.space import SearchOptions, enumerate_space

CLUSTER = a100_cluster(4, per_node=8)
MOE = gpt_graph(h=256, a=4, layers=4, seq=256, vocab=4096, experts=8, top_k=2)


def _space():
    return enumerate_space(MOE, CLUSTER, SearchOptions(global_batch=64))


def _direct(kind: str, space, rows: np.ndarray, axes: tuple[str, ...], nbytes: np.ndarray) -> np.ndarray:
    """cost.comm's time for each candidate and element on its own: the reference."""
    fn = collectives._KINDS[kind]
    out = np.zeros(nbytes.shape)
    for i, row in enumerate(rows.tolist()):
        config = space.config(row)
        group = (expert_dp_placement(config, CLUSTER.devices_per_node) if axes == assemble.EXPERT_DP
                 else comm.group_placement(config, axes, CLUSTER.devices_per_node))
        for j, b in enumerate(np.round(nbytes[i]).tolist()):
            out[i, j] = fn(b, group, CLUSTER) if b > 0 else 0.0
    return out


@pytest.mark.parametrize("kind", ["ag", "rs", "ar"])
@pytest.mark.parametrize("axes", [("dp", "ep", "cp"), assemble.EXPERT_DP, ("tp",)])
def test_collectives_priced_by_class_equal_each_candidate_priced_alone(kind: str, axes: tuple[str, ...]) -> None:
    space = _space()
    rng = np.random.default_rng(7)
    rows = rng.choice(len(space), 300, replace=False)
    c = {k: v[rows] for k, v in space.columns.items()}
    classes = rng.integers(0, 12, len(rows))  # coarse classes: members ask different questions
    base = rng.choice([0.0, -3.0, 1e3, 5e6, 2.5e8, 1e10], size=(12, 4))
    nbytes = base[classes] * (1 + (rng.random((len(rows), 4)) < 0.1))  # a tenth of them differ from their class
    pricing = Pricing({}, classes)
    got = assemble.collective_s(kind, assemble.mesh_sizes(c, pricing), axes, nbytes, CLUSTER)
    assert got.tobytes() == _direct(kind, space, rows, axes, nbytes).tobytes()
    again = assemble.collective_s(kind, assemble.mesh_sizes(c), axes, nbytes[:, 0], CLUSTER)  # [n], no classes
    assert again.tobytes() == _direct(kind, space, rows, axes, nbytes[:, :1])[:, 0].tobytes()


def test_classes_that_mix_meshes_are_split_by_mesh() -> None:
    sizes = np.array([[1, 2, 1, 1, 4, 0, 0], [1, 4, 1, 1, 2, 0, 0], [1, 2, 1, 1, 4, 0, 0]])
    mesh = Mesh.of(sizes, Pricing({}, np.zeros(3, dtype=np.int64)))  # one class, two meshes
    assert (sizes[mesh.reps][mesh.inverse] == sizes).all()
    assert len(mesh.meshes) == 2 and mesh.inverse[0] == mesh.inverse[2] != mesh.inverse[1]


def test_a_price_is_computed_once_per_quick_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    space = _space()
    c = dict(space.columns)
    calls = []
    real = collectives._KINDS["ar"]
    monkeypatch.setitem(collectives._KINDS, "ar", lambda *a: calls.append(a[0]) or real(*a))
    pricing = Pricing({}, None)
    nbytes = np.full((len(space), 2), 4e6)
    first = assemble.collective_s("ar", assemble.mesh_sizes(c, pricing), ("dp",), nbytes, CLUSTER)
    n = len(calls)
    second = assemble.collective_s("ar", assemble.mesh_sizes(c, pricing), ("dp",), nbytes, CLUSTER)
    placements = {comm.group_placement(space.config(r), ("dp",), CLUSTER.devices_per_node) for r in range(len(space))}
    assert n == len(placements) and len(calls) == n  # once per placement, then remembered
    assert first.tobytes() == second.tobytes()


def test_int_codes_tell_rows_apart_as_unique_does() -> None:
    rng = np.random.default_rng(3)
    cols = [rng.integers(0, 5, 400), rng.integers(0, 3000, 400), rng.choice([1, 2**40], 400)]
    for columns in (cols, [c * 2**20 for c in cols]):  # the second overflows the mixed radix: ranked instead
        _, want = np.unique(np.stack(columns, axis=1), axis=0, return_inverse=True)
        _, got = np.unique(int_codes(*columns), return_inverse=True)
        assert np.array_equal(want.reshape(-1), got.reshape(-1))


def test_quick_estimate_in_chunks_with_classes_equals_one_piece_without(monkeypatch: pytest.MonkeyPatch) -> None:
    """The quick estimate as the search makes it (chunks of whole keys, shared prices, classes) equals one
    assembly of each pipeline shape with no classes and no shared prices, bit for bit."""
    space = _space()
    fast = surrogate.quick_estimate(MOE, CLUSTER, space, 64, cost)
    monkeypatch.setattr(surrogate, "CHUNK", 10**9)
    monkeypatch.setattr(surrogate, "Pricing", lambda prices, classes: None)
    plain = surrogate.quick_estimate(MOE, CLUSTER, space, 64, cost)
    for f in dataclasses.fields(fast):
        assert getattr(fast, f.name).tobytes() == getattr(plain, f.name).tobytes(), f.name


def test_chunks_cover_every_row_and_keep_each_key_whole() -> None:
    keys = np.sort(np.random.default_rng(5).integers(0, 40, 1000))
    parts = surrogate._chunks(keys, 64)
    assert np.array_equal(np.concatenate([keys[p] for p in parts]), keys)
    assert all(keys[a.stop - 1] != keys[b.start] for a, b in itertools.pairwise(parts))
    assert max(p.stop - p.start for p in parts) < 64 + np.bincount(keys).max()


@pytest.mark.parametrize("axes", [("dp", "ep", "cp"), assemble.EXPERT_DP])
def test_collectives_priced_per_class_spread_equal_each_candidate_priced_alone(axes: tuple[str, ...]) -> None:
    """collective_s(per_class=True) on one row of values per class of the mesh, spread to the candidates, is
    cost.comm on each candidate's own row, when the rows of a class share their values (Mesh.uniform, which
    says no as soon as one row differs)."""
    space = _space()
    rng = np.random.default_rng(8)
    rows = rng.choice(len(space), 300, replace=False)
    c = {k: v[rows] for k, v in space.columns.items()}
    classes = int_codes(c["tp"], c["cp"], c["ep"], rng.integers(0, 3, len(rows)))  # a class: one mesh or split
    base = rng.choice([0.0, 1e3, 5e6, 2.5e8, 1e10], size=(classes.max() + 1, 4))
    mesh = assemble.mesh_sizes(c, Pricing({}, classes))
    nbytes = base[classes[mesh.reps]][mesh.inverse]  # every row its class's values
    assert mesh.uniform(nbytes)
    got = assemble.collective_s("rs", mesh, axes, nbytes[mesh.reps], CLUSTER, per_class=True)[mesh.inverse]
    assert got.tobytes() == _direct("rs", space, rows, axes, nbytes).tobytes()
    member = np.nonzero(mesh.reps[mesh.inverse] != np.arange(len(rows)))[0][0]  # a row not its class's own
    nbytes[member, 1] += 1.0
    assert not mesh.uniform(nbytes)
