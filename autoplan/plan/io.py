"""Plans as JSON: `plan_to_json` / `plan_from_json` and file helpers, with a schema version.

The JSON is the interface between planning (anywhere) and execution (on the cluster): it carries the
config, the estimate, the stage split and per-layer recompute, and the notes. A ranked list
(`plans_to_json`) is the best plan's object with every ranked plan under "ranked", so `load_plan`
and `autoplan run --plan` read it as the best plan and `load_plans` reads them all.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
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
        "stages": [{"index": s.index, "layer_names": list(s.layer_names), **({"group": s.group} if s.group else {})}
                   for s in plan.stages],
        "layer_recompute": [[name, mode.value] for name, mode in plan.layer_recompute],
        "estimate": plan.estimate.to_dict(),
        "notes": list(plan.notes),
        # written only when set, so older plans (and the golden files) keep their exact bytes
        **({"folded": list(plan.folded)} if plan.folded else {}),
        **({"sample_shape": list(plan.sample_shape)} if plan.sample_shape else {}),
        **({"fingerprint": plan.fingerprint} if plan.fingerprint else {}),
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
            stages=tuple(Stage(index=s["index"], layer_names=tuple(s["layer_names"]), group=s.get("group", ""))
                         for s in data.get("stages", ())),
            layer_recompute=tuple((n, r) for n, r in data.get("layer_recompute", ())),
            rank=data.get("rank", 0),
            notes=tuple(data.get("notes", ())),
            engine=Engine.from_dict(data["engine"]) if data.get("engine") is not None else None,
            folded=tuple(data.get("folded", ())),
            sample_shape=tuple(data.get("sample_shape", ())),
            fingerprint=str(data.get("fingerprint", "")),
        )
    except KeyError as exc:
        raise ValueError(f"plan JSON lacks the field {exc.args[0]!r}") from None


def plan_to_json(plan: Plan) -> str:
    return json.dumps(plan_to_dict(plan), indent=2) + "\n"


def json_object(text: str, what: str = "plan") -> dict:
    """`text` parsed as a JSON object, or a one-line ValueError naming `what` was expected."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} JSON must be an object")
    return data


def plan_from_json(text: str) -> Plan:
    return plan_from_dict(json_object(text, "plan"))


def save_plan(plan: Plan, path: str | Path) -> None:
    Path(path).write_text(plan_to_json(plan))


def load_plan(path: str | Path) -> Plan:
    return plan_from_json(Path(path).read_text())


def plans_to_json(plans: Sequence[Plan]) -> str:
    """Every ranked plan, best first: the best plan's fields at the top level (what `load_plan` and
    `autoplan run --plan` read) plus "ranked", the list of all plans in the same form."""
    if not plans:
        raise ValueError("no plans to write")
    out = plan_to_dict(plans[0])
    out["ranked"] = [plan_to_dict(p) for p in plans]
    return json.dumps(out, indent=2) + "\n"


def load_plans(path: str | Path) -> tuple[Plan, ...]:
    """The ranked plans of a file from `plans_to_json` (or the one plan of a single-plan file)."""
    text = Path(path).read_text()
    best = plan_from_json(text)  # checks the JSON and the best plan's fields
    ranked = json.loads(text).get("ranked")
    return tuple(plan_from_dict(d) for d in ranked) if isinstance(ranked, list) else (best,)
