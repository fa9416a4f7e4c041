"""Shipped profiles load with datasheet-sane values; bad profiles give one precise error."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
from test_cost_graph_helper import write_profile_variant

from autoplan.cluster import Cluster, ClusterSpec
from autoplan.cluster import load as load_module

REPO = Path(__file__).resolve().parents[2]
SHIPPED = ("dgx-a100-80gb", "dgx-h100-80gb", "h100-roce-400g", "h200", "jean-zay-a100-80gb", "local-cpu")

# Vendor datasheets (dense tensor-core FLOP/s, HBM bytes/s, NVLink one direction, NIC per GPU):
# A100 SXM4 80GB, H100 SXM5, H200 SXM datasheets; the sources are cited beside each figure in profiles/.
DATASHEET = {
    "dgx-a100-80gb": {
        "bf16": 312e12,
        "fp32": 19.5e12,
        "mem_bw": 2.039e12,
        "mem_gb": 80,
        "nvlink": 300e9,
        "nic": 25e9,
    },
    "dgx-h100-80gb": {
        "bf16": 989e12,
        "fp32": 67e12,
        "mem_bw": 3.35e12,
        "mem_gb": 80,
        "nvlink": 450e9,
        "nic": 50e9,
    },
    "h100-roce-400g": {"bf16": 989e12, "fp32": 67e12, "mem_bw": 3.35e12, "mem_gb": 80, "nvlink": 450e9, "nic": 50e9},
    # Jean Zay's A100 nodes: the A100 datasheet, 4 x 100 Gb/s Omni-Path per 8 GPUs (BLOOM paper 3.4.1)
    "jean-zay-a100-80gb": {"bf16": 312e12, "fp32": 19.5e12, "mem_bw": 2.039e12, "mem_gb": 80, "nvlink": 300e9,
                           "nic": 6.25e9},
    "h200": {"bf16": 989e12, "fp32": 67e12, "mem_bw": 4.8e12, "mem_gb": 141, "nvlink": 450e9, "nic": 50e9},
}


def test_names_lists_every_shipped_profile() -> None:
    assert set(SHIPPED) <= set(Cluster.names())


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profile_loads_with_sane_fractions(name: str) -> None:
    spec = Cluster.load(name, num_nodes=4)
    assert isinstance(spec, ClusterSpec)
    assert spec.num_devices == 4 * spec.devices_per_node
    assert spec.devices_per_node == 8
    dev = spec.device
    for frac in (dev.matmul_efficiency, dev.attention_efficiency, dev.mem_bw_efficiency):
        assert 0 < frac <= 1
    for link in (spec.intra_node, spec.inter_node):
        assert 0 < link.allreduce_busbw_fraction <= 1 and 0 < link.alltoall_bw_fraction <= 1
        assert 0 < link.p2p_bw_fraction <= 1 and 0 < link.latency_s < 0.1
    assert 0 < dev.runtime_reserve_bytes < dev.mem_bytes
    assert dev.matmul_half_size_flops > 0
    assert {d for d, _ in dev.peak_flops} == {"bf16", "fp16", "tf32", "fp32"}
    assert spec.peak_flops == dev.peak(spec.dtype) > 0  # the training dtype has a peak


@pytest.mark.parametrize("name", sorted(DATASHEET))
def test_gpu_profiles_match_datasheets(name: str) -> None:
    sheet = DATASHEET[name]
    spec = Cluster.load(name)
    dev = spec.device
    assert dev.peak("bf16") == pytest.approx(sheet["bf16"], rel=0.01)
    assert dev.peak("fp16") == dev.peak("bf16")
    assert dev.peak("tf32") == pytest.approx(sheet["bf16"] / 2, rel=0.01)
    assert dev.peak("fp32") == pytest.approx(sheet["fp32"], rel=0.01)
    assert dev.mem_bw_bytes_per_s == pytest.approx(sheet["mem_bw"], rel=0.01)
    assert abs(dev.mem_bytes / 1e9 - sheet["mem_gb"]) / sheet["mem_gb"] < 0.1
    assert spec.intra_node.bw_bytes_per_s == pytest.approx(sheet["nvlink"])
    assert spec.inter_node.bw_bytes_per_s == pytest.approx(sheet["nic"])
    # achieved all-reduce bus bandwidth: published nccl-tests ranges (A100 ~230 of 300, H100 360-480 of 450)
    assert 0.6 <= spec.intra_node.allreduce_busbw_fraction <= 1.0
    assert 0.5 <= dev.matmul_efficiency <= 0.9


def test_every_number_in_shipped_profiles_has_a_source_comment() -> None:
    for name in SHIPPED:
        checked = 0
        for line in (REPO / "profiles" / f"{name}.yaml").read_text().splitlines():
            key, _, value = line.split("#", 1)[0].partition(":")
            try:
                float(value)
            except ValueError:
                continue
            if key.strip() != "schema_version":
                assert "#" in line, f"{name}: no source comment on {line!r}"
                checked += 1
        assert checked >= 20, f"{name}: only {checked} numbers found"


def test_num_nodes_and_devices_per_node_override() -> None:
    spec = Cluster.load("local-cpu", num_nodes=1, devices_per_node=2)
    assert spec.num_devices == 2
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="num_nodes must be a positive integer"):
            Cluster.load("dgx-a100-80gb", num_nodes=bad)
    with pytest.raises(ValueError, match="devices_per_node must be a positive integer"):
        Cluster.load("dgx-a100-80gb", devices_per_node=0)


def test_unknown_name_lists_known_profiles_and_close_match() -> None:
    with pytest.raises(ValueError) as err:
        Cluster.load("dgx-a100-80g")
    message = str(err.value)
    assert "did you mean 'dgx-a100-80gb'" in message
    assert all(name in message for name in SHIPPED)


def test_missing_file_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        Cluster.load(tmp_path / "nope.yaml")


def test_a_path_loads_the_same_values_as_the_name(tmp_path: Path) -> None:
    path = write_profile_variant(tmp_path, lambda d: None)
    assert Cluster.load(path).device == Cluster.load("dgx-a100-80gb").device
    assert Cluster.load(str(path), num_nodes=3).inter_node == Cluster.load("dgx-a100-80gb").inter_node


def test_misspelled_key_names_field_file_and_close_match(tmp_path: Path) -> None:
    def edit(d):
        d["device"]["matmul_eficiency"] = d["device"].pop("matmul_efficiency")

    path = write_profile_variant(tmp_path, edit)
    with pytest.raises(ValueError) as err:
        Cluster.load(path)
    message = str(err.value)
    assert str(path) in message
    assert "unknown field 'device.matmul_eficiency'" in message
    assert "did you mean 'matmul_efficiency'" in message


def test_missing_field_names_field_and_file(tmp_path: Path) -> None:
    path = write_profile_variant(tmp_path, lambda d: d["inter_node"].pop("latency_s"))
    with pytest.raises(ValueError) as err:
        Cluster.load(path)
    assert str(path) in str(err.value) and "missing field 'inter_node.latency_s'" in str(err.value)


def test_missing_dtype_peak_and_bad_values(tmp_path: Path) -> None:
    path = write_profile_variant(tmp_path, lambda d: d["device"]["peak_flops"].pop("tf32"))
    with pytest.raises(ValueError, match="missing field 'device.peak_flops.tf32'"):
        Cluster.load(path)
    path = write_profile_variant(tmp_path, lambda d: d["intra_node"].update(allreduce_busbw_fraction=1.3))
    with pytest.raises(ValueError, match=r"intra_node.allreduce_busbw_fraction.*\(0, 1\]"):
        Cluster.load(path)
    path = write_profile_variant(tmp_path, lambda d: d["device"].update(mem_bytes="lots"))
    with pytest.raises(ValueError, match="device.mem_bytes' must be a number"):
        Cluster.load(path)
    path = write_profile_variant(tmp_path, lambda d: d.update(schema_version=99))
    with pytest.raises(ValueError, match="schema_version 99"):
        Cluster.load(path)


def test_yaml11_exponent_without_sign_is_read_as_number(tmp_path: Path) -> None:
    path = write_profile_variant(tmp_path, lambda d: None)
    text = path.read_text().replace("  latency_s: 2.7e-06", "  latency_s: 27e-7")
    path.write_text(text)
    assert Cluster.load(path).inter_node.latency_s == pytest.approx(2.7e-6)


def test_profiles_found_from_installed_wheel_data_dir(tmp_path: Path, monkeypatch) -> None:
    """A wheel installs profiles/*.yaml under <prefix>/share/autoplan/profiles (pyproject data-files);
    with no source checkout beside the package, the loader must find them there."""
    shared = tmp_path / "prefix" / "share" / "autoplan" / "profiles"
    shared.mkdir(parents=True)
    (shared / "dgx-a100-80gb.yaml").write_text((REPO / "profiles" / "dgx-a100-80gb.yaml").read_text())
    monkeypatch.setattr(load_module, "__file__", str(tmp_path / "site" / "autoplan" / "cluster" / "load.py"))
    monkeypatch.setattr(sysconfig, "get_path", lambda name, scheme=None: str(tmp_path / "prefix"))
    assert Cluster.names() == ("dgx-a100-80gb",)
    assert Cluster.load("dgx-a100-80gb").device.peak("bf16") == 312e12


def test_pyproject_ships_profiles_as_data_files() -> None:
    text = (REPO / "pyproject.toml").read_text()
    assert '"share/autoplan/profiles" = ["profiles/*.yaml"]' in text
