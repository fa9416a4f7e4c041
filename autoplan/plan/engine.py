"""The training engine a plan runs under: how it computes attention, which kernels it fuses, what it
overlaps, how its ZeRO-3 gathers. A step time depends on the engine as much as on the plan.

`Engine.load(name_or_path)` reads engines/<name>.yaml (shipped) or a user's YAML file; every field of a
shipped engine cites the engine's docs or code beside it. Frozen, so `dataclasses.replace` builds
variants: `replace(Engine.load("megatron-core"), attention="unfused")`; each field changes the estimate
through its own mechanism only (see autoplan/cost). This module imports nothing else from autoplan at
import time (the loader is imported when `load` is called).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

ATTENTION_KINDS = ("flash", "unfused")
SELECTIVE_KINDS = ("attention", "op")
ZERO3_KINDS = ("fsdp2", "deepspeed")
GRAD_REDUCTIONS = ("all_reduce", "reduce_scatter")
# ParallelConfig.zero (Rajbhandari et al., ZeRO, SC'20): 0 replicated, 1 + optimizer states, 2 + gradients,
# 3 + weights sharded
ZERO_STAGES = (0, 1, 2, 3)
RMSNORM_KINDS = ("eager", "eager_fp32", "fused")
# Transformer Engine userbuffers' overlaps by their ub_tp_comm_overlap_cfg names (transformer_engine/pytorch/
# module/base.py initialize_ub `methods`): Engine.tp_overlap_margin_sms_by_op's keys
TE_UB_OPS = ("qkv_fprop", "qkv_dgrad", "qkv_wgrad", "proj_fprop", "proj_dgrad", "fc1_fprop", "fc1_dgrad", "fc1_wgrad",
             "fc2_fprop", "fc2_dgrad")
# what an engine overlaps with the compute it issues from the same host thread (none under launch_blocking)
OVERLAP_FIELDS = ("tp_comm_overlap", "tp_bwd_overlap", "dp_comm_overlap", "param_gather_overlap", "cp_comm_overlap",
                  "grad_reduce_async", "pp_p2p_overlap")


def is_zero_stage(value: object) -> bool:
    """Whether `value` is a ZeRO stage at all (among ZERO_STAGES; a bool is not, though True == 1): the one
    test behind ParallelConfig.zero, SearchOptions.zero, plan.layout.zero_layout, Engine.zero_stages and an
    engine YAML's list (Engine.runs_zero asks, beside it, whether an engine runs the stage)."""
    return not isinstance(value, bool) and value in ZERO_STAGES


def check_zero_stage(value: object, *, integer: bool = False) -> None:
    """ValueError, one line, unless `value` is a ZeRO stage (is_zero_stage; with `integer`, also an int, as a
    ParallelConfig's must be: 2.0 is refused there)."""
    if not is_zero_stage(value) or (integer and not isinstance(value, int)):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {value!r}")


def zero_runs_on(stage: object, zero0_1d_only: bool, *, tp: int = 1, pp: int = 1, dp: int = 1, cp: int = 1,
                 ep: int = 1) -> bool:
    """Whether ZeRO stage `stage` runs on the mesh (tp, pp, dp, cp, ep) as far as Engine.zero0_1d_only says:
    every stage but 0 does; 0 does unless that field is set, there is data parallelism (the dense group
    dp * ep * cp > 1) and another dimension (tp, pp, cp or ep > 1) beside it. Engine.runs_zero and the
    search's enumeration (search/space.py) both ask this."""
    return stage != 0 or not zero0_1d_only or dp * ep * cp == 1 or tp == pp == cp == ep == 1


def schedule_name(schedule: object) -> str:
    """The name a pipeline schedule goes by, lowercased: a Schedule's value or the string given (any case).
    Engine.schedules, Engine.runs_schedule and the search's engine_schedules (search/space.py) compare these."""
    return str(getattr(schedule, "value", schedule)).lower()


def schedule_names() -> tuple[str, ...]:
    """ParallelConfig.schedule's names, in Schedule's order (read when called: plan.types imports this module)."""
    from autoplan.plan.types import Schedule

    return tuple(s.value for s in Schedule)


