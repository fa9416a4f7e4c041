"""Engine profiles as files: read engines/*.yaml (shipped) or a user's YAML into a frozen Engine, with
the same one-line errors as a cluster profile (cluster/load.py's key checks and suggestions).

Format (schema_version 1): flat `field: value` pairs, the fields of autoplan.plan.engine.Engine; a
field left out keeps the default (autoplan's own executor). Each value should carry its source (the
engine's docs or code) in a comment beside it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import yaml

from autoplan.cluster.load import _check_keys, _suggest, named_yaml, shipped_dirs, shipped_yaml
from autoplan.plan.engine import (
    ATTENTION_KINDS,
    GRAD_REDUCTIONS,
    RMSNORM_KINDS,
    SELECTIVE_KINDS,
    ZERO3_KINDS,
    Engine,
    is_schedule,
    is_zero_stage,
    schedule_names,
)

SCHEMA_VERSION = 1
_CHOICES = {"attention": ATTENTION_KINDS, "zero3": ZERO3_KINDS, "zero3_grad_reduction": GRAD_REDUCTIONS,
            "selective_recompute": SELECTIVE_KINDS, "rmsnorm": RMSNORM_KINDS}
_FIELDS = {f.name: f.type for f in dataclasses.fields(Engine) if f.name != "source"}


def engine_dirs() -> tuple[Path, ...]:
    """Where shipped engines may live: engines/ in the checkout, then <prefix>/share/autoplan/engines."""
    return shipped_dirs("engines")


def engine_names() -> tuple[str, ...]:
    return tuple(sorted(shipped_yaml(engine_dirs())))


def engine_path(name_or_path: str | os.PathLike[str]) -> Path:
    """The file a shipped engine name or a path refers to (cluster.load.named_yaml)."""
    return named_yaml(name_or_path, engine_dirs(), "engine", existing_file_is_path=True)


def _value(key: str, value: Any, path: str) -> Any:
    kind = _FIELDS[key]
    if kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{path}: field {key!r} must be true or false, got {value!r}")
        return value
    if kind == "int":
        if isinstance(value, str):  # PyYAML reads 5e7 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            hint = " (YAML reads yes / no / on / off as booleans)" if isinstance(value, bool) else ""
            raise ValueError(f"{path}: field {key!r} must be a non-negative integer, got {value!r}{hint}")
        return value
    if kind in ("tuple[int, ...]", "tuple[int, ...] | None"):  # zero_stages(_with_pp): a YAML list of stages
        if value is None and kind.endswith("None"):  # null: as zero_stages
            return None
        if not isinstance(value, list) or not all(is_zero_stage(z) for z in value):
            null = ", or null: as zero_stages" if kind.endswith("None") else ""
            raise ValueError(f"{path}: field {key!r} must be a YAML list of ZeRO stages among 0, 1, 2, 3 "
                             f"(e.g. [0, 1]{null}), got {value!r}")
        return tuple(value)
    if kind == "tuple[tuple[str, int], ...]":  # tp_overlap_margin_sms_by_op: a YAML mapping, checked by Engine
        return () if value is None else value
    if kind == "tuple[str, ...]":  # schedules: a YAML list of ParallelConfig.schedule names
        return _schedules(key, value, path)
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
            raise ValueError(f"{path}: field {key!r} must be a probability in [0, 1), got {value!r}")
        return float(value)
    value = str(value)
    if key in _CHOICES and value not in _CHOICES[key]:
        raise ValueError(f"{path}: field {key!r} must be one of {', '.join(map(repr, _CHOICES[key]))}, got "
                         f"{value!r}{_suggest(value, _CHOICES[key])}")
    return value


def _schedules(key: str, value: Any, path: str) -> tuple[str, ...]:
    """A YAML list of schedules, each item refused by name with a suggestion where it is no schedule
    (plan.engine.is_schedule, the Engine's own rule); order and duplicates are the Engine's to check."""
    names = schedule_names()
    if not isinstance(value, list) or not value:
        raise ValueError(f"{path}: field {key!r} must be a YAML list of pipeline schedules among "
                         f"{', '.join(map(repr, names))} (e.g. [1f1b, interleaved]), got {value!r}")
    for v in value:
        if not is_schedule(v):
            raise ValueError(f"{path}: field {key!r}: unknown pipeline schedule {v!r}: choose among "
                             f"{', '.join(map(repr, names))}{_suggest(str(v), names)}")
    return tuple(str(v) for v in value)


def parse_engine(data: Any, path: str) -> Engine:
    """Validate one engine mapping (as read from YAML) and build the Engine."""
    if not isinstance(data, dict):
        raise ValueError(f"{path}: an engine file is a mapping of fields, got {type(data).__name__}")
    _check_keys(data, ("schema_version", "name"), tuple(k for k in _FIELDS if k != "name"), "", path)
    if data["schema_version"] != SCHEMA_VERSION:
        raise ValueError(f"{path}: schema_version {data['schema_version']!r} is not supported (this autoplan "
                         f"reads {SCHEMA_VERSION})")
    values = {k: _value(k, v, path) for k, v in data.items() if k != "schema_version"}
    try:
        return Engine(**values, source=path)
    except ValueError as exc:  # a rule across fields (Engine.__post_init__): name the file as every field error does
        raise ValueError(f"{path}: {exc}") from None


def load_engine(name_or_path: str | os.PathLike[str]) -> Engine:
    path = engine_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    shipped = path in shipped_yaml(engine_dirs()).values()
    return parse_engine(data, f"engines/{path.name}" if shipped else str(path))
