"""LayerCost.forward_s is the one home of a layer's forward seconds (compute + the tp / cp / ep traffic exposed
in forward), which the data-parallel, pipeline, timeline, p2p, DeepSpeed and surrogate code all split by."""

from autoplan.cost.types import LayerCost


def _cost(fwd_comm_s: float = 0.02) -> LayerCost:
    return LayerCost(fwd_s=0.25, bwd_s=0.5, bwd_weight_s=0.125, recompute_s=0.0625, tp_comm_s=0.03125,
                     cp_comm_s=0.015625, ep_comm_s=0.0078125, act_mem_bytes=0, param_count=0, grad_param_count=0,
                     expert_param_count=0, output_bytes=0, fwd_comm_s=fwd_comm_s)


def test_forward_is_compute_plus_forward_traffic():
    c = _cost()
    assert c.forward_s == 0.25 + 0.02  # by hand: fwd_s + fwd_comm_s
    # what is left of time_s is the backward: bwd + recompute + the traffic not spent in forward
    assert abs((c.time_s - c.forward_s) - (0.5 + 0.0625 + 0.03125 + 0.015625 + 0.0078125 - 0.02)) < 1e-15


def test_forward_without_forward_traffic_is_compute():
    assert _cost(fwd_comm_s=0.0).forward_s == 0.25
