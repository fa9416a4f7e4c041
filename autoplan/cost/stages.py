"""Checks that a ParallelConfig can run a LayerGraph on a cluster, and the default pipeline split.
"""

from __future__ import annotations

from autoplan.cluster.types import ClusterSpec
from autoplan.graph.types import LayerGraph, LayerRole
from autoplan.plan.layout import default_stages
from autoplan.plan.types import ParallelConfig


def check_config(graph: LayerGraph, cluster: ClusterSpec, config: ParallelConfig, global_batch: int, *,
                 explicit_stages: bool = False) -> int:
    """Raise ValueError (one line, with the numbers) for a config that cannot run; return the number of
    microbatches per pipeline per step. Memory is not checked here (estimates say fits=False).
    `explicit_stages`: the caller gives its own split (check_stages then asks only for non-empty stages),
    so pp * virtual_stages may exceed the blocks: a stage may hold only the embedding or the head, as in
    Llama 3's layout (Dubey et al. 2024, section 3.3.2: "the first model chunk on the first stage has only
    the embedding, and the last model chunk on the last stage has only output projection and loss")."""
    if config.num_devices != cluster.num_devices:
        raise ValueError(f"config uses pp*dp*ep*cp*tp = {config.num_devices} devices but cluster "
                         f"{cluster.name!r} has {cluster.num_devices}: make the product {cluster.num_devices}")
    m = config.num_microbatches(global_batch)
    sizes = tuple({**k, "num_blocks": None} for k in graph.divisibility_sizes()) if explicit_stages else None
    errors = graph.divisibility_errors(config, sizes=sizes)  # the rules' one home: plan.layout.divisibility_errors
    if errors:
        raise ValueError(errors[0])
    return m


def balanced_stages(graph: LayerGraph, config: ParallelConfig | int) -> tuple[tuple[str, ...], ...]:
    """The default split of `graph` for `config` (autoplan.plan.layout.default_stages: the executor calls
    the same function, so the priced split is the split that runs). An int means that many looped
    stages (pp = count, one chunk per rank)."""
    if isinstance(config, int):
        if config < 1:
            raise ValueError(f"num_stages must be >= 1, got {config}")
        config = ParallelConfig(pp=config)
    return default_stages([layer.name for layer in graph.layers],
                          [layer.role is LayerRole.BLOCK for layer in graph.layers], config)


def check_stages(graph: LayerGraph, stages: tuple[tuple[str, ...], ...], num_stages: int) -> tuple[tuple[str, ...], ...]:
    """Validate a given split: num_stages non-empty stages holding every layer once, in model order."""
    stages = tuple(tuple(s) for s in stages)
    if len(stages) != num_stages:
        raise ValueError(f"stages has {len(stages)} entries but pp*virtual_stages = {num_stages}")
    flat = [name for stage in stages for name in stage]
    names = [layer.name for layer in graph.layers]
    if flat != names:
        raise ValueError(f"stages must list all {len(names)} layers of {graph.model_name!r} once, in model "
                         f"order; got {len(flat)} names")
    if any(not stage for stage in stages):
        raise ValueError("every pipeline stage needs at least one layer")
    return stages
