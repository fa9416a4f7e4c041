"""The checks `autoplan run` and `autoplan.execute` make in the parent process before any rank starts, each
failure one ValueError (or FileNotFoundError) line saying what to change:

- the run flags agree (steps, checkpoint and resume directories, the data file and the model's vocabulary);
- the plan is consistent (its degrees multiply to its device count, the rank count matches, the batch divides,
  the schedule takes the microbatches) and was made for this model (Plan.fingerprint);
- the model divides as the plan needs (plan.layout.divisibility_errors), the stage layout is the model's, and
  the executor can parallelise every part of it as the plan asks (else: which module, and why);
- the predicted peak memory per rank fits the target: on the CPU the host's RAM divided by the ranks on it,
  on a GPU its memory. The prediction is the larger of the plan's estimate (without its runtime reserve) and
  the executor's own floor: float32 weights, gradients and AdamW states (4 + 4 + 8 bytes per parameter) of
  the parameters a rank holds under the plan's tp / pp / ep split and ZeRO layout (plan.layout.zero_layout).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from autoplan.execute.checkpoint_dirs import latest_checkpoint
from autoplan.plan.layout import divisibility_errors, rank_stages, zero_layout
from autoplan.plan.types import ParallelConfig, Plan, Schedule

if TYPE_CHECKING:  # torch is imported by the model checks, not by the flag checks
    from torch import nn

    from autoplan.execute.source import ModelSpec

_GIB = 2**30
BYTES_PER_PARAM = 4 + 4 + 8  # float32 weight, float32 gradient, AdamW exp_avg + exp_avg_sq (float32)


def check_run_flags(*, steps: int, save_every: int = 0, checkpoint_dir: str | None = None,
                    resume: str | None = None, data: str | None = None) -> None:
    """The flags alone (no model, no torch work)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"--steps must be a positive number of optimizer steps, got {steps!r}")
    if save_every < 0:
        raise ValueError(f"--save-every must be 0 (never) or a positive number of steps, got {save_every}")
    if save_every and not checkpoint_dir:
        raise ValueError(f"--save-every {save_every} needs --checkpoint-dir DIR: where to write the checkpoints")
    if resume is not None:
        if not Path(resume).is_dir():
            raise FileNotFoundError(f"--resume {resume}: no such directory")
        if latest_checkpoint(resume) is None:
            raise ValueError(f"--resume {resume}: no complete checkpoint there (a step-N directory written by "
                             f"--save-every): resume from the --checkpoint-dir of an earlier run")
    if data is not None and not Path(data).is_file():
        raise FileNotFoundError(f"--data {data}: no such file")


def check_plan(plan: Plan | ParallelConfig, *, global_batch: int, nproc_per_node: int | None,
               nnodes: int = 1) -> None:
    config = plan.config if isinstance(plan, Plan) else plan
    if isinstance(plan, Plan) and plan.num_devices != config.num_devices:
        raise ValueError(f"the plan's degrees give pp*dp*ep*cp*tp = {config.pp}*{config.dp}*{config.ep}*{config.cp}*"
                         f"{config.tp} = {config.num_devices} devices but the plan says num_devices "
                         f"{plan.num_devices}: the plan was edited inconsistently; fix the degrees or plan again")
    if nproc_per_node and nproc_per_node * nnodes != config.num_devices:
        raise ValueError(f"the plan needs pp*dp*ep*cp*tp = {config.num_devices} ranks but --nproc-per-node is "
                         f"{nproc_per_node} ({nnodes} node(s): {nproc_per_node * nnodes} ranks): launch "
                         f"{config.num_devices} processes or change the degrees")
    count = config.num_microbatches(global_batch)
    _check_schedule(config, count)


