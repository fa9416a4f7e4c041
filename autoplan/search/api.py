"""The public API: `autoplan(model, cluster, ...) -> Plans` and `estimate(model, cluster, config, ...)`.

`model` is an nn.Module, a preset name, "path/to/file.py:factory" or a captured LayerGraph; `cluster` a
ClusterSpec or a profile name / path. Models are captured once per (model, seq_len) and reused.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from autoplan.cluster.types import ClusterSpec
from autoplan.graph import forked, named
from autoplan.graph.named import is_preset_name, load_model
from autoplan.graph.types import LayerGraph
from autoplan.plan.engine import Engine, as_engine
from autoplan.plan.types import Estimate, ParallelConfig, Plan
from autoplan.search.search import search
from autoplan.search.space import SearchOptions, engine_search_options

_CLUSTER_OPTIONS = ("num_nodes", "devices_per_node")
_SEARCH_OPTIONS = tuple(f.name for f in dataclasses.fields(SearchOptions) if f.name not in ("global_batch", "top_k"))
_module_graphs: weakref.WeakKeyDictionary[Any, dict[int, LayerGraph]] = weakref.WeakKeyDictionary()


class Plans(tuple):
    """The ranked plans, best first: a tuple of Plan that prints as a table. `candidates` holds what the
    search estimated (search.search's record: "quick", "exact"), for `pareto_png`."""

    candidates: dict[str, Any] | None = None

    @property
    def best(self) -> Plan:
        return self[0]

    def table(self) -> Any:
        from autoplan.search.table import plans_table

        return plans_table(self)

    def pareto_png(self, path: str | Path) -> None:
        """Plot step time against memory for the candidates (autoplan.search.pareto)."""
        from autoplan.search.pareto import pareto_png

        pareto_png(self, self.candidates, path)

    def __rich__(self) -> Any:
        return self.table()

    def __str__(self) -> str:
        from autoplan.search.table import render

        return render(self.table())

    def __repr__(self) -> str:
        return f"Plans({len(self)} plans)\n{self}"


def _check_size(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def load_cluster(cluster: ClusterSpec | str | Path, **cluster_options: Any) -> ClusterSpec:
    if isinstance(cluster, ClusterSpec):
        if cluster_options:
            return dataclasses.replace(cluster, **cluster_options)
        return cluster
    from autoplan.cluster.load import Cluster

    return Cluster.load(str(cluster), **cluster_options)


@lru_cache(maxsize=16)
def _named_graph(spec: str, seq_len: int) -> LayerGraph:
    """Captured once per (spec, seq_len) and cached on disk (autoplan.graph.cache): a preset's entry is found
    by its name without building the model, so a warm plan of a preset never imports torch, and a cold one
    is captured in a forked child where possible (graph/named.py), so the planning process does not either.
    Other models are built and found by the structure of the module."""
    if not is_preset_name(spec):
        from autoplan.models.user import model_name_of

        return _captured(load_model(spec), seq_len, model_name_of(spec))
    return named.preset_graph(spec, seq_len)


def _capture(model: Any, seq_len: int, name: str | None, copy_model: bool = True) -> LayerGraph:
    from autoplan.graph.capture import capture

    return capture(model, seq_len=seq_len, microbatch=1, model_name=name, copy_model=copy_model)


def _captured(model: Any, seq_len: int, name: str | None) -> LayerGraph:
    """The graph of an nn.Module from the disk cache, keyed by its structure, else captured and stored."""
    from autoplan.graph import cache

    key = cache.key_of({"module": cache.module_fingerprint(model), "seq_len": seq_len, "microbatch": 1})
    return cache.cached(key, lambda: _capture(model, seq_len, name), model_name=name)


@lru_cache(maxsize=16)
def _named_fingerprint(spec: str) -> str:
    """A preset's fingerprint is cached on disk beside its graph (no torch import when warm)."""
    if not is_preset_name(spec):
        from autoplan.graph.fingerprint import model_fingerprint  # imports torch

        return model_fingerprint(load_model(spec))
    return named.preset_fingerprint(spec)


def fingerprint_of(model: Any) -> str:
    """The fingerprint a plan for `model` carries ("" for a LayerGraph, whose module is not known)."""
    if isinstance(model, (str, Path)):
        return _named_fingerprint(str(model))
    if isinstance(model, LayerGraph):
        return ""
    from autoplan.graph.fingerprint import model_fingerprint

    return model_fingerprint(model)


def model_graph(model: Any, seq_len: int) -> LayerGraph:
    """The layer graph of `model` at `seq_len`, captured once (microbatch 1; the cost model scales it)."""
    _check_size("seq_len", seq_len)
    if isinstance(model, LayerGraph):
        if model.seq_len != seq_len:
            raise ValueError(f"the layer graph was captured at seq_len {model.seq_len}, not {seq_len}: capture again")
        return model
    if isinstance(model, (str, Path)):
        return _named_graph(str(model), seq_len)
    from torch import nn

    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a preset name, 'path/to/file.py:factory', a Hugging Face model directory, "
                         f"an nn.Module or a LayerGraph, got {type(model).__name__}")

    per_len = _module_graphs.setdefault(model, {})
    if seq_len not in per_len:
        per_len[seq_len] = _captured(model, seq_len, getattr(getattr(model, "config", None), "name", None))
    return per_len[seq_len]


def _split_options(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    unknown = sorted(set(options) - set(_SEARCH_OPTIONS) - set(_CLUSTER_OPTIONS))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}: known are {sorted(_SEARCH_OPTIONS + _CLUSTER_OPTIONS)}")
    return ({k: v for k, v in options.items() if k in _SEARCH_OPTIONS},
            {k: v for k, v in options.items() if k in _CLUSTER_OPTIONS})


def autoplan(model: Any, cluster: Any, *, global_batch: int, seq_len: int, top_k: int = 5,
             engine: Engine | str | Path | None = None, **options: Any) -> Plans:
    """The top_k fastest plans that fit, best first. Options: the SearchOptions fields (tp=8 or tp=(4, 8)
    fixes or restricts a degree; zero, sp, schedules, recompute, microbatch, use_ilp, progress) and
    num_nodes / devices_per_node for a cluster given by name. `engine` (an Engine, a shipped engine name
    or an engine YAML path; default autoplan's own executor) is what the plans are priced for; each Plan
    records it."""
    _check_size("global_batch", global_batch)
    _check_size("seq_len", seq_len)
    eng = as_engine(engine)
    search_options, cluster_options = _split_options(options)
    search_options = engine_search_options(search_options, eng)  # before the cluster and the capture
    spec = load_cluster(cluster, **cluster_options)
    opts = SearchOptions(global_batch=global_batch, top_k=top_k, **search_options)
    from autoplan.cost import with_engine

    record: dict[str, Any] = {}
    found = search(model_graph(model, seq_len), spec, opts, record=record, cost_model=with_engine(eng))
    forked.reap()  # a capture child's exit, if one ran, is over by now
    fingerprint = fingerprint_of(model)
    plans = Plans(dataclasses.replace(plan, fingerprint=fingerprint, engine=eng) for plan in found)
    plans.candidates = record
    return plans


def check_config(config: ParallelConfig, cluster: ClusterSpec, global_batch: int) -> None:
    """The errors a user can make in a config, each one line with the numbers."""
    if config.tp > cluster.devices_per_node:
        raise ValueError(f"tp={config.tp} is larger than a node of {cluster.devices_per_node} devices: tensor "
                         f"parallelism stays inside a node, use tp <= {cluster.devices_per_node}")
    if config.num_devices != cluster.num_devices:
        raise ValueError(f"tp*pp*dp*cp*ep = {config.tp}*{config.pp}*{config.dp}*{config.cp}*{config.ep} = "
                         f"{config.num_devices} devices, but the cluster has {cluster.num_devices}: "
                         f"change the degrees (or omit dp to derive it)")
    config.num_microbatches(global_batch)


def estimate(model: Any, cluster: Any, config: ParallelConfig | Mapping[str, Any], *, global_batch: int,
             seq_len: int, engine: Engine | str | Path | None = None, **cluster_options: Any) -> Estimate:
    """The predicted step of one configuration (a ParallelConfig or a dict; dp may be omitted) under
    `engine` (an Engine, a shipped name or a YAML path; default autoplan's own executor)."""
    _check_size("global_batch", global_batch)
    _check_size("seq_len", seq_len)
    eng = as_engine(engine)
    unknown = sorted(set(cluster_options) - set(_CLUSTER_OPTIONS))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}: known are {list(_CLUSTER_OPTIONS)}")
    spec = load_cluster(cluster, **cluster_options)
    if not isinstance(config, ParallelConfig):
        if not isinstance(config, Mapping):
            raise ValueError(f"config must be a ParallelConfig or a dict, got {type(config).__name__}")
        config = ParallelConfig.from_dict(config, num_devices=spec.num_devices)
    check_config(config, spec, global_batch)
    # before the capture and the pricing
    eng.check_zero(config.zero, pp=config.pp, tp=config.tp, dp=config.dp, cp=config.cp, ep=config.ep)
    eng.check_schedule(config.schedule, pp=config.pp)
    from autoplan.cost import estimate_config

    est = estimate_config(model_graph(model, seq_len), spec, config, global_batch=global_batch, engine=eng)
    forked.reap()  # a capture child's exit, if one ran, is over by now
    return est


