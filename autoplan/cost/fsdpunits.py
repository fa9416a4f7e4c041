"""FSDP2's parameter groups on one rank and where their collectives fall in the rank's layer order.

Both FSDP2 users autoplan prices wrap each block in `fully_shard` and then the model (or the pipeline stage)
itself: autoplan's executor (execute/fsdp.py apply_data_parallel: `wrap(block)` per block, then
`wrap(model)`) and torchtitan (torchtitan/parallelisms/parallelize_llama.py at 5ddf28e5, 2024-04:
`fully_shard(transformer_block, ...)` per block, then `model = fully_shard(model, **fsdp_config)`). The
outer call's parameter group holds what no block holds -- the embedding, the final norm, the output
projection (Engine.fsdp_root_unit) -- and FSDP2 runs it as one unit (torch/distributed/_composable/fsdp,
spring 2024; torch.distributed.fsdp._fully_shard in 2.13):

- its all-gather is issued by the root's pre-forward hook, before any layer of the rank runs (the
  embedding waits for the whole group, output projection included);
- its reduce-scatter waits for the end of the rank's backward: the root's post-backward hook is registered
  on the module's inputs (RegisterPostBackwardFunction), which for a first stage are token ids without
  gradients, so FSDPState._root_post_backward_final_callback reduces the group after the last layer's
  backward; a later stage's inputs get their gradients last as well;
- it is gathered again for the backward only if it reshards after its forward (Engine.fsdp_root_reshards):
  FSDPState._lazy_init sets the root's post_forward_mesh_info to None ('For the root, do not reshard after
  forward since for training, the parameters would be freed and all-gathered immediately') -- always in
  the spring-2024 code torchtitan ran, in torch 2.13 only while reshard_after_forward is left at its
  default (`_auto_reshard_after_forward`), which autoplan's executor does not do (it passes True).

torchtitan also keeps the last block gathered (parallelize_llama.py: `reshard_after_forward = layer_id <
len(model.layers) - 1`, 'As an optimization, do not reshard after forward for the last transformer block
since FSDP would prefetch it immediately'): Engine.fsdp_last_block_reshards False drops that block's
backward all-gather (the block just before the head, on the rank that holds the head).

Elements per layer slot, in the rank's forward order; dense parameters only (the root group holds no
experts). DeepSpeed's stage 3 (cost/deepspeed.py) gathers per sub-module and does not come here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autoplan.graph.types import Layer, LayerRole
from autoplan.plan.engine import Engine


@dataclass(frozen=True, slots=True)
class UnitNumels:
    """Dense elements each layer slot's collectives move (forward order): the forward all-gather issued
    before that slot, the backward all-gather issued before that slot's backward, and the gradient
    reduction issued after it."""

    fwd_gather: tuple[float, ...]
    bwd_gather: tuple[float, ...]
    reduce: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class RootTerms:
    """What the module docstring's rules do to one rank, in elements (floats, or numpy arrays of ranks
    alike: the quick estimate's vectorised form, search/rootunit.py): `grouped` leave the non-block
    layers' own slots and move as the root group, whole: gathered before the rank's first layer
    (`fwd_first`) and reduced after its last backward (`reduce_last`), those same elements, and again
    gathered before its first backward (`bwd_first`) where the root reshards; `kept_blocks` blocks (0 or 1:
    the last one before the head) skip their backward gather."""

    grouped: Any
    bwd_first: Any
    kept_blocks: Any

    @property
    def fwd_first(self) -> Any:
        return self.grouped

    @property
    def reduce_last(self) -> Any:
        return self.grouped


def root_terms(non_block: Any, head_and_block: Any, engine: Engine) -> RootTerms:
    """The rank's root-group and last-block terms (RootTerms) from `non_block`, the dense elements of its
    layers that no block holds, and `head_and_block`, 1 (True) where it holds the head and a block."""
    root = non_block if engine.fsdp_root_unit else 0.0 * non_block
    kept = 0.0 * head_and_block if engine.fsdp_last_block_reshards else 1.0 * head_and_block
    return RootTerms(grouped=root, bwd_first=root if engine.fsdp_root_reshards else 0.0 * root, kept_blocks=kept)


def unit_numels(layers: Sequence[Layer], counts: Sequence[float], engine: Engine) -> UnitNumels:
    """Per-slot elements of a rank's FSDP2 collectives for `layers` holding `counts` dense parameters
    each (module docstring, root_terms). Without a root unit (or without non-block layers) each slot
    moves its own."""
    n = len(counts)
    blocks = [layer.role is LayerRole.BLOCK for layer in layers]
    own = [float(x) for x in counts]
    last = max((i for i in range(n) if blocks[i]), default=None)
    head = any(layer.role is LayerRole.HEAD for layer in layers) and last is not None
    terms = root_terms(sum(x for x, block in zip(own, blocks) if not block), float(head), engine)
    bwd = list(own)
    if terms.kept_blocks:
        bwd[last] = 0.0
    if not engine.fsdp_root_unit or n == 0 or all(blocks):
        return UnitNumels(fwd_gather=tuple(own), bwd_gather=tuple(bwd), reduce=tuple(own))
    fwd = [x if block else 0.0 for x, block in zip(own, blocks)]
    bwd = [x if block else 0.0 for x, block in zip(bwd, blocks)]
    reduce = list(fwd)
    fwd[0] += terms.fwd_first  # gathered by the root's pre-forward, before the rank's first layer
    reduce[0] += terms.reduce_last  # reduced by the final callback, after the rank's last backward (slot 0's)
    bwd[-1] += terms.bwd_first  # re-gathered by the root's pre-backward, before the first backward (slot n-1's)
    return UnitNumels(fwd_gather=tuple(fwd), bwd_gather=tuple(bwd), reduce=tuple(reduce))


__all__ = ["RootTerms", "UnitNumels", "root_terms", "unit_numels"]
