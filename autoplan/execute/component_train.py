"""The training loop of a ComponentPlan on this rank (see execute/components.py for the groups and the
schedule): seeded model and data, AdamW per group, per-step global mean losses equal on every rank.

The same seed gives the same initial weights (the full model is built after torch.manual_seed(seed) on
every rank, before any sharding) and the same data (Program.make_batch from the step's generator), so
one process running the model's own forward is the reference for every plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoplan.execute.component_models import Program
from autoplan.execute.components import (
    Layout,
    _Group,
    build_groups,
    full_parameters,
    prepare_backward,
    program_of,
    recv,
    send,
    transfers,
    wait_all,
)
from autoplan.plan.components import ComponentPlan


@dataclass(frozen=True, slots=True, kw_only=True)
class ComponentTrainOptions:
    steps: int
    seed: int = 0
    lr: float = 1e-3
    weight_decay: float = 0.01
    optimizer: str = "adamw"  # or "sgd" (plain SGD: its update shows a wrongly scaled gradient, Adam's hides it)

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps must be a positive integer, got {self.steps!r}")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {self.optimizer!r}")


@dataclass(frozen=True, slots=True)
class _Edge:
    """An activation edge between two groups: the producing component, its group and the consuming group."""

    index: int
    component: str
    src: int
    dst: int


@dataclass
class _Run:
    plan: ComponentPlan
    program: Program
    layouts: list[Layout]
    group: _Group
    edges: list[_Edge]
    device: torch.device
    rank: int

    @property
    def sink(self) -> bool:
        return self.program.stages[-1].name in {s.name for s in self.group.stages}

    def tag(self, edge: _Edge, k: int, backward: bool) -> int:
        return (k * len(self.edges) + edge.index) * 2 + int(backward)


def _edges(plan: ComponentPlan, program: Program) -> list[_Edge]:
    out: list[_Edge] = []
    for stage in program.stages:
        for need in stage.needs:
            src, dst = plan.group_of(need), plan.group_of(stage.name)
            if src != dst and not any(e.component == need and e.dst == dst for e in out):
                out.append(_Edge(len(out), need, src, dst))
    return out


def train_components(model: nn.Module, plan: ComponentPlan, options: ComponentTrainOptions, *,
                     device: torch.device) -> dict[str, Any]:
    """Train `model` (built from options.seed on every rank) under `plan` on this rank; returns the losses,
    step times, this rank's group and its parameters (full tensors by the model's names)."""
    program = program_of(model, plan)
    layouts, group = build_groups(plan, program, device=device, lr=options.lr, weight_decay=options.weight_decay,
                                  optimizer=options.optimizer)
    run = _Run(plan, program, layouts, group, _edges(plan, program), device, dist.get_rank())
    if run.sink and any(e.src == group.index for e in run.edges):
        raise ValueError(f"group {group.index} holds the loss but also feeds another group: reorder the groups")
    losses, times = [], []
    for step in range(options.steps):
        batch = program.make_batch(options.seed, step, plan.global_batch)
        t0 = time.perf_counter()
        local = _step(run, batch)
        group.optimizer.step()
        group.optimizer.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(_global_loss(run, local))
    return {"losses": losses, "step_times_s": times, "group": group.index, "params": full_parameters(group)}


def _rows(run: _Run, k: int) -> slice:
    per_mb = run.plan.microbatch_samples
    replica, _ = run.group.layout.coords(run.rank)
    share = per_mb // run.group.layout.dp
    start = k * per_mb + replica * share
    return slice(start, start + share)


def _step(run: _Run, batch: dict[str, torch.Tensor]) -> float | None:
    """One step's forwards and backwards on this rank; its replica's mean loss on the loss group."""
    m, works, kept, total = run.plan.num_microbatches, [], [], 0.0
    for k in range(m):
        rows = {name: t[_rows(run, k)].to(run.device) for name, t in batch.items()}
        received, values = _forward(run, k, rows, works)
        if run.sink:
            loss = run.program.loss(values[run.program.stages[-1].name], rows) / m
            prepare_backward(run.group, last=k == m - 1)
            loss.backward()
            _send_input_grads(run, k, received, works)
            total += float(loss.detach())
        else:
            kept.append((received, values))
    for k, (received, values) in enumerate(kept):
        outs, grads = _output_grads(run, k, values)
        prepare_backward(run.group, last=k == m - 1)
        torch.autograd.backward(outs, grads)
        _send_input_grads(run, k, received, works)
    wait_all(works)
    return total if run.sink else None


def _forward(run: _Run, k: int, rows: dict[str, torch.Tensor], works: list) -> tuple[dict, dict]:
    """Receive this group's inputs of microbatch k, run its stages, send the outputs other groups need."""
    received: dict[int, torch.Tensor] = {}
    values: dict[str, torch.Tensor] = {}
    samples = run.plan.microbatch_samples
    for edge in (e for e in run.edges if e.dst == run.group.index):
        pieces = sorted((first, recv(sender, run.tag(edge, k, False), run.device))
                        for sender, receiver, _, first, _ in transfers(run.layouts[edge.src], run.layouts[edge.dst],
                                                                       samples) if receiver == run.rank)
        x = torch.cat([p for _, p in pieces]).requires_grad_(True)
        received[edge.index] = values[edge.component] = x
    for stage in run.group.stages:
        args = [rows[f] for f in stage.fields] + [values[n] for n in stage.needs]
        values[stage.name] = stage.module(*args)
    for edge in (e for e in run.edges if e.src == run.group.index):
        out = values[edge.component]
        for sender, receiver, first, _, n in transfers(run.layouts[edge.src], run.layouts[edge.dst], samples):
            if sender == run.rank:
                send(out[first:first + n], receiver, run.tag(edge, k, False), works)
    return received, values


