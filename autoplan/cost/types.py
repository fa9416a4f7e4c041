"""The cost model's values: the cost of one layer on one device, and where a device group sits.

Frozen, hashable; the search codes against LayerCost (see the cost <-> search contract).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerCost:
    """One layer, one microbatch, on one device, under a config and a recompute mode."""

    fwd_s: float  # forward compute (after the tp / cp / ep split)
    bwd_s: float  # backward compute (input + weight gradients)
    bwd_weight_s: float  # the weight-gradient part of bwd_s (zero-bubble schedules defer it)
    recompute_s: float  # extra forward work in backward under this recompute mode
    tp_comm_s: float  # exposed TP / SP communication, forward + backward (+ the recomputed forward's)
    cp_comm_s: float  # exposed CP key/value exchange, forward + backward
    ep_comm_s: float  # exposed EP all-to-all dispatch + combine, forward + backward
    act_mem_bytes: int  # activation bytes held per in-flight microbatch under this recompute mode
    param_count: int  # parameters held by this device (after the tp / ep split, before ZeRO)
    grad_param_count: int  # parameters whose gradients are data-parallel reduced over dp*ep*cp (dense)
    expert_param_count: int  # ... and expert parameters, reduced over dp*cp only
    output_bytes: int  # activation this device sends to the next stage if a pipeline cut follows
    # extension (default 0, additive to the contract): working memory of this layer's backward beyond
    # what is held per microbatch (the re-materialised activations under full / selective recompute)
    work_mem_bytes: int = 0
    # extension (default 0): the part of tp_comm_s + cp_comm_s + ep_comm_s spent in the forward pass
    fwd_comm_s: float = 0.0
    # extension (default 0): host time to issue the layer's ops in one microbatch (fwd, bwd, recompute),
    # and the kernels' device time; fwd_s / bwd_s / recompute_s are already max(device, host) per phase
    host_s: float = 0.0
    device_s: float = 0.0
    # extension (default 0): what bwd_s (and bwd_weight_s) lose when the weight gradients land in a freed
    # .grad (Engine.grad_freed_after_reduce): the weight-gradient GEMMs write their output once instead of
    # accumulating into the gradient; estimate_config applies it to the microbatches it holds for
    fresh_grad_saving_s: float = 0.0

    @property
    def time_s(self) -> float:
        return (self.fwd_s + self.bwd_s + self.recompute_s
                + self.tp_comm_s + self.cp_comm_s + self.ep_comm_s)

    @property
    def forward_s(self) -> float:
        """The layer's forward seconds: its forward compute and the tp / cp / ep traffic exposed in forward
        (the rest of time_s is its backward, recompute included)."""
        return self.fwd_s + self.fwd_comm_s

    @property
    def comm_s(self) -> float:
        return self.tp_comm_s + self.cp_comm_s + self.ep_comm_s


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupPlacement:
    """Where the members of one communication group sit: `size` ranks over `num_nodes` nodes, at
    least `per_node` of them in each node it spans (the ring's bottleneck node)."""

    size: int
    num_nodes: int
    per_node: int

    @property
    def crosses_nodes(self) -> bool:
        return self.num_nodes > 1
