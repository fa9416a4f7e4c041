"""The H100 profiles' inter-node fraction reaches the comm model: a ring across nodes moves at per_node NICs x
400 Gb/s x the profile's fraction (NVIDIA's 46-48 GB/s per 400G NIC, nccl-tests issue 290), checked against a
hand computation of cost/comm's ring formula; the RoCE profile is the DGX H100 device on another fabric."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoplan.cluster import Cluster
from autoplan.cost.comm import all_gather_s
from autoplan.cost.types import GroupPlacement

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30


@pytest.mark.parametrize("name", ["dgx-h100-80gb", "h100-roce-400g", "h200"])
def test_cross_node_ring_moves_at_the_fraction_times_the_line_rate(name: str) -> None:
    cluster = Cluster.load(name, num_nodes=2)
    assert cluster.inter_node.allreduce_busbw_fraction == 0.94  # 47 of 50 GB/s per 400G NIC
    group = GroupPlacement(size=8, num_nodes=2, per_node=4)  # 4 NICs per node: the network binds
    nbytes = 8 * GIB
    bw = 4 * 400e9 / 8 * 0.94  # 188 GB/s, below NVLink's 450 x 0.822 = 370
    # Simple protocol at this size: base 35 us (NVLink's, the larger) + 5 NVLink steps x 3.4 us
    # + 2 network steps x 14 us (7 hops, 4 GPUs of the ring per node: ceil(7 / 4) cross it) + 7/8 S / bw
    hand = 3.5e-5 + 5 * 3.4e-6 + 2 * 1.4e-5 + 7 / 8 * nbytes / bw
    assert all_gather_s(nbytes, group, cluster) == pytest.approx(hand, rel=1e-12)
    busbw = 7 / 8 * nbytes / all_gather_s(nbytes, group, cluster)
    assert busbw == pytest.approx(188e9, rel=2e-3)  # nccl-tests' busbw of the model: 0.94 x 200 GB/s


def test_eight_nics_per_node_leave_nvlink_the_bottleneck() -> None:
    """8 x 47 = 376 GB/s of NICs exceed NVLink's 370 GB/s ring (450 x 0.822, nccl-tests#212): the ring runs at 370."""
    cluster = Cluster.load("dgx-h100-80gb", num_nodes=2)
    group = GroupPlacement(size=16, num_nodes=2, per_node=8)
    nbytes = 64 * GIB
    hand = 3.5e-5 + (15 - 2) * 3.4e-6 + 2 * 1.4e-5 + 15 / 16 * nbytes / (450e9 * 0.822)
    assert all_gather_s(nbytes, group, cluster) == pytest.approx(hand, rel=1e-12)


def test_roce_profile_is_the_dgx_h100_device_on_another_fabric() -> None:
    roce, dgx = Cluster.load("h100-roce-400g"), Cluster.load("dgx-h100-80gb")
    assert roce.device == dgx.device and roce.intra_node == dgx.intra_node
    assert roce.inter_node.name == "roce-400g" and dgx.inter_node.name == "infiniband-ndr"
    assert roce.inter_node.bw_bytes_per_s == dgx.inter_node.bw_bytes_per_s == 50e9
    text = (REPO / "profiles" / "h100-roce-400g.yaml").read_text()
    for cited in ("2407.21783", "issue 1368", "issue 267", "issue 290"):
        assert cited in text


def test_llama3_405b_records_use_the_roce_profile_and_say_why() -> None:
    records = json.loads((REPO / "bench/data/published/published_runs.json").read_text())["records"]
    llama = [r for r in records if r["set"] == "llama3-405b"]
    assert len(llama) == 3
    for record in llama:
        assert record["cluster"]["profile"] == "h100-roce-400g"
        assert "RDMA over Converged Ethernet" in record["source"] and "3.3.1" in record["source"]
