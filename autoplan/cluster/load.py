"""Cluster profiles as files: read profiles/*.yaml (or a user's YAML) into a frozen ClusterSpec, and
render a ClusterSpec back into the same format (the profiler writes it).

Format (schema_version 1): units are FLOP/s, bytes, bytes/s and seconds; every number may carry its
source in a comment. Top level: schema_version, name, devices_per_node, device, intra_node, inter_node;
optional description, dtype, notes, measured (raw profiler medians, free-form). A CPU profile's
device.cpu_cores (the cores its ranks share) makes loading for another rank count rescale the per-rank
figures (cpu_share.py).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sysconfig
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from autoplan.cluster import cpu_share
from autoplan.cluster.dump import BY_RANKS, SCHEMA_VERSION, dump_profile
from autoplan.cluster.types import ClusterSpec, DeviceSpec, LinkSpec

__all__ = ["DTYPES", "SCHEMA_VERSION", "Cluster", "dump_profile", "named_yaml", "parse_profile", "profile_dirs",
           "read_profile", "shipped_dirs", "shipped_yaml"]  # dump_profile: the writer (cluster/dump.py) beside the reader

DTYPES = ("bf16", "fp16", "tf32", "fp32")
_TOP_REQUIRED = ("schema_version", "name", "devices_per_node", "device", "intra_node", "inter_node")
_TOP_OPTIONAL = ("description", "dtype", "notes", "measured")
_FRACTIONS = frozenset(
    {
        "matmul_efficiency",
        "attention_efficiency",
        "mem_bw_efficiency",
        "allreduce_busbw_fraction",
        "alltoall_bw_fraction",
        "p2p_bw_fraction",
        "tree_busbw_ratio",
        "eager_norm_fwd_bw_efficiency",
        "eager_norm_bwd_bw_efficiency",
    }
)
_INTEGERS = frozenset({"mem_bytes", "runtime_reserve_bytes", "num_sms", "nccl_sms", "compute_capability"})
_BOOLEANS = frozenset({"gemm_epilogue_overlap"})


def shipped_dirs(folder: str) -> tuple[Path, ...]:
    """Where a shipped data folder ("profiles", "engines") may live, in order: the source checkout (or
    editable install), then the wheel's data directory (pyproject's data-files put it under
    <prefix>/share/autoplan/<folder>)."""
    candidates = [Path(__file__).resolve().parents[2] / folder]
    for scheme in (None, f"{os.name}_user"):
        try:
            data = sysconfig.get_path("data") if scheme is None else sysconfig.get_path("data", scheme)
        except KeyError:
            continue
        candidates.append(Path(data) / "share" / "autoplan" / folder)
    return tuple(dict.fromkeys(candidates))


def profile_dirs() -> tuple[Path, ...]:
    """Where shipped profiles may live (shipped_dirs("profiles"))."""
    return shipped_dirs("profiles")


def shipped_yaml(directories: tuple[Path, ...]) -> dict[str, Path]:
    """name -> file of the YAML files in the first of `directories` that has any (profiles, engines)."""
    for directory in directories:
        found = {p.stem: p for p in sorted(directory.glob("*.yaml"))}
        if found:
            return found
    return {}


def _shipped() -> dict[str, Path]:
    return shipped_yaml(profile_dirs())


def named_yaml(name_or_path: str | os.PathLike[str], directories: tuple[Path, ...], what: str, *,
               existing_file_is_path: bool = False) -> Path:
    """The file a shipped name or a YAML path refers to: a shipped name first, then anything that looks
    like a path (FileNotFoundError when missing); otherwise one ValueError line with the close match and
    the known names. `what` names the kind ("engine", "serving engine")."""
    text = os.fspath(name_or_path)
    shipped = shipped_yaml(directories)
    if text in shipped:
        return shipped[text]
    looks_like_path = isinstance(name_or_path, os.PathLike) or os.sep in text or text.endswith((".yaml", ".yml"))
    if looks_like_path or (existing_file_is_path and Path(text).is_file()):
        if not Path(text).is_file():
            raise FileNotFoundError(f"{what} file {text!r} does not exist")
        return Path(text)
    known = ", ".join(sorted(shipped)) or "(none found in " + ", ".join(map(str, directories)) + ")"
    raise ValueError(f"unknown {what} {text!r}{_suggest(text, list(shipped))}; known {what.split()[-1]}s: {known}; "
                     f"or pass a path to a YAML file")


def _suggest(word: str, choices: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_keys(
    section: Mapping[str, Any], required: tuple[str, ...], optional: tuple[str, ...], where: str, path: str
) -> None:
    """One ValueError for the first unknown key (with the close match) or the first missing one."""
    allowed = required + optional
    for key in section:
        if key not in allowed:
            raise ValueError(
                f"{path}: unknown field '{where}{key}'{_suggest(str(key), allowed)}; "
                f"allowed fields here: {', '.join(allowed)}"
            )
    for key in required:
        if key not in section:
            raise ValueError(
                f"{path}: missing field '{where}{key}': add it (see profiles/dgx-a100-80gb.yaml)"
            )


def _number(value: Any, field: str, path: str, *, allow_zero: bool = False, fraction: bool | None = None) -> float:
    """A positive number (or 0 with allow_zero); a fraction of nominal, in (0, 1], when `fraction` is true or,
    left None, when the field's name is one of _FRACTIONS."""
    # PyYAML (YAML 1.1) reads "1e9" without a dot or exponent sign as a string: accept it.
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{path}: field {field!r} must be a number, got {value!r}")
    if not (value > 0 or (allow_zero and value == 0)):
        raise ValueError(f"{path}: field {field!r} must be {'>=' if allow_zero else '>'} 0, got {value!r}")
    if (field.rsplit(".", 1)[-1] in _FRACTIONS if fraction is None else fraction) and value > 1:
        raise ValueError(
            f"{path}: field {field!r} is a fraction of nominal and must be in (0, 1], got {value!r}"
        )
    return float(value)


