"""Exports read back by each engine's own code (copied into tests/fixtures/engines with the source commit):
Megatron-LM flags through an argparse parser of Megatron's flag definitions, the torchtitan TOML through
tomllib and torchtitan's config dataclasses, the DeepSpeed JSON against the keys and checks DeepSpeed
reads. Each must give the plan's layout, or a note, and never less recompute than the plan."""

from __future__ import annotations

import importlib.util
import json
import shlex
import sys
import warnings
from pathlib import Path

import pytest

from autoplan.plan.export import ExportNote, export_plan
from autoplan.plan.layout import rank_stages
from autoplan.plan.types import Breakdown, Estimate, ParallelConfig, Plan, Recompute, Stage

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
FIXTURES = Path(__file__).parents[1] / "fixtures" / "engines"
ORDER = ("none", "selective", "full")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"engine_fixture_{name}", FIXTURES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"engine_fixture_{name}"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


MEG, TITAN, DS = _load("megatron_args"), _load("torchtitan_config"), _load("deepspeed_config")


def make_plan(counts: tuple[int, ...], modes: str = "", global_batch: int = 64, **config) -> Plan:
    """A plan of sum(counts) blocks split as `counts` (model order), per-block recompute from `modes`
    ("n", "s", "f" per block; default: the config's mode)."""
    c = ParallelConfig(**config)
    names = [f"layers.{i}" for i in range(sum(counts))]
    stages, start = [], 0
    for k, n in enumerate(counts):
        layer_names = (["embed"] if k == 0 else []) + names[start:start + n] + (["head"] if k == len(counts) - 1 else [])
        stages.append(Stage(index=k, layer_names=tuple(layer_names)))
        start += n
    letter = {"n": Recompute.NONE, "s": Recompute.SELECTIVE, "f": Recompute.FULL}
    per_layer = tuple((name, letter[m]) for name, m in zip(names, modes) if letter[m] is not c.recompute)
    est = Estimate(step_time_s=1.0, tokens_per_s=1.0, mfu=0.5, peak_mem_bytes=1, mem_capacity_bytes=2, fits=True,
                   breakdown=Breakdown(compute=1.0))
    return Plan(config=c, estimate=est, model_name="m", cluster_name="c", num_devices=c.num_devices,
                global_batch=global_batch, seq_len=1024, stages=tuple(stages), layer_recompute=per_layer, rank=1)


def planned_modes(plan: Plan) -> list[list[str]]:
    return [[plan.recompute_for(n).value for n in s.layer_names if n.startswith("layers.")] for s in plan.stages]


# (plan, the parts that some engine cannot express: engine -> number of notes)
CASES = {
    "1f1b-even-full": (make_plan((4, 4, 4, 4), tp=2, pp=4, dp=2, cp=2, sp=True, zero=1, microbatch=2,
                                 recompute="full"), {"megatron": 0, "torchtitan": 1, "deepspeed": 2}),
    "interleaved-uneven": (make_plan((1, 2, 2, 2, 2, 2, 2, 3), tp=4, pp=4, dp=2, sp=True, zero=3,
                                     schedule="interleaved", virtual_stages=2), {"megatron": 0, "torchtitan": 0,
                                                                                  "deepspeed": 4}),
    "zb-v-uneven": (make_plan((3, 4, 4, 5), pp=2, dp=4, zero=2, schedule="zb", virtual_stages=2),
                    {"megatron": 1, "torchtitan": 0, "deepspeed": 3}),
    "ends-uneven-block-recompute": (make_plan((3, 5, 5, 3), "ffnffnnnffnnnffn", pp=4, dp=2, zero=2),
                                    {"megatron": 0, "torchtitan": 1, "deepspeed": 3}),
    "every-2nd-full": (make_plan((4, 4), "nfnfnfnf", pp=2, dp=4, zero=3, schedule="gpipe"),
                       {"megatron": 1, "torchtitan": 0, "deepspeed": 3}),
    "moe-selective": (make_plan((8,), tp=2, ep=4, dp=2, zero=3, recompute="selective"),
                      {"megatron": 0, "torchtitan": 2, "deepspeed": 3}),
    "ddp-only": (make_plan((6,), dp=8), {"megatron": 0, "torchtitan": 0, "deepspeed": 0}),
    "moe-folded": (make_plan((4, 4), pp=2, tp=2, dp=4, etp=1, eep=8, sp=True, zero=1),
                   {"megatron": 0, "torchtitan": 1, "deepspeed": 3}),
    "mixed-recompute": (make_plan((4, 4), "fsnnsnnf", pp=2, dp=4, zero=1),
                        {"megatron": 1, "torchtitan": 2, "deepspeed": 1}),
}