def _output_grads(run: _Run, k: int, values: dict[str, torch.Tensor]) -> tuple[list, list]:
    """The gradients of this group's sent outputs for microbatch k, summed over the groups they fed."""
    grads: dict[str, torch.Tensor] = {}
    samples = run.plan.microbatch_samples
    for edge in (e for e in run.edges if e.src == run.group.index):
        out = values[edge.component]
        g = grads.setdefault(edge.component, torch.zeros_like(out))
        for sender, receiver, _, first, n in transfers(run.layouts[edge.src], run.layouts[edge.dst], samples,
                                                       gradients=True):
            if receiver == run.rank:
                g[first:first + n] += recv(sender, run.tag(edge, k, True), run.device)
    names = list(grads)
    return [values[n] for n in names], [grads[n] for n in names]


def _send_input_grads(run: _Run, k: int, received: dict[int, torch.Tensor], works: list) -> None:
    """Send dL/dx of each received input back, scaled by dp_src / dp_dst (see execute/components.py)."""
    samples = run.plan.microbatch_samples
    for edge in (e for e in run.edges if e.dst == run.group.index):
        x = received[edge.index]
        grad = x.grad if x.grad is not None else torch.zeros_like(x)
        scale = run.layouts[edge.src].dp / run.layouts[edge.dst].dp
        for sender, receiver, first, _, n in transfers(run.layouts[edge.src], run.layouts[edge.dst], samples,
                                                       gradients=True):
            if sender == run.rank:
                send(grad[first:first + n] * scale, receiver, run.tag(edge, k, True), works)


def _global_loss(run: _Run, local: float | None) -> float:
    """Mean over the loss group's replicas (its tp ranks carry the same value)."""
    value = torch.tensor([0.0 if local is None else local], dtype=torch.float64, device=run.device)
    dist.all_reduce(value)
    final = run.layouts[run.plan.group_of(run.program.stages[-1].name)]
    return float(value.item()) / (final.dp * final.tp)