def plan_for(model: str, cluster: ClusterSpec, config: ParallelConfig, *, global_batch: int,
             seq_len: int, engine: Engine | str | Path | None = None) -> Plan:
    """One given configuration as a Plan carrying its estimate (what `autoplan run` with configuration
    flags hands the executor, so the run report puts measured and predicted step time side by side)."""
    eng = as_engine(engine)
    est = estimate(model, cluster, config, global_batch=global_batch, seq_len=seq_len, engine=eng)
    return Plan(config=config, estimate=est, model_name=model, cluster_name=cluster.name,
                num_devices=config.num_devices, global_batch=global_batch, seq_len=seq_len,
                fingerprint=fingerprint_of(model), engine=eng)


class ComponentPlans(tuple):
    """Ranked plans for a model with components, best first: a tuple of ComponentPlan that prints as a
    table (search/component_table.py)."""

    @property
    def best(self) -> Any:
        return self[0]

    def table(self) -> Any:
        from autoplan.search.component_table import component_plans_table

        return component_plans_table(self)

    def __rich__(self) -> Any:
        return self.table()

    def __str__(self) -> str:
        from autoplan.search.table import render

        return render(self.table())

    def __repr__(self) -> str:
        return f"ComponentPlans({len(self)} plans)\n{self}"


