"""autoplan() / estimate(): each bad input is one clear ValueError line with the numbers."""

from __future__ import annotations

import pytest
from test_cost_graph_helper import a100_cluster, gpt_graph

import autoplan
from autoplan.cost import estimate_config
from autoplan.plan.types import ParallelConfig

GRAPH = gpt_graph(h=256, a=8, layers=4, seq=256, vocab=1024)
CLUSTER = a100_cluster(2, per_node=8)  # 16 devices


def _est(config, global_batch=16):
    return autoplan.estimate(GRAPH, CLUSTER, config, global_batch=global_batch, seq_len=256)


@pytest.mark.parametrize("config, global_batch, message", [
    ({"tp": 2, "pp": 2}, 10, r"global batch 10 does not divide into dp\*ep=4"),
    ({"tp": 3}, 16, r"16 devices do not divide by tp\*pp\*cp\*ep=3"),
    ({"tp": 2, "pp": 2, "dp": 2}, 16, r"= 8 devices, but the cluster has 16"),
    ({"schedule": "pipedream"}, 16, r"unknown schedule 'pipedream'"),
    ({"recompute": "some"}, 16, r"unknown recompute mode 'some'"),
    ({"tp": 16}, 16, r"tp=16 is larger than a node of 8 devices"),
    ({"tp": 0}, 16, r"tp must be a positive integer, got 0"),
    ({"microbatch": 2.5}, 16, r"microbatch must be a positive integer"),
    ({"tq": 2}, 16, r"unknown config key\(s\) \['tq'\]"),
])
def test_estimate_bad_config_is_one_clear_line(config, global_batch, message) -> None:
    with pytest.raises(ValueError, match=message) as err:
        _est(config, global_batch)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"global_batch": 0, "seq_len": 256}, "global_batch must be a positive integer, got 0"),
    ({"global_batch": 8, "seq_len": -1}, "seq_len must be a positive integer, got -1"),
    ({"global_batch": 8, "seq_len": 128}, "captured at seq_len 256, not 128"),
    ({"global_batch": 8, "seq_len": 256, "colour": 1}, r"unknown option\(s\) \['colour'\]"),
    ({"global_batch": 8, "seq_len": 256, "tp": 16}, "no parallel configuration of 16 devices"),
    ({"global_batch": 8, "seq_len": 256, "recompute": "lots"}, "unknown recompute mode 'lots'"),
])
def test_autoplan_bad_input_is_one_clear_line(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message) as err:
        autoplan.autoplan(GRAPH, CLUSTER, **kwargs)
    assert "\n" not in str(err.value)


def test_estimate_dict_derives_dp_and_matches_the_cost_model() -> None:
    got = _est({"tp": 2, "pp": 2, "microbatch": 2})
    ref = estimate_config(GRAPH, CLUSTER, ParallelConfig(tp=2, pp=2, dp=4, microbatch=2), global_batch=16)
    assert got == ref


def test_unknown_model_and_cluster_names() -> None:
    with pytest.raises(ValueError, match="unknown model 'gpt5'"):
        autoplan.estimate("gpt5", CLUSTER, {}, global_batch=16, seq_len=256)
    with pytest.raises((ValueError, FileNotFoundError)):
        autoplan.estimate(GRAPH, "no-such-cluster", {}, global_batch=16, seq_len=256)
