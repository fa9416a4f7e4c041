"""Distributed checkpoints that a run under one plan can resume under another.

Model and optimizer state go through torch.distributed.checkpoint (DCP) keyed by the reference model's FQNs
(get_state_dict strips FSDP / checkpoint-wrapper / compile prefixes; expert shards are DTensors of the full
[E, f, h] shape), so DCP reshards on load. Layout: `<root>/step-00000010/`, written as `<root>/.step-...tmp`
and renamed once complete, so a crash mid-save leaves the previous checkpoint as the latest loadable one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from autoplan.execute.checkpoint_dirs import _is_complete, _step_of, latest_checkpoint

# Optimizer state keyed by parameter FQN ("state.layers.0.attn.wq.weight.exp_avg"), not by the position of
# the parameter in one rank's optimizer, so it maps across plans and pipeline stages.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _pairs(model_parts: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer] | torch.optim.Optimizer
           ) -> list[tuple[nn.Module, torch.optim.Optimizer]]:
    """One optimizer per model part (one part per local pipeline stage)."""
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    model_parts, optimizers = list(model_parts), list(optimizers)
    if not model_parts or len(model_parts) != len(optimizers):
        raise ValueError(f"checkpoints need one optimizer per model part: got {len(model_parts)} model parts and "
                         f"{len(optimizers)} optimizers; build one optimizer over each part's parameters")
    return list(zip(model_parts, optimizers))


def _state_dicts(pairs: list[tuple[nn.Module, torch.optim.Optimizer]]) -> list[tuple[dict, dict]]:
    """(model state, optimizer state) of each part, in this rank's current layout (DTensors where sharded).

    Note: get_state_dict initialises an optimizer that has no state yet with a zero-gradient, zero-lr step
    (Adam's step counter becomes 1), so save or load before the first optimizer step changes the run."""
    return [get_state_dict(model, optimizer, options=_OPTIONS) for model, optimizer in pairs]


def _merged(parts: list[tuple[dict, dict]], step: int) -> dict[str, Any]:
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for model_sd, optim_sd in parts:
        for target, source, what in ((model, model_sd, "model"), (optim, optim_sd, "optimizer")):
            clash = target.keys() & source.keys()
            if clash:
                raise ValueError(f"{what} state key {min(clash)!r} appears in two model parts: each "
                                 f"parameter must live in exactly one part")
            target.update(source)
    return {"model": model, "optim": optim, "step": torch.tensor(step, dtype=torch.int64)}


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


@contextlib.contextmanager
def _quiet_if_single_process() -> Iterator[None]:
    """Without a process group DCP runs in one process, as wanted here, but warns that it assumes so."""
    with warnings.catch_warnings():
        if not _distributed():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")
        yield


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def save_checkpoint(path: str | os.PathLike, *, step: int, model_parts: Sequence[nn.Module],
                    optimizers: Sequence[torch.optim.Optimizer] | torch.optim.Optimizer, keep: int = 2) -> Path:
    """Save model and optimizer state after `step` optimizer steps; collective (every rank, its own parts).

    `path` is a root directory: the checkpoint goes to `<path>/step-<step, 8 digits>` and all but the newest
    `keep` complete step directories there are removed afterwards. If `path` is itself named `step-N`, the
    checkpoint goes exactly there and nothing is removed. Either way it is written to a hidden `.tmp`
    sibling and renamed once DCP has written its metadata. `path` must be on a filesystem all ranks see.
    Returns the checkpoint directory.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if keep < 1:
        raise ValueError(f"keep must be at least 1 (the checkpoint just written), got {keep}")
    given = Path(path)
    named = _step_of(given) is not None
    final = given if named else given / f"step-{step:08d}"
    root = final.parent
    tmp = root / f".{final.name}.tmp"
    state = _merged(_state_dicts(_pairs(model_parts, optimizers)), step)
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save of this step
    _barrier()
    with _quiet_if_single_process():  # dcp.save returns on every rank once the coordinator wrote the metadata
        dcp.save(state, checkpoint_id=tmp, no_dist=not _distributed())
    if _rank() == 0:
        _replace(tmp, final)
        if not named:
            _prune(root, keep)
    _barrier()
    return final


def _remove(directory: Path) -> None:
    """Rename out of the `step-N` namespace first, so a crash while deleting never leaves a half checkpoint."""
    trash = directory.with_name(f".{directory.name}.old")
    shutil.rmtree(trash, ignore_errors=True)
    directory.rename(trash)
    shutil.rmtree(trash)


def _replace(tmp: Path, final: Path) -> None:
    if final.exists():  # a re-save of the same step
        _remove(final)
    tmp.rename(final)


def _prune(root: Path, keep: int) -> None:
    complete = sorted((d for d in root.iterdir() if _step_of(d) is not None and _is_complete(d)), key=_step_of)
    for old in complete[:-keep]:
        _remove(old)


def load_checkpoint(path: str | os.PathLike, *, model_parts: Sequence[nn.Module],
                    optimizers: Sequence[torch.optim.Optimizer] | torch.optim.Optimizer) -> int:
    """Load the latest complete checkpoint under `path` into this rank's parts and optimizers; collective.

    The parts may be sharded differently from the run that saved it (another plan): DCP reads each rank's
    shards of every tensor it holds. Returns the step stored with the checkpoint (optimizer steps done).
    Raises FileNotFoundError when there is no complete checkpoint under `path`.
    """
    directory = latest_checkpoint(path)
    if directory is None:
        raise FileNotFoundError(f"no complete checkpoint (a step-N directory with DCP metadata) under {path}")
    pairs = _pairs(model_parts, optimizers)
    parts = _state_dicts(pairs)
    state = _merged(parts, step=-1)
    with _quiet_if_single_process():
        dcp.load(state, checkpoint_id=directory, no_dist=not _distributed())
    for (model, optimizer), (model_sd, optim_sd) in zip(pairs, parts):
        # DCP fills tensors in place but replaces non-tensor values (lr, betas, ...) in the merged dicts
        set_state_dict(model, optimizer, options=_OPTIONS,
                       model_state_dict={k: state["model"][k] for k in model_sd},
                       optim_state_dict={k: state["optim"][k] for k in optim_sd})
    return int(state["step"].item())


__all__ = ["latest_checkpoint", "load_checkpoint", "save_checkpoint"]
