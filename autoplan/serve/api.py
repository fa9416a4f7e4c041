"""The serving API: `serve_plan(model, cluster, ...)` ranks serving layouts; `serve_estimate(model,
cluster, config, ...)` predicts one. TTFT and TPOT are defined in autoplan.serve.types.

`model` is a preset name, "file.py:factory", an nn.Module, a captured LayerGraph or ComponentGraph, or a
ServeModel. A model with components (a vision tower + projector feeding a language model: tiny-llava,
llava-1.5-7b) is served as encode -> prefill -> decode (serve/encoder.py), images_per_request images per
request (default 1);
`cluster` a ClusterSpec or a profile name / path; `engine` a shipped engine name ("vllm", "sglang",
"tensorrt-llm", "torch-eager"), a YAML path or a ServeEngine (default vllm).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from typing_extensions import Self

from autoplan.serve.engine import load_engine
from autoplan.serve.model import serve_model
from autoplan.serve.physics import Hardware, gemm_efficiency, gemm_peak_flops
from autoplan.serve.plan import ServePlan
from autoplan.serve.search import Scored, ServeSearchOptions, min_devices, search
from autoplan.serve.types import ServeConfig, ServeEstimate, ServeModel, Workload

_CAPTURE_SEQ_LEN = 32  # shapes and parameter counts do not depend on it; short keeps capture fast
_MODEL_OPTIONS = ("dtype", "kv_dtype")
_WORKLOAD_OPTIONS = ("burstiness", "simulate", "images_per_request")
_CLUSTER_OPTIONS = ("num_nodes", "devices_per_node")
_SEARCH_OPTIONS = tuple(f.name for f in dataclasses.fields(ServeSearchOptions))


class ServePlans(tuple):
    """Ranked serving plans, best first, with `min_devices` (the fewest devices that hold the target
    load), `scored` (every candidate, for the Pareto plot) and `plot(path)`."""

    min_devices: int | None
    scored: list[Scored]

    def __new__(cls, plans: list[ServePlan], *, min_devices: int | None, scored: list[Scored]) -> Self:
        obj = super().__new__(cls, plans)
        obj.min_devices, obj.scored = min_devices, scored
        return obj

    @property
    def best(self) -> ServePlan:
        return self[0]

    def plot(self, path: str | Path) -> Path:
        from autoplan.serve.plot import pareto_png

        best = next((s for s in self.scored if s.config == self[0].config), None) if self else None
        title = f"{self[0].model_name} on {self[0].cluster_name} ({self[0].engine_name})" if self else ""
        return pareto_png(self.scored, path, title=title, best=best)

    def table(self) -> str:
        from autoplan.serve.plan import describe

        rows = [(f"{'#':>2}  {'layout':<52} {'GPUs':>4} {'TTFT ms':>9} {'TPOT ms':>8} {'tok/s/GPU':>10} "
                f"{'tok/s/user':>10} {'max conc':>8}  SLO")]
        for i, p in enumerate(self, 1):
            e = p.estimate
            rows.append(f"{i:>2}  {describe(p.config):<52} {p.config.num_devices:>4} {e.ttft_s * 1e3:>9.1f} "
                        f"{e.tpot_s * 1e3:>8.2f} {e.tokens_per_s_per_gpu:>10,.0f} {e.tokens_per_s_per_user:>10.1f} "
                        f"{e.max_concurrency:>8}  {'ok' if p.meets_slo else 'miss'}")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


def load_serving(model: Any, cluster: Any, engine: Any = None, **options: Any) -> tuple[ServeModel, Hardware]:
    """The ServeModel and the Hardware (cluster, engine, GEMM peak) the estimate of `model` on `cluster`
    uses; options: dtype, kv_dtype, num_nodes, devices_per_node."""
    from autoplan.search.api import load_cluster, model_graph

    cluster_options = {k: options[k] for k in _CLUSTER_OPTIONS if k in options}
    spec = load_cluster(cluster, **cluster_options)
    eng = load_engine(engine)
    dtype = options.get("dtype") or spec.dtype
    act = "bf16" if dtype in ("fp8", "int8", "int4") else dtype
    if isinstance(model, ServeModel):
        served = model
    else:
        from autoplan.graph.types import LayerGraph

        components = _components(model)
        if components is not None:
            served = _with_encoder(components, weight_dtype=dtype, kv_dtype=options.get("kv_dtype"), act_dtype=act)
        else:
            graph = model if isinstance(model, LayerGraph) else model_graph(model, _CAPTURE_SEQ_LEN)
            served = serve_model(graph, weight_dtype=dtype, kv_dtype=options.get("kv_dtype"), act_dtype=act)
    hw = Hardware(cluster=spec, engine=eng, peak_flops=gemm_peak_flops(spec, served.weight_bytes, act),
                  attention_peak_flops=spec.device.peak(act),
                  gemm_efficiency=gemm_efficiency(spec, served.weight_bytes))
    return served, hw


def _components(model: Any) -> Any:
    """The ComponentGraph of a model with components (None for a single chain): multimodal presets, a
    ComponentGraph, or any module whose tree holds two families of blocks (graph.components.find_roots),
    captured with room for the image tokens in the text."""
    from autoplan.graph.components import find_roots, num_image_tokens
    from autoplan.graph.types import ComponentGraph, LayerGraph
    from autoplan.models.multimodal import MULTIMODAL_PRESETS
    from autoplan.models.user import is_file_spec, is_hf_dir
    from autoplan.search.api import component_graph, load_model

    if isinstance(model, ComponentGraph):
        return None if model.is_single else model
    if isinstance(model, LayerGraph):
        return None
    if isinstance(model, (str, Path)) and not (str(model) in MULTIMODAL_PRESETS or is_file_spec(str(model))
                                               or is_hf_dir(str(model))):
        return None  # a decoder preset, or a name model_graph refuses with its own message

    module = load_model(str(model)) if isinstance(model, (str, Path)) else model
    if not find_roots(module):
        return None
    config = getattr(module, "config", None)
    image_tokens = num_image_tokens(config) if getattr(config, "vision_config", None) is not None else 0
    example = module.example_inputs() if callable(getattr(module, "example_inputs", None)) else None
    return component_graph(module if example is not None else model, image_tokens + _CAPTURE_SEQ_LEN, example)


def _with_encoder(graph: Any, **dtypes: Any) -> ServeModel:
    """The ServeModel of a model with components: its language model, with the encoder in front."""
    from autoplan.serve.encoder import serve_encoder

    split = graph.encoder_split()
    if split is None or not split.decoder.vocab_size:
        raise ValueError(f"{graph.model_name} has components but no language model fed by an encoder (its last "
                         f"component, {graph.components[-1].name}, has no token vocabulary): serving plans serve "
                         f"encoder -> language model models such as tiny-llava or llava-1.5-7b")
    served = serve_model(split.decoder, **dtypes)
    return dataclasses.replace(served, name=graph.model_name, encoder=serve_encoder(split, act_bytes=served.act_bytes))


def _images(workload: Workload, served: ServeModel, given: bool) -> Workload:
    """images_per_request: 1 by default for a model with an encoder; refused for one without."""
    if served.encoder is None:
        if workload.images_per_request:
            raise ValueError(f"images_per_request={workload.images_per_request}: {served.name} has no encoder "
                             f"(serve a model with components, e.g. tiny-llava or llava-1.5-7b)")
        return workload
    return workload if given else dataclasses.replace(workload, images_per_request=1)


def _check_options(options: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}: known are {sorted(allowed)}")


def _workload(input_len: int, output_len: int, concurrency: int | None, rate: float | None,
              options: Mapping[str, Any]) -> Workload:
    extra = {k: options[k] for k in _WORKLOAD_OPTIONS if k in options}
    if "simulate" in extra and not isinstance(extra["simulate"], bool):
        raise ValueError(f"simulate must be True or False, got {extra['simulate']!r}")
    return Workload(input_len=input_len, output_len=output_len, concurrency=concurrency, rate=rate, **extra)


def _as_tuple(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    return tuple(value) if isinstance(value, (list, tuple, set)) else (value,)


def serve_plan(model: Any, cluster: Any, *, input_len: int, output_len: int, concurrency: int | None = None,
               rate: float | None = None, ttft_slo_s: float | None = None, tpot_slo_s: float | None = None,
               engine: Any = None, top_k: int = 5, **options: Any) -> ServePlans:
    """The top_k serving plans, best first: the most output tokens/s per GPU among those meeting the
    SLOs, then the rest by how far they miss. Options: tp, pp, ep, replicas, max_batch (an int or a
    tuple restricts the search), disaggregated (True / False; default both), max_instances, dtype
    ("bf16", "fp8", ...: weights), kv_dtype, num_nodes, devices_per_node, burstiness (gamma shape of
    open-loop arrival gaps, 1 = Poisson; != 1 uses the discrete-event simulation), simulate (True: the
    simulation for any load); for a model with an encoder images_per_request (default 1), encoder_tp and
    encoder_replicas (0: co-located with prefill; restrict the search like tp)."""
    _check_options(options, _SEARCH_OPTIONS + _MODEL_OPTIONS + _CLUSTER_OPTIONS + _WORKLOAD_OPTIONS)
    workload = _workload(input_len, output_len, concurrency, rate, options)
    for name, slo in (("ttft_slo_s", ttft_slo_s), ("tpot_slo_s", tpot_slo_s)):
        if slo is not None and not slo > 0:
            raise ValueError(f"{name} must be a positive number of seconds, got {slo!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
    served, hw = load_serving(model, cluster, engine, **{k: v for k, v in options.items() if k not in _WORKLOAD_OPTIONS})
    workload = _images(workload, served, "images_per_request" in options)
    tuples = ("tp", "pp", "ep", "replicas", "max_batch", "encoder_tp", "encoder_replicas")
    opts = ServeSearchOptions(**{k: (_as_tuple(v) if k in tuples else v)
                                 for k, v in options.items() if k in _SEARCH_OPTIONS})
    scored = search(served, hw, workload, ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s, opts=opts)
    fitting = [s for s in scored if s.estimate.fits]
    if not fitting:
        biggest = max((s.estimate.weight_bytes_per_gpu for s in scored), default=0.0)
        raise ValueError(f"no serving layout of {served.name} fits {hw.cluster.num_devices} x {hw.cluster.device.name} "
                         f"({hw.cluster.device.mem_bytes / 2**30:.0f} GiB each; the weights alone take "
                         f"{biggest / 2**30:.0f} GiB per device at the smallest tp tried): add devices or use fp8 weights")
    plans = [ServePlan(config=s.config, estimate=s.estimate, workload=workload, model_name=served.name,
                       cluster_name=hw.cluster.name, engine_name=hw.engine.name, meets_slo=s.meets,
                       ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s) for s in _distinct(fitting)[:top_k]]
    return ServePlans(plans, min_devices=min_devices(scored, workload), scored=scored)


def _distinct(scored: list[Scored]) -> list[Scored]:
    """Drop plans that differ from a better-ranked one only in a batch cap that does not bind (same
    layout, same TTFT and TPOT): the first, the smallest such cap, stays."""
    seen, out = set(), []
    for s in scored:
        key = (dataclasses.replace(s.config, max_batch=1), round(s.estimate.ttft_s, 9), round(s.estimate.tpot_s, 9))
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def serve_estimate(model: Any, cluster: Any, config: ServeConfig | Mapping[str, Any], *, input_len: int,
                   output_len: int, concurrency: int | None = None, rate: float | None = None,
                   engine: Any = None, **options: Any) -> ServeEstimate:
    """The estimate of one serving config (a ServeConfig or a dict of its fields). Options: dtype,
    kv_dtype, num_nodes, devices_per_node, burstiness, simulate, images_per_request (as serve_plan)."""
    _check_options(options, _MODEL_OPTIONS + _CLUSTER_OPTIONS + _WORKLOAD_OPTIONS)
    workload = _workload(input_len, output_len, concurrency, rate, options)
    if not isinstance(config, ServeConfig):
        if not isinstance(config, Mapping):
            raise ValueError(f"config must be a ServeConfig or a dict, got {type(config).__name__}")
        config = ServeConfig.from_dict(config)
    served, hw = load_serving(model, cluster, engine, **{k: v for k, v in options.items() if k not in _WORKLOAD_OPTIONS})
    workload = _images(workload, served, "images_per_request" in options)
    from autoplan.serve.estimate import estimate_serving

    return estimate_serving(served, hw, config, workload)