def _required_fields(cls: type) -> tuple[str, ...]:
    return tuple(
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )


def _optional_fields(cls: type) -> tuple[str, ...]:
    required = _required_fields(cls)
    return tuple(f.name for f in dataclasses.fields(cls) if f.name not in required)


def _section(data: Any, where: str, path: str) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: field {where!r} must be a mapping of fields, got {type(data).__name__}")
    return data


def _parse_device(data: Any, path: str) -> DeviceSpec:
    data = _section(data, "device", path)
    _check_keys(data, _required_fields(DeviceSpec), _optional_fields(DeviceSpec), "device.", path)
    peaks = _section(data["peak_flops"], "device.peak_flops", path)
    _check_keys(peaks, DTYPES, (), "device.peak_flops.", path)
    values: dict[str, Any] = {"name": str(data["name"])}
    values["peak_flops"] = tuple((d, _number(peaks[d], f"device.peak_flops.{d}", path)) for d in DTYPES)
    for key in data:
        if key in ("name", "peak_flops"):
            continue
        if key in _BOOLEANS:
            if not isinstance(data[key], bool):
                raise ValueError(f"{path}: field 'device.{key}' must be true or false, got {data[key]!r}")
            values[key] = data[key]
            continue
        number = _number(data[key], f"device.{key}", path, allow_zero=key in _optional_fields(DeviceSpec))
        values[key] = int(number) if key in _INTEGERS else number
    if values["runtime_reserve_bytes"] >= values["mem_bytes"]:
        raise ValueError(
            f"{path}: device.runtime_reserve_bytes ({values['runtime_reserve_bytes']}) must be below "
            f"device.mem_bytes ({values['mem_bytes']})"
        )
    return DeviceSpec(**values)


def _parse_link(data: Any, where: str, path: str) -> LinkSpec:
    data = _section(data, where, path)
    _check_keys(data, _required_fields(LinkSpec), _optional_fields(LinkSpec), f"{where}.", path)
    values: dict[str, Any] = {"name": str(data["name"])}
    for key in data:
        if key == BY_RANKS:
            values[key] = _by_ranks(data[key], f"{where}.{key}", path)
        elif key != "name":
            values[key] = _number(
                data[key], f"{where}.{key}", path, allow_zero=key in _optional_fields(LinkSpec)
            )
    return LinkSpec(**values)