def is_schedule(value: object) -> bool:
    """Whether `value` names a pipeline schedule (schedule_name among schedule_names, any case): the one test
    behind Engine.schedules and an engine YAML's list (cluster/engines.py, which names the item it refuses)."""
    return schedule_name(value) in schedule_names()


def _stage_list(name: str, stages: object) -> tuple[int, ...]:
    """An engine field listing ZeRO stages (zero_stages, zero_stages_with_pp) as a sorted tuple, or ValueError."""
    if not isinstance(stages, (list, tuple)) or not all(is_zero_stage(z) for z in stages):
        raise ValueError(f"engine field {name!r} must be a list of ZeRO stages among 0, 1, 2, 3, got {stages!r}")
    if 0 not in stages or len(set(stages)) != len(stages):
        raise ValueError(f"engine field {name!r} must list distinct stages with 0 among them (a plan with "
                         f"nothing data parallel runs unsharded), got {list(stages)}")
    return tuple(sorted(stages))


@dataclass(frozen=True, slots=True, kw_only=True)
class Engine:
    """What the cost model needs to know about the software that runs a plan. Defaults: autoplan's own
    executor (eager PyTorch, SDPA attention, FSDP2, DTensor TP without overlap)."""

    name: str = "autoplan"
    # --- contract fields (issue 8) ---
    attention: str = "flash"  # 'flash': fused kernel, no s x s scores stored; 'unfused': scores materialised
    fused_elementwise: bool = False  # bias+activation, bias+dropout+residual and norms as single kernels
    tp_comm_overlap: bool = False  # TP all-gather / reduce-scatter overlapped with the GEMMs beside them
    dp_comm_overlap: bool = True  # gradient reduction overlapped with the backward (buckets / hooks)
    param_gather_overlap: bool = True  # ZeRO weight all-gathers overlapped with compute (prefetch; ZeRO-1/2: next forward)
    cuda_graphs: bool = False  # kernels replayed from CUDA graphs: no host cost per op
    zero3: str = "fsdp2"  # how ZeRO-3 gathers: FSDP2 (per block, prefetched) or DeepSpeed stage 3
    # --- additive fields the physics needs ---
    tp_bwd_overlap: bool = False  # column-parallel input-gradient TP collectives overlap their weight-gradient GEMMs
    te_userbuffers: bool = False  # tp_comm_overlap runs through Transformer Engine's userbuffers, which register 10 communication buffers of [s b / cp, h] (cost/reserve.py userbuffer_bytes)
    te_cublas_workspaces: int = 0  # Transformer Engine cuBLAS workspaces (module/base.py get_workspace: 32 MiB on sm 9.x, else 4 MiB; x3 with userbuffers) beside PyTorch's
    gemm_streams: int = 1  # streams PyTorch's GEMMs run on, each with its own cuBLAS workspace (CublasHandlePool.cpp setCublasWorkspace): the compute stream
    tp_overlap_margin_sms: int = 0  # with tp_comm_overlap: SMs TE's userbuffers keep from the GEMMs beside its reduce-scatter / bulk overlaps for their whole run (cost/userbuffers.py); 0: NCCL's channels over the hidden time (cost/overlap.py)
    # --- TE userbuffers' margin per overlap (cost/userbuffers.py) ---
    tp_overlap_margin_sms_by_op: tuple[tuple[str, int], ...] = ()  # with tp_comm_overlap: SMs each named TE userbuffers overlap (TE_UB_OPS, its ub_tp_comm_overlap_cfg key) keeps from its GEMM (num_sm where set_sm_margin, else 0), in place of tp_overlap_margin_sms for that op; a mapping in YAML / replace(), kept as sorted pairs; (): every op as tp_overlap_margin_sms says
    # --- TE userbuffers' communication SMs per overlap without a margin (cost/userbuffers.py comm_contention_s) ---
    tp_overlap_comm_sms_by_op: tuple[tuple[str, int], ...] = ()  # with tp_comm_overlap: SMs each named TE userbuffers overlap's communication kernel holds while it runs beside its GEMM on every SM (num_sm of a pipeline / bulk overlap with set_sm_margin off; an op with a margin, or a ring_exchange one on the copy engines, holds none beyond it); same format as tp_overlap_margin_sms_by_op; (): NCCL's channels over the hidden time in a phase without a margin (cost/overlap.py)
    description: str = "autoplan's executor (eager PyTorch, SDPA attention, FSDP2, DTensor TP, torch.distributed.pipelining)"
    block_forward_ops: int = 0  # host-issued ops in one block's forward (0: the captured graph's count)
    block_backward_ops: int = 0  # ... in its backward (0: compute.BACKWARD_OPS_PER_FORWARD_OP x forward)
    checkpoint_forward_ops: int = 0  # host ops of the activation-checkpoint wrapper around a fully recomputed block, forward
    checkpoint_backward_ops: int = 0  # ... and in its backward (RNG state restore, detach, the re-entrant backward)
    block_forward_syncs: int = 0  # device-synchronising host-to-device copies in one block's forward (torch.tensor(x, device=cuda))
    main_grads_fp32: bool = False  # gradients accumulate in an fp32 buffer (Megatron main_grad): 4 B/param
    embedding_grad_add: bool = False  # the embedding's dense weight gradient (autograd's .grad) is added into the fp32 main_grad by the DDP's per-parameter hook, every microbatch (cost/compute.embedding_grad_add_s)
    grad_freed_after_reduce: bool = True  # .grad is None when a backward starts (zero_grad(set_to_none) each step; FSDP2 frees it after each reduce-scatter): autograd adopts the weight-gradient GEMM's output, no accumulate pass (cost/compute.py)
    grad_reduce_fp32: bool = True  # bf16/fp8 training reduces gradients in fp32 (fp16 always in fp16)
    pipelined_fsdp_defers_sync: bool = True  # with pp > 1, FSDP gradient sync waits for the last microbatch
    grad_reduce_async: bool = False  # gradients reduced every microbatch: the backward does not wait for its reduce-scatters, which run on beside the next microbatches' compute
    dp_bucket_numel: int = 0  # gradient bucket size (elements) of the DP reduction; 0: one bucket per layer
    gather_copy_out: bool = True  # all-gathered weights are copied out of the collective's buffer on the compute stream
    tp_splits_unfolded_experts: bool = False  # unfolded routed experts split over the dense tp group (plan.layout.expert_tp_split)
    selective_recompute: str = "attention"  # what 'selective' recomputes: Megatron's attention core, or torchtitan's per-op policy
    # memory-bound passes the engine's code adds around the GEMMs and the attention core (cost/passes.py)
    separate_qkv_bias_add: bool = False  # the QKV projection adds its bias in a kernel of its own (matmul, then + bias)
    separate_fc2_bias_add: bool = False  # the MLP output projection adds its bias in a kernel of its own
    bias_grad_reduction: bool = True  # each biased linear's bias gradient is its own reduction over the tokens
    attention_layout_copies: bool = False  # Megatron's [s, b, np, hn] core: context permute copy, QKV split's cat in backward
    attention_grad_scale: bool = False  # baddbmm(alpha) backward scales the dQ and dK products in passes of their own
    rmsnorm: str = "eager"  # a Llama-style block's RMSNorms without fused_elementwise: 'eager' (composite ops in the training dtype), 'eager_fp32' (upcast to fp32 first), 'fused' (one kernel each way)
    reduce_scatter_copy_in: bool = True  # FSDP2 copies the unsharded gradients into the reduce-scatter input (reduce dtype) before the compute stream goes on
    fsdp_root_unit: bool = True  # FSDP2's outer fully_shard holds the non-block layers (embedding, final norm, head) as one group: gathered before the rank's first layer, reduced after its last backward (cost/fsdpunits.py, search/rootunit.py; autoplan's executor: engines/autoplan.yaml)
    fsdp_root_reshards: bool = True  # ... and that group is freed after the forward and gathered again when the backward starts
    fsdp_last_block_reshards: bool = True  # the last block before the head is freed after its forward and gathered again for its backward
    dp_grad_passes: int = 0  # read + write passes over the local gradients (reduce dtype) that a once-per-step all-reduce not overlapped with the backward makes on the compute stream (flatten, divide, copy back)
    dp_overlap_grad_passes: int = 0  # ... the same when the all-reduce overlaps the backward (dp_comm_overlap: bucket copy-in, copy back)
    grad_buffer_passes: bool = False  # a contiguous gradient buffer zeroed every step and scaled by 1 / dp before its once-per-step collective, on the compute stream (Megatron-Core: cost/dataparallel.py grad_buffer_passes_s)
    pp_recv_all_gather: bool = False  # each pipeline receive (activation forward, gradient backward) is all-gathered over tp from the 1/tp chunks the tp ranks were sent (Megatron's scatter/gather); no SP
    pp_recv_gather_copy: bool = False  # ... into a list of chunk views (torch.distributed.all_gather), which copies each chunk out of NCCL's flat output
    pp_p2p_batched: bool = True  # a pipeline rank's send and receive of one slot go out together (batch_isend_irecv: torch.distributed.pipelining, Megatron); False: each is a blocking send or recv of its own in the schedule's order (DeepSpeed's PipelineEngine), so a rank's stream also waits out each transfer it receives (cost/estimate.py)
    pp_p2p_overlap: bool = False  # under the interleaved schedule (v > 1) the pipeline sends and receives are asynchronous, waited just before the chunk that needs them, so the steady state hides them and only the fill and drain wait for them (Megatron-Core overlap_p2p_comm: cost/p2p.py p2p_overlapped)
    pp_partitioned_tensors: bool = False  # with tp > 1 each pipeline transfer is DeepSpeed's PartitionedTensor: a 1/tp chunk plus a meta tensor, re-gathered over tp by the receiver, and the sender re-gathers its own output before the backward (cost/estimate.py partitioned_role_s); no SP
    grad_sync_per_chunk: bool = False  # with a pipeline, the once-per-step gradient reduction is launched per model chunk by the schedule once that chunk's last backward is done, all its buckets at once (the chunks after the first as one bucket) on the one data-parallel communicator (interleaved: every rank, the cool-down's later backwards hiding the earlier chunks'; 1F1B: all but the first stage, after their cool-down), not bucket by bucket beside the backward (Megatron-Core's delayed grad_sync_func: cost/chunksync.py)
    param_gather_per_chunk: bool = False  # with param_gather_overlap and several model chunks per rank, the once-per-step weight all-gathers run one at a time, the chunks in turn: the first chunk's layer by layer beside its first forward, each later chunk's whole beside the p forwards of the chunk before it (Megatron-Core's distributed optimizer under the interleaved schedule: cost/chunksync.py later_gathers_s)
    tied_reduce_before_dp: bool = False  # a head tied to the embedding (LayerGraph.tied_embedding_params) on another pipeline rank: its gradient all-reduce between the first and last stage runs before the data-parallel reduction (DeepSpeed's ReduceTiedGrads), else after it (Megatron's train_step)
    fused_adam: bool = False  # one fused multi-tensor Adam kernel (apex / DeepSpeed FusedAdam) instead of torch.optim.AdamW's per-op passes
    separate_qkv_projections: bool = True  # Q, K and V from three linears (wq, wk, wv), not one fused QKV GEMM (cost/projections.py)
    recompute_early_stop: bool = True  # full recompute through torch's non-reentrant checkpoint, which stops after the last saved tensor: the MLP output GEMM is not re-run (cost/projections.py)
    fused_softmax_max_keys: int = 0  # Megatron's fused scale-mask-softmax runs only under its shape rules (cost/passes.py), else a torch fallback in fp32; 0: no such rules
    attention_dropout: float = 0.0  # dropout probability the engine trains with on the attention probabilities (0: none; a block without dropout, BlockShape.dropout, never has it); a fused kernel pays kernels.FUSED_DROPOUT_SLOWDOWN for it
    # what autograd keeps for the backward (cost/memory.block_activation_bytes)
    sp_saves_gathered_input: bool = True  # with SP, the column-parallel linears keep their all-gathered input (DTensor), not the local shard
    attention_saves_repeated_kv: bool = True  # grouped-query K / V are repeated to the query heads before the attention kernel, which keeps them
    cp_saves_gathered_kv: bool = True  # context parallelism keeps the all-gathered K / V for the attention backward (not re-exchanged)
    cp_comm_overlap: bool = False  # the CP K / V exchange runs beside the attention core (ring P2P); False: all-gathered before it, exposed
    cp_separate_kv_collectives: bool = True  # the exposed CP exchange (cp_comm_overlap False) all-gathers K and V, and reduce-scatters dK and dV, in a collective of its own each (two per exchange, two latencies), not one collective of the concatenated pair
    rmsnorm_saves_normalized: bool = True  # an eager RMSNorm keeps x * rstd for its weight's gradient beside its input x
    swiglu_saves_activation: bool = True  # an eager SwiGLU (silu(gate) * up) keeps silu(gate) beside gate and up
    # DeepSpeed ZeRO-3 (zero3='deepspeed'); ignored with fsdp2
    zero3_prefetch_numel: int = 50_000_000  # stage3_prefetch_bucket_size
    zero3_max_reuse_numel: int = 1_000_000_000  # stage3_max_reuse_distance
    zero3_max_live_numel: int = 1_000_000_000  # stage3_max_live_parameters: no prefetch above this many gathered
    zero3_persistence_numel: int = 100_000  # stage3_param_persistence_threshold: smaller params not sharded
    zero3_reduce_bucket_numel: int = 500_000_000  # reduce_bucket_size
    zero3_grad_reduction: str = "reduce_scatter"  # 'all_reduce' (DeepSpeed 2021 default) or 'reduce_scatter'
    zero3_sync_per_module: bool = False  # a device synchronize before each sub-module's compute
    zero3_gather_copy_out: bool = False  # all_gather into a list: one copy kernel per rank per gather
    zero3_fetch_norm: bool = False  # every fetched parameter's norm is computed (a debug f-string evaluated eagerly)
    zero3_regather_persistent: bool = False  # the step ends by re-gathering the persistent parameters rank by rank
    zero3_trace_aligned: bool = True  # the recorded sub-module trace lines up with the step counter: prefetch and keep-for-later work
    zero3_serial_grad_checks: bool = False  # the step checks overflow and sums the gradient norm one parameter at a time, reading each result on the host
    zero3_small_grad_hooks: bool = False  # the small (persistent) parameters' gradient hooks fill and flush the reduce buckets in autograd's order
    # torch's copy_ of a view onto the very data it reads is a no-op (pytorch/pytorch PR #88884, 2022-11, in torch 2.0:
    # 'copy_: Short-circuit when self and src view the same data'); before it one read and one write ran
    self_copy_skipped: bool = True
    # CUDA_LAUNCH_BLOCKING=1 (CUDA C Programming Guide, "Asynchronous Concurrent Execution": "Programmers can
    # globally disable asynchronicity of kernel launches for all CUDA applications running on a system by setting
    # the CUDA_LAUNCH_BLOCKING environment variable to 1"): every launch returns when its kernel has run, so the
    # host's time per op adds to the device's instead of hiding under it (cost/layer.py), and nothing the host
    # issues overlaps: every *_overlap field and grad_reduce_async must be false (checked below)
    launch_blocking: bool = False
    score_bias_input: bool = False  # the materialised attention scores start from a bias broadcast over them (ALiBi as baddbmm's input, beta != 0): a write and a read of the scores more per forward (cost/passes.py)
    # DeepSpeed's BF16_Optimizer (deepspeed/runtime/bf16_optimizer.py, from v0.6.2): what the engine does for a
    # plan trained in bf16 only (gated in one place, Engine.bf16_optimizer_runs; fp16 / fp32 plans never see it)
    bf16_optimizer_grads: bool = False  # under bf16, every microbatch's backward starts with the bf16 .grads None (clear_lp_grads) and ends by casting each into the fp32 gradient (update_hp_grads): fresh gradients every microbatch and a cast + add pass per parameter (cost/layer.py hp_grad_update_s)
    bf16_grad_comm: bool = False  # under bf16, the data-parallel all-reduce of BF16_Optimizer's fp32 gradient buffer travels in bf16: each bucket is cast to bf16, scaled, reduced and copied back into the fp32 buffer (DeepSpeed's default communication_data_type; cost/gradpasses.py dp_wire_bytes, bf16_comm_pass_bytes); the tied head's all-reduce stays fp32
    zero1_all_reduce: bool = False  # under bf16, ZeRO-1 reduces the full gradients with an all-reduce (each rank then updates its shard and all-gathers the weights), not a reduce-scatter: BF16_Optimizer's own sharding under DeepSpeed's pipeline engine (plan.layout.zero_layout)
    # the ZeRO stages (ParallelConfig.zero) the engine runs, ascending, 0 among them (a plan with nothing data
    # parallel runs unsharded under every engine); the search enumerates only these and a config with another
    # is refused before pricing (check_zero). Each engine YAML cites its engine's code for its list
    zero_stages: tuple[int, ...] = ZERO_STAGES
    # ... and those it runs with a pipeline (pp > 1), among zero_stages, 0 among them; None: zero_stages (an
    # engine whose pipeline runs every stage it has). The search enumerates only these where pp > 1 and a
    # config with another is refused (check_zero with its pp). Each engine YAML cites its engine's code
    zero_stages_with_pp: tuple[int, ...] | None = None
    # ZeRO 0 (replicated data parallelism) runs only as the only parallel dimension: with data parallelism
    # (dp * ep * cp > 1), only at tp = pp = cp = ep = 1 (zero_runs_on); false: beside any other dimension.
    # The search drops the others and a config with one is refused (check_zero). Each engine YAML cites its code
    zero0_1d_only: bool = False
    # the pipeline schedules (ParallelConfig.schedule values) the engine runs where pp > 1 (with pp = 1 none
    # runs: every engine's no-pipeline path); the search enumerates only these and a config or a forced
    # schedule with another is refused (check_schedule). Each engine YAML cites its engine's code
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zb")
    source: str = ""  # the file it came from

    def __post_init__(self) -> None:
        for name, allowed in (("attention", ATTENTION_KINDS), ("zero3", ZERO3_KINDS),
                              ("zero3_grad_reduction", GRAD_REDUCTIONS), ("selective_recompute", SELECTIVE_KINDS),
                              ("rmsnorm", RMSNORM_KINDS)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"engine field {name!r} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
        if not 0.0 <= self.attention_dropout < 1.0:
            raise ValueError(f"engine field 'attention_dropout' must be a probability in [0, 1), got {self.attention_dropout!r}")
        self._check_launch_blocking()
        self._check_zero_stages()
        self._check_schedules()
        self._check_sms_by_op()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "bool" and not isinstance(value, bool):
                raise ValueError(f"engine field {f.name!r} must be true or false, got {value!r}")
            if f.type == "int" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"engine field {f.name!r} must be a non-negative integer, got {value!r}")

    def _check_sms_by_op(self) -> None:
        """tp_overlap_margin_sms_by_op and tp_overlap_comm_sms_by_op, each as sorted (op, SMs) pairs (a mapping,
        or the pairs a JSON list of lists comes back as), each op among TE_UB_OPS once, each count a
        non-negative integer."""
        for name in ("tp_overlap_margin_sms_by_op", "tp_overlap_comm_sms_by_op"):
            given = getattr(self, name)
            try:
                pairs = list(given.items()) if isinstance(given, dict) else [tuple(p) for p in given]
                ok = all(len(p) == 2 for p in pairs)
            except TypeError:
                ok = False
            if not ok or any(op not in TE_UB_OPS or isinstance(n, bool) or not isinstance(n, int) or n < 0
                             for op, n in pairs) or len({op for op, _ in pairs}) != len(pairs):
                raise ValueError(f"engine field {name!r} must map TE userbuffers overlaps among "
                                 f"{', '.join(TE_UB_OPS)} (each once) to non-negative SM counts, got {given!r}")
            object.__setattr__(self, name, tuple(sorted(pairs)))

    def _check_launch_blocking(self) -> None:
        """Under launch_blocking a collective's launch returns only when it has run, so nothing issued from the
        host thread runs beside it: an overlap field left true would price an overlap that cannot happen."""
        if not self.launch_blocking:
            return
        on = [name for name in OVERLAP_FIELDS if getattr(self, name)]
        if on:
            raise ValueError(f"engine field 'launch_blocking' is true (every kernel launch synchronous: no overlap), "
                             f"so {', '.join(map(repr, on))} must be false")

    def _check_zero_stages(self) -> None:
        """zero_stages as a sorted tuple (a JSON list comes back as one) of distinct stages among 0-3, with 0;
        zero_stages_with_pp the same (or None), among zero_stages."""
        object.__setattr__(self, "zero_stages", _stage_list("zero_stages", self.zero_stages))
        if self.zero_stages_with_pp is None:
            return
        with_pp = _stage_list("zero_stages_with_pp", self.zero_stages_with_pp)
        extra = sorted(set(with_pp) - set(self.zero_stages))
        if extra:
            raise ValueError(f"engine field 'zero_stages_with_pp' lists stage(s) {extra} that zero_stages "
                             f"{list(self.zero_stages)} does not: a stage run with a pipeline is one the engine runs")
        object.__setattr__(self, "zero_stages_with_pp", with_pp)

    def _check_schedules(self) -> None:
        """schedules as a tuple in Schedule's order of distinct schedule names (is_schedule; a JSON list comes
        back as one)."""
        names, given = schedule_names(), self.schedules
        values = [schedule_name(v) for v in given] if isinstance(given, (list, tuple)) else None
        if not values or not all(map(is_schedule, values)) or len(set(values)) != len(values):
            raise ValueError(f"engine field 'schedules' must be a list of distinct pipeline schedules among "
                             f"{', '.join(map(repr, names))}, got {given!r}")
        object.__setattr__(self, "schedules", tuple(n for n in names if n in values))

    def zero_stages_at(self, pp: int) -> tuple[int, ...]:
        """The ZeRO stages this engine runs at pipeline degree `pp`: zero_stages, or zero_stages_with_pp where pp > 1."""
        return self.zero_stages if pp <= 1 or self.zero_stages_with_pp is None else self.zero_stages_with_pp

    def runs_zero(self, stage: object, *, pp: int = 1, tp: int = 1, dp: int = 1, cp: int = 1, ep: int = 1) -> bool:
        """Whether this engine runs ZeRO stage `stage` at pipeline degree `pp` (a stage at all, is_zero_stage,
        among zero_stages_at(pp)) on the mesh with the other degrees (zero_runs_on: zero0_1d_only; the defaults,
        nothing data parallel, leave it out): the one test behind check_zero and the search's stages
        (search/space.py engine_zero, engine_zero_with_pp, enumerate_space)."""
        return (is_zero_stage(stage) and stage in self.zero_stages_at(pp)
                and zero_runs_on(stage, self.zero0_1d_only, tp=tp, pp=pp, dp=dp, cp=cp, ep=ep))

    def check_zero(self, zero: int, *, pp: int = 1, tp: int = 1, dp: int = 1, cp: int = 1, ep: int = 1) -> None:
        """ValueError, one line, when this engine does not run ZeRO stage `zero` at pipeline degree `pp` on the
        mesh with the other degrees (runs_zero; pp > 1 also stands for 'only with a pipeline' in the search)."""
        if self.runs_zero(zero, pp=pp, tp=tp, dp=dp, cp=cp, ep=ep):
            return
        if self.runs_zero(zero, pp=pp):  # the stage runs here, but not beside these degrees
            others = ", ".join(f"{k}={v}" for k, v in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)) if v > 1)
            sharded = ", ".join(str(z) for z in self.zero_stages_at(pp) if z)
            raise ValueError(f"engine {self.name!r} runs ZeRO stage 0 (replicated data parallelism) only as the only "
                             f"parallel dimension (its zero0_1d_only), not beside {others}: use --zero / zero= among "
                             f"{sharded or 'none (this engine shards nothing here)'}, or tp = pp = cp = ep = 1, or an "
                             f"engine that runs zero 0 beside them")
        if not self.runs_zero(zero):
            runs = ", ".join(map(str, self.zero_stages))
            raise ValueError(f"engine {self.name!r} runs ZeRO stage(s) {runs} only (its zero_stages), not zero {zero}: "
                             f"use --zero / zero= among {runs}, or an engine that runs stage {zero}")
        runs = ", ".join(map(str, self.zero_stages_at(pp)))
        raise ValueError(f"engine {self.name!r} runs ZeRO stage(s) {runs} only with a pipeline (pp > 1: its "
                         f"zero_stages_with_pp), not zero {zero}: use --zero / zero= among {runs}, or pp=1, or an "
                         f"engine that runs stage {zero} with a pipeline")

    def runs_schedule(self, schedule: object) -> bool:
        """Whether this engine's pipeline runs `schedule` (a Schedule or its name, among schedules)."""
        return schedule_name(schedule) in self.schedules

    def check_schedule(self, schedule: object, *, pp: int | None = None) -> None:
        """ValueError, one line, when a pipeline would run `schedule` and this engine does not (runs_schedule):
        a config's pipeline degree `pp` (with pp = 1 no schedule runs: nothing to refuse), None for a schedule
        the caller forces on the search."""
        if (pp is not None and pp <= 1) or self.runs_schedule(schedule):
            return
        value, runs = str(getattr(schedule, "value", schedule)), ", ".join(self.schedules)
        raise ValueError(f"engine {self.name!r} runs pipeline schedule(s) {runs} only (its schedules), not "
                         f"{value!r}: use --schedule / --schedules / schedules= among {runs}, or an engine that "
                         f"runs {value!r}")

    def bf16_optimizer_runs(self, dtype: str) -> bool:
        """Whether DeepSpeed's BF16_Optimizer runs a plan trained in `dtype`: the one gate of bf16_optimizer_grads,
        zero1_all_reduce and bf16_grad_comm (hp_grads, zero1_all_reduces, bf16_comm), read by the exact model (cost/layer.py,
        cost/estimate.py), its ZeRO layout (plan.layout.zero_layout) and the quick estimate (search/assemble.py).
        DeepSpeed builds it only for a bf16 model: v0.6.2-v0.7.x engine.py _configure_optimizer `elif
        self.bfloat16_enabled(): self.optimizer = self._configure_bf16_optimizer(...)` (after ZeRO, amp and fp16);
        v0.8.0 on, _do_optimizer_sanity_check returns BFLOAT16 for `model_dtype == torch.bfloat16 and
        grad_accum_dtype == torch.float32`. An fp16 model gets FP16_Optimizer, fp32 none. Which ZeRO stages
        build it is the engine's (the fields are set only where every bf16 run the engine can run has it: see
        engines/megatron-deepspeed.yaml)."""
        return dtype == "bf16"

    def hp_grads(self, dtype: str) -> bool:
        """bf16_optimizer_grads for a plan trained in `dtype` (bf16_optimizer_runs)."""
        return self.bf16_optimizer_grads and self.bf16_optimizer_runs(dtype)

    def zero1_all_reduces(self, dtype: str) -> bool:
        """zero1_all_reduce for a plan trained in `dtype` (bf16_optimizer_runs)."""
        return self.zero1_all_reduce and self.bf16_optimizer_runs(dtype)

    def bf16_comm(self, dtype: str) -> bool:
        """bf16_grad_comm for a plan trained in `dtype` (bf16_optimizer_runs)."""
        return self.bf16_grad_comm and self.bf16_optimizer_runs(dtype)

    @staticmethod
    def load(name_or_path: str | os.PathLike[str]) -> Engine:
        """A shipped engine by name (see `Engine.names()`) or an engine YAML file by path."""
        from autoplan.cluster.engines import load_engine

        return load_engine(name_or_path)

    @staticmethod
    def names() -> tuple[str, ...]:
        """Names of the shipped engines."""
        from autoplan.cluster.engines import engine_names

        return engine_names()

    def to_dict(self) -> dict[str, Any]:
        """JSON-native fields (zero_stages, zero_stages_with_pp, schedules as lists; from_dict takes them back as
        the tuples)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Engine:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown engine field(s) {unknown}: known fields are {sorted(known)}")
        return cls(**data)


def as_engine(engine: Engine | str | os.PathLike[str] | None) -> Engine:
    """An Engine from an Engine, a shipped name or a path; None is the default (autoplan's executor)."""
    if engine is None:
        return Engine()
    if isinstance(engine, Engine):
        return engine
    if isinstance(engine, (str, os.PathLike)):
        return Engine.load(engine)
    raise ValueError(f"engine must be an Engine, a shipped engine name or a YAML path, got {type(engine).__name__}")
