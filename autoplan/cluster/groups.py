"""Heterogeneous clusters as text: "dgx-a100-80gb:4,dgx-h100-80gb:2" and profiles with `groups:`.

A groups profile (schema_version 1) names, instead of a device, its node groups in rank order, each a
shipped profile name or a path (relative to the file) and a node count, and optionally the link between
groups in the inter_node format:

    schema_version: 1
    name: a100-h100
    groups:
      - {profile: dgx-a100-80gb, nodes: 4}
      - {profile: dgx-h100-80gb, nodes: 2, devices_per_node: 8}   # devices_per_node: optional
    inter_group: {name: ib-hdr, bw_bytes_per_s: 25.0e+9, ...}      # optional, as inter_node
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from autoplan.cluster.types import ClusterSpec, LinkSpec, NodeGroup, heterogeneous

_ITEM = r"[^,:\s][^,]*:\s*\d+"
_GROUP_LIST = re.compile(rf"^\s*{_ITEM}\s*(,\s*{_ITEM}\s*)*$")
_TOP = ("schema_version", "name", "groups")
_TOP_OPTIONAL = ("description", "inter_group", "notes")
_GROUP_KEYS = ("profile", "nodes", "devices_per_node")


def is_group_list(text: str) -> bool:
    """Whether `text` is the profile:nodes form (one item or a comma list)."""
    return bool(_GROUP_LIST.match(text)) and not Path(text).is_file()


def _items(text: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        profile, _, nodes = item.strip().rpartition(":")
        out.append((profile.strip(), int(nodes)))
    return out


def load_group_list(text: str, *, num_nodes: int = 1, devices_per_node: int | None = None) -> ClusterSpec:
    """"a:4,b:2" as a cluster (one item: that profile on that many nodes)."""
    from autoplan.cluster.load import Cluster

    if num_nodes != 1:
        raise ValueError(f"cluster {text!r} gives each group's node count: drop --nodes / num_nodes={num_nodes}")
    items = _items(text)
    if len(items) == 1:
        return Cluster.load(items[0][0], num_nodes=_nodes(items[0][1], items[0][0]),
                            devices_per_node=devices_per_node)
    return combine(items, devices_per_node=devices_per_node)


def _nodes(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"node group {where!r}: nodes must be a positive integer, got {value!r}")
    return value


def _link(value: Any, where: str) -> LinkSpec | None:
    from autoplan.cluster.load import _parse_link

    if value is None or isinstance(value, LinkSpec):
        return value
    return _parse_link(value, "inter_group", where)


def combine(groups: Sequence[Any], *, name: str = "", inter_group: Any = None, devices_per_node: int | None = None,
            base: Path | None = None, notes: tuple[str, ...] = ()) -> ClusterSpec:
    """Node groups (profile or ClusterSpec, nodes) -> one heterogeneous ClusterSpec; group names are the
    profiles' names, made unique with "#2", "#3" when a profile appears twice."""
    from autoplan.cluster.load import Cluster

    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence) or len(groups) < 2:
        raise ValueError("combine takes at least two (profile, nodes) pairs, e.g. "
                         "[('dgx-a100-80gb', 4), ('dgx-h100-80gb', 2)]")
    built, seen = [], {}
    for entry in groups:
        if not isinstance(entry, Sequence) or isinstance(entry, str) or len(entry) != 2:
            raise ValueError(f"node group {entry!r}: give (profile, nodes)")
        profile, nodes = entry
        nodes = _nodes(nodes, str(profile))
        if isinstance(profile, ClusterSpec):
            spec = _resized(profile, nodes, devices_per_node)
        else:
            where = _resolve(profile, base)
            spec = Cluster.load(where, num_nodes=nodes, devices_per_node=devices_per_node)
        label = spec.name
        seen[label] = seen.get(label, 0) + 1
        built.append(NodeGroup(name=label if seen[label] == 1 else f"{label}#{seen[label]}", spec=spec))
    return heterogeneous(tuple(built), name=name, inter_group=_link(inter_group, name or "combine"), notes=notes)


def _resized(spec: ClusterSpec, nodes: int, devices_per_node: int | None) -> ClusterSpec:
    import dataclasses

    if spec.groups:
        raise ValueError(f"cluster {spec.name!r} is already heterogeneous: list its groups instead")
    return dataclasses.replace(spec, num_nodes=nodes, devices_per_node=devices_per_node or spec.devices_per_node)


def _resolve(profile: Any, base: Path | None) -> str:
    text = os.fspath(profile)
    if base is not None and not Path(text).is_absolute() and (base / text).is_file():
        return str(base / text)
    return text


def parse_groups_profile(data: Mapping[str, Any], path: Path, *, num_nodes: int = 1,
                         devices_per_node: int | None = None) -> ClusterSpec:
    """A profile with `groups:` (format in the module docstring) as a heterogeneous ClusterSpec."""
    from autoplan.cluster.load import SCHEMA_VERSION, _check_keys

    where = str(path)
    _check_keys(data, _TOP, _TOP_OPTIONAL, "", where)
    if data["schema_version"] != SCHEMA_VERSION:
        raise ValueError(f"{where}: schema_version {data['schema_version']!r} is not supported "
                         f"(this autoplan reads {SCHEMA_VERSION})")
    if num_nodes != 1:
        raise ValueError(f"{where} lists its groups' node counts: drop --nodes / num_nodes={num_nodes}")
    groups = data["groups"]
    if not isinstance(groups, list) or len(groups) < 2:
        raise ValueError(f"{where}: field 'groups' must list at least two node groups")
    items = []
    for i, group in enumerate(groups):
        if not isinstance(group, Mapping):
            raise ValueError(f"{where}: groups[{i}] must be a mapping with profile and nodes")
        _check_keys(group, _GROUP_KEYS[:2], _GROUP_KEYS[2:], f"groups[{i}].", where)
        per_node = group.get("devices_per_node", devices_per_node)
        spec = combine_one(group["profile"], _nodes(group["nodes"], f"{where}: groups[{i}]"), per_node, path.parent)
        items.append((spec, spec.num_nodes))
    notes = data.get("notes") or ()
    return combine(items, name=str(data["name"]), inter_group=_link(data.get("inter_group"), where),
                   notes=tuple(str(n) for n in notes))


def combine_one(profile: Any, nodes: int, devices_per_node: int | None, base: Path) -> ClusterSpec:
    from autoplan.cluster.load import Cluster

    return Cluster.load(_resolve(profile, base), num_nodes=nodes, devices_per_node=devices_per_node)
