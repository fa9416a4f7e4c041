"""The three engine mappings behind autoplan.plan.export: a plan -> (value, notes) for Megatron-LM,
torchtitan and DeepSpeed. Each says in its docstring which engine source it follows.

Degrees: autoplan's devices are pp * dp * ep * cp * tp and dense layers are replicated over dp * ep
(expert parallelism carved out of data parallelism). Megatron-LM derives its data-parallel size as
world / (tp * pp * cp) = dp * ep and splits experts over ep (with expert tp = tp, its default);
torchtitan's data-parallel degrees (replicate * shard) are dp * ep, ep borrowed from them; DeepSpeed's
batch identity train_batch_size = micro batch * accumulation steps * data-parallel world holds with a
data-parallel world of dp * ep.

Expert layouts: Megatron-Core and torchtitan place experts on a mesh of their own over the same ranks
(Megatron's expert RankGenerator, torchtitan's sparse mesh [pp, dp_replicate, efsdp, ep, etp]), etp
innermost and ep next: autoplan's folded layout (etp, eep) is theirs exactly, written as
--expert-model-parallel-size eep --expert-tensor-parallel-size etp (expert_parallel_degree,
expert_tensor_parallel_degree). An unfolded plan's experts sit on the dense mesh's ep axis, outside cp:
the same as their expert mesh with etp = tp unless cp > 1 (a note then).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autoplan.plan.layout import rank_stages, uses_v_placement
from autoplan.plan.types import Plan, Recompute, Schedule

if TYPE_CHECKING:
    from autoplan.plan.export import Split

Modes = tuple[tuple[Recompute, ...], ...]
_NONE, _SEL, _FULL = Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL


def _count(modes: Modes, *which: Recompute) -> int:
    return sum(m in which for stage in modes for m in stage)


def _total(modes: Modes) -> int:
    return sum(len(s) for s in modes)


# --- Megatron-LM ----------------------------------------------------------------------------------------

# ZeRO-1: the distributed optimizer (optimizer states sharded, gradients reduce-scattered once per step);
# ZeRO-2/3: Megatron-FSDP's sharding strategies (arguments.py --data-parallel-sharding-strategy choices
# no_shard / optim / optim_grads / optim_grads_params), which it requires with the fsdp_dtensor checkpoint
# format and (version 1) the distributed optimizer (validate_args).
_MEGATRON_ZERO = {
    0: [],
    1: ["--use-distributed-optimizer"],
    2: ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads", "--use-distributed-optimizer",
        "--ckpt-format", "fsdp_dtensor"],
    3: ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
        "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor"],
}


def megatron(plan: Plan, split: Split | None, modes: Modes) -> tuple[list[str], list[str]]:
    """Megatron-LM flags: degrees, sequence parallelism, batch, ZeRO, pipeline schedule and split, recompute."""
    c, notes = plan.config, []
    args = ["--tensor-model-parallel-size", str(c.tp), "--pipeline-model-parallel-size", str(c.pp),
            "--context-parallel-size", str(c.cp), "--expert-model-parallel-size", str(c.expert_ep),
            "--micro-batch-size", str(c.microbatch), "--global-batch-size", str(plan.global_batch),
            "--seq-length", str(plan.seq_len), "--bf16"]
    if c.sp:
        args.append("--sequence-parallel")
    if c.expert_ep > 1 or c.folded:
        # megatron/core/model_parallel_config.py expert_tensor_parallel_size (None: tensor_model_parallel_size)
        args += ["--expert-tensor-parallel-size", str(c.expert_tp)]
        notes += _expert_mesh_note(c, "Megatron-Core")
    if split is not None:
        args += ["--num-layers", str(split.num_blocks)]
    args += _MEGATRON_ZERO[c.zero]
    args += _megatron_pipeline(plan, split, notes)
    args += _megatron_recompute(modes, notes)
    return args, notes


def _expert_mesh_note(c: Any, engine: str) -> list[str]:
    """An unfolded plan with ep and cp: the engine's expert mesh puts ep inside cp, autoplan's ep axis
    lies outside it (the same degrees, other groups)."""
    if c.folded or c.ep == 1 or c.cp == 1:
        return []
    return [(f"ep={c.ep} with cp={c.cp}: {engine} forms expert-parallel groups of ranks tp apart (its expert mesh, "
             f"inside the cp group); the plan's ep axis is cp*tp apart. The same degrees run on other groups: "
             f"plan with folded experts (etp={c.tp}, eep={c.ep}) to price {engine}'s layout")]


def _megatron_pipeline(plan: Plan, split: Split | None, notes: list[str]) -> list[str]:
    """Megatron-LM runs 1F1B, or interleaved 1F1B with virtual stages in looped placement
    (schedules.py forward_backward_pipelining_with/without_interleaving). An even split is
    --num-layers-per-virtual-pipeline-stage; one that differs only at the ends is
    --decoder-first/last-pipeline-num-layers (v = 1); any other is --pipeline-model-parallel-layout
    ("E" embedding, "t" a block, "L" loss, "|" between stages in model order: pipeline_parallel_layer_layout.py)."""
    c = plan.config
    if c.pp == 1:
        return []
    v = c.virtual_stages
    instead = "1F1B" if v == 1 else f"interleaved 1F1B over the same {v} chunks per rank, placed looped" + (
        " instead of in a V" if uses_v_placement(c) else "")
    if c.schedule is Schedule.GPIPE:
        notes.append("schedule gpipe: Megatron-LM trains pipelines with 1F1B (the same bubble, fewer "
                     "microbatches' activations held); the flags give 1F1B")
    elif c.schedule is Schedule.ZERO_BUBBLE:
        notes.append(f"schedule zb (zero bubble, v={v}): Megatron-LM has no zero-bubble schedule; the flags give "
                     f"{instead}")
    if split is None:
        return ["--num-virtual-stages-per-pipeline-rank", str(v)] if v > 1 else []
    if split.between:
        notes.append(f"layers between blocks ({', '.join(split.between)}) have no place in a Megatron-LM layout")
    counts = split.counts
    if len(set(counts)) == 1:
        return ["--num-layers-per-virtual-pipeline-stage", str(counts[0])] if v > 1 else []
    if v == 1 and min(counts) > 0 and len(set(counts[1:-1])) <= 1:
        return ["--decoder-first-pipeline-num-layers", str(counts[0]),
                "--decoder-last-pipeline-num-layers", str(counts[-1])]
    last = len(counts) - 1
    stages = [("E" if k == 0 else "") + (f"t*{n}" if n > 1 else "t" * n) + ("L" if k == last else "")
              for k, n in enumerate(counts)]
    return ["--pipeline-model-parallel-layout", "|".join(stages)]


def _megatron_recompute(modes: Modes, notes: list[str]) -> list[str]:
    """--recompute-granularity selective recomputes the attention core (recompute_modules default
    ["core_attn"], as autoplan's selective); full with --recompute-method uniform and 1 layer recomputes
    every block; block with N recomputes the first N blocks of every stage (recompute.py)."""
    n, sel, full = _total(modes), _count(modes, _SEL), _count(modes, _FULL)
    if sel + full == 0:
        return []
    if full == 0:
        if sel < n:
            notes.append(f"selective recompute on {sel} of {n} blocks: Megatron-LM applies selective recompute "
                         f"to every block or none; the flags give every block")
        return ["--recompute-granularity", "selective"]
    if sel:
        notes.append(f"a mix of selective ({sel}) and full ({full}) recompute: Megatron-LM recomputes at one "
                     f"granularity; the flags give full recompute of all {sel + full} blocks that recompute")
    per = [sum(m is not _NONE for m in stage) for stage in modes]
    if all(p == len(stage) for p, stage in zip(per, modes)):
        return ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    if len(set(per)) > 1:
        notes.append(f"full recompute of {'/'.join(map(str, per))} blocks per stage: Megatron-LM's block method "
                     f"recomputes as many in every stage; the flags give the first {max(per)} of each")
    return ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", str(max(per))]


# --- torchtitan -----------------------------------------------------------------------------------------

# torch.distributed.pipelining get_schedule_class names, as autoplan's executor picks the classes
# (execute/pipeline.py): zb with v = 2 is the V schedule, with v = 1 the looped interleaved zero bubble.
_TITAN_SCHEDULE = {Schedule.GPIPE: "GPipe", Schedule.ONE_F_ONE_B: "1F1B", Schedule.INTERLEAVED: "Interleaved1F1B"}


def torchtitan(plan: Plan, split: Split | None, modes: Modes) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """[training] batch, [parallelism] degrees / FSDP / pipeline, [activation_checkpoint] (job_config.py v0.2.2).

    Batch: local_batch_size is per data-parallel rank per forward-backward; with pp > 1 it holds all the
    step's microbatches of pipeline_parallel_microbatch_size, without pp torchtitan accumulates
    global_batch_size / (local_batch_size * dp) steps (train.py)."""
    c, notes = plan.config, []
    n_mb = c.num_microbatches(plan.global_batch)
    training = {"local_batch_size": c.microbatch * (n_mb if c.pp > 1 else 1),
                "global_batch_size": plan.global_batch, "seq_len": plan.seq_len}
    par: dict[str, Any] = {**_titan_data_parallel(plan, notes), "tensor_parallel_degree": c.tp,
                           "context_parallel_degree": c.cp, "pipeline_parallel_degree": c.pp,
                           "expert_parallel_degree": c.expert_ep}
    if c.expert_ep > 1:
        par["expert_tensor_parallel_degree"] = c.expert_tp  # unfolded: ETP = TP, as autoplan prices it
        notes += _expert_mesh_note(c, "torchtitan")
        if c.expert_tp not in (1, c.tp):
            notes.append(f"etp={c.expert_tp}: torchtitan supports expert tensor parallelism of 1 or tp={c.tp} only "
                         f"(ParallelDims: 'Currently we only support ETP=TP or ETP=1')")
    if c.tp > 1 and not c.sp:
        notes.append("sequence parallelism off: torchtitan's tensor parallelism always shards the norms over the "
                     "sequence (SequenceParallel in apply_tp), so it runs with sp on (less activation memory)")
    par.update(_titan_pipeline(plan, split, notes))
    return {"training": training, "parallelism": par, "activation_checkpoint": _titan_ac(plan, modes, notes)}, notes


def _titan_data_parallel(plan: Plan, notes: list[str]) -> dict[str, Any]:
    """ZeRO-3: FSDP2 over the dp * ep replicas, resharding after forward; ZeRO-2: without resharding.
    torchtitan has no optimizer-only sharding (ZeRO-1) and replicates (DDP) only when data parallelism is
    the only parallelism (apply_ddp); both are written as ZeRO-2-like FSDP."""
    c = plan.config
    replicas = c.dp * c.ep
    if replicas == 1:
        if c.cp > 1:
            notes.append("with cp > 1 torchtitan shards weights over the cp group (FSDP), which the plan does not")
        return {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": 1}
    if c.zero == 0 and c.num_devices == replicas and c.ep == 1:
        return {"data_parallel_replicate_degree": replicas, "data_parallel_shard_degree": 1}
    if c.zero in (0, 1):
        why = ("has no optimizer-only sharding" if c.zero == 1
               else "replicates (DDP) only when data parallelism is the only parallelism")
        notes.append(f"zero={c.zero}: torchtitan {why}; written as FSDP over the {replicas} replicas without "
                     f"resharding after forward (ZeRO-2: gradients sharded too, reduce-scattered every microbatch)")
    return {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": replicas,
            "fsdp_reshard_after_forward": "always" if c.zero == 3 else "never"}


def _titan_pipeline(plan: Plan, split: Split | None, notes: list[str]) -> dict[str, Any]:
    """Schedule name and the split as module_fqns_per_model_part (one list per stage, model order) in the
    module names of torchtitan's decoder models (tok_embeddings, layers.<i>, norm, output); torchtitan
    places the stages looped, or in a V for ZBVZeroBubble / DualPipeV (pipeline_module_split)."""
    c = plan.config
    if c.pp == 1:
        return {}
    name = _TITAN_SCHEDULE.get(c.schedule) or ("ZBVZeroBubble" if uses_v_placement(c) else "InterleavedZeroBubble")
    out: dict[str, Any] = {"pipeline_parallel_schedule": name, "pipeline_parallel_microbatch_size": c.microbatch}
    if split is None:
        notes.append("the plan carries no stage split: torchtitan splits the layers its own way")
        return out
    if split.between:
        notes.append(f"layers between blocks ({', '.join(split.between)}) have no torchtitan module name")
    index = {name: i for i, name in enumerate(n for stage in split.blocks for n in stage)}
    last = len(split.blocks) - 1
    out["module_fqns_per_model_part"] = [
        (["tok_embeddings"] if k == 0 else []) + [f"layers.{index[n]}" for n in stage]
        + (["norm", "output"] if k == last else []) for k, stage in enumerate(split.blocks)]
    return out


def _titan_ac(plan: Plan, modes: Modes, notes: list[str]) -> dict[str, Any]:
    """mode none / full; per-layer full recompute as mode selective with selective_ac_option N, which
    wraps every N-th block in the order each rank builds its stages (activation_checkpoint.py
    _apply_layer_sac, one counter per process). torchtitan's selective "op" policy saves attention and
    every other matmul, not autoplan's selective (the attention core recomputed): written as full."""
    n, sel, full = _total(modes), _count(modes, _SEL), _count(modes, _FULL)
    if sel + full == 0:
        return {"mode": "none"}
    if sel == 0 and full < n:
        every = _titan_every_nth(plan, modes)
        if every is not None:
            return {"mode": "selective", "selective_ac_option": str(every)}
        notes.append(f"full recompute of {full} of {n} blocks: torchtitan wraps every block or every N-th; "
                     f"written as full recompute of every block")
    elif sel:
        notes.append(f"selective recompute of the attention core ({sel} of {n} blocks): torchtitan's selective "
                     f"modes are every N-th block or op-level saving; written as full recompute of every block")
    return {"mode": "full"}


def _titan_every_nth(plan: Plan, modes: Modes) -> int | None:
    """The N whose every-N-th-block wrapping (counted per rank over its stages in order) is exactly the
    plan's set of fully recomputed blocks, or None."""
    c = plan.config
    full = [[m is _FULL for m in stage] for stage in modes]
    if len(full) != c.pp * c.virtual_stages:
        return None
    order = [[f for s in rank_stages(c, r) for f in full[s]] for r in range(c.pp)]
    for every in range(2, max(len(o) for o in order) + 1):
        if all(f == ((i + 1) % every == 0) for o in order for i, f in enumerate(o)):
            return every
    return None


# --- DeepSpeed ------------------------------------------------------------------------------------------

def deepspeed(plan: Plan, split: Split | None, modes: Modes) -> tuple[dict[str, Any], list[str]]:
    """train_batch_size / train_micro_batch_size_per_gpu / gradient_accumulation_steps (config.py
    _batch_assertion), bf16, zero_optimization.stage, tensor_parallel.autotp_size (AutoTP training), and
    the "pipeline" keys get_pipeline_config reads. Context, expert and sequence parallelism and the
    pipeline split are set in DeepSpeed's model code, not its config: each is a note."""
    c, notes = plan.config, []
    zero = c.zero
    if c.pp > 1 and zero >= 2:
        notes.append(f"zero={zero} with pp={c.pp}: DeepSpeed's PipelineEngine refuses ZeRO-2/3; written as stage 1")
        zero = 1
    if c.tp > 1 and zero == 3:
        notes.append("zero=3 with tp > 1: DeepSpeed's AutoTP training allows ZeRO up to 2; written as stage 2")
        zero = 2
    config: dict[str, Any] = {
        "train_batch_size": plan.global_batch, "train_micro_batch_size_per_gpu": c.microbatch,
        "gradient_accumulation_steps": c.num_microbatches(plan.global_batch), "bf16": {"enabled": True},
        "zero_optimization": {"stage": zero}}
    if c.tp > 1:
        config["tensor_parallel"] = {"autotp_size": c.tp}
    if c.sp:
        notes.append("sequence parallelism over the tp group: not a DeepSpeed option (Megatron-DeepSpeed model code)")
    if c.cp > 1:
        notes.append(f"cp={c.cp}: DeepSpeed's sequence parallelism (Ulysses) is set in the model code and "
                     f"exchanges heads by all-to-all, not the ring context parallelism priced here")
    if c.expert_ep > 1:
        notes.append(f"ep={c.expert_ep}: set in the model code, deepspeed.moe.layer.MoE(..., ep_size={c.expert_ep})")
    if c.folded:
        notes.append(f"folded experts (etp={c.expert_tp}, eep={c.expert_ep}): DeepSpeed-MoE forms its expert-parallel "
                     f"groups from data-parallel ranks only (deepspeed/utils/groups.py), not from tp or cp ranks")
    if c.pp > 1:
        config["pipeline"] = _ds_pipeline(plan, split, modes, notes)
    elif _count(modes, _SEL, _FULL):
        notes.append("recompute without a pipeline: DeepSpeed applies it in the model code "
                     "(deepspeed.checkpointing.checkpoint around each block)")
    return config, notes


def _ds_pipeline(plan: Plan, split: Split | None, modes: Modes, notes: list[str]) -> dict[str, Any]:
    """DeepSpeed's PipelineEngine runs 1F1B with one stage per rank (pipe/schedule.py TrainSchedule), splits
    layers by PipelineModule(num_stages, partition_method) in the training script, and recomputes every
    activation_checkpoint_interval layers fully (pipe/engine.py)."""
    c = plan.config
    if c.schedule is not Schedule.ONE_F_ONE_B or c.virtual_stages > 1:
        notes.append(f"schedule {c.schedule.value} (v={c.virtual_stages}): DeepSpeed's pipeline runs 1F1B with "
                     f"one stage per rank")
    if split is not None and len(set(split.counts)) > 1:
        notes.append(f"stage split {'/'.join(map(str, split.counts))} blocks: DeepSpeed's PipelineModule "
                     f"partitions uniformly, by parameters or by layer type, not by an explicit split")
    n, recomputed = _total(modes), _count(modes, _SEL, _FULL)
    if recomputed and _count(modes, _FULL) < n:
        notes.append(f"recompute ({recomputed} of {n} blocks, {_count(modes, _SEL)} selective): DeepSpeed's "
                     f"pipeline recomputes every layer fully or none; written as every layer")
    return {"stages": c.pp, "partition": "uniform", "activation_checkpoint_interval": 1 if recomputed else 0}
