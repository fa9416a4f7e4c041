"""Plans as JSON: `plan_to_json` / `plan_from_json` and file helpers, with a schema version.

The JSON is the interface between planning (anywhere) and execution (on the cluster): it carries the
config, the estimate, the stage split and per-layer recompute, and the notes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autoplan.plan.engine import Engine
from autoplan.plan.types import Estimate, ParallelConfig, Plan, Stage

SCHEMA_VERSION = 1


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    out = _plan_dict(plan)
    if plan.engine is not None:  # additive key: plans without an engine serialise as before
        out["engine"] = plan.engine.to_dict()
    return out


def _plan_dict(plan: Plan) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "model_name": plan.model_name,
        "cluster_name": plan.cluster_name,
        "num_devices": plan.num_devices,
        "global_batch": plan.global_batch,
        "seq_len": plan.seq_len,
        "rank": plan.rank,
        "config": plan.config.to_dict(),
        "stages": [{"index": s.index, "layer_names": list(s.layer_names)} for s in plan.stages],
        "layer_recompute": [[name, mode.value] for name, mode in plan.layer_recompute],
        "estimate": plan.estimate.to_dict(),
        "notes": list(plan.notes),
    }


def plan_from_dict(data: dict[str, Any]) -> Plan:
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ValueError(f"plan schema_version {version!r} is not supported: this autoplan reads version "
                         f"{SCHEMA_VERSION}")
    try:
        return Plan(
            config=ParallelConfig.from_dict(data["config"]),
            estimate=Estimate.from_dict(data["estimate"]),
            model_name=data["model_name"],
            cluster_name=data["cluster_name"],
            num_devices=data["num_devices"],
            global_batch=data["global_batch"],
            seq_len=data["seq_len"],
            stages=tuple(Stage(index=s["index"], layer_names=tuple(s["layer_names"])) for s in data.get("stages", ())),
            layer_recompute=tuple((n, r) for n, r in data.get("layer_recompute", ())),
            rank=data.get("rank", 0),
            notes=tuple(data.get("notes", ())),
            engine=Engine.from_dict(data["engine"]) if data.get("engine") is not None else None,
        )
    except KeyError as exc:
        raise ValueError(f"plan JSON lacks the field {exc.args[0]!r}") from None


def plan_to_json(plan: Plan) -> str:
    return json.dumps(plan_to_dict(plan), indent=2) + "\n"


def plan_from_json(text: str) -> Plan:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"plan is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("plan JSON must be an object")
    return plan_from_dict(data)


def save_plan(plan: Plan, path: str | Path) -> None:
    Path(path).write_text(plan_to_json(plan))


def load_plan(path: str | Path) -> Plan:
    return plan_from_json(Path(path).read_text())