def _by_ranks(data: Any, field: str, path: str) -> tuple[tuple[int, float], ...]:
    """{ranks: fraction} (ranks an integer >= 2, fraction in (0, 1]) as LinkSpec keeps it: pairs, ranks ascending."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: field {field!r} must map group sizes to fractions, e.g. {{2: 0.66, 4: 0.74}}, "
                         f"got {data!r}")
    out = []
    for ranks, fraction in data.items():
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 2:
            raise ValueError(f"{path}: field {field!r}: group size {ranks!r} must be an integer >= 2")
        out.append((ranks, _number(fraction, f"{field}.{ranks}", path, fraction=True)))
    return tuple(sorted(out))


def _positive_int(value: Any, what: str, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}: {hint}")
    return value


def parse_profile(
    data: Any, path: str, *, num_nodes: int = 1, devices_per_node: int | None = None
) -> ClusterSpec:
    """Validate one profile mapping (as read from YAML) and build the ClusterSpec."""
    data = _section(data, "(top level)", path)
    _check_keys(data, _TOP_REQUIRED, _TOP_OPTIONAL, "", path)
    if devices_per_node is not None:
        data = cpu_share.rescale(data, devices_per_node, path)
    if data["schema_version"] != SCHEMA_VERSION:
        raise ValueError(
            f"{path}: schema_version {data['schema_version']!r} is not supported (this autoplan reads {SCHEMA_VERSION})"
        )
    num_nodes = _positive_int(num_nodes, "num_nodes", "pass num_nodes >= 1")
    if devices_per_node is None:
        devices_per_node = _positive_int(
            data["devices_per_node"], f"{path}: devices_per_node", "fix the profile"
        )
    devices_per_node = _positive_int(devices_per_node, "devices_per_node", "pass devices_per_node >= 1")
    dtype = str(data.get("dtype", "bf16"))
    if dtype not in DTYPES:
        raise ValueError(
            f"{path}: dtype {dtype!r} is not one of {', '.join(DTYPES)}{_suggest(dtype, DTYPES)}"
        )
    notes = data.get("notes") or ()
    if isinstance(notes, str) or not isinstance(notes, (list, tuple)):
        raise ValueError(f"{path}: field 'notes' must be a list of strings, got {notes!r}")
    return ClusterSpec(
        name=str(data["name"]),
        device=_parse_device(data["device"], path),
        devices_per_node=devices_per_node,
        num_nodes=num_nodes,
        intra_node=_parse_link(data["intra_node"], "intra_node", path),
        inter_node=_parse_link(data["inter_node"], "inter_node", path),
        dtype=dtype,
        source=path,
        notes=tuple(str(n) for n in notes),
    )


def read_profile(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The raw mapping of a profile file (the `measured:` section included)."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    return data


class Cluster:
    """Entry point for profiles: `Cluster.load("dgx-a100-80gb", num_nodes=16)`, `Cluster.names()`."""

    @staticmethod
    def names() -> tuple[str, ...]:
        """Names of the shipped profiles."""
        return tuple(sorted(_shipped()))

    @staticmethod
    def path(name_or_path: str | os.PathLike[str]) -> Path:
        """The file a name or path refers to: a shipped profile name, or a path to a YAML file."""
        text = os.fspath(name_or_path)
        shipped = _shipped()
        if text in shipped:
            return shipped[text]
        looks_like_path = (
            isinstance(name_or_path, os.PathLike) or os.sep in text or text.endswith((".yaml", ".yml"))
        )
        if looks_like_path or Path(text).is_file():
            if not Path(text).is_file():
                raise FileNotFoundError(f"cluster profile file {text!r} does not exist")
            return Path(text)
        known = ", ".join(sorted(shipped)) or "(none found in " + ", ".join(map(str, profile_dirs())) + ")"
        raise ValueError(
            f"unknown cluster profile {text!r}{_suggest(text, list(shipped))}; known profiles: {known}; or pass a path to a YAML file"
        )

    @staticmethod
    def load(
        name_or_path: str | os.PathLike[str], *, num_nodes: int = 1, devices_per_node: int | None = None
    ) -> ClusterSpec:
        """Read a shipped profile by name or any profile file by path, for num_nodes nodes
        (devices_per_node overrides the profile's, e.g. a 2-rank local run).

        Heterogeneous clusters: "dgx-a100-80gb:4,dgx-h100-80gb:2" (profile:nodes, comma separated) or a
        profile with `groups:` (cluster/groups.py); their node counts are in the text, so num_nodes stays 1,
        and devices_per_node, when given, applies to every group."""
        from autoplan.cluster.groups import is_group_list, load_group_list, parse_groups_profile

        if isinstance(name_or_path, str) and is_group_list(name_or_path):
            return load_group_list(name_or_path, num_nodes=num_nodes, devices_per_node=devices_per_node)
        path = Cluster.path(name_or_path)
        data = read_profile(path)
        if isinstance(data, Mapping) and "groups" in data:
            return parse_groups_profile(data, path, num_nodes=num_nodes, devices_per_node=devices_per_node)
        return parse_profile(data, str(path), num_nodes=num_nodes, devices_per_node=devices_per_node)

    @staticmethod
    def combine(groups: Any, *, name: str = "", inter_group: LinkSpec | Mapping[str, Any] | None = None,
                devices_per_node: int | None = None) -> ClusterSpec:
        """One cluster of node groups of different kinds: `groups` is a sequence of (profile, nodes) with a
        profile name, a path or a ClusterSpec, e.g. [("dgx-a100-80gb", 4), ("dgx-h100-80gb", 2)];
        inter_group the link between groups (a LinkSpec or a link mapping as in a profile; default: the
        slowest of the groups' inter-node links). See cluster.types.heterogeneous."""
        from autoplan.cluster.groups import combine

        return combine(groups, name=name, inter_group=inter_group, devices_per_node=devices_per_node)
