"""Render a ClusterSpec as profile YAML in the shipped format (cluster/load.py reads it back): `dump_profile`,
each number with its source comment, floats to 6 significant digits, the `measured:` section free-form."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import yaml

from autoplan.cluster.types import ClusterSpec, DeviceSpec, LinkSpec

SCHEMA_VERSION = 1  # the profile format's version, read and written (cluster/load.py imports it from here)
BY_RANKS = "allreduce_busbw_fraction_by_ranks"


class _FlowMapping(tuple):
    """(ranks, fraction) pairs that _scalar writes as a YAML flow mapping {2: 0.658, 4: 0.74}."""


def _scalar(value: Any) -> str:
    if isinstance(value, _FlowMapping):
        return "{" + ", ".join(f"{int(k)}: {_scalar(float(v))}" for k, v in value) + "}"
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        value = float(f"{float(value):.6g}")  # 6 significant digits; numpy scalars print differently
        if value != 0 and not 1e-3 <= abs(value) < 1e5:
            # shortest exact form with a dot and a signed exponent, as YAML 1.1 (PyYAML) requires
            return np.format_float_scientific(value, unique=True, trim="0", exp_digits=2)
        return repr(value)
    return json.dumps(str(value))


def _plain(value: Any) -> Any:
    """Builtin types only (str subclasses such as torch's version, numpy scalars, tuples), so the
    `measured:` section stays safe YAML."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    return str(value)


def dump_profile(
    spec: ClusterSpec,
    *,
    comments: Mapping[str, str] | None = None,
    description: str = "",
    measured: Mapping[str, Any] | None = None,
    header: tuple[str, ...] = (),
) -> str:
    """The profile as YAML text in the shipped format, `comments` ("device.matmul_efficiency" ->
    source) beside each number, `measured` appended as a free-form section. parse_profile reads it back
    to the same spec, floats to 6 significant digits."""
    comments = dict(comments or {})
    lines = [f"# {line}" for line in header]

    def put(indent: int, key: str, value: Any, path: str) -> None:
        note = " ".join(comments.get(path, "").split())
        text = f"{'  ' * indent}{key}: {_scalar(value)}"
        lines.append(f"{text:<40} # {note}" if note else text)

    lines.append(f"schema_version: {SCHEMA_VERSION}")
    put(0, "name", spec.name, "name")
    put(0, "description", description or spec.name, "description")
    put(0, "dtype", spec.dtype, "dtype")
    put(0, "devices_per_node", spec.devices_per_node, "devices_per_node")
    lines.append("device:")
    for field in dataclasses.fields(DeviceSpec):
        value = getattr(spec.device, field.name)
        if field.name == "peak_flops":
            lines.append("  peak_flops:")
            for dtype, flops in value:
                put(2, dtype, float(flops), f"device.peak_flops.{dtype}")
        else:
            put(1, field.name, value, f"device.{field.name}")
    for level in ("intra_node", "inter_node"):
        lines.append(f"{level}:")
        for field in dataclasses.fields(LinkSpec):
            value = getattr(getattr(spec, level), field.name)
            if field.name == BY_RANKS:
                if value:  # a flow mapping: YAML reads it back with integer keys
                    put(1, field.name, _FlowMapping(value), f"{level}.{field.name}")
                continue
            put(1, field.name, value, f"{level}.{field.name}")
    if spec.notes:
        lines.append("notes:")
        lines += [f"  - {_scalar(note)}" for note in spec.notes]
    text = "\n".join(lines) + "\n"
    if measured:
        text += yaml.safe_dump(
            {"measured": _plain(measured)}, sort_keys=False, default_flow_style=None, width=120
        )
    return text