def _check_schedule(config: ParallelConfig, microbatches: int) -> None:
    """torch.distributed.pipelining's own requirements (schedules.py: Schedule1F1B, ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble), checked before launch instead of on every rank."""
    if config.pp == 1:
        return
    if config.schedule is Schedule.ONE_F_ONE_B and microbatches < config.pp:
        raise ValueError(f"schedule 1f1b needs at least pp={config.pp} microbatches per step, got {microbatches}: "
                         f"use a smaller --microbatch or a larger --global-batch")
    rounds = max(1, microbatches // config.pp)
    looped = config.schedule is Schedule.INTERLEAVED or (config.schedule is Schedule.ZERO_BUBBLE
                                                         and config.virtual_stages == 1)
    if looped and config.virtual_stages * config.pp > 1 and microbatches % rounds:
        raise ValueError(f"schedule {config.schedule.value} needs the microbatches per step ({microbatches}) to be a "
                         f"multiple of {rounds} (microbatches // pp): use a multiple of pp={config.pp}")


def check_fingerprint(plan: Plan | ParallelConfig, spec: ModelSpec, meta: nn.Module) -> None:
    """The plan was made for this model: its fingerprint, or for old plans its preset name."""
    if not isinstance(plan, Plan):
        return
    from autoplan.models import PRESETS

    if plan.fingerprint:
        from autoplan.graph.fingerprint import model_fingerprint

        mine = model_fingerprint(meta)
        if mine != plan.fingerprint:
            raise ValueError(f"the plan was made for another model ({plan.model_name}, fingerprint "
                             f"{plan.fingerprint}) than {spec.name} (fingerprint {mine}): plan again for this "
                             f"model (autoplan plan --model ...)")
    elif plan.model_name in PRESETS and spec.is_preset and plan.model_name != spec.name:
        raise ValueError(f"the plan was made for {plan.model_name}, not {spec.name}: plan again for this model, or "
                         f"run it with --model {plan.model_name}")


def model_sizes(spec: ModelSpec, meta: nn.Module) -> dict[str, int]:
    """The sizes divisibility_errors checks: heads, kv heads, FFN width, experts, vocabulary, blocks."""
    if spec.is_preset:
        c = meta.config
        return {"num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads, "ffn_hidden_size": c.ffn_hidden_size,
                "num_experts": c.num_experts, "vocab_size": c.vocab_size, "num_blocks": c.num_layers}
    roles = spec.roles
    blocks = [b for _, b in roles.blocks]
    return {"num_heads": _common(b.num_heads for b in blocks), "num_kv_heads": _common(b.num_kv_heads for b in blocks),
            "ffn_hidden_size": _common(b.ffn_hidden_size for b in blocks),
            "num_experts": max((b.num_experts for b in blocks), default=0), "vocab_size": roles.vocab_size,
            "num_blocks": len(blocks)}


def _common(values) -> int:
    known = {v for v in values if v}
    return min(known) if len(known) == 1 else 0


def check_divisibility(config: ParallelConfig, sizes: dict[str, int], *, seq_len: int, global_batch: int,
                       vocab_sharded: bool) -> None:
    errors = divisibility_errors(config, seq_len=seq_len, global_batch=global_batch,
                                 **{**sizes, "vocab_size": sizes["vocab_size"] if vocab_sharded else 0})
    if errors:
        raise ValueError(errors[0])


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_target(ranks_here: int) -> tuple[int, str]:
    """(bytes a rank may use, how that was found)."""
    import torch

    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        return total, f"a GPU here has {total / _GIB:.1f} GiB"
    total = host_memory_bytes()
    return total // max(ranks_here, 1), (f"this host has {total / _GIB:.1f} GiB of RAM for {ranks_here} rank(s), "
                                         f"{total / max(ranks_here, 1) / _GIB:.1f} GiB each")


def _stage_blocks(spec: ModelSpec, meta: nn.Module, plan: Plan | ParallelConfig) -> tuple[tuple[str, ...], ...]:
    """The blocks of each pipeline stage (checking the plan's stage layout against the model)."""
    config = plan.config if isinstance(plan, Plan) else plan
    if spec.is_preset and config.pp == 1:
        return (tuple(f"layers.{n}" for n in meta.layers),)
    if spec.is_preset:
        from autoplan.execute.apply import plan_stages  # checks the stage layout

        return tuple(tuple(n for n in s.layer_names if n.startswith("layers.")) for s in plan_stages(meta, plan))
    from autoplan.execute.generic import stage_blocks

    return stage_blocks(spec.roles, plan) if config.pp > 1 else (spec.roles.block_paths,)


def _first_stage_paths(spec: ModelSpec) -> tuple[str, ...]:
    if spec.is_preset:
        return ("embed",)
    from autoplan.graph.types import LayerRole

    return tuple(p for u in spec.roles.layers if u.role is LayerRole.EMBEDDING for p in u.paths)


def _under(name: str, paths) -> str | None:
    return next((p for p in paths if name == p or name.startswith(p + ".")), None)