def exported(plan: Plan, engine: str, notes: int):
    out = export_plan(plan, engine)
    assert len(out.notes) == notes, out.notes
    return out


def at_least(exported_modes: list[str], planned: list[str]) -> None:
    assert all(ORDER.index(e) >= ORDER.index(p) for e, p in zip(exported_modes, planned, strict=True))


@pytest.mark.parametrize("case", CASES)
def test_megatron_flags_parse_back_to_the_plan(case: str) -> None:
    plan, notes = CASES[case]
    c = plan.config
    out = exported(plan, "megatron", notes["megatron"])
    args, rest = MEG.build_parser().parse_known_args(out.value)
    assert rest == []
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size,
            args.expert_model_parallel_size, args.sequence_parallel) == (c.tp, c.pp, c.cp, c.expert_ep, c.sp)
    # Megatron-Core resolves an unset expert tp to tp (model_parallel_config.py __post_init__)
    assert (args.expert_tensor_parallel_size or args.tensor_model_parallel_size) == c.expert_tp
    assert (args.micro_batch_size, args.global_batch_size, args.seq_length) == (c.microbatch, 64, 1024)
    # Megatron's data-parallel size is world / (tp pp cp); its microbatches per step follow
    dp = c.num_devices // (c.tp * c.pp * c.cp)
    assert args.global_batch_size // (args.micro_batch_size * dp) == c.num_microbatches(64)
    assert args.use_distributed_optimizer == (c.zero >= 1) and args.use_megatron_fsdp == (c.zero >= 2)
    if c.zero >= 2:
        assert args.data_parallel_sharding_strategy == ("optim_grads" if c.zero == 2 else "optim_grads_params")
        assert args.ckpt_format == "fsdp_dtensor"
    counts = MEG.stage_layers(args)
    assert counts == [len(m) for m in planned_modes(plan)] and (MEG.virtual_pipeline_size(args) or 1) == c.virtual_stages
    MEG.check_recompute(args)
    for chunk, planned in zip(counts, planned_modes(plan)):
        # the block method recomputes a stage's first blocks: the blocks are alike, so compare as multisets
        got, want = (sorted(m, key=ORDER.index) for m in (MEG.recomputed_layers(args, chunk), planned))
        at_least(got, want)
        if notes["megatron"] == 0:
            assert got == want


def test_megatron_file_is_a_bash_array_of_the_same_flags() -> None:
    plan = CASES["interleaved-uneven"][0]
    out = export_plan(plan, "megatron")
    body = out.text.split("MEGATRON_PARALLEL_ARGS=(")[1].rsplit(")", 1)[0]
    assert shlex.split(body) == out.value
    assert "--pipeline-model-parallel-layout" in out.value  # v = 2 with an uneven split needs the layout
    assert out.value[out.value.index("--pipeline-model-parallel-layout") + 1] == "Et|t*2|t*2|t*2|t*2|t*2|t*2|t*3L"