_component_graphs: weakref.WeakKeyDictionary[Any, dict[tuple, Any]] = weakref.WeakKeyDictionary()


@lru_cache(maxsize=8)
def _named_components(spec: str, seq_len: int) -> Any:
    from autoplan.graph.capture import capture_components

    return capture_components(load_model(spec), seq_len=seq_len, model_name=spec)


def component_graph(model: Any, seq_len: int, example_inputs: tuple[Any, ...] | None = None) -> Any:
    """The ComponentGraph of `model` (nn.Module, preset name or a ComponentGraph) at seq_len, captured once."""
    from autoplan.graph.types import ComponentGraph

    _check_size("seq_len", seq_len)
    if isinstance(model, ComponentGraph):
        return model
    if isinstance(model, (str, Path)) and example_inputs is None:
        return _named_components(str(model), seq_len)
    if isinstance(model, (str, Path)):
        model = load_model(str(model))
    from autoplan.graph.capture import capture_components

    key = (seq_len, None if example_inputs is None else tuple(getattr(x, "shape", x) for x in example_inputs))
    per_key = _component_graphs.setdefault(model, {})
    if key not in per_key:
        per_key[key] = capture_components(model, seq_len=seq_len, example_inputs=example_inputs)
    return per_key[key]


def plan_components(model: Any, cluster: Any, *, global_batch: int, seq_len: int, top_k: int = 3,
                    devices: tuple[int, ...] | None = None, num_microbatches: int | tuple[int, ...] | None = None,
                    group_options: Mapping[str, Mapping[str, Any]] | None = None,
                    example_inputs: tuple[Any, ...] | None = None, **options: Any) -> ComponentPlans:
    """Training plans for a model with components (a vision tower + projector + language model, a policy
    with a sensor branch): each device group runs its components with its own strategy, found by the
    existing search on the group's devices, and the groups form a pipeline (search/components.py).

    `options` are SearchOptions fields applied to every group (pp=1, zero=(0, 3), ...) and num_nodes /
    devices_per_node; `group_options` per group, keyed by a component name ("model.language_model":
    {"tp": 2}); `devices` fixes each group's device count; `num_microbatches` the hand-off microbatches.
    A model with one chain of blocks raises ValueError: plan it with autoplan()."""
    from autoplan.search.components import ComponentOptions
    from autoplan.search.components import plan_components as search_components

    _check_size("global_batch", global_batch)
    _check_size("seq_len", seq_len)
    search_options, cluster_options = _split_options(options)
    spec = load_cluster(cluster, **cluster_options)
    ms = (num_microbatches,) if isinstance(num_microbatches, int) else num_microbatches
    opts = ComponentOptions(global_batch=global_batch, top_k=top_k, devices=tuple(devices) if devices else None,
                            num_microbatches=tuple(ms) if ms else None, search=search_options,
                            group_search={k: dict(v) for k, v in (group_options or {}).items()})
    graph = component_graph(model, seq_len, example_inputs)
    return ComponentPlans(search_components(graph, spec, opts))