def floor_bytes_per_rank(spec: ModelSpec, meta: nn.Module, plan: Plan | ParallelConfig, *,
                         global_batch: int) -> tuple[int, int]:
    """(bytes, parameters) of the most loaded rank's float32 weights, gradients and AdamW states: block and
    embedding / head parameters split over tp (a lower bound: norms stay whole), experts over ep, each
    sharded over the data-parallel group where the ZeRO layout shards it."""
    config = plan.config if isinstance(plan, Plan) else plan
    split = _stage_blocks(spec, meta, plan)
    layout = zero_layout(config, config.num_microbatches(global_batch))
    block_of = {b: i for i, blocks in enumerate(split) for b in blocks}
    first = _first_stage_paths(spec)
    per_stage = [0.0] * len(split)
    count = [0.0] * len(split)
    for name, p in meta.named_parameters():
        block = _under(name, block_of)
        stage = block_of[block] if block else (0 if _under(name, first) else len(split) - 1)
        expert = ".experts." in f".{name}"
        group = config.dp * config.cp * (1 if expert else config.ep)
        n = p.numel() / (config.ep if expert else config.tp)
        w = 4 * n / (group if layout.shards_weights else 1)
        g = 4 * n / (group if layout.shards_gradients else 1)
        o = 8 * n / (group if layout.shards_optimizer else 1)
        per_stage[stage] += w + g + o
        count[stage] += n
    ranks = [rank_stages(config, r) for r in range(config.pp)] if config.pp > 1 else [(0,)]
    worst = max(ranks, key=lambda stages: sum(per_stage[s] for s in stages))
    return int(sum(per_stage[s] for s in worst)), int(sum(count[s] for s in worst))


def check_memory(spec: ModelSpec, meta: nn.Module, plan: Plan | ParallelConfig, *, global_batch: int,
                 ranks_here: int) -> None:
    floor, params = floor_bytes_per_rank(spec, meta, plan, global_batch=global_batch)
    predicted, what = floor, (f"float32 weights, gradients and AdamW states of its {params / 1e9:.2f} B "
                              f"parameters")
    if isinstance(plan, Plan):
        m = plan.estimate.memory
        estimate = m.total_bytes - m.reserve if m.total_bytes else plan.estimate.peak_mem_bytes
        if estimate > predicted:
            predicted, what = estimate, f"the plan's predicted peak on {plan.cluster_name}, runtime reserve aside"
    target, where = memory_target(ranks_here)
    if predicted > target:
        raise ValueError(f"the plan needs about {predicted / _GIB:.1f} GiB per rank ({what}) but {where}: shard "
                         f"more (larger tp or pp, zero=3, more ranks) or run on a machine with more memory")


def preflight(plan: Plan | ParallelConfig, spec: ModelSpec, meta: nn.Module, *, global_batch: int, seq_len: int,
              nproc_per_node: int | None = None, nnodes: int = 1, data: str | None = None) -> None:
    """Every check after the flags' (check_run_flags), in the order a user fixes them; ValueError on the first."""
    from autoplan.execute.support import unsupported

    config = plan.config if isinstance(plan, Plan) else plan
    check_plan(plan, global_batch=global_batch, nproc_per_node=nproc_per_node, nnodes=nnodes)
    check_fingerprint(plan, spec, meta)
    sizes = model_sizes(spec, meta)
    # presets always split the vocabulary over tp; other models keep embedding and head whole when tp does not
    # divide it (tensor_parallel.vocab_parallel)
    check_divisibility(config, sizes, seq_len=seq_len, global_batch=global_batch, vocab_sharded=spec.is_preset)
    problem = unsupported(spec, meta, config, seq_len=seq_len)
    if problem:
        raise ValueError(problem)
    check_memory(spec, meta, plan, global_batch=global_batch, ranks_here=nproc_per_node or config.num_devices)
    if data is not None and spec.input_shape:
        raise ValueError(f"--data {data}: a token file, but {spec.name} takes inputs of shape {spec.input_shape}, not "
                         f"tokens: drop --data (it trains on seeded inputs and class labels)")
    if data is not None:
        from autoplan.execute.data import load_tokens

        load_tokens(data, vocab_size=sizes["vocab_size"], seq_len=seq_len)


__all__ = ["BYTES_PER_PARAM", "check_divisibility", "check_fingerprint", "check_memory", "check_plan",
           "check_run_flags", "floor_bytes_per_rank", "host_memory_bytes", "memory_target", "model_sizes",
           "preflight"]
