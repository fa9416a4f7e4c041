"""Plans for models with components: each device group runs some components with its own Plan, the groups
form a pipeline that hands microbatches of activations (and their gradients) from group to group.

Frozen values with a JSON round trip, like plan/types.py and plan/io.py; this module imports only those.
Ranks: group i holds ranks first_rank .. first_rank + num_devices - 1, groups in the plan's order (a
topological order of the components' DAG). Each group's Plan is a plan for a cluster of its num_devices
devices at the step's global batch, with config.microbatch * dp * ep = global_batch / num_microbatches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoplan.plan.io import json_object, plan_from_dict, plan_to_dict
from autoplan.plan.types import Estimate, ParallelConfig, Plan

SCHEMA_VERSION = 1
KIND = "components"


@dataclass(frozen=True, slots=True, kw_only=True)
class ComponentGroup:
    """One device group: the components it runs (in order), its ranks and its plan. `slot_time_s` is the
    time of one hand-off microbatch through the group (forward + backward, with its share of the
    transfers); `tail_time_s` what it does once per step (optimizer, exposed gradient reduction)."""

    components: tuple[str, ...]
    first_rank: int
    num_devices: int
    plan: Plan
    slot_time_s: float = 0.0
    tail_time_s: float = 0.0
    peak_mem_bytes: int = 0  # the plan's peak plus the activations held while later groups work

    def __post_init__(self) -> None:
        object.__setattr__(self, "components", tuple(self.components))
        if not self.components:
            raise ValueError("a component group needs at least one component")
        if self.plan.config.num_devices != self.num_devices:
            raise ValueError(f"group {'+'.join(self.components)} has {self.num_devices} devices but its plan "
                             f"uses {self.plan.config.num_devices}")

    @property
    def name(self) -> str:
        return "+".join(self.components)

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.num_devices)


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupEdge:
    """Activations from group `src` to group `dst` (indices into ComponentPlan.groups): bytes of one
    hand-off microbatch (all its samples), and the time of one hop as priced (forward; the gradient
    hop back costs the same)."""

    src: int
    dst: int
    activation_bytes: int
    hop_time_s: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ComponentPlan:
    """A plan for a model with components: device groups, their plans, the edges and the whole step."""

    model_name: str
    cluster_name: str
    num_devices: int
    global_batch: int
    seq_len: int
    num_microbatches: int  # hand-off microbatches per step
    groups: tuple[ComponentGroup, ...]
    edges: tuple[GroupEdge, ...]
    estimate: Estimate  # the whole step; tokens_per_s counts seq_len tokens per sample
    input_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    rank: int = 0
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("groups", "edges", "notes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "input_shapes", tuple((str(n), tuple(s)) for n, s in self.input_shapes))
        end = 0
        for group in self.groups:
            if group.first_rank != end:
                raise ValueError(f"group {group.name} starts at rank {group.first_rank}, expected {end}: "
                                 f"groups hold consecutive ranks in order")
            end += group.num_devices
        if end != self.num_devices:
            raise ValueError(f"the groups hold {end} devices but the plan has {self.num_devices}")
        if self.global_batch % self.num_microbatches:
            raise ValueError(f"{self.num_microbatches} microbatches do not divide global batch {self.global_batch}")
        for edge in self.edges:
            if not 0 <= edge.src < edge.dst < len(self.groups):
                raise ValueError(f"edge {edge.src} -> {edge.dst} must run forward between the {len(self.groups)} groups")

    @property
    def samples_per_s(self) -> float:
        return self.global_batch / self.estimate.step_time_s

    @property
    def microbatch_samples(self) -> int:
        return self.global_batch // self.num_microbatches

    def group_of(self, component: str) -> int:
        for i, group in enumerate(self.groups):
            if component in group.components:
                return i
        raise KeyError(f"no group runs component {component!r}")

    def explain(self) -> str:
        """The plan in plain words."""
        e = self.estimate
        shapes = ", ".join(f"{n} {list(s)}" for n, s in self.input_shapes)
        lines = [f"{self.model_name} on {self.num_devices} x {self.cluster_name}: {len(self.groups)} device groups, "
                 f"{self.num_microbatches} microbatches of {self.microbatch_samples} samples handed from group to "
                 f"group; step {e.step_time_s:.4g} s, {self.samples_per_s:,.1f} samples/s, "
                 f"{e.tokens_per_s:,.0f} tokens/s, MFU {e.mfu:.1%}" + (f"; input per microbatch of 1: {shapes}"
                                                                       if shapes else "")]
        for i, g in enumerate(self.groups):
            c = g.plan.config
            lines.append(f"  group {i} ranks {g.first_rank}-{g.first_rank + g.num_devices - 1}: {g.name}: tp {c.tp} "
                         f"pp {c.pp} dp {c.dp} cp {c.cp} zero {c.zero} microbatch {c.microbatch} "
                         f"recompute {c.recompute.value}; {g.slot_time_s * 1e3:.3g} ms per microbatch, "
                         f"{g.peak_mem_bytes / 2**30:.2f} GiB")
        for edge in self.edges:
            lines.append(f"  group {edge.src} -> {edge.dst}: {edge.activation_bytes / 2**20:.3g} MiB per microbatch, "
                         f"{edge.hop_time_s * 1e3:.3g} ms per hop (and as much for the gradients back)")
        lines += [f"  {note}" for note in self.notes]
        return "\n".join(lines)


def component_plan_to_dict(plan: ComponentPlan) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": KIND,
        "model_name": plan.model_name,
        "cluster_name": plan.cluster_name,
        "num_devices": plan.num_devices,
        "global_batch": plan.global_batch,
        "seq_len": plan.seq_len,
        "num_microbatches": plan.num_microbatches,
        "groups": [{"components": list(g.components), "first_rank": g.first_rank, "num_devices": g.num_devices,
                    "slot_time_s": g.slot_time_s, "tail_time_s": g.tail_time_s, "peak_mem_bytes": g.peak_mem_bytes,
                    "plan": plan_to_dict(g.plan)} for g in plan.groups],
        "edges": [{"src": e.src, "dst": e.dst, "activation_bytes": e.activation_bytes, "hop_time_s": e.hop_time_s}
                  for e in plan.edges],
        "estimate": plan.estimate.to_dict(),
        "input_shapes": [[n, list(s)] for n, s in plan.input_shapes],
        "rank": plan.rank,
        "notes": list(plan.notes),
    }


def component_plan_from_dict(data: dict[str, Any]) -> ComponentPlan:
    if data.get("kind") != KIND or data.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"not a component plan of schema_version {SCHEMA_VERSION} (kind {data.get('kind')!r}, "
                         f"schema_version {data.get('schema_version')!r})")
    try:
        groups = tuple(ComponentGroup(components=tuple(g["components"]), first_rank=g["first_rank"],
                                      num_devices=g["num_devices"], plan=plan_from_dict(g["plan"]),
                                      slot_time_s=g.get("slot_time_s", 0.0), tail_time_s=g.get("tail_time_s", 0.0),
                                      peak_mem_bytes=g.get("peak_mem_bytes", 0)) for g in data["groups"])
        return ComponentPlan(
            model_name=data["model_name"], cluster_name=data["cluster_name"], num_devices=data["num_devices"],
            global_batch=data["global_batch"], seq_len=data["seq_len"], num_microbatches=data["num_microbatches"],
            groups=groups, edges=tuple(GroupEdge(**e) for e in data.get("edges", ())),
            estimate=Estimate.from_dict(data["estimate"]),
            input_shapes=tuple((n, tuple(s)) for n, s in data.get("input_shapes", ())),
            rank=data.get("rank", 0), notes=tuple(data.get("notes", ())),
        )
    except KeyError as exc:
        raise ValueError(f"component plan JSON lacks the field {exc.args[0]!r}") from None


def component_plan_to_json(plan: ComponentPlan) -> str:
    return json.dumps(component_plan_to_dict(plan), indent=2) + "\n"


def component_plan_from_json(text: str) -> ComponentPlan:
    return component_plan_from_dict(json_object(text, "component plan"))


def save_component_plan(plan: ComponentPlan, path: str | Path) -> None:
    Path(path).write_text(component_plan_to_json(plan))


def load_component_plan(path: str | Path) -> ComponentPlan:
    return component_plan_from_json(Path(path).read_text())


# What autoplan's component executor (execute/components.py) runs in each device group: dp x tp, with no
# pipeline, context or expert parallelism inside the group, no sequence parallelism, recompute none or full
# for the whole group. The component search plans groups within these options (search/components.py) and
# the executor refuses anything else with group_config_errors: one home for both.
EXECUTOR_GROUP_OPTIONS: dict[str, tuple] = {"pp": (1,), "cp": (1,), "ep": (1,), "sp": (False,),
                                            "recompute": ("none", "full")}


def group_config_errors(config: ParallelConfig, *, per_layer_recompute: bool = False) -> tuple[str, ...]:
    """What in a group's config the component executor cannot run (empty when it can)."""
    out = [f"{a}={getattr(config, a)}" for a in ("pp", "cp", "ep") if getattr(config, a) > 1]
    out += ["sp=True"] if config.sp else []
    if config.recompute.value not in EXECUTOR_GROUP_OPTIONS["recompute"]:
        out.append(f"recompute={config.recompute.value}")
    out += ["per-layer recompute"] if per_layer_recompute else []
    out += [f"etp={config.etp}, eep={config.eep}"] if config.folded else []
    return tuple(out)
