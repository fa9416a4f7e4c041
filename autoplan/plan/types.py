"""The plan's vocabulary: mesh axes, parallel configurations, estimates and plans.

Frozen, hashable values passed between the stages (cost, search, execute). This module imports nothing
else from autoplan, so a plan made on a laptop can be read and applied on a cluster from its JSON.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from autoplan.plan.engine import Engine, check_zero_stage


class _StrEnum(str, Enum):
    """`enum.StrEnum` for Python 3.10: members compare equal to their string values."""

    def __str__(self) -> str:  # pragma: no cover - trivial
        return self.value


class MeshAxis(_StrEnum):
    PP = "pp"
    DP = "dp"
    EP = "ep"
    CP = "cp"
    TP = "tp"


# Outermost first. tp is innermost so its groups are consecutive ranks inside a node (NVLink); then cp,
# ep, dp; pp outermost, so its point-to-point traffic is the one that crosses nodes first.
MESH_AXIS_ORDER: tuple[MeshAxis, ...] = (MeshAxis.PP, MeshAxis.DP, MeshAxis.EP, MeshAxis.CP, MeshAxis.TP)
# The dense parameters' data-parallel axes: every replica of a dense weight (an ep rank holds other experts
# but the same dense weights; a cp rank other tokens). The cost model's dense dp group, the quick estimate's
# (search.collectives re-exports it) and the executor's dense_dp mesh (execute/mesh.py sub_meshes) all span these.
DENSE_DP: tuple[str, ...] = ("dp", "ep", "cp")


class Schedule(_StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZERO_BUBBLE = "zb"


class Recompute(_StrEnum):
    NONE = "none"
    SELECTIVE = "selective"  # re-run only the attention core (Korthikanti et al. 2022)
    FULL = "full"  # keep only each block's input, re-run the whole block in backward


def _parse_enum(enum_type: type[Enum], value: Any, what: str) -> Any:
    if isinstance(value, enum_type):
        return value
    try:
        return enum_type(str(value).lower())
    except ValueError:
        known = ", ".join(repr(m.value) for m in enum_type)  # type: ignore[attr-defined]
        raise ValueError(f"unknown {what} {value!r}: choose one of {known}") from None


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelConfig:
    """One point of the search space: how a training step is split across devices.

    Devices: pp * dp * ep * cp * tp. The global batch is split over the dp * ep replicas (expert
    parallelism is carved out of data parallelism, as in Megatron-LM and DeepSpeed-MoE): dense layers are
    replicated over dp * ep, expert weights are sharded over ep and replicated over dp.
    Each replica runs global_batch / (dp * ep * microbatch) microbatches per step.

    MoE parallel folding (Megatron-Core's expert_tensor_parallel_size / expert_model_parallel_size;
    Liu et al. 2025, "MoE Parallel Folding", arXiv 2504.14960): `etp` and `eep` give the expert layers a
    layout of their own over the same dp * ep * cp * tp ranks of a pipeline stage, etp * eep * edp of
    them, edp the expert data-parallel degree that is left (Megatron-Core parallel_state.py: the expert
    RankGenerator, order etp (innermost), ep, dp, with its own pp groups equal to the dense ones). 0
    means "as the dense layers": etp = tp, eep = ep, edp = dp * cp, today's layout (experts sharded over
    the dense mesh's ep axis). See expert_tp / expert_ep / expert_dp / folded.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    sp: bool = False  # sequence parallelism over the tp group (Korthikanti et al. 2022)
    zero: int = 0  # 0: replicated; 1: optimizer states; 2: + gradients; 3: + weights (FSDP)
    microbatch: int = 1  # sequences per microbatch per replica
    schedule: Schedule = Schedule.ONE_F_ONE_B
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved / zero-bubble V schedules)
    recompute: Recompute = Recompute.NONE
    etp: int = 0  # expert tensor parallel degree; 0: as tp (Megatron-Core's default ETP = TP)
    eep: int = 0  # expert (model) parallel degree of the folded expert layout; 0: as ep

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "cp", "ep", "microbatch", "virtual_stages"):
            _check_positive_int(name, getattr(self, name))
        for name in ("etp", "eep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a positive integer (or 0: as the dense layers), got {value!r}")
        stage_ranks = self.dp * self.ep * self.cp * self.tp
        if stage_ranks % (self.expert_tp * self.expert_ep):
            raise ValueError(
                f"etp*eep = {self.expert_tp}*{self.expert_ep} does not divide the {stage_ranks} ranks of a "
                f"pipeline stage (dp*ep*cp*tp): choose expert degrees whose product divides {stage_ranks}"
            )
        check_zero_stage(self.zero, integer=True)
        if not isinstance(self.sp, bool):
            raise ValueError(f"sp must be true or false, got {self.sp!r}")
        object.__setattr__(self, "schedule", _parse_enum(Schedule, self.schedule, "schedule"))
        object.__setattr__(self, "recompute", _parse_enum(Recompute, self.recompute, "recompute mode"))
        if self.sp and self.tp == 1:
            object.__setattr__(self, "sp", False)  # SP is defined over the tp group; nothing to do
        if self.virtual_stages > 1 and self.schedule not in (Schedule.INTERLEAVED, Schedule.ZERO_BUBBLE):
            raise ValueError(
                f"virtual_stages={self.virtual_stages} needs schedule 'interleaved' or 'zb', "
                f"not {self.schedule.value!r}"
            )

    @property
    def num_devices(self) -> int:
        return self.pp * self.dp * self.ep * self.cp * self.tp

    @property
    def num_replicas(self) -> int:
        """Data-parallel replicas that split the global batch (dp * ep)."""
        return self.dp * self.ep

    @property
    def expert_tp(self) -> int:
        """Ranks each routed expert's weights are split over (Megatron-Core ETP)."""
        return self.etp or self.tp

    @property
    def expert_ep(self) -> int:
        """Ranks the routed experts are spread over (Megatron-Core EP)."""
        return self.eep or self.ep

    @property
    def expert_dp(self) -> int:
        """Ranks holding a replica of the same expert shard (the expert data-parallel degree): dp * cp
        unfolded, the rest of the stage's dp * ep * cp * tp ranks over etp * eep when folded."""
        return self.dp * self.ep * self.cp * self.tp // (self.expert_tp * self.expert_ep)

    @property
    def folded(self) -> bool:
        """Whether the experts have a layout of their own (etp, eep other than the dense tp, ep)."""
        return (self.expert_tp, self.expert_ep) != (self.tp, self.ep)

    def num_microbatches(self, global_batch: int) -> int:
        """Microbatches per pipeline per step; raises if the batch does not divide."""
        per_replica, rest = divmod(global_batch, self.num_replicas * self.microbatch)
        if rest or per_replica < 1:
            raise ValueError(
                f"global batch {global_batch} does not divide into dp*ep={self.num_replicas} replicas "
                f"x microbatch {self.microbatch}: use a global batch that is a multiple of "
                f"{self.num_replicas * self.microbatch}"
            )
        return per_replica

    def mesh_shape(self) -> tuple[tuple[str, int], ...]:
        """(axis name, size) outermost first, in MESH_AXIS_ORDER."""
        return tuple((axis.value, getattr(self, axis.value)) for axis in MESH_AXIS_ORDER)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["schedule"] = self.schedule.value
        out["recompute"] = self.recompute.value
        for name in ("etp", "eep"):  # written only when set, so older plans keep their exact bytes
            if not out[name]:
                del out[name]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, num_devices: int | None = None) -> ParallelConfig:
        """Build from a dict with keys tp, pp, dp, cp, ep, sp, zero, microbatch, schedule,
        virtual_stages, recompute (and etp, eep). Omitted keys take defaults; an omitted `dp` is derived from
        `num_devices` (the rest of the devices). Unknown keys are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown config key(s) {unknown}: known keys are {sorted(known)}")
        values = dict(data)
        if values.get("dp") is None:
            values.pop("dp", None)
            if num_devices is not None:
                other = 1
                for name in ("tp", "pp", "cp", "ep"):
                    v = values.get(name, 1)
                    _check_positive_int(name, v)
                    other *= v
                if num_devices % other:
                    raise ValueError(
                        f"{num_devices} devices do not divide by tp*pp*cp*ep={other}: "
                        f"choose degrees whose product divides {num_devices}"
                    )
                values["dp"] = num_devices // other
        return cls(**values)


_BREAKDOWN_FIELDS = (
    "compute", "recompute", "tp_comm", "dp_comm", "pp_bubble", "pp_comm", "ep_comm", "cp_comm", "optimizer",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Breakdown:
    """Seconds of one training step per cause. Entries are the exposed (not overlapped) time, so they
    add up to the step time. Reads like a mapping too: `breakdown["compute"]`."""

    compute: float = 0.0
    recompute: float = 0.0
    tp_comm: float = 0.0
    dp_comm: float = 0.0
    pp_bubble: float = 0.0
    pp_comm: float = 0.0
    ep_comm: float = 0.0
    cp_comm: float = 0.0
    optimizer: float = 0.0

    def __getitem__(self, key: str) -> float:
        if key not in _BREAKDOWN_FIELDS:
            raise KeyError(key)
        return getattr(self, key)

    def keys(self) -> tuple[str, ...]:
        return _BREAKDOWN_FIELDS

    def items(self) -> Iterator[tuple[str, float]]:
        return ((k, getattr(self, k)) for k in _BREAKDOWN_FIELDS)

    def __iter__(self) -> Iterator[str]:
        return iter(_BREAKDOWN_FIELDS)

    def __len__(self) -> int:
        return len(_BREAKDOWN_FIELDS)

    @property
    def total_s(self) -> float:
        return sum(getattr(self, k) for k in _BREAKDOWN_FIELDS)

    def to_dict(self) -> dict[str, float]:
        return dict(self.items())


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryBreakdown:
    """Peak bytes on the most loaded device, per cause."""

    weights: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    reserve: int = 0  # runtime: CUDA context, allocator fragmentation, communication buffers

    @property
    def total_bytes(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.reserve

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    """The predicted cost of one training step under one ParallelConfig."""

    step_time_s: float
    tokens_per_s: float
    mfu: float  # model FLOPs (no recompute) / (step time * devices * peak), as in Chowdhery et al. 2022
    peak_mem_bytes: int
    mem_capacity_bytes: int
    fits: bool
    breakdown: Breakdown
    memory: MemoryBreakdown = field(default_factory=MemoryBreakdown)
    model_flops: float = 0.0  # per step, forward + backward, no recompute
    hardware_flops: float = 0.0  # per step, recompute included

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["breakdown"] = self.breakdown.to_dict()
        out["memory"] = self.memory.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Estimate:
        values = dict(data)
        values["breakdown"] = Breakdown(**values["breakdown"])
        values["memory"] = MemoryBreakdown(**values.get("memory", {}))
        return cls(**values)


@dataclass(frozen=True, slots=True, kw_only=True)
class Stage:
    """One pipeline stage (a model chunk): the module paths it holds, in order.

    With virtual stages, there are pp * virtual_stages stages; stage i runs on pipeline rank i % pp
    (looped placement, as Megatron's interleaved 1F1B) unless the schedule says otherwise.
    Module paths are those of the layer graph ("embed", "layers.0", ..., "norm", "head").
    `group` (additive): on a heterogeneous cluster, the node group the stage's pipeline rank runs on
    (ClusterSpec.groups' name); empty on a homogeneous one."""

    index: int
    layer_names: tuple[str, ...]
    group: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_names", tuple(self.layer_names))


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A ranked, explained parallel configuration for one model on one cluster.

    `stages` cuts the model for the pipeline; `layer_recompute` maps block paths to a recompute mode
    where it differs from `config.recompute` (the ILP may choose per layer)."""

    config: ParallelConfig
    estimate: Estimate
    model_name: str
    cluster_name: str
    num_devices: int
    global_batch: int
    seq_len: int
    stages: tuple[Stage, ...] = ()
    layer_recompute: tuple[tuple[str, Recompute], ...] = ()
    rank: int = 0  # 1 = best; 0 when not from a search
    notes: tuple[str, ...] = ()  # plain-language reasons, filled by the search
    # layouts the ranking folded into this one (predicted the same within the tie tolerances of
    # autoplan.search.ties), each said by how it differs: "zero=2", "dp=16 cp=2 microbatch=2"
    folded: tuple[str, ...] = ()
    # the shape of one input sample the plan was priced for when the model takes no token ids (a CNN
    # or ViT: (channels, height, width)); empty for token models, whose sample is seq_len tokens
    sample_shape: tuple[int, ...] = ()
    # graph.fingerprint.model_fingerprint of the model the plan was made for ("": unknown, not checked)
    fingerprint: str = ""
    engine: Engine | None = None  # the engine the estimate was made for (None: not recorded, older plans)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(
            self,
            "layer_recompute",
            tuple((str(n), _parse_enum(Recompute, r, "recompute mode")) for n, r in self.layer_recompute),
        )
        object.__setattr__(self, "notes", tuple(self.notes))
        object.__setattr__(self, "folded", tuple(self.folded))
        object.__setattr__(self, "sample_shape", tuple(int(d) for d in self.sample_shape))

    @property
    def samples_per_s(self) -> float:
        """Training samples (sequences, images) per second: the global batch over the step time."""
        t = self.estimate.step_time_s
        return self.global_batch / t if t > 0 else 0.0

    def recompute_for(self, layer_name: str) -> Recompute:
        return dict(self.layer_recompute).get(layer_name, self.config.recompute)

    def explain(self) -> str:
        """The plan in plain words (autoplan.plan.explain.explain)."""
        from autoplan.plan.explain import explain

        return explain(self)

    def to_megatron_args(self, *, strict: bool = False) -> list[str]:
        """Megatron-LM flags for this layout (autoplan.plan.export.to_megatron_args)."""
        from autoplan.plan.export import to_megatron_args

        return to_megatron_args(self, strict=strict)

    def to_torchtitan_toml(self, *, strict: bool = False) -> str:
        """A torchtitan job TOML for this layout (autoplan.plan.export.to_torchtitan_toml)."""
        from autoplan.plan.export import to_torchtitan_toml

        return to_torchtitan_toml(self, strict=strict)

    def to_deepspeed_config(self, *, strict: bool = False) -> dict[str, Any]:
        """A DeepSpeed config dict for this layout (autoplan.plan.export.to_deepspeed_config)."""
        from autoplan.plan.export import to_deepspeed_config

        return to_deepspeed_config(self, strict=strict)
