"""The quick estimate's collectives per candidate: each candidate's mesh degrees (mesh_sizes,
expert_dp_degree), cost.comm's time of an all-gather, reduce-scatter or all-reduce over a group of them
(collective_s, priced once per distinct question: search/pricing.py), and a rank's gradient reduction per
layer or in the engine's buckets (_bucketed_reduce), a reduce-scatter or an all-reduce by the ZeRO layout
(reduce_s, by_layout). Used by search/assemble.py and search/chunks.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from autoplan.cluster.types import ClusterSpec
from autoplan.cost import comm
from autoplan.cost.experts import expert_dp_placement
from autoplan.plan.types import DENSE_DP  # the dense data-parallel axes; importable from here as before
from autoplan.search.pricing import MESH_COLS, Mesh, Pricing, config_of, price_classes, price_rows

_KINDS = {"ag": comm.all_gather_s, "rs": comm.reduce_scatter_s, "ar": comm.all_reduce_s}
# the experts' data-parallel group (cost.experts.expert_dp_placement: dp * cp unfolded, edp when folded)
EXPERT_DP = ("edp",)


def mesh_sizes(c: dict[str, np.ndarray], pricing: Pricing | None = None) -> Mesh:
    """[n, 7] mesh degrees per candidate (MESH_AXIS_ORDER's five, then the folded expert degrees), with what
    pricing their collectives shares (search/pricing.py)."""
    return Mesh.of(np.stack([c[k] for k in MESH_COLS], axis=1), pricing)


def dense_dp_degree(c: dict[str, np.ndarray]) -> np.ndarray:
    """The dense data-parallel group's size per candidate (DENSE_DP's): dp * ep * cp."""
    return c["dp"] * c["ep"] * c["cp"]


def expert_dp_degree(c: dict[str, np.ndarray]) -> np.ndarray:
    """ParallelConfig.expert_dp per candidate: dp * ep * cp * tp / (expert_tp * expert_ep)."""
    etp = np.where(c["etp"] > 0, c["etp"], c["tp"])
    eep = np.where(c["eep"] > 0, c["eep"], c["ep"])
    return c["dp"] * c["ep"] * c["cp"] * c["tp"] // (etp * eep)


def collective_s(kind: str, sizes: Mesh, axes: tuple[str, ...], nbytes: np.ndarray,
                 cluster: ClusterSpec, per_class: bool = False) -> np.ndarray:
    """cost.comm's time of `kind` ('ag', 'rs', 'ar') for each candidate's group over `axes` (the mesh from
    mesh_sizes; EXPERT_DP for the experts' data-parallel group) and message size (an array [n] or [n, p];
    with `per_class`, one row per class of the mesh, and so the result); each distinct (group placement,
    bytes) pair is priced once (search/pricing.py)."""
    mesh = sizes if isinstance(sizes, Mesh) else Mesh.of(sizes)
    per_node = cluster.devices_per_node
    if axes == EXPERT_DP:
        def place(row: tuple[int, ...]) -> Any:
            return expert_dp_placement(config_of(row), per_node)
    else:
        def place(row: tuple[int, ...]) -> Any:
            return comm.group_placement(config_of(row), axes, per_node)
    fn = _KINDS[kind]
    price = price_classes if per_class else price_rows
    return price(mesh, np.round(np.asarray(nbytes, dtype=float)), place, lambda b, group: fn(b, group, cluster),
                 (axes, kind))


def by_layout(lay: dict[str, np.ndarray], rs: Any, ar: Any) -> Any:
    """The gradient reduction's seconds by each candidate's layout (plan.layout.zero_layout's grad_reduction,
    assemble.layouts' "reduce_scatter"): `rs` where it reduce-scatters, else `ar` ([n, p] or broadcast)."""
    return np.where(scatters(lay), rs, ar)


def scatters(lay: dict[str, np.ndarray]) -> np.ndarray:
    """Whether each candidate's layout reduce-scatters its gradients [n, 1] (else it all-reduces them)."""
    return lay["reduce_scatter"][:, None] > 0


def reduce_s(sizes: Mesh, axes: tuple[str, ...], nbytes: np.ndarray, cluster: ClusterSpec,
             lay: dict[str, np.ndarray]) -> np.ndarray:
    """A gradient reduction of `nbytes` over each candidate's group over `axes`: collective_s's
    reduce-scatter or all-reduce, by its layout (by_layout)."""
    return by_layout(lay, collective_s("rs", sizes, axes, nbytes, cluster), collective_s("ar", sizes, axes, nbytes, cluster))


def _bucket_count(params: np.ndarray, layers: np.ndarray, bucket: int) -> np.ndarray:
    """How many collectives a rank's gradients take: one per layer, or per bucket of `bucket` elements."""
    if not bucket:
        return layers
    return np.maximum(np.ceil(params / bucket), 1.0)


def _bucketed_reduce(per_layer_total, params, layers, sizes, lay, wire, cluster, engine, bucket=None) -> np.ndarray:
    """Reduction time of a rank's gradients: per layer, or in the engine's buckets (dp_bucket_numel, or
    `bucket` elements: np.inf for one collective of them all)."""
    bucket = engine.dp_bucket_numel if bucket is None else bucket
    if not bucket:
        return per_layer_total
    buckets = _bucket_count(params, layers, bucket)
    one = np.minimum(params / buckets, bucket) * wire
    return reduce_s(sizes, DENSE_DP, one, cluster, lay) * buckets
