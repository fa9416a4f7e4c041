"""An intra-node all-reduce's bus bandwidth by the group's size (LinkSpec.allreduce_busbw_fraction_by_ranks):
the shipped DGX A100 profile against the nccl-tests figures it cites (vTrain's AR_GPU{2,4,8} tables), and
the profile field's checks."""

from __future__ import annotations

import dataclasses
import math

import pytest
import yaml

from autoplan.cluster.load import Cluster, dump_profile, parse_profile, read_profile
from autoplan.cost import GroupPlacement, all_gather_s, all_reduce_s

A100 = Cluster.load("dgx-a100-80gb")
GIB = 2.0**30


def _busbw(seconds: float, nbytes: float, n: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce: 2 (n - 1) / n * S / t (its PERFORMANCE.md)."""
    return 2.0 * (n - 1) / n * nbytes / seconds


@pytest.mark.parametrize(("n", "measured"), [(2, 197.28e9), (4, 221.86e9), (8, 229.35e9)])
def test_a_1_gib_all_reduce_has_the_measured_bus_bandwidth_for_its_group_size(n: int, measured: float) -> None:
    # vTrain trace/a100/AR_GPU{n}_1M_1024M_LUT, the 1073741824-byte row: 197.28 / 221.86 / 229.35 GB/s
    group = GroupPlacement(size=n, num_nodes=1, per_node=n)
    busbw = _busbw(all_reduce_s(GIB, group, A100), GIB, n)
    assert busbw == pytest.approx(measured, rel=0.02)


def test_the_fraction_by_ranks_is_the_ring_bandwidth_and_others_keep_the_flat_one() -> None:
    link = A100.intra_node
    group = GroupPlacement(size=2, num_nodes=1, per_node=2)
    flat = dataclasses.replace(A100, intra_node=dataclasses.replace(link, allreduce_busbw_fraction_by_ranks=()))
    # same latency terms, the bandwidth term 2 (n-1)/n S / (300e9 f): the difference is S (1/f2 - 1/f8) / 300e9
    diff = all_reduce_s(GIB, group, A100) - all_reduce_s(GIB, group, flat)
    assert math.isclose(diff, GIB * (1 / 0.658 - 1 / 0.77) / 300e9, rel_tol=1e-9)
    # all-gather and reduce-scatter rings use the all-reduce bus bandwidth (comm.all_gather_s): also by size
    assert all_gather_s(GIB, group, A100) > all_gather_s(GIB, group, flat)
    eight = GroupPlacement(size=8, num_nodes=1, per_node=8)  # not listed: the flat fraction
    assert all_reduce_s(GIB, eight, A100) == all_reduce_s(GIB, eight, flat)


def test_the_field_round_trips_and_rejects_bad_entries(tmp_path) -> None:
    data = read_profile(Cluster.path("dgx-a100-80gb"))
    again = parse_profile(yaml.safe_load(dump_profile(A100)), "again.yaml")
    assert again.intra_node.allreduce_busbw_fraction_by_ranks == A100.intra_node.allreduce_busbw_fraction_by_ranks
    for bad, says in (({1: 0.5}, "group size 1 must be an integer >= 2"), ({2: 1.5}, "must be in (0, 1]"),
                      ([0.6, 0.7], "must map group sizes to fractions")):
        broken = {**data, "intra_node": {**data["intra_node"], "allreduce_busbw_fraction_by_ranks": bad}}
        with pytest.raises(ValueError, match=r"intra_node\.allreduce_busbw_fraction_by_ranks") as err:
            parse_profile(broken, "p.yaml")
        assert says in str(err.value)
