"""Fit a profile's efficiency and overhead fields to measured runs (the JSON of `autoplan validate`),
cross-validated: the fit sees only some of the plans, and its error is reported on the others.

The fit minimises sum_i log(predicted_i(theta) / measured_i)^2 over the chosen fields theta, each in log
space within its bounds (scipy.optimize.least_squares, trust-region reflective), predicted_i the cost
model's step time of run i (cost.estimate_config) on the profile with theta put in. Log ratios weigh a
2x error the same on a 10 ms and a 1 s step. The fitted profile is the starting one with those fields
replaced, each commented as measured, naming the runs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # numpy is imported where used: `autoplan --help` reads DEFAULT_FIELDS without it
    import numpy as np

# fields fitted by default: what a CPU run's step time is most sensitive to and no microbenchmark pins
# down. Not op_overhead_s: bench/cpu_core_rates.py measures it directly (thread CPU time, load-proof); fitted,
# it soaked up the distributed wrappers' costs and then over-predicted single-process runs 3-4x.
DEFAULT_FIELDS = ("device.matmul_efficiency", "device.tp_op_overhead_s", "device.dp_layer_overhead_s",
                  "device.cpu_oversubscribed_efficiency", "intra_node.latency_s",
                  "intra_node.allreduce_busbw_fraction", "intra_node.p2p_bw_fraction")
_FRACTION_BOUNDS = (1e-3, 1.0)
_OTHER_BOUNDS = (1e-3, 1e3)  # x the starting value


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    """One measured plan: what the cost model needs to predict it, and what was measured."""

    model: str
    nproc_per_node: int
    plan: Any  # autoplan.plan.types.Plan
    measured_s: float
    source: str  # the file it came from


@dataclass(frozen=True, slots=True, kw_only=True)
class Fit:
    """Fitted field values and the errors (MAPE, fractions) before and after, on each split."""

    values: dict[str, float]
    start: dict[str, float]
    train: tuple[int, ...]
    held_out: tuple[int, ...]
    mape_before: dict[str, float]
    mape_after: dict[str, float]


def load_runs(paths: Sequence[str | Path]) -> list[Run]:
    """The measured plans of validate JSON files (failed runs skipped)."""
    from autoplan.plan.io import plan_from_dict

    runs = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read validation {path}: {exc}") from None
        if not isinstance(data, dict) or "plans" not in data or "model" not in data:
            raise ValueError(f"{path} is not the JSON of `autoplan validate --json`")
        for entry in data["plans"]:
            if entry.get("measured_step_time_s") and "plan" in entry:
                runs.append(Run(model=data["model"], nproc_per_node=int(data["nproc_per_node"]),
                                plan=plan_from_dict(entry["plan"]), measured_s=float(entry["measured_step_time_s"]),
                                source=Path(path).name))
    if not runs:
        raise ValueError(f"no measured runs in {', '.join(map(str, paths))}")
    return runs


def get_field(data: Mapping[str, Any], field: str) -> float:
    section, _, key = field.rpartition(".")
    node: Any = data
    for part in section.split(".") if section else ():
        node = node.get(part) if isinstance(node, Mapping) else None
    if not isinstance(node, Mapping) or key not in node:
        raise ValueError(f"the profile has no field {field!r}: name fields as section.key, e.g. "
                         f"device.op_overhead_s or intra_node.latency_s")
    return float(node[key])


def with_fields(data: Mapping[str, Any], values: Mapping[str, float]) -> dict[str, Any]:
    """A copy of the profile mapping with `values` put in; an inter_node that equals intra_node (one
    machine's loopback, as local-cpu) follows the intra_node fields."""
    out = json.loads(json.dumps(data))
    mirror = out.get("inter_node") == out.get("intra_node")
    for field, value in values.items():
        section, _, key = field.rpartition(".")
        node = out
        for part in section.split("."):
            node = node[part]
        node[key] = float(value)
        if mirror and section == "intra_node":
            out["inter_node"][key] = float(value)
    return out


def bounds(field: str, start: float) -> tuple[float, float]:
    if field.rsplit(".", 1)[-1].endswith(("_efficiency", "_fraction")):
        return _FRACTION_BOUNDS
    return start * _OTHER_BOUNDS[0], start * _OTHER_BOUNDS[1]


def fit_parameters(predict: Callable[[np.ndarray], np.ndarray], measured: np.ndarray, start: np.ndarray,
                   lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
    """argmin_theta sum log(predict(theta) / measured)^2 with lower <= theta <= upper, searched in
    log(theta) from `start`, moved 5 % inside the bounds (trust-region reflective barely leaves a start
    on a bound: a fraction of 1.0 would never come down)."""
    import numpy as np
    from scipy.optimize import least_squares

    lo, hi = np.log(lower), np.log(upper)
    margin = np.minimum(0.05, (hi - lo) / 4)
    x0 = np.clip(np.log(start), lo + margin, hi - margin)

    def residuals(x: np.ndarray) -> np.ndarray:
        return np.log(predict(np.exp(x)) / measured)

    result = least_squares(residuals, x0, bounds=(lo, hi), method="trf", x_scale=1.0, diff_step=1e-3)
    return np.exp(result.x)


def split(n: int, held_out_fraction: float, seed: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(train, held out) indices: a seeded random choice of round(n * fraction) runs held out, at
    least one each side when n >= 2."""
    import numpy as np

    if not 0 < held_out_fraction < 1:
        raise ValueError(f"the held-out fraction must be in (0, 1), got {held_out_fraction}")
    if n < 2:
        raise ValueError(f"cross-validation needs at least 2 measured runs, got {n}")
    k = min(max(1, round(n * held_out_fraction)), n - 1)
    held = sorted(np.random.default_rng(seed).choice(n, size=k, replace=False).tolist())
    return tuple(i for i in range(n) if i not in held), tuple(held)


def mape_of(predicted: np.ndarray, measured: np.ndarray, idx: Sequence[int]) -> float:
    import numpy as np

    i = list(idx)
    return float(np.mean(np.abs(predicted[i] - measured[i]) / measured[i])) if i else math.nan


def run_predictor(runs: Sequence[Run], profile: Mapping[str, Any], fields: Sequence[str], path: str,
                  graph_for: Callable[[str, int], Any] | None = None) -> Callable[[np.ndarray], np.ndarray]:
    """predict(theta) -> every run's predicted step time on the profile with `fields` = theta."""
    import numpy as np

    from autoplan.cluster.load import parse_profile
    from autoplan.cost import estimate_config

    if graph_for is None:
        from autoplan.search.api import model_graph as graph_for
    graphs = {(r.model, r.plan.seq_len): graph_for(r.model, r.plan.seq_len) for r in runs}

    def predict(theta: np.ndarray) -> np.ndarray:
        data = with_fields(profile, dict(zip(fields, theta)))
        clusters = {n: parse_profile(data, path, devices_per_node=n) for n in {r.nproc_per_node for r in runs}}
        out = []
        for r in runs:
            p = r.plan
            stages = tuple(s.layer_names for s in p.stages) or None
            est = estimate_config(graphs[(r.model, p.seq_len)], clusters[r.nproc_per_node], p.config,
                                  global_batch=p.global_batch, stages=stages,
                                  layer_recompute=dict(p.layer_recompute) or None)
            out.append(est.step_time_s)
        return np.array(out)

    return predict


def calibrate(runs: Sequence[Run], profile: Mapping[str, Any], path: str, *, fields: Sequence[str] = DEFAULT_FIELDS,
              held_out_fraction: float = 0.3, seed: int = 0,
              graph_for: Callable[[str, int], Any] | None = None) -> Fit:
    """Fit `fields` on the training split of `runs`; report the MAPE before and after on both splits."""
    import numpy as np

    fields = tuple(fields)
    start = np.array([get_field(profile, f) for f in fields])
    for field, value in zip(fields, start):
        if value <= 0:
            raise ValueError(f"{field} is {value} in the starting profile: the fit searches around a positive "
                             f"value, so set a measured (or rough) one first")
    lower, upper = (np.array(b) for b in zip(*(bounds(f, s) for f, s in zip(fields, start))))
    train, held = split(len(runs), held_out_fraction, seed)
    measured = np.array([r.measured_s for r in runs])
    predict_all = run_predictor(runs, profile, fields, path, graph_for)
    train_runs = [runs[i] for i in train]
    predict_train = run_predictor(train_runs, profile, fields, path, graph_for)
    theta = fit_parameters(predict_train, measured[list(train)], start, lower, upper)
    before, after = predict_all(start), predict_all(theta)
    return Fit(values=dict(zip(fields, theta.tolist())), start=dict(zip(fields, start.tolist())), train=train,
               held_out=held,
               mape_before={"train": mape_of(before, measured, train), "held_out": mape_of(before, measured, held)},
               mape_after={"train": mape_of(after, measured, train), "held_out": mape_of(after, measured, held)})


def _line_index(lines: list[str], section: str, key: str) -> int | None:
    """The line of `key:` inside the top-level `section:` block (two-space indent) of a profile."""
    inside = False
    for i, line in enumerate(lines):
        if line and not line[0].isspace():
            inside = line.split("#", 1)[0].strip() == f"{section}:"
        elif inside and line.startswith(f"  {key}:"):
            return i
    return None


def fitted_profile_text(text: str, fit: Fit, *, note: str, name: str | None = None) -> str:
    """The starting profile's text with the fitted fields replaced and commented as measured, `note`
    (the runs and the errors) in a header line; every other line kept. Read back, it holds exactly the
    fitted values."""
    import yaml

    from autoplan.cluster.dump import _scalar

    lines = text.splitlines()
    data = yaml.safe_load(text)
    mirror = data.get("inter_node") == data.get("intra_node")
    for field, value in fit.values.items():
        section, _, key = field.rpartition(".")
        targets = [section] + (["inter_node"] if mirror and section == "intra_node" else [])
        for target in targets:
            i = _line_index(lines, target, key)
            if i is None:
                raise ValueError(f"cannot find {target}.{key} in the profile text to replace")
            head = f"  {key}: {_scalar(float(value))}"
            was = f"; fitted from {fit.start[field]:.4g}" if field in fit.start else ""
            lines[i] = (f"{head:<39}# measured: calibrated to measured runs (see the top){was}"
                        + (" (as intra_node)" if target != section else ""))
    lines.insert(0, f"# Calibrated: {note}")
    if name is not None:
        for i, line in enumerate(lines):
            if line.startswith("name:"):
                lines[i] = f"name: {_scalar(name)}"
    out = "\n".join(lines) + "\n"
    back = yaml.safe_load(out)
    for field, value in fit.values.items():
        if not math.isclose(get_field(back, field), value, rel_tol=1e-5):
            raise AssertionError(f"{field} reads back as {get_field(back, field)}, not {value}")
    return out
