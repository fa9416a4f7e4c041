"""The checks before a ComponentPlan's ranks start, in the style of execute/preflight.py (each failure one
ValueError line saying what to change), made by `autoplan run --plan` and `autoplan.execute_components`:

- the run flags (preflight.check_run_flags) and the rank count (the plan's devices);
- what the component executor runs (components.check_executable: dp x tp groups, recompute none or full);
- the model: one the component executor has a program for, with the plan's components (program_of), and
  for a LLaVA-style model a sequence longer than its image tokens;
- memory per rank: float32 weights, gradients and AdamW states (preflight.BYTES_PER_PARAM per parameter)
  of the components a rank's group holds, split over its tp and sharded over its dp where the group's
  ZeRO layout shards them, against the host's RAM divided by the ranks (a GPU's memory on a GPU box).
"""

from __future__ import annotations

from typing import Any

from autoplan.execute.preflight import BYTES_PER_PARAM, check_run_flags, memory_target
from autoplan.plan.components import ComponentPlan
from autoplan.plan.layout import zero_layout

_GIB = 2**30


def meta_model(model: str) -> Any:
    """The model of a component run (a multimodal preset or file.py:factory) on the meta device."""
    from autoplan.execute.component_worker import build_model
    from autoplan.execute.source import meta_device

    with meta_device():
        return build_model(model, 0)


def check_ranks(plan: ComponentPlan, nproc_per_node: int | None) -> None:
    if nproc_per_node is not None and nproc_per_node != plan.num_devices:
        groups = " + ".join(f"{g.num_devices} ({g.name})" for g in plan.groups)
        raise ValueError(f"the component plan needs {plan.num_devices} ranks = {groups} but --nproc-per-node is "
                         f"{nproc_per_node}: launch {plan.num_devices} processes or plan again for "
                         f"{nproc_per_node} devices")


def check_sequence(meta: Any, plan: ComponentPlan) -> None:
    config = getattr(meta, "config", None)
    if getattr(config, "vision_config", None) is None:
        return
    from autoplan.graph.components import num_image_tokens

    tokens = num_image_tokens(config)
    if plan.seq_len <= tokens:
        raise ValueError(f"the plan's seq_len {plan.seq_len} leaves no text after the {tokens} image tokens: plan "
                         f"again with --seq-len > {tokens}")


def rank_bytes(meta: Any, plan: ComponentPlan) -> list[tuple[float, str]]:
    """(bytes per rank, group name) of each group's float32 training state (see the module docstring)."""
    from autoplan.execute.components import program_of

    try:
        program = program_of(meta, plan)
    except ValueError as exc:
        raise ValueError(f"{exc}: the plan was made for {plan.model_name}; plan this model again "
                         f"(autoplan plan --model ...)") from None
    out = []
    for group in plan.groups:
        c = group.plan.config
        layout = zero_layout(c, plan.num_microbatches)
        params = sum(p.numel() for name in group.components for p in program.stage(name).module.parameters())
        per_rank = params / c.tp
        shard = {"w": layout.shards_weights, "g": layout.shards_gradients, "o": layout.shards_optimizer}
        size = {"w": 4, "g": 4, "o": BYTES_PER_PARAM - 8}
        out.append((sum(size[k] * per_rank / (c.dp if shard[k] else 1) for k in size), group.name))
    return out


def component_preflight(plan: ComponentPlan, model: str, *, steps: int, nproc_per_node: int | None = None) -> None:
    """Every check before launch, in the order a user fixes them; ValueError on the first."""
    from autoplan.execute.components import check_executable

    check_run_flags(steps=steps)
    check_ranks(plan, nproc_per_node)
    check_executable(plan)
    meta = meta_model(model)
    check_sequence(meta, plan)
    target, where = memory_target(plan.num_devices)
    need, name = max(rank_bytes(meta, plan))
    if need > target:
        raise ValueError(f"group {name} needs about {need / _GIB:.1f} GiB per rank (float32 weights, gradients and "
                         f"AdamW states) but {where}: give it more devices or a larger tp, zero=3, or run on a "
                         f"machine with more memory")


__all__ = ["component_preflight", "rank_bytes"]
