"""The training loop every plan runs: seeded model and data, AdamW, N steps, and the run report.

The same seed gives the same initial weights (the full model is built on CPU after
torch.manual_seed(seed), before any sharding) and the same data (the global batch of step k is drawn
from a torch.Generator seeded with (seed * 1000003 + k) mod 2^32), so one process with tp = pp = dp = 1 is the
reference for every plan. Loss: mean next-token cross entropy over all tokens of the global batch; cp ranks
hold equal zig-zag shards of each sequence (chunks r and 2cp-1-r of 2*cp), so their mean loss is exact. A model
without tokens (ModelSpec.input_shape: a ViT, a ResNet) trains on seeded inputs and class labels
(execute.images), its loss the mean cross entropy over the samples.
"""

from __future__ import annotations

import contextlib
import dataclasses
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from autoplan.execute.apply import apply_plan, config_of, recompute_lookup
from autoplan.execute.checkpoint import load_checkpoint, save_checkpoint
from autoplan.execute.context import zigzag_positions
from autoplan.execute.data import (  # noqa: F401 - the data functions' home was this module
    TOKEN_FILE_FORMATS,
    load_tokens,
    make_batch,
    sample_windows,
    step_generator,
)
from autoplan.execute.experts import check_expert_layout
from autoplan.execute.fsdp import prepare_microbatch
from autoplan.execute.generic import build_generic_parts
from autoplan.execute.gradnorm import global_grad_norm
from autoplan.execute.images import image_batch, local_rows
from autoplan.execute.mesh import SubMeshes, build_expert_mesh, build_mesh, sub_meshes
from autoplan.execute.pipeline import (
    SCALE_GRADS,
    build_schedule,
    holds_first_stage,
    holds_last_stage,
    local_stage_indices,
)
from autoplan.execute.recompute import original_fqn
from autoplan.execute.source import ModelSpec
from autoplan.execute.trace import ActionTrace
from autoplan.models import Transformer, TransformerConfig, preset, preset_config
from autoplan.plan.layout import ZeroLayout, divisibility_errors, zero_layout
from autoplan.plan.types import ParallelConfig, Plan


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainOptions:
    """What to run besides the plan. lr / weight_decay are AdamW's (recorded in the report)."""

    steps: int
    global_batch: int
    seq_len: int
    seed: int = 0
    lr: float = 1e-3
    weight_decay: float = 0.01
    save_every: int = 0  # 0: never
    checkpoint_dir: str | None = None
    resume: str | None = None  # a checkpoint directory to start from
    data: str | None = None  # a token file (see load_tokens); None: synthetic uniform tokens
    trace: bool = False  # record the pipeline's action timestamps (execute.trace) into TrainResult.actions

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.save_every and not self.checkpoint_dir:
            raise ValueError(f"save_every={self.save_every} needs a checkpoint directory (--checkpoint-dir)")


@dataclass
class TrainResult:
    """Per-step global mean losses (identical on every rank), step times and this rank's peak memory."""

    losses: list[float]
    step_times_s: list[float]
    peak_mem_bytes: int
    start_step: int = 0
    parts: list[nn.Module] = field(default_factory=list, repr=False)
    grad_norms: list[float] = field(default_factory=list)  # global gradient norm per step (execute.gradnorm)
    actions: list[list[Any]] = field(default_factory=list)  # the last step's, with options.trace


def build_model(model_name: str, seed: int) -> Transformer:
    """The full model on CPU, the same weights for the same seed under every plan."""
    torch.manual_seed(seed)
    with torch.device("cpu"):
        return preset(model_name)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over tokens ([B, S, V] logits, [B, S] targets) or samples ([B, C], [B]); logits may be a
    vocab-sharded DTensor (then call it under loss_parallel())."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def local_batch(batch: torch.Tensor, config: ParallelConfig, meshes: SubMeshes) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (inputs, targets): rows of replica dp_rank * ep + ep_rank; columns of its cp shard, the
    load-balanced ("zig-zag") split of context.zigzag_positions: the sequence cut into 2*cp equal chunks,
    cp rank r holding chunks r and 2cp-1-r (targets: the same positions + 1). All of the sequence when cp = 1."""
    replica = meshes.rank_on("dp") * config.ep + meshes.rank_on("ep")
    rows = batch.shape[0] // config.num_replicas
    positions = zigzag_positions(batch.shape[1] - 1, config.cp, meshes.rank_on("cp"))
    mine = batch[replica * rows:(replica + 1) * rows]
    return mine[:, positions].contiguous(), mine[:, positions + 1].contiguous()


def _scalar(t: torch.Tensor) -> float:
    return float((t.full_tensor() if isinstance(t, DTensor) else t).detach())


def peak_memory_bytes(device: torch.device) -> int:
    """torch.cuda.max_memory_allocated on GPU; the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


