"""The quick estimate's form of FSDP2's root group and torchtitan's kept last block (cost/fsdpunits.py), over
[candidates, pipeline ranks] arrays: cost.fsdpunits.root_terms, called on the arrays, says which elements
leave the non-block layers' own slots and where they go; the quick estimate (search/assemble.py) then spreads
the rank's remaining collectives over its blocks as equal units (the closed form of search/exposed.py) and
adds the root group's own collectives whole: its forward all-gather comes before the rank's first layer, its
backward re-gather before the first backward, its reduction after the last backward, none with compute
after it on the rank (cost.overlap.overlapped_s: exposed in full). The kept last block drops one unit's
backward gather, the one the closed form exposes (its g + (L - 1) max(0, g + q - c) + q less g: the rank's
backward opens on that block without waiting, as the exact model's two streams do).

With the root group, the closed form's units are the blocks, and so is its compute c: the layers the root
group holds compute before the rank's first block or after its last, where no collective of the blocks
runs beside them (cost.overlap.overlapped_s) but the first block's prefetched gather (issued when the layer
before it starts): the embedding's forward, the head's backward hide min(g, their compute) of it, the rest
of it slowing them by SM contention as any hidden collective does (overlap.hidden_penalty_s). The non-block
layers' freed-gradient saving (cost.estimate.fresh_grad_share) is left in their backward.

Where the exact model applies them (cost.dataparallel.rank_dp_times: FSDP2 engines, one chunk per rank)
the rank's terms are here; elsewhere `quick_root` is None and the quick estimate is what it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from autoplan.cost.fsdpunits import RootTerms, root_terms
from autoplan.graph.types import LayerGraph, LayerRole
from autoplan.plan.engine import Engine

# rank_roots' fields per layer-table key ([keys, p]; built where uses_roots) and per rank ([p]; always:
# DeepSpeed's stage 3 reads rank_blocks too, search/deepspeed_terms.py)
ROOT_PER_KEY = ("root_params", "root_fwd", "root_bwd", "lead_fwd", "tail_bwd")
ROOT_SHARED = ("root_layers", "rank_blocks", "head_and_block")


@dataclass(frozen=True, slots=True)
class QuickRoot:
    """One pipeline shape's root-group terms: `units` [1, p] equal units a rank's own collectives spread
    over (its blocks where a root group holds the rest, else its layers), `dense` [n, p] their dense
    elements, and cost.fsdpunits.root_terms' `terms` over the arrays: the root group's elements gathered
    forward (`fwd_first`), backward (`bwd_first`) and reduced (`reduce_last`) [n, p], and `kept` [1, p] (1
    where the last block skips its backward gather)."""

    units: np.ndarray
    dense: np.ndarray
    terms: RootTerms
    fwd: np.ndarray  # [n, p] forward seconds of the layers the root group holds (0 where none)
    bwd: np.ndarray  # ... their backward
    lead_fwd: np.ndarray  # [n, p] forward seconds of those before the rank's first block
    tail_bwd: np.ndarray  # ... backward seconds of those after its last block

    @property
    def fwd_first(self) -> np.ndarray:
        return self.terms.fwd_first

    @property
    def bwd_first(self) -> np.ndarray:
        return self.terms.bwd_first

    @property
    def reduce_last(self) -> np.ndarray:
        return self.terms.reduce_last

    @property
    def kept(self) -> np.ndarray:
        return self.terms.kept_blocks

    def first_hidden(self, gather: np.ndarray, before: np.ndarray, frac, prefetch: bool) -> np.ndarray:
        """What the first block's prefetched gather (`gather` over the units, one unit's) costs less than the
        closed form's g once the `before` seconds of compute ahead of it hide min(g, before) of it: that,
        less the SM contention it causes (`frac`); nothing without prefetch (Engine.param_gather_overlap)."""
        return (1.0 - frac) * np.minimum(gather / self.units, before) if prefetch else 0.0 * before

    def bwd_gathered(self, expert: np.ndarray) -> np.ndarray:
        """Elements the backward gathers (and FSDP2 copies out): the units' less a kept block, the root's."""
        return self.dense - self.kept * self.dense / self.units + self.bwd_first + expert


def uses_roots(engine: Engine, v: int) -> bool:
    """Whether the quick estimate prices FSDP2's root group and kept last block for `engine` at `v` chunks
    per rank (where the exact model has them, cost.dataparallel.rank_dp_times: FSDP2, one chunk per rank)
    and they move anything (a root unit, or a last block kept gathered)."""
    return (engine.zero3 == "fsdp2" and v == 1
            and (engine.fsdp_root_unit or not engine.fsdp_last_block_reshards))


def rank_roots(graph: LayerGraph, table: np.ndarray, keys: np.ndarray, bounds: np.ndarray,
               ranks: tuple[int, ...], pp: int, cols: dict[str, int], *, tables: bool = True) -> dict[str, np.ndarray]:
    """Per rank of one pipeline shape (stage s holds layers bounds[s]:bounds[s + 1], on rank ranks[s]), of
    its non-block layers: with `tables` (uses_roots; nothing else reads them), dense elements, forward and
    backward seconds, those before its first block (forward) and after its last (backward) [keys, p]
    (ROOT_PER_KEY, from layer-table columns cols["dense"], ["fwd"], ["time"]); always its non-block layers
    and blocks [p], and whether it holds the head and a block [p] (ROOT_SHARED; cost.fsdpunits.unit_numels'
    inputs)."""
    out = {k: np.zeros((len(keys), pp)) for k in ROOT_PER_KEY} if tables else {}
    roots, blocks, head = np.zeros(pp), np.zeros(pp), np.zeros(pp)
    for s, r in enumerate(ranks):
        span = range(int(bounds[s]), int(bounds[s + 1]))
        held = [i for i in span if graph.layers[i].role is LayerRole.BLOCK]
        for i in (i for i in span if graph.layers[i].role is not LayerRole.BLOCK):
            if tables:
                _add_root_layer(out, table, keys, i, r, cols, held)
            roots[r] += 1.0
            head[r] = max(head[r], float(graph.layers[i].role is LayerRole.HEAD))
        blocks[r] += len(held)
    return {**out, "root_layers": roots, "rank_blocks": blocks, "head_and_block": head * (blocks > 0)}


def _add_root_layer(out: dict[str, np.ndarray], table: np.ndarray, keys: np.ndarray, i: int, r: int,
                    cols: dict[str, int], held: list[int]) -> None:
    """Non-block layer i's terms added to rank r's ROOT_PER_KEY tables (`held`: the rank's stage's blocks)."""
    fwd, bwd = table[keys, i, cols["fwd"]], table[keys, i, cols["time"]] - table[keys, i, cols["fwd"]]
    out["root_params"][:, r] += table[keys, i, cols["dense"]]
    out["root_fwd"][:, r] += fwd
    out["root_bwd"][:, r] += bwd
    out["lead_fwd"][:, r] += fwd if not held or i < held[0] else 0.0
    out["tail_bwd"][:, r] += bwd if held and i > held[-1] else 0.0


def quick_root(extra: dict[str, np.ndarray], dense: np.ndarray, layers: np.ndarray, v: int,
               engine: Engine) -> QuickRoot | None:
    """The terms where the exact model has them (FSDP2, one chunk per rank, rank_roots' fields in `extra`)
    and they move anything; `dense` [n, p] the rank's dense elements, `layers` [1, p] its layers."""
    if not uses_roots(engine, v) or "root_params" not in extra:
        return None
    grouped = engine.fsdp_root_unit & (extra["root_layers"] > 0)[None, :]
    terms = root_terms(np.where(grouped, extra["root_params"], 0.0), extra["head_and_block"][None, :], engine)
    units = np.where(grouped, np.maximum(extra["rank_blocks"], 1.0)[None, :], layers)

    def held(name: str) -> np.ndarray:
        return np.where(grouped, extra[name], 0.0)

    return QuickRoot(units=units, dense=dense - terms.grouped, terms=terms, fwd=held("root_fwd"),
                     bwd=held("root_bwd"), lead_fwd=held("lead_fwd"), tail_bwd=held("tail_bwd"))


@dataclass(frozen=True, slots=True)
class RootSeconds:
    """The root group's collectives [n, p], each exposed whole (module docstring): its forward all-gather
    before the rank's first layer, its backward re-gather before the first backward, its reduction after
    the last backward."""

    fwd: np.ndarray
    bwd: np.ndarray
    reduce: np.ndarray


def root_seconds(root: QuickRoot, gather: Callable[[np.ndarray], np.ndarray],
                 reduce: Callable[[np.ndarray], np.ndarray]) -> RootSeconds:
    """The root group's seconds, priced by `gather` and `reduce` on its elements (the quick estimate's
    collective_s at the weights' and the gradients' bytes; zero elements cost zero: cost.comm)."""
    return RootSeconds(fwd=gather(root.fwd_first), bwd=gather(root.bwd_first), reduce=reduce(root.reduce_last))
