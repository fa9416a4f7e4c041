"""A cluster as data: the device, how many per node, how many nodes, and the two link levels.

Frozen values read from profiles/*.yaml (see load.py) or written by the profiler (probe.py). The cost
model reads nothing else about hardware.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSpec:
    """One accelerator (or one CPU rank). Peak FLOP/s are dense (no sparsity), per dtype name
    ("bf16", "fp16", "tf32", "fp32"), as (dtype, flops) pairs so the value stays hashable."""

    name: str
    peak_flops: tuple[tuple[str, float], ...]
    mem_bytes: int
    mem_bw_bytes_per_s: float
    # achievable fractions of peak, named so the cost model never holds a literal
    matmul_efficiency: float  # large GEMMs (e.g. 8192^3 bf16)
    matmul_half_size_flops: float  # FLOPs of one matmul at which efficiency is half of the large-GEMM one
    attention_efficiency: float  # fused attention kernel, fraction of peak
    mem_bw_efficiency: float  # fraction of mem_bw reached by elementwise kernels (STREAM-like)
    runtime_reserve_bytes: int  # context, allocator fragmentation, NCCL buffers: not available to training
    # host time to issue one framework op (Python + dispatcher + kernel launch); a layer whose ops take
    # longer to issue than to run leaves the device idle. 0 = never host-bound (added by the cost model)
    op_overhead_s: float = 0.0
    # extra host time per op of a tensor-parallel layer (tp > 1): the executor's DTensor dispatch
    # (sharding propagation, redistribution) in front of each op. 0 = none (added by the cost model)
    tp_op_overhead_s: float = 0.0
    # extra host time per layer per pass (forward; twice for the backward) when its parameters are wrapped
    # for data parallelism (dp * ep * cp > 1): the executor's FSDP2 per-module hooks (unshard, reshard,
    # gradient-reduction bookkeeping). 0 = none (added by the cost model)
    dp_layer_overhead_s: float = 0.0
    # CPU profiles: the cores the devices_per_node rank processes of a node share (0: each device computes
    # on its own). Loading for another rank count rescales the per-rank figures (cluster/cpu_share.py);
    # the cost model lets idle pipeline ranks free their share (cost/timeline.shared_cores_makespan)
    cpu_cores: float = 0.0
    # CPU profiles: the throughput a core delivers while more rank processes than cores share it, relative to
    # one rank per core (context switches, cache refills); used only when rescaling (cluster/cpu_share.py)
    cpu_oversubscribed_efficiency: float = 1.0
    # streaming multiprocessors (0: not a GPU; matmuls then follow the matmul_half_size_flops curve). GEMM
    # tiles and FlashAttention blocks are scheduled over them in waves (NVIDIA "Matrix Multiplication
    # Background User's Guide", section 3.2 wave quantization)
    num_sms: int = 0
    # SMs one in-flight NCCL collective of a communicator inside one node occupies (one thread block per
    # channel): compute overlapped with it runs on the others (0: no contention modelled). Communicators
    # across nodes get their own count (cost/overlap.nccl_channels, from compute_capability and the inter-node
    # link's nccl_path_bw_bytes_per_s)
    nccl_sms: int = 0
    # CUDA compute capability x 10 (80: A100, 90: H100 / H200): NCCL's comm->minCompCap, which selects its
    # per-architecture channel rules (0: unknown, cross-node channels then fall back to nccl_sms)
    compute_capability: int = 0
    # GEMM kernels overlap a tile's epilogue (the C write) with the next tile's mainloop (persistent,
    # ping-pong warp-specialised kernels: CUTLASS 3 KernelTmaWarpSpecializedPingpong); False: the C traffic
    # adds, as measured for cuBLAS on A100 and on H100 (profiles/dgx-h100-80gb.yaml cites the measurements)
    gemm_epilogue_overlap: bool = False
    # seconds from a GEMM tile's start to the arrival of its first stage of A and B, paid once per tile by
    # kernels that load each tile's operands only once it starts (CUTLASS 2.x multistage prologue): one
    # global-memory round trip per wave of tiles (cost/kernels.gemm_pass_s). 0: hidden or not modelled
    gemm_tile_fill_s: float = 0.0
    # fraction of mem_bw PyTorch's eager fp32-upcast RMSNorm reaches as a whole (x.float(), pow, mean, * rsqrt,
    # the cast back, * weight: reduction, broadcast and dtype-casting kernels), forward and backward, on the
    # bytes its kernels move (Engine.rmsnorm 'eager_fp32'; cost/kernels.eager_norm_time_s). 0: mem_bw_efficiency
    eager_norm_fwd_bw_efficiency: float = 0.0
    eager_norm_bwd_bw_efficiency: float = 0.0

    def peak(self, dtype: str = "bf16") -> float:
        table = dict(self.peak_flops)
        if dtype not in table:
            raise ValueError(f"device {self.name!r} has no peak FLOP/s for dtype {dtype!r}: has {sorted(table)}")
        return table[dtype]


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkSpec:
    """One level of the interconnect, as seen by one device (unidirectional bandwidth per device)."""

    name: str  # "nvlink", "infiniband", "loopback", ...
    bw_bytes_per_s: float  # per device, one direction
    latency_s: float  # alpha of the alpha-beta model, per step of a ring
    allreduce_busbw_fraction: float  # nccl-tests bus bandwidth reached by large all-reduces / bw
    alltoall_bw_fraction: float  # algorithm bandwidth of large all-to-alls / bw
    p2p_bw_fraction: float  # send/recv bandwidth / bw
    # NCCL's cost model for large messages (Simple protocol; src/graph/tuning.cc): a fixed latency per
    # collective and a latency per ring step; latency_s above is the small-message (LL) per-step latency.
    # 0 = use latency_s for every protocol (no protocol choice modelled)
    simple_latency_s: float = 0.0
    base_latency_s: float = 0.0
    # NCCL's cap on the LL protocol's bus bandwidth (tuning.cc llMaxBws; 0 = no cap)
    ll_max_bw_bytes_per_s: float = 0.0
    # NCCL's LL128 protocol on this link: latency per ring step (tuning.cc hwLat[..][RING][LL128]); 0 = NCCL does
    # not enable LL128 here (it does on Volta/Ampere NVLink and, from v2.18, Hopper, with the NIC on the GPU's PCIe
    # switch), so rings pick between LL and Simple
    ll128_latency_s: float = 0.0
    # inter-node link: the bandwidth NCCL's topology gives one GPU's path to its NIC, min(PCIe link
    # width x GT/s / 80, NIC speed), in bytes/s (src/graph/topo.cc); its topology search fits one ring per
    # such path and sizes the cross-node communicator's channels from it (cost/overlap.nccl_channels).
    # 0 = unknown (cross-node channels fall back to DeviceSpec.nccl_sms)
    nccl_path_bw_bytes_per_s: float = 0.0
    # intra-node link: nccl-tests all_reduce_perf's large-message bus bandwidth / bw measured for groups of
    # that many ranks inside one node, where it differs from allreduce_busbw_fraction (a 2-rank ring on
    # NVSwitch reaches less than an 8-rank one): ((ranks, fraction), ...), ranks ascending; a group size not
    # listed uses allreduce_busbw_fraction. () = one fraction for every group size
    allreduce_busbw_fraction_by_ranks: tuple[tuple[int, float], ...] = ()
    # NCCL's tree all-reduce (cost/comm.all_reduce_s): the latency of one hop of its tree on this link (intra-node:
    # a hop of the chain through the node's GPUs; inter-node: a level of the double binary tree), 0 = the inter-node
    # hop at simple_latency_s (or latency_s) and no intra-node chain latency
    tree_latency_s: float = 0.0
    # inter-node link: bus bandwidth of NCCL's tree all-reduce / that of its ring (allreduce_busbw_fraction) across
    # more than two nodes, in (0, 1] (the tree does not reach the ring's NIC bandwidth there), 0 = 1 (the ring's)
    tree_busbw_ratio: float = 0.0

    def busbw_fraction(self, ranks: int) -> float:
        """The all-reduce bus-bandwidth fraction of a ring of `ranks` members on this link."""
        for listed, fraction in self.allreduce_busbw_fraction_by_ranks:
            if listed == ranks:
                return fraction
        return self.allreduce_busbw_fraction


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeGroup:
    """Nodes of one kind inside a heterogeneous cluster: `spec` describes them as a cluster of their own
    (its num_nodes is the group's node count). Ranks are numbered group after group, in order."""

    name: str  # the profile it came from, e.g. "dgx-a100-80gb"
    spec: ClusterSpec

    @property
    def num_devices(self) -> int:
        return self.spec.num_devices


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterSpec:
    """num_nodes nodes of devices_per_node devices each; intra_node links inside a node, inter_node
    across nodes (per device: on DGX each GPU has its own NIC).

    Heterogeneous (additive): `groups` lists node groups of different kinds (cluster.load.Cluster.combine
    builds it), ranks numbered group after group, and `inter_group` is the link between two groups. The
    top-level fields then describe a conservative stand-in for code that reads one device (see
    heterogeneous()); the cost model prices each pipeline rank on its own group (cost/hetero.py)."""

    name: str
    device: DeviceSpec
    devices_per_node: int
    num_nodes: int
    intra_node: LinkSpec
    inter_node: LinkSpec
    dtype: str = "bf16"  # training compute dtype the planner assumes
    source: str = ""  # the file it came from
    notes: tuple[str, ...] = field(default_factory=tuple)
    groups: tuple[NodeGroup, ...] = ()
    inter_group: LinkSpec | None = None

    def __post_init__(self) -> None:
        for name in ("devices_per_node", "num_nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def num_devices(self) -> int:
        return self.devices_per_node * self.num_nodes

    @property
    def peak_flops(self) -> float:
        return self.device.peak(self.dtype)

    @property
    def total_peak_flops(self) -> float:
        """Peak FLOP/s of all devices together (each group's own device when heterogeneous)."""
        if self.groups:
            return sum(g.num_devices * g.spec.peak_flops for g in self.groups)
        return self.num_devices * self.peak_flops

    def group_of_rank(self, rank: int) -> int:
        """Index in `groups` of the group holding global rank `rank` (0 for a homogeneous cluster)."""
        if not 0 <= rank < self.num_devices:
            raise ValueError(f"rank {rank} out of range for {self.num_devices} devices")
        start = 0
        for i, group in enumerate(self.groups):
            start += group.num_devices
            if rank < start:
                return i
        return 0


def heterogeneous(groups: tuple[NodeGroup, ...], *, name: str = "", inter_group: LinkSpec | None = None,
                  notes: tuple[str, ...] = ()) -> ClusterSpec:
    """One cluster of several node groups. Every group must train in the same dtype.

    inter_group defaults to the slowest of the groups' inter-node links: traffic between two groups leaves
    one group's NICs and enters the other's, so the slower NIC bounds it (nccl-tests PERFORMANCE.md: a
    transfer runs at its bottleneck link). The top-level fields are a stand-in for code that reads one
    device (the search's screening, the CLI's checks): the device with the lowest peak FLOP/s, given the
    smallest memory and the largest runtime reserve of any group; devices_per_node the gcd of the groups';
    the slowest intra- and inter-node links. Estimates of a heterogeneous cluster never price a layer on
    this stand-in (cost/hetero.py prices each pipeline rank on its own group)."""
    if len(groups) < 2:
        raise ValueError(f"a heterogeneous cluster needs at least two node groups, got {len(groups)}")
    dtypes = {g.spec.dtype for g in groups}
    if len(dtypes) > 1:
        raise ValueError(f"node groups train in different dtypes {sorted(dtypes)}: give every group's profile "
                         f"the same dtype")
    specs = [g.spec for g in groups]
    slow = min(specs, key=lambda c: c.peak_flops)
    device = dataclasses.replace(
        slow.device, name=f"{slow.device.name} (slowest of {len(groups)} groups)",
        mem_bytes=min(c.device.mem_bytes for c in specs),
        runtime_reserve_bytes=max(c.device.runtime_reserve_bytes for c in specs))
    per_node = math.gcd(*(c.devices_per_node for c in specs))
    total = sum(c.num_devices for c in specs)
    inter_group = inter_group or min((c.inter_node for c in specs), key=lambda link: link.bw_bytes_per_s)
    return ClusterSpec(
        name=name or "+".join(f"{g.name}:{g.spec.num_nodes}" for g in groups), device=device,
        devices_per_node=per_node, num_nodes=total // per_node,
        intra_node=min((c.intra_node for c in specs), key=lambda link: link.bw_bytes_per_s),
        inter_node=min([c.inter_node for c in specs] + [inter_group], key=lambda link: link.bw_bytes_per_s),
        dtype=specs[0].dtype, source=", ".join(dict.fromkeys(c.source for c in specs if c.source)),
        notes=tuple(notes), groups=tuple(groups), inter_group=inter_group)