@pytest.mark.parametrize("case", CASES)
def test_torchtitan_toml_loads_into_its_config_and_matches(case: str) -> None:
    plan, notes = CASES[case]
    c = plan.config
    out = exported(plan, "torchtitan", notes["torchtitan"])
    job = TITAN.dict_to_dataclass(TITAN.JobConfig, tomllib.loads(out.text))
    p, t = job.parallelism, job.training
    shard = TITAN.validate_dims(p, c.num_devices)
    assert (p.tensor_parallel_degree, p.pipeline_parallel_degree, p.context_parallel_degree,
            p.expert_parallel_degree) == (c.tp, c.pp, c.cp, c.expert_ep)
    batch_degree = p.data_parallel_replicate_degree * shard
    assert batch_degree == c.dp * c.ep and t.seq_len == 1024
    if c.expert_ep > 1:
        assert p.expert_tensor_parallel_degree == c.expert_tp
    n_mb = c.num_microbatches(64)
    assert TITAN.gradient_accumulation_steps(t, batch_degree) * (t.local_batch_size // c.microbatch) == n_mb
    if c.zero == 3:
        assert shard == c.dp * c.ep and p.fsdp_reshard_after_forward == "always"
    if c.pp > 1:
        assert p.pipeline_parallel_schedule in TITAN.SCHEDULES and t.local_batch_size // p.pipeline_parallel_microbatch_size == n_mb
        chunks = p.module_fqns_per_model_part
        assert [[int(n.split(".")[1]) for n in s if n.startswith("layers.")] for s in chunks] == [
            [int(n.split(".")[1]) for n in s.layer_names if n.startswith("layers.")] for s in plan.stages]
        assert chunks[0][0] == "tok_embeddings" and chunks[-1][-2:] == ["norm", "output"]
        single = p.pipeline_parallel_schedule in TITAN.SINGLE_STAGE
        assert single == (len(chunks) == c.pp)
    # the stages each rank builds (torchtitan's placement) are those the plan was priced with
    per_rank = [TITAN.stage_indices(c.pp * c.virtual_stages, c.pp, r, p.pipeline_parallel_schedule)
                for r in range(c.pp)]
    assert [tuple(s) for s in per_rank] == [rank_stages(c, r) for r in range(c.pp)]
    planned = planned_modes(plan)
    ac = job.activation_checkpoint
    for stages in per_rank:
        wanted = [m for s in stages for m in planned[s]]
        if ac.mode == "selective":
            got = ["full" if w else "none" for w in TITAN.layer_sac_wrapped(ac.selective_ac_option, len(wanted))]
        else:
            got = [{"none": "none", "full": "full"}[ac.mode]] * len(wanted)
        at_least(got, wanted)
        if notes["torchtitan"] == 0:
            assert got == wanted


@pytest.mark.parametrize("case", CASES)
def test_deepspeed_config_has_only_keys_deepspeed_reads(case: str) -> None:
    plan, notes = CASES[case]
    c = plan.config
    out = exported(plan, "deepspeed", notes["deepspeed"])
    config = json.loads(out.text)
    assert config == out.value and set(config) <= DS.TOP_LEVEL_KEYS
    assert set(config["zero_optimization"]) <= DS.ZERO_KEYS and config["zero_optimization"]["stage"] in DS.ZERO_STAGES
    assert set(config["bf16"]) <= DS.BF16_KEYS and config["bf16"]["enabled"] is True
    assert DS.batch_sizes(config, world_size=c.dp * c.ep) == (64, c.microbatch, c.num_microbatches(64))
    DS.engine_checks(config, pipeline=c.pp > 1)
    if c.tp > 1:
        assert set(config["tensor_parallel"]) <= DS.TP_KEYS and config["tensor_parallel"]["autotp_size"] == c.tp
    if c.pp > 1:
        pipe = config["pipeline"]
        assert set(pipe) <= set(DS.PIPELINE_DEFAULTS) and pipe["stages"] == c.pp
        recomputes = any(m != "none" for s in planned_modes(plan) for m in s)
        assert pipe["activation_checkpoint_interval"] == (1 if recomputes else 0)
    assert config["zero_optimization"]["stage"] == c.zero or notes["deepspeed"] > 0


def test_strict_raises_naming_the_parts_and_default_warns() -> None:
    plan = CASES["zb-v-uneven"][0]
    with pytest.raises(ValueError, match="megatron cannot express all of this plan: schedule zb"):
        plan.to_megatron_args(strict=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = plan.to_megatron_args()
    assert [w.category for w in caught] == [ExportNote] and "no zero-bubble schedule" in str(caught[0].message)
    assert args == export_plan(plan, "megatron").value
    ddp = CASES["ddp-only"][0]
    assert ddp.to_deepspeed_config(strict=True)["zero_optimization"] == {"stage": 0}
    assert tomllib.loads(ddp.to_torchtitan_toml(strict=True))["parallelism"]["data_parallel_replicate_degree"] == 8


def test_unknown_engine_and_engine_mismatch() -> None:
    plan = CASES["ddp-only"][0]
    with pytest.raises(ValueError, match="unknown engine 'nemo': choose one of megatron, torchtitan, deepspeed"):
        export_plan(plan, "nemo")

    class Priced:  # a plan that records the engine it was priced for (Plan.engine, when plans carry it)
        engine = "torchtitan"
        def __getattr__(self, name):
            return getattr(plan, name)

    notes = export_plan(Priced(), "megatron").notes  # type: ignore[arg-type]
    assert len(notes) == 1 and "priced for torchtitan, not megatron" in notes[0]
    assert export_plan(Priced(), "torchtitan").notes == ()  # type: ignore[arg-type]
