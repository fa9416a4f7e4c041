"""The batches a model without tokens trains on (a ViT, a ResNet: ModelSpec.input_shape set): seeded inputs
and class labels, the same under every plan, and each rank's rows.

Inputs ~ N(0, 1) of [global_batch, *input_shape], labels uniform in [0, num_outputs), both drawn from the
step's generator (data.step_generator), so one process is the reference for every plan. The loss is the
mean cross entropy over the samples (train.cross_entropy on [batch, classes] logits). A data-parallel
replica holds contiguous rows (replica dp_rank * ep + ep_rank, as train.local_batch): with a model that
normalises over the batch (BatchNorm), the single-process reference must use the same microbatch size,
which then groups the same samples.
"""

from __future__ import annotations

import torch

from autoplan.execute.data import step_generator
from autoplan.execute.mesh import SubMeshes
from autoplan.plan.types import ParallelConfig


def image_batch(seed: int, step: int, *, global_batch: int, input_shape: tuple[int, ...],
                num_outputs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs [B, *input_shape], labels [B]) of one step."""
    generator = step_generator(seed, step)
    inputs = torch.randn((global_batch, *input_shape), generator=generator)
    return inputs, torch.randint(0, num_outputs, (global_batch,), generator=generator)


def local_rows(batch: tuple[torch.Tensor, torch.Tensor], config: ParallelConfig,
               meshes: SubMeshes) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (inputs, labels): the rows of its data-parallel replica (cp = 1: no sequence to split)."""
    inputs, labels = batch
    replica = meshes.rank_on("dp") * config.ep + meshes.rank_on("ep")
    rows = inputs.shape[0] // config.num_replicas
    mine = slice(replica * rows, (replica + 1) * rows)
    return inputs[mine].contiguous(), labels[mine].contiguous()


__all__ = ["image_batch", "local_rows"]
