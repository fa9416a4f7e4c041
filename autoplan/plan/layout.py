"""Layout facts that the cost model, the search and the executor must agree on, each with one home:
which pipeline rank runs each stage, the default stage split, what each ZeRO stage shards (and when it
communicates) in the engine that runs it, and which sizes must divide.

Pure functions of a ParallelConfig and plain numbers; nothing else from autoplan is imported except the
plan's own types (plan.types, plan.engine), so the executor (which never imports cost/ or search/) calls the same functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autoplan.plan.engine import check_zero_stage
from autoplan.plan.types import ParallelConfig, Schedule

# --- pipeline placement -------------------------------------------------------------------------------

def uses_v_placement(config: ParallelConfig) -> bool:
    """The zero-bubble V schedule (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024;
    torch.distributed.pipelining ScheduleZBVZeroBubble / ScheduleDualPipeV): 'zb' with 2 chunks per rank
    places the chunks in a V, not looped."""
    return config.schedule is Schedule.ZERO_BUBBLE and config.virtual_stages == 2


def num_stages(config: ParallelConfig) -> int:
    return config.pp * config.virtual_stages


def stage_ranks(config: ParallelConfig) -> tuple[int, ...]:
    """The pipeline rank of each of the pp * virtual_stages stages, in model order.

    Looped (GPipe, 1F1B, Megatron's interleaved 1F1B, interleaved zero bubble: torch's
    ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble): stage i on rank i % pp.
    V (zero-bubble V): stage i on rank i for i < pp, on rank 2 pp - 1 - i after, so rank 0 holds the
    first and the last stage (torch.distributed.pipelining's stage_index_to_group_rank for style "v")."""
    p, n = config.pp, num_stages(config)
    if uses_v_placement(config):
        return tuple(i if i < p else 2 * p - 1 - i for i in range(n))
    return tuple(i % p for i in range(n))


def rank_stages(config: ParallelConfig, pp_rank: int) -> tuple[int, ...]:
    """The stages pipeline rank `pp_rank` holds, in increasing order."""
    if not 0 <= pp_rank < config.pp:
        raise ValueError(f"pipeline rank {pp_rank} out of range for pp={config.pp}")
    return tuple(i for i, r in enumerate(stage_ranks(config)) if r == pp_rank)


def default_block_counts(num_blocks: int, config: ParallelConfig) -> tuple[int, ...]:
    """Blocks per stage of the default split (Megatron-LM's even split by count, in model order).

    When the count does not divide, the extra blocks go first to stages on ranks that hold neither the
    first stage (embedding) nor the last (head), one per rank in turn, then to the other middle stages,
    then to the first and last stages: the ranks that also carry the embedding and the head get the
    fewest blocks. With V placement rank 0 holds both ends."""
    n = num_stages(config)
    if n > max(num_blocks, 1):
        raise ValueError(f"pp*virtual_stages = {n} pipeline stages but the model has {num_blocks} blocks: "
                         f"use at most {num_blocks} stages")
    if num_blocks == 0:
        return (0,) * n
    base, extra = divmod(num_blocks, n)
    ranks = stage_ranks(config)
    ends = {0, n - 1}
    busy = {ranks[0], ranks[-1]}
    seen: dict[int, int] = {}
    turn = []  # (priority, pass over the rank's stages, stage)
    for q in range(n):
        turn.append((2 if q in ends else (1 if ranks[q] in busy else 0), seen.get(ranks[q], 0), q))
        seen[ranks[q]] = seen.get(ranks[q], 0) + 1
    counts = [base] * n
    for _, _, q in sorted(turn)[:extra]:
        counts[q] += 1
    return tuple(counts)


def default_stages(layer_names: Sequence[str], is_block: Sequence[bool],
                   config: ParallelConfig) -> tuple[tuple[str, ...], ...]:
    """The default split of an ordered list of layers into pp * virtual_stages stages.

    Blocks are counted out by default_block_counts; layers before the first block (the embedding) join
    the first stage, layers after the last block (final norm, head) the last, and other layers between
    blocks follow the block before them. Both the cost model (graph layer names) and the executor (module
    names) call this, so the split that is priced is the split that runs."""
    return split_by_counts(layer_names, is_block, default_block_counts(sum(map(bool, is_block)), config))


def split_by_counts(layer_names: Sequence[str], is_block: Sequence[bool],
                    counts: Sequence[int]) -> tuple[tuple[str, ...], ...]:
    """The layers cut into len(counts) stages holding counts[q] blocks each, in model order: layers before
    the first block join the first stage, layers after the last block the last, other layers between
    blocks follow the block before them (default_stages' rule, for any counts)."""
    names, flags = list(layer_names), list(is_block)
    if len(names) != len(flags):
        raise ValueError(f"{len(names)} layer names but {len(flags)} block flags")
    block_idx = [i for i, f in enumerate(flags) if f]
    n = len(counts)
    if sum(counts) != len(block_idx) or min(counts, default=0) < 0:
        raise ValueError(f"stage block counts {list(counts)} do not add up to the {len(block_idx)} blocks")
    if not block_idx:
        return (tuple(names),) + ((),) * (n - 1) if n > 1 else (tuple(names),)
    cuts, total = [], 0
    for c in counts[:-1]:
        total += c  # a cut before block `total`; after the last block when the stages after it hold none
        cuts.append(block_idx[total] if total < len(block_idx) else block_idx[-1] + 1)
    bounds = [0, *cuts, len(names)]
    return tuple(tuple(names[bounds[k]:bounds[k + 1]]) for k in range(n))


# --- data parallelism: what each ZeRO stage shards, and when it communicates -----------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class ZeroLayout:
    """What one ZeRO stage does in the engine that runs it.

    shards_*: sharded over the data-parallel group at the step's peak (not only at rest).
    grad_reduction: the collective that reduces gradients ("all_reduce" or "reduce_scatter").
    reduce_every_microbatch: gradients are reduced after each microbatch's backward; otherwise they
    accumulate unsharded and are reduced once, during the last microbatch's backward.
    weight_gathers_per_microbatch: all-gathers of the weights per microbatch (ZeRO-3: 2, forward and
    backward); weight_gathers_per_step: all-gathers once per step (ZeRO-1/2 after the sharded optimizer
    step: the updated weights)."""

    zero: int
    shards_optimizer: bool
    shards_gradients: bool
    shards_weights: bool
    grad_reduction: str
    reduce_every_microbatch: bool
    weight_gathers_per_microbatch: int
    weight_gathers_per_step: int


def zero_layout(config: ParallelConfig, num_microbatches: int, *, zero3: str = "fsdp2",
                pipelined_fsdp_defers_sync: bool = True, zero1_all_reduce: bool = False) -> ZeroLayout:
    """The ZeRO layout of `config` (Rajbhandari et al., ZeRO, SC'20) as the engine runs it.

    - zero 0: replicated weights, gradients all-reduced once per step (DDP / FSDP2 replicate with
      gradient sync on the last microbatch only).
    - zero 1: optimizer states sharded; full gradients accumulate and are reduce-scattered once per
      step; the updated weight shards are all-gathered after the step (Megatron's distributed
      optimizer; FSDP2 reshard_after_forward=False with gradient sync on the last microbatch).
    - zero 2: also gradients sharded: reduce-scattered after every microbatch (FSDP2 SHARD_GRAD_OP's
      default; DeepSpeed stage 2 reduces in buckets as gradients are produced; Megatron-FSDP's
      optim_grads, megatron_fsdp.py _process_post_backward_gradients: `grad_reduce_every_bprop`, with
      or without a pipeline, each backward's unsharded gradient bucket reduce-scattered into the sharded
      fp32 main_grad and freed). Whether the next microbatch waits for those reductions is the
      engine's (Engine.grad_reduce_async; cost.dataparallel.async_reduce_s).
    - zero 3: also weights: all-gathered before each microbatch's forward and again before its backward
      (FSDP2 reshard_after_forward=True; DeepSpeed stage 3), gradients reduce-scattered every microbatch.
    With pp > 1, torch.distributed.pipelining defers FSDP2's gradient sync and resharding to the last
    microbatch (PipelineStage.backward_maybe_with_nosync: set_requires_gradient_sync(False),
    set_reshard_after_backward(False) until the last backward): `pipelined_fsdp_defers_sync` (the
    autoplan executor) then accumulates unsharded gradients and keeps the stage's weights gathered for the
    step, whatever the ZeRO stage; only the optimizer states stay sharded.
    `zero1_all_reduce` (Engine.zero1_all_reduce): zero 1 all-reduces the full gradients instead (DeepSpeed's
    pipeline engine under bf16: deepspeed/runtime/pipe/engine.py _exec_reduce_grads -> _bf16_reduce_grads ->
    buffered_allreduce_fallback of the BF16_Optimizer's fp32 gradients; its step updates the local shard and
    all-gathers the weights, bf16_optimizer.py all_gather_dp_groups)."""
    z = config.zero
    check_zero_stage(z)
    if zero3 not in ("fsdp2", "deepspeed"):
        raise ValueError(f"zero3 must be 'fsdp2' or 'deepspeed', got {zero3!r}")
    if config.num_replicas * config.cp == 1 or z == 0:
        return ZeroLayout(zero=z, shards_optimizer=False, shards_gradients=False, shards_weights=False,
                          grad_reduction="all_reduce", reduce_every_microbatch=False,
                          weight_gathers_per_microbatch=0, weight_gathers_per_step=0)
    deferred = pipelined_fsdp_defers_sync and config.pp > 1
    if z == 1 or deferred:
        # deferred ZeRO-3 still reshards after each forward (reshard_after_forward=True) and re-gathers
        # for that microbatch's backward; the first forward's gather is the per-step one
        reduction = "all_reduce" if zero1_all_reduce and z == 1 else "reduce_scatter"
        return ZeroLayout(zero=z, shards_optimizer=True, shards_gradients=False, shards_weights=False,
                          grad_reduction=reduction, reduce_every_microbatch=False,
                          weight_gathers_per_microbatch=1 if z == 3 else 0, weight_gathers_per_step=1)
    if z == 2:
        return ZeroLayout(zero=z, shards_optimizer=True, shards_gradients=True, shards_weights=False,
                          grad_reduction="reduce_scatter", reduce_every_microbatch=True,
                          weight_gathers_per_microbatch=0, weight_gathers_per_step=1)
    return ZeroLayout(zero=z, shards_optimizer=True, shards_gradients=True, shards_weights=True,
                      grad_reduction="reduce_scatter", reduce_every_microbatch=True,
                      weight_gathers_per_microbatch=2, weight_gathers_per_step=0)


# --- which sizes must divide ----------------------------------------------------------------------------

def divisibility_errors(config: ParallelConfig, *, num_heads: int = 0, num_kv_heads: int = 0,
                        ffn_hidden_size: int = 0, num_experts: int = 0, vocab_size: int = 0,
                        seq_len: int = 0, num_blocks: int | None = None,
                        global_batch: int | None = None) -> tuple[str, ...]:
    """Every way `config` fails to divide the model, one line each saying what to change (empty when it
    runs). 0 / None means "not known, not checked". The search filters with it, the cost model and the
    executor refuse with its first line.

    - tp divides the attention heads, the kv heads, the FFN width (Megatron column / row splits, Shoeybi
      et al. 2019) and the vocabulary (vocab-parallel embedding and loss);
    - ep (eep when folded) divides the routed experts;
    - folded experts with tp > 1: tp divides the tokens of a microbatch on a cp rank (they are split
      over the tp group before the experts, expert_token_split);
    - 2 cp divides seq_len (the load-balanced causal split into 2 cp chunks: Megatron-core CP, Llama 3);
    - pp * virtual_stages <= the blocks;
    - dp * ep * microbatch divides the global batch."""
    out = []
    t = config.tp
    for what, value in (("attention heads", num_heads), ("kv heads", num_kv_heads),
                        ("ffn hidden size", ffn_hidden_size), ("vocabulary", vocab_size)):
        if value and value % t:
            out.append(f"tp={t} does not divide the {what} ({value}): choose tp among the divisors of {value}")
    if config.ep > 1 and not num_experts:
        out.append(f"ep={config.ep} on a model without routed experts: use ep=1")
    elif config.folded and not num_experts:
        out.append(f"etp={config.etp}, eep={config.eep} on a model without routed experts: leave them unset")
    elif num_experts and num_experts % config.expert_ep:
        name = "eep" if config.folded else "ep"
        out.append(f"{name}={config.expert_ep} does not divide the {num_experts} experts: choose {name} among "
                   f"the divisors of {num_experts}")
    out += _token_split_errors(config, seq_len)
    if config.cp > 1 and seq_len and seq_len % (2 * config.cp):
        out.append(f"cp={config.cp} needs seq_len divisible by 2*cp={2 * config.cp} (load-balanced causal "
                   f"split), got seq_len={seq_len}: choose cp with 2*cp dividing it")
    if num_blocks is not None and num_stages(config) > max(num_blocks, 1):
        out.append(f"pp*virtual_stages = {num_stages(config)} pipeline stages but the model has {num_blocks} "
                   f"blocks: use at most {num_blocks} stages")
    if global_batch is not None:
        per = config.num_replicas * config.microbatch
        if global_batch % per or global_batch < per:
            out.append(f"global batch {global_batch} does not divide into dp*ep={config.num_replicas} "
                       f"replicas x microbatch {config.microbatch}: use a global batch that is a multiple of {per}")
        else:
            out += schedule_errors(config, global_batch // per)
    return tuple(out)


def schedule_errors(config: ParallelConfig, num_microbatches: int) -> tuple[str, ...]:
    """What the pipeline schedule that runs the plan refuses for this number of microbatches per step
    (torch.distributed.pipelining 2.13, autoplan's executor; the search enumerates only what passes):
    - 1F1B (Schedule1F1B.__init__): at least as many microbatches as stages;
    - interleaved 1F1B and looped zero bubble (ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble):
      rounds = max(1, m // pp), and m a multiple of the rounds;
    - GPipe and the zero-bubble V (ScheduleZBVZeroBubble): any m."""
    if config.pp == 1:
        return ()
    m, p = num_microbatches, config.pp
    if config.schedule is Schedule.ONE_F_ONE_B and m < p:
        return ((f"1F1B needs at least pp={p} microbatches per step, got {m}: use a smaller microbatch, a larger "
                f"global batch or another schedule"),)
    looped = config.schedule is Schedule.INTERLEAVED or (config.schedule is Schedule.ZERO_BUBBLE
                                                          and not uses_v_placement(config))
    rounds = max(1, m // p)
    if looped and m % rounds:
        return ((f"{config.schedule.value} runs microbatches in rounds of pp={p}: {m} microbatches are not a "
                f"multiple of the {rounds} rounds; use a number of microbatches that is"),)
    return ()


# --- MoE parallel folding: the experts' own layout over the same ranks -----------------------------------

EXPERT_AXIS_NAMES = ("pp", "edp", "eep", "etp")


def expert_mesh_shape(config: ParallelConfig) -> tuple[tuple[str, int], ...]:
    """(axis, size) outermost first of the experts' layout when folded: (pp, edp, eep, etp) over the same
    ranks as the dense (pp, dp, ep, cp, tp) mesh, etp innermost, then the expert-parallel axis, then expert
    data parallelism (Megatron-Core parallel_state.py initialize_model_parallel: the expert RankGenerator
    with order "tp-ep-dp-pp" and the dense one's pp groups). A pipeline stage holds the same contiguous
    block of dp*ep*cp*tp ranks in both meshes, so stage-local rank l is (edp, eep, etp) =
    (l // (eep*etp), l // etp % eep, l % etp). Unfolded configs keep today's layout (the dense mesh's ep
    axis; expert data parallelism over dp*cp) and have no expert mesh of their own."""
    return (("pp", config.pp), ("edp", config.expert_dp), ("eep", config.expert_ep), ("etp", config.expert_tp))


def expert_tp_split(config: ParallelConfig, *, unfolded_over_tp: bool) -> int:
    """Ranks each routed expert's weights and GEMMs are split over. Folded: etp. Unfolded: the dense tp
    group when the engine splits unfolded experts over it (Engine.tp_splits_unfolded_experts:
    Megatron-Core, whose expert tensor-parallel size defaults to the tensor-parallel size), else 1:
    autoplan's executor (execute/experts.py ExpertParallel) holds each of its ep shard's experts whole on
    every tp rank and runs them on the tp group's replicated tokens."""
    if config.folded:
        return config.expert_tp
    return config.tp if unfolded_over_tp else 1


def expert_token_split(config: ParallelConfig) -> int:
    """How many ways the tokens entering the routed experts are split inside the dense tp group. Folded:
    tp (each tp rank routes its 1/tp of the group's replicated tokens, so every rank of the stage holds
    distinct tokens, as Megatron-Core's MoE layer does on its sequence-parallel shard); unfolded: 1 (the
    tp ranks route the same tokens, today's executor)."""
    return config.tp if config.folded else 1


def _token_split_errors(config: ParallelConfig, seq_len: int) -> list[str]:
    split = expert_token_split(config)
    if split == 1 or not seq_len or seq_len % config.cp:
        return []
    tokens = config.microbatch * seq_len // config.cp
    if tokens % split:
        return [(f"folded experts with tp={split} split the {tokens} tokens of a microbatch on a cp rank over "
                 f"the tp group, which does not divide them: use a microbatch * seq_len / cp divisible by {split}")]
    return []
