"""The published checks (bench/data/published/published_runs.json) as predictions: each record is run through
the cost model as a user would describe it (the model's shape, the cluster profile, the config, the
engine) and compared with what its source measured. Printed by bench/accuracy.py; never fitted to.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's autoplan

from graphs import gpt_graph, llama_graph

from autoplan.cluster.load import Cluster
from autoplan.cost import estimate_config
from autoplan.graph.types import LayerGraph, LayerRole
from autoplan.plan.engine import Engine
from autoplan.plan.layout import split_by_counts
from autoplan.plan.types import Estimate, ParallelConfig

DATA = Path(__file__).resolve().parent / "data"
RUNS = DATA / "published" / "published_runs.json"


@dataclass(frozen=True)
class Result:
    """One run: predicted and measured step time (seconds), the error (predicted / measured - 1: negative
    = predicted too fast), and whether the prediction says it fits."""

    set: str
    label: str
    engine: str
    predicted_s: float
    measured_s: float
    fits: bool = True
    estimate: Estimate | None = None

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1.0


def megatron_flops(*, B: int, s: int, l: int, h: int, V: int) -> float:
    """Narayanan et al. 2021, appendix: FLOPs per iteration with full recompute (their TFLOP/s count it)."""
    return 96.0 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))


def megatron_core_flops(*, B: int, s: int, l: int, h: int, V: int, a: int, ffn: int | None = None,
                        kv_heads: int | None = None, swiglu: bool = False) -> float:
    """FLOPs per iteration as Megatron-Core's TFLOP/s counts them (NVIDIA/Megatron-LM 937571cfd49d,
    megatron/training/training.py num_floating_point_operations): 12 B s l h^2 ((1 + g/a + s/h) q/h + f/h x
    (3/2 with --swiglu) + V / (2 l h)), q = kv_channels x a (h / a x a = h by default), g the query groups
    (a without --group-query-attention), f --ffn-hidden-size (4h by default): forward + backward, full (not
    causal) attention scores, no recompute; V is Megatron's padded vocabulary."""
    g, f = kv_heads or a, ffn or 4 * h
    attention = 1 + g / a + s / h
    mlp = f / h * (1.5 if swiglu else 1.0)
    return 12.0 * B * s * l * h * h * (attention + mlp + V / (2 * l * h))