@dataclass
class _Job:
    config: ParallelConfig
    meshes: SubMeshes
    parts: list[nn.Module]
    indices: tuple[int, ...]
    optimizers: list[torch.optim.Optimizer]
    schedule: Any
    device: torch.device
    layout: ZeroLayout  # the ZeRO layout of plan.layout.zero_layout
    vocab_size: int = 0
    trace: ActionTrace | None = None


def check_divides(model_config: TransformerConfig, config: ParallelConfig, options: TrainOptions) -> None:
    """Refuse, with the first line of plan.layout.divisibility_errors (the rule the search filters with and
    the cost model refuses with), a plan whose degrees do not divide the model, the sequence or the batch."""
    c = model_config
    errors = divisibility_errors(config, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads or c.num_heads,
                                 ffn_hidden_size=c.ffn_hidden_size or 0, num_experts=c.num_experts,
                                 vocab_size=c.vocab_size, seq_len=options.seq_len, num_blocks=c.num_layers,
                                 global_batch=options.global_batch)
    if errors:
        raise ValueError(f"{c.name}: {errors[0]}")


def _setup(model_name: str | ModelSpec, plan: Plan | ParallelConfig, options: TrainOptions, device: torch.device) -> _Job:
    config = config_of(plan)
    check_expert_layout(config)
    generic = isinstance(model_name, ModelSpec) and not model_name.is_preset
    if not generic:  # other models: execute.preflight checked them in the parent, with their roles
        model_name = getattr(model_name, "name", model_name)
        check_divides(preset_config(model_name), config, options)
    mesh = build_mesh(config, device_type=device.type)
    meshes = sub_meshes(mesh, build_expert_mesh(config, device_type=device.type))
    num_microbatches = config.num_microbatches(options.global_batch)  # raises when the batch does not divide
    layout = zero_layout(config, num_microbatches)  # what the cost model priced
    if generic:  # any other model: execute.generic
        parts = build_generic_parts(model_name, plan, meshes, device=device, seed=options.seed,
                                    recompute_for=recompute_lookup(plan), layout=layout)
        vocab_size = model_name.roles.vocab_size
    else:
        model = build_model(model_name, options.seed)
        if options.seq_len > model.config.max_seq_len:
            raise ValueError(f"seq_len {options.seq_len} exceeds {model_name}'s max_seq_len "
                             f"{model.config.max_seq_len}: use --seq-len <= {model.config.max_seq_len}")
        parts = apply_plan(model, plan, meshes, device=device, num_microbatches=num_microbatches)
        vocab_size = model.config.vocab_size
    indices = local_stage_indices(config, meshes.rank_on("pp")) if config.pp > 1 else (0,)
    optimizers = [torch.optim.AdamW(p.parameters(), lr=options.lr, weight_decay=options.weight_decay,
                                    foreach=False) for p in parts]
    schedule = None
    if config.pp > 1:
        schedule = build_schedule(parts, indices, config, pp_group=meshes.pp.get_group(), device=device,
                                  num_microbatches=num_microbatches, loss_fn=cross_entropy)
    trace = ActionTrace() if options.trace and schedule is not None else None
    if trace is not None:
        trace.instrument(schedule)
    return _Job(config, meshes, parts, indices, optimizers, schedule, device, layout, vocab_size, trace)


def _forward_backward(job: _Job, inputs: torch.Tensor, targets: torch.Tensor, num_microbatches: int) -> float | None:
    """One step's forward and backward; returns this rank's mean loss, None off the last stage."""
    with loss_parallel() if job.config.tp > 1 else contextlib.nullcontext():
        if job.schedule is not None:
            last = holds_last_stage(job.indices, job.config)
            losses: list[torch.Tensor] = []
            args = (inputs,) if holds_first_stage(job.indices) else ()
            kwargs = {"target": targets, "losses": losses} if last else {}
            job.schedule.step(*args, **kwargs)
            return _scalar(sum(x.detach() for x in losses)) / len(losses) if last else None
        part, total = job.parts[0], None
        for i, (mb_inputs, mb_targets) in enumerate(zip(inputs.chunk(num_microbatches),
                                                        targets.chunk(num_microbatches))):
            # reduce now or accumulate, free the gathered weights or keep them: as zero_layout says
            prepare_microbatch(part, job.layout, last=i == num_microbatches - 1)
            loss = cross_entropy(part(mb_inputs), mb_targets) / num_microbatches
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()  # one device sync, below
        return _scalar(total)


def _global_loss(job: _Job, local: float | None) -> float:
    """Mean over the data-parallel ranks of the last stage (all tp ranks carry the same value)."""
    value = torch.tensor([0.0 if local is None else local], dtype=torch.float64, device=job.device)
    dist.all_reduce(value)
    c = job.config
    return float(value.item()) / (c.dp * c.ep * c.cp * c.tp)


