"""Run plans with the executor and put each measured step next to its prediction; the validation's
JSON ({"plans": [...], "spearman", "mape", ...}, the plan-entry keys a contract: config,
predicted_step_time_s, measured_step_time_s, predicted_peak_mem_bytes, measured_peak_mem_bytes)."""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Sequence
from typing import Any

from autoplan.plan.types import Plan
from autoplan.validate.machine import CpuMeter, load_1min, wait_quiet
from autoplan.validate.metrics import best_gap, mape, spearman


def describe(config: Any) -> str:
    """A short label: 'tp1 pp4 dp2 zb v2 mb4 z1 rc-sel' (defaults left out)."""
    c = config
    parts = [f"tp{c.tp}", f"pp{c.pp}", f"dp{c.dp}"]
    parts += [f"{k}{getattr(c, k)}" for k in ("cp", "ep") if getattr(c, k) > 1]
    parts += ["sp"] if c.sp else []
    if c.pp > 1:
        parts += [c.schedule.value] + ([f"v{c.virtual_stages}"] if c.virtual_stages > 1 else [])
    parts += [f"mb{c.microbatch}"] + ([f"z{c.zero}"] if c.zero else [])
    parts += [] if c.recompute.value == "none" else [f"rc-{c.recompute.value[:3]}"]
    return " ".join(parts)


def run_plan(plan: Plan, model: str, *, steps: int, timeout_s: float, seed: int = 0) -> dict[str, Any]:
    """One plan on its ranks (autoplan.execute); the entry for the validation JSON. A failed run gives
    an entry with "error" and no measurement."""
    from autoplan.execute.launch import RunFailed, execute
    from autoplan.plan.io import plan_to_dict

    entry: dict[str, Any] = {
        "label": describe(plan.config), "config": plan.config.to_dict(), "plan": plan_to_dict(plan),
        "predicted_step_time_s": plan.estimate.step_time_s,
        "predicted_peak_mem_bytes": plan.estimate.peak_mem_bytes,
        "measured_step_time_s": None, "measured_peak_mem_bytes": None, "load_1min": load_1min(),
    }
    start, meter = time.perf_counter(), CpuMeter().start()
    try:
        report = execute(plan, model, steps=steps, seed=seed, timeout_s=timeout_s, out=io.StringIO())
    except RunFailed as exc:
        entry["error"] = str(exc).splitlines()[0]
    else:
        entry["measured_step_time_s"] = report["step_time_s"]
        entry["measured_peak_mem_bytes"] = max(report["peak_mem_bytes_per_rank"])
        entry["step_times_s"] = report["step_times_s"]
    entry["wall_s"] = time.perf_counter() - start
    entry["other_cpu_cores"] = meter.other_cores()
    return entry


def _quiet_run(plan: Plan, model: str, *, steps: int, timeout_s: float, seed: int, quiet_cores: float | None,
               max_wait_s: float, retries: int, progress: Callable[[str], None]) -> dict[str, Any]:
    best: dict[str, Any] | None = None
    for attempt in range(retries + 1):
        if quiet_cores is not None:
            wait_quiet(quiet_cores, timeout_s=max_wait_s)
        entry = run_plan(plan, model, steps=steps, timeout_s=timeout_s, seed=seed)
        others = entry.get("other_cpu_cores")
        if best is None or (others or 0.0) < (best.get("other_cpu_cores") or 0.0):
            best = entry
        if entry.get("error") or quiet_cores is None or others is None or others <= 2 * quiet_cores:
            break
        if attempt < retries:
            progress(f"      other processes used {others:.2f} cores during the run: again")
    assert best is not None
    return best


def _others(entry: dict[str, Any]) -> str:
    cores = entry.get("other_cpu_cores")
    return "" if cores is None else f", other processes used {cores:.2f} cores meanwhile"


def summarize(entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """spearman, mape (fractions), best_gap, over the plans that ran; None where too few ran."""
    ok = [e for e in entries if e.get("measured_step_time_s")]
    pred = [e["predicted_step_time_s"] for e in ok]
    meas = [e["measured_step_time_s"] for e in ok]
    out: dict[str, Any] = {"num_measured": len(ok), "spearman": None, "mape": None, "best_gap": None}
    if ok:
        out["mape"] = mape(pred, meas)
        out["best_gap"] = best_gap(pred, meas)
        out["predicted_best"] = ok[min(range(len(ok)), key=pred.__getitem__)]["label"]
        out["measured_best"] = ok[min(range(len(ok)), key=meas.__getitem__)]["label"]
    if len(ok) >= 2:
        out["spearman"] = spearman(pred, meas)
    return out


def validate_plans(plans: Sequence[Plan], model: str, *, steps: int, timeout_s: float = 300.0, seed: int = 0,
                   progress: Callable[[str], None] = print, quiet_cores: float | None = None,
                   max_wait_s: float = 120.0, retries: int = 0,
                   on_entry: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """Run every plan in turn, reporting progress one line per plan. With `quiet_cores`, each run waits
    (up to max_wait_s) until other processes use at most that many cores, and a run during which they
    used more is repeated up to `retries` times, keeping the run they disturbed least. `on_entry` sees
    the entries so far after each plan (to save partial results)."""
    entries = []
    for i, plan in enumerate(plans, 1):
        progress(f"[{i}/{len(plans)}] {describe(plan.config)}: predicted {plan.estimate.step_time_s:.4f} s, "
                 f"running {steps} steps on {plan.config.num_devices} ranks ...")
        entry = _quiet_run(plan, model, steps=steps, timeout_s=timeout_s, seed=seed, quiet_cores=quiet_cores,
                           max_wait_s=max_wait_s, retries=retries, progress=progress)
        if entry.get("error"):
            progress(f"      FAILED: {entry['error']}")
        else:
            ratio = entry["measured_step_time_s"] / entry["predicted_step_time_s"]
            progress(f"      measured {entry['measured_step_time_s']:.4f} s (x{ratio:.2f} the prediction), "
                     f"peak {entry['measured_peak_mem_bytes'] / 2**20:.0f} MiB, {entry['wall_s']:.0f} s"
                     + _others(entry))
        entries.append(entry)
        if on_entry is not None:
            on_entry(entries)
    return entries