def padded_vocab(V: int, tp: int, divisible_by: int = 128) -> int:
    """megatron/training/tokenizer/tokenizer.py _vocab_size_with_padding: V rounded up to a multiple of
    --make-vocab-size-divisible-by (default 128) x TP."""
    multiple = divisible_by * tp
    return -(-V // multiple) * multiple


MODEL_FIELDS = {"gpt": ("hidden", "heads", "layers", "vocab", "seq_len"),
                "llama": ("hidden", "heads", "kv_heads", "ffn", "layers", "vocab", "seq_len")}


def graph_of(model: dict) -> LayerGraph:
    family = model.get("family")
    if family not in MODEL_FIELDS:
        raise ValueError(f"model family {family!r}: give 'family' one of {sorted(MODEL_FIELDS)}")
    missing = [k for k in MODEL_FIELDS[family] if k not in model]
    if missing:
        raise ValueError(f"model field(s) {missing} missing: a {family} model needs {list(MODEL_FIELDS[family])}")
    if family == "gpt":
        return gpt_graph(h=model["hidden"], a=model["heads"], layers=model["layers"], seq=model["seq_len"],
                         vocab=model["vocab"], ffn=model.get("ffn"), tied=model.get("tied_embeddings", True))
    return llama_graph(h=model["hidden"], a=model["heads"], kv=model["kv_heads"], ffn=model["ffn"],
                       layers=model["layers"], seq=model["seq_len"], vocab=model["vocab"])


def ends_alone_stages(graph: LayerGraph, num_stages: int) -> tuple[tuple[str, ...], ...]:
    """Llama 3's pipeline layout (Dubey et al. 2024, section 3.3.2: "we reduce one Transformer layer each
    from the first and the last stages ... the first model chunk on the first stage has only the embedding,
    and the last model chunk on the last stage has only output projection and loss calculation"): the
    layers before the first block alone in the first stage, those after the last block alone in the last,
    the blocks split evenly (in order, the first stages taking any remainder) over the stages between."""
    base, extra = divmod(len(graph.blocks), num_stages - 2)
    middle = [base + (1 if q < extra else 0) for q in range(num_stages - 2)]
    return split_by_counts([layer.name for layer in graph.layers],
                           [layer.role is LayerRole.BLOCK for layer in graph.layers], [0, *middle, 0])


def embeddings_weighted_stages(graph: LayerGraph, num_stages: int) -> tuple[tuple[str, ...], ...]:
    """DeepSpeed's --pp-partition-method 'type:transformer|embedding' (BLOOM, bigscience-workshop/bigscience
    train/tr11-176B-ml/tr11-176B-ml.slurm; deepspeed/runtime/pipe/module.py _partition_layers: weight 1 for
    each layer whose class name matches, 0 for the rest, ds_utils.partition_balanced over the stages): the
    embedding and the tied head (EmbeddingPipe both) weigh one block each, so with blocks + 2 a multiple of
    the stages every stage holds (blocks + 2) / stages of them: the first stage one block fewer (the
    embedding), the last one fewer (the head). Other counts are not needed here and are refused."""
    per, rest = divmod(len(graph.blocks) + 2, num_stages)
    if rest or per < 1 or num_stages < 2:
        raise ValueError(f"{len(graph.blocks)} blocks + 2 embeddings do not split evenly over {num_stages} stages")
    counts = [per - 1, *[per] * (num_stages - 2), per - 1]
    return split_by_counts([layer.name for layer in graph.layers],
                           [layer.role is LayerRole.BLOCK for layer in graph.layers], counts)


def engine_of(rec: dict) -> Engine:
    """The record's engine with its overrides (a JSON list such as zero_stages becomes the Engine's tuple in
    Engine.__post_init__)."""
    return dataclasses.replace(Engine.load(rec["engine"]), **rec.get("engine_overrides", {}))


def predict(rec: dict) -> Result:
    """The record's step through estimate_config, and its measured step time."""
    model, cl, cfg = rec["model"], rec["cluster"], rec["config"]
    cluster = dataclasses.replace(Cluster.load(cl["profile"], num_nodes=cl["gpus"] // 8), dtype=cl["dtype"])
    graph = graph_of(model)
    config = ParallelConfig.from_dict(cfg)
    overrides = None
    if rec.get("every_other_layer_full"):
        # torchtitan "selective layer" AC (torchtitan/parallelisms/parallelize_llama.py checkpoint_wrapper,
        # April 2024: `checkpoint_wrapper._count % every_x_layer == 0` wraps the 2nd, 4th, ... block, i.e.
        # layers.1, layers.3, ..., in a full checkpoint and returns the others unwrapped): every second
        # block fully recomputed, the others recompute nothing
        overrides = {b.name: ("full" if i % 2 == 1 else "none") for i, b in enumerate(graph.blocks)}
    stages = None
    if rec.get("stage_layout") == "ends_alone":
        stages = ends_alone_stages(graph, config.pp * config.virtual_stages)
    elif rec.get("stage_layout") == "embeddings_weighted":
        stages = embeddings_weighted_stages(graph, config.pp * config.virtual_stages)
    est = estimate_config(graph, cluster, config, global_batch=rec["global_batch"], engine=engine_of(rec),
                          layer_recompute=overrides, stages=stages)
    step = measured_step_s(rec, cluster.peak_flops, est.model_flops)
    return Result(set=rec["set"], label=rec["id"], engine=rec["engine"], predicted_s=est.step_time_s,
                  measured_s=step, fits=est.fits, estimate=est)


def measured_step_s(rec: dict, peak_flops: float, model_flops: float) -> float:
    """The record's measured step time (seconds) from what its source published: an iteration time as
    such, or teraFLOP/s, tokens/s or MFU through that source's own FLOP convention (`peak_flops` the
    profile's dense peak per GPU, `model_flops` the estimate's own count for a plain MFU)."""
    model, cfg, gpus, measured = rec["model"], rec["config"], rec["cluster"]["gpus"], rec["measured"]
    if "iteration_time_s" in measured:
        return measured["iteration_time_s"]
    if "tflops_per_gpu_with_recompute" in measured:
        flops = megatron_flops(B=rec["global_batch"], s=model["seq_len"], l=model["layers"], h=model["hidden"],
                               V=model["vocab"])
        return flops / (measured["tflops_per_gpu_with_recompute"] * 1e12 * gpus)
    if "tflops_per_gpu_megatron_core" in measured or "mfu_megatron_core_flops" in measured:
        flops = megatron_core_flops(B=rec["global_batch"], s=model["seq_len"], l=model["layers"], h=model["hidden"],
                                    V=padded_vocab(model["vocab"], cfg.get("tp", 1)), a=model["heads"], ffn=model.get("ffn"),
                                    kv_heads=model.get("kv_heads"), swiglu=model["family"] == "llama")
        if "tflops_per_gpu_megatron_core" in measured:
            return flops / (measured["tflops_per_gpu_megatron_core"] * 1e12 * gpus)
        return flops / (measured["mfu_megatron_core_flops"] * peak_flops * gpus)
    if "tokens_per_s_per_gpu" in measured:
        return rec["global_batch"] / gpus * model["seq_len"] / measured["tokens_per_s_per_gpu"]
    return model_flops / (measured["mfu"] * peak_flops * gpus)  # MFU: the same model FLOPs over the measured step


REQUIRED_KEYS = ("id", "set", "engine", "model", "cluster", "config", "global_batch", "measured")
CLUSTER_KEYS = ("profile", "gpus", "dtype")
MEASURED_KEYS = ("iteration_time_s", "tflops_per_gpu_with_recompute", "tflops_per_gpu_megatron_core",
                 "mfu_megatron_core_flops", "tokens_per_s_per_gpu", "mfu")  # what measured_step_s reads


def records(path: Path | str = RUNS) -> list[dict]:
    """The records of a file of published_runs.json's format, each checked for the keys every record
    needs: a ValueError of one line naming the file, the record and the key otherwise."""
    try:
        recs = json.loads(Path(path).read_text())["records"]
        if not isinstance(recs, list):
            raise TypeError("'records' is not a list")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a records file ({type(err).__name__}: {err}): give a JSON object "
                         f"whose 'records' is a list of records") from None
    seen: set = set()
    for i, rec in enumerate(recs):
        problem = record_problem(rec, seen)
        if problem:
            name = f"record {rec['id']!r}" if isinstance(rec, dict) and "id" in rec else f"record #{i}"
            raise ValueError(f"{path}: {name}: {problem}")
    return recs


def record_problem(rec: object, seen: set) -> str | None:
    """What a record lacks (the first missing key), or None: see REQUIRED_KEYS, CLUSTER_KEYS, MEASURED_KEYS."""
    if not isinstance(rec, dict):
        return f"not a JSON object: each record has keys {list(REQUIRED_KEYS)}"
    for key in REQUIRED_KEYS:
        if key not in rec:
            return f"missing key {key!r}: each record has keys {list(REQUIRED_KEYS)}"
    for key in ("model", "cluster", "config", "measured"):
        if not isinstance(rec[key], dict):
            return f"{key!r} is not a JSON object"
    for key in CLUSTER_KEYS:
        if key not in rec["cluster"]:
            return f"missing key 'cluster.{key}': its cluster has keys {list(CLUSTER_KEYS)}"
    if not set(MEASURED_KEYS) & set(rec["measured"]):
        return f"'measured' has none of {list(MEASURED_KEYS)}: give the figure its source published"
    if rec["id"] in seen:
        return "duplicate id: give each record its own"
    seen.add(rec["id"])
    return None


@dataclass(frozen=True)
class Refused:
    """A record (or one of its alternatives) the cost model would not price: why, in one line. Counted,
    never in an error summary."""

    set: str
    label: str
    engine: str
    reason: str


def price(rec: dict) -> Result | Refused:
    """predict(rec), or the reason it cannot be priced: estimate_config's ValueError (an engine that does
    not run the config, degrees that do not divide, ...) or any other error, named by its type."""
    try:
        return predict(rec)
    except Exception as err:  # noqa: BLE001 - one record must not stop the others (the bench exits 1)
        reason = str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}"
        return Refused(set=rec["set"], label=rec["id"], engine=rec["engine"],
                       reason=" ".join(reason.split()) or type(err).__name__)


@dataclass(frozen=True)
class Alternative:
    """A record priced with other plausible values of settings its source does not publish (the record's
    optional "alternatives": name, why, config and / or engine_overrides fields laid over the record's own).
    Shown beside the record, never chosen: the set summaries use the recorded settings only."""

    name: str
    why: str
    result: Result | Refused


ALTERNATIVE_KEYS = ("name", "why", "config", "engine_overrides")


def with_alternative(rec: dict, alt: dict) -> dict:
    """The record with one alternative's config and engine_overrides fields replacing its own (the rest kept)."""
    check_alternative(rec, alt)
    return {**rec, "config": {**rec["config"], **alt.get("config", {})},
            "engine_overrides": {**rec.get("engine_overrides", {}), **alt.get("engine_overrides", {})},
            "alternatives": []}


def check_alternative(rec: dict, alt: dict) -> None:
    """One line naming the record for a malformed alternative: an unknown key, an unknown ParallelConfig or
    Engine field, no name / why, or nothing changed."""
    where = f"{rec['id']}: alternative {alt.get('name', '(unnamed)')!r}"
    unknown = {"key": sorted(set(alt) - set(ALTERNATIVE_KEYS)),
               "config field": sorted(set(alt.get("config", {})) - {f.name for f in dataclasses.fields(ParallelConfig)}),
               "engine_overrides field": sorted(set(alt.get("engine_overrides", {}))
                                                - {f.name for f in dataclasses.fields(Engine)})}
    for what, names in unknown.items():
        if names:
            raise ValueError(f"{where}: unknown {what}(s) {names}: an alternative lays ParallelConfig / Engine "
                             f"fields over the record's, with keys {list(ALTERNATIVE_KEYS)}")
    if not alt.get("name") or not alt.get("why"):
        raise ValueError(f"{where}: give it a 'name' and a 'why' (which unpublished setting it varies, and why)")
    if not alt.get("config") and not alt.get("engine_overrides"):
        raise ValueError(f"{where}: it changes nothing: give 'config' and / or 'engine_overrides' fields")


def alternatives(rec: dict) -> list[Alternative]:
    """Each of the record's alternatives priced by price() on the record with those fields replaced (a
    Refused result where it cannot be)."""
    out = []
    for alt in rec.get("alternatives", []):
        out.append(Alternative(name=alt["name"], why=alt["why"], result=price(with_alternative(rec, alt))))
    return out


def recorded_values(rec: dict) -> str:
    """The record's own values of the fields its alternatives vary, e.g. 'microbatch 1, virtual_stages 23'."""
    config, engine, sources = ParallelConfig.from_dict(rec["config"]), engine_of(rec), {}
    for alt in rec.get("alternatives", []):
        for key in alt.get("config", {}):
            sources.setdefault(key, config)
        for key in alt.get("engine_overrides", {}):
            sources.setdefault(key, engine)
    shown = {key: getattr(src, key) for key, src in sources.items()}
    return ", ".join(f"{key} {getattr(value, 'value', value)}" for key, value in shown.items())
