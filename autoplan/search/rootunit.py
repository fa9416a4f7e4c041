"""The quick estimate's form of FSDP2's root group and torchtitan's kept last block (cost/fsdpunits.py), over
[candidates, pipeline ranks] arrays: cost.fsdpunits.root_terms, called on the arrays, says which elements
leave the non-block layers' own slots and where they go; the quick estimate (search/assemble.py) then spreads
the rank's remaining collectives over its blocks as equal units (the closed form of search/exposed.py) and
adds the root group's own collectives whole: its forward all-gather comes before the rank's first layer, its
backward re-gather before the first backward, its reduction after the last backward, none with compute
after it on the rank (cost.overlap.overlapped_s: exposed in full). The kept last block drops one unit's
backward gather, the one the closed form exposes (its g + (L - 1) max(0, g + q - c) + q less g: the rank's
backward opens on that block without waiting, as the exact model's two streams do).

Where the exact model applies them (cost.dataparallel.rank_dp_times: FSDP2 engines, one chunk per rank)
the rank's terms are here; elsewhere `quick_root` is None and the quick estimate is what it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from autoplan.cost.fsdpunits import root_terms
from autoplan.graph.types import LayerGraph, LayerRole
from autoplan.plan.engine import Engine


@dataclass(frozen=True, slots=True)
class QuickRoot:
    """One pipeline shape's root-group terms: `units` [1, p] equal units a rank's own collectives spread
    over (its blocks where a root group holds the rest, else its layers), `dense` [n, p] their dense
    elements, the root group's elements gathered forward (`fwd_first`), backward (`bwd_first`) and
    reduced (`reduce_last`) [n, p], and `kept` [1, p] (1 where the last block skips its backward gather)."""

    units: np.ndarray
    dense: np.ndarray
    fwd_first: np.ndarray
    bwd_first: np.ndarray
    reduce_last: np.ndarray
    kept: np.ndarray

    def bwd_gathered(self, expert: np.ndarray) -> np.ndarray:
        """Elements the backward gathers (and FSDP2 copies out): the units' less a kept block, the root's."""
        return self.dense - self.kept * self.dense / self.units + self.bwd_first + expert


def rank_roots(graph: LayerGraph, table: np.ndarray, keys: np.ndarray, bounds: np.ndarray,
               ranks: tuple[int, ...], pp: int, dense_col: int) -> dict[str, np.ndarray]:
    """Per rank of one pipeline shape (stage s holds layers bounds[s]:bounds[s + 1], on rank ranks[s]): the
    dense elements of its non-block layers [keys, p] (layer-table column `dense_col`), its non-block layers
    and blocks [p], and whether it holds the head and a block [p] (cost.fsdpunits.unit_numels' inputs)."""
    non_block, roots, blocks, head = np.zeros((len(keys), pp)), np.zeros(pp), np.zeros(pp), np.zeros(pp)
    for s, r in enumerate(ranks):
        for i in range(int(bounds[s]), int(bounds[s + 1])):
            role = graph.layers[i].role
            if role is LayerRole.BLOCK:
                blocks[r] += 1.0
                continue
            non_block[:, r] += table[keys, i, dense_col]
            roots[r] += 1.0
            head[r] = max(head[r], float(role is LayerRole.HEAD))
    return {"root_params": non_block, "root_layers": roots, "rank_blocks": blocks,
            "head_and_block": head * (blocks > 0)}


def quick_root(extra: dict[str, np.ndarray], dense: np.ndarray, layers: np.ndarray, v: int,
               engine: Engine) -> QuickRoot | None:
    """The terms where the exact model has them (FSDP2, one chunk per rank, rank_roots' fields in `extra`)
    and they move anything; `dense` [n, p] the rank's dense elements, `layers` [1, p] its layers."""
    if engine.zero3 != "fsdp2" or v != 1 or "root_params" not in extra:
        return None
    if not engine.fsdp_root_unit and engine.fsdp_last_block_reshards:
        return None
    grouped = engine.fsdp_root_unit & (extra["root_layers"] > 0)[None, :]
    terms = root_terms(np.where(grouped, extra["root_params"], 0.0), extra["head_and_block"][None, :], engine)
    units = np.where(grouped, np.maximum(extra["rank_blocks"], 1.0)[None, :], layers)
    return QuickRoot(units=units, dense=dense - terms.grouped, fwd_first=terms.fwd_first,
                     bwd_first=terms.bwd_first, reduce_last=terms.reduce_last, kept=terms.kept_blocks)


def root_seconds(root: QuickRoot, gather: Callable[[np.ndarray], np.ndarray],
                 reduce: Callable[[np.ndarray], np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(forward all-gather, backward re-gather, reduction) seconds of the root group [n, p], priced by
    `gather` and `reduce` on its elements (the quick estimate's collective_s at the weights' and the
    gradients' bytes; zero elements cost zero: cost.comm)."""
    return gather(root.fwd_first), gather(root.bwd_first), reduce(root.reduce_last)