def _step_batch(job: _Job, model: str | ModelSpec, options: TrainOptions, tokens: Any,
                step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (inputs, targets) of one step: seeded images and labels for a model without tokens,
    else synthetic tokens or windows of the token file."""
    if isinstance(model, ModelSpec) and model.input_shape:
        pair = image_batch(options.seed, step, global_batch=options.global_batch, input_shape=model.input_shape,
                           num_outputs=model.num_outputs)
        return local_rows(pair, job.config, job.meshes)
    if tokens is None:
        batch = make_batch(options.seed, step, global_batch=options.global_batch, seq_len=options.seq_len,
                           vocab_size=job.vocab_size)
    else:
        batch = sample_windows(tokens, options.seed, step, global_batch=options.global_batch, seq_len=options.seq_len)
    return local_batch(batch, job.config, job.meshes)


def train(model_name: str | ModelSpec, plan: Plan | ParallelConfig, options: TrainOptions, *, device: torch.device,
          on_step: Callable[[int], None] | None = None) -> TrainResult:
    """Run options.steps optimizer steps of the plan on this rank (the process group is initialised)."""
    job = _setup(model_name, plan, options, device)
    start = _maybe_resume(job, options)
    vocab = job.vocab_size
    tokens = load_tokens(options.data, vocab_size=vocab, seq_len=options.seq_len) if options.data else None
    n_mb = job.config.num_microbatches(options.global_batch)
    losses, times, norms = [], [], []
    pp_group = job.meshes.pp.get_group() if job.config.pp > 1 else None
    for step in range(start, options.steps):
        if on_step is not None:
            on_step(step)
        inputs, targets = (t.to(device) for t in _step_batch(job, model_name, options, tokens, step))
        t0 = time.perf_counter()
        local = _forward_backward(job, inputs, targets, n_mb)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t_norm = time.perf_counter()
        norms.append(global_grad_norm(job.parts, pp_group=pp_group))  # not timed: a check, not the plan's work
        t1 = time.perf_counter()
        for optimizer in job.optimizers:
            optimizer.step()
            optimizer.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t1 + (t_norm - t0))
        losses.append(_global_loss(job, local))
        if options.save_every and (step + 1) % options.save_every == 0:
            _save(job, options, step + 1)
    return TrainResult(losses=losses, step_times_s=times, peak_mem_bytes=peak_memory_bytes(device),
                       start_step=start, parts=job.parts, grad_norms=norms,
                       actions=job.trace.last_step() if job.trace else [])


def _save(job: _Job, options: TrainOptions, step: int) -> None:
    """Into <checkpoint_dir>/step-<step>, keyed by the original parameter names (any plan can load it)."""
    save_checkpoint(options.checkpoint_dir, step=step, model_parts=job.parts, optimizers=job.optimizers)


def _maybe_resume(job: _Job, options: TrainOptions) -> int:
    """The number of steps already done: 0, or the step of the newest checkpoint under options.resume."""
    if not options.resume:
        return 0
    return load_checkpoint(options.resume, model_parts=job.parts, optimizers=job.optimizers)


def full_parameters(parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    """This rank's parameters as full CPU tensors by their original names (a collective over each
    parameter's mesh: every rank of the stage calls it in the same order)."""
    out = {}
    for part in parts:
        for name, param in part.named_parameters():
            full = param.full_tensor() if isinstance(param, DTensor) else param
            out[original_fqn(name)] = full.detach().cpu().clone()
    return out


def report(result: TrainResult, *, plan: Plan | ParallelConfig, model_name: str, options: TrainOptions,
           peak_mem_per_rank: list[int], world_size: int) -> dict[str, Any]:
    """The run report (JSON-ready): losses, median step time after the first, prediction, memory."""
    config = config_of(plan)
    steady = result.step_times_s[1:] or result.step_times_s
    out: dict[str, Any] = {
        "model": model_name,
        "plan": config.to_dict(),
        "world_size": world_size,
        "seed": options.seed,
        "data": options.data or "synthetic",
        "global_batch": options.global_batch,
        "seq_len": options.seq_len,
        "start_step": result.start_step,
        "steps": options.steps,
        "losses": result.losses,
        "grad_norms": result.grad_norms,
        "step_times_s": result.step_times_s,
        "step_time_s": statistics.median(steady) if steady else None,
        "peak_mem_bytes_per_rank": peak_mem_per_rank,
        "optimizer": {"name": "AdamW", "lr": options.lr, "weight_decay": options.weight_decay,
                      "betas": [0.9, 0.999], "eps": 1e-8},
        "numerics": {"dtype": "float32", "pipeline_scale_grads": SCALE_GRADS, "grad_clip": None},
        "zero_layout": dataclasses.asdict(zero_layout(config, config.num_microbatches(options.global_batch))),
    }
    if isinstance(plan, Plan):
        out["predicted_step_time_s"] = plan.estimate.step_time_s
        out["predicted_peak_mem_bytes"] = plan.estimate.peak_mem_bytes
    return out
