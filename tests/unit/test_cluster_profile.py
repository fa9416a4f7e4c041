"""From raw measurements to a profile, without ranks: synthetic data with known answers, the YAML round
trip, and the CLI's checks that run before any measuring."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from autoplan.cli.profile import check_writable, register, write_atomic
from autoplan.cluster import Cluster, probe
from autoplan.cluster.load import dump_profile
from autoplan.cluster.report import build_profile, summary_tables

ALPHA, BUSBW = (
    {
        "all_reduce": 30e-6,
        "all_gather": 20e-6,
        "reduce_scatter": 20e-6,
        "all_to_all": 40e-6,
        "send_recv": 10e-6,
    },
    {
        "all_reduce": 360e9,
        "all_gather": 350e9,
        "reduce_scatter": 340e9,
        "all_to_all": 270e9,
        "send_recv": 300e9,
    },
)
SIZES = [2**k for k in range(12, 29, 2)]


def _ring_time(op: str, n: int, nbytes: float) -> float:
    """Hand-written ring formulas (FORMULAS.md 'Collectives')."""
    steps = {"all_reduce": 2 * (n - 1), "send_recv": 1}.get(op, n - 1)
    volume = {"all_reduce": 2 * (n - 1) / n, "send_recv": 1.0}.get(op, (n - 1) / n)
    return steps * ALPHA[op] + volume * nbytes / BUSBW[op]


def _raw(device_name: str, backend: str, n: int = 8, train: str = "bf16") -> dict:
    peak, eff, half = 989e12, 0.7, 6e9
    matmul = []
    for m in (512, 1024, 2048, 4096, 8192):
        flops = 2.0 * m**3
        t = flops / (peak * eff * flops / (flops + half))
        matmul.append(
            {"dtype": train, "shape": [m, m, m], "flops": flops, "samples_s": [t, t * 1.01, t * 0.99]}
        )
    att_flops = 4.0 * 4 * 32 * 4096**2 * 128 / 2
    rank = {
        "matmul": matmul,
        "attention": {
            "dtype": train,
            "shape": [4, 32, 4096, 128],
            "flops": att_flops,
            "samples_s": [att_flops / (0.5 * peak)] * 3,
        },
        "memory": {
            "bytes": 2**30,
            "copy_bytes_moved": 2**31,
            "copy_samples_s": [2**31 / 3.0e12] * 3,
            "add_bytes_moved": 3 * 2**30,
            "add_samples_s": [3 * 2**30 / 2.85e12] * 3,
        },
        "op_overhead": {"calls": 200, "samples_s": [6e-6] * 3},
    }
    comm = [
        {
            "level": "intra_node",
            "op": op,
            "group_size": n,
            "bytes": s,
            "samples_s": [_ring_time(op, n, s)] * 5,
        }
        for op in ALPHA
        for s in SIZES
    ]
    env = {
        "device_name": device_name,
        "backend": backend,
        "nproc_per_node": n,
        "world_size": n,
        "nnodes": 1,
        "hostname": "test",
        "date": "2026-01-01T00:00:00+00:00",
        "torch": "2.13.0",
        "mem_bytes": 80 * 2**30,
        "runtime_used_bytes": 2**30,
    }
    return {"env": env, "train_dtype": train, "compute": [rank, rank], "comm": comm}


def test_gpu_measurements_give_known_fractions_against_the_datasheet() -> None:
    profile = build_profile(_raw("NVIDIA H100 80GB HBM3", "nccl"), name="my-h100")
    spec, sheet = profile.spec, Cluster.load("dgx-h100-80gb")
    assert spec.device.peak("bf16") == sheet.device.peak("bf16")  # datasheet peaks kept
    assert spec.device.matmul_efficiency == pytest.approx(0.7, rel=1e-3)
    assert spec.device.matmul_half_size_flops == pytest.approx(6e9, rel=1e-2)
    assert spec.device.attention_efficiency == pytest.approx(0.5, rel=1e-6)
    assert spec.device.mem_bw_efficiency == pytest.approx(2.85e12 / 3.35e12, rel=1e-6)
    assert spec.device.op_overhead_s == pytest.approx(6e-6)
    assert spec.intra_node.bw_bytes_per_s == 450e9
    assert spec.intra_node.latency_s == pytest.approx(ALPHA["all_reduce"], rel=1e-6)
    assert spec.intra_node.allreduce_busbw_fraction == pytest.approx(360 / 450, rel=1e-6)
    assert spec.intra_node.alltoall_bw_fraction == pytest.approx(270 / 450, rel=1e-6)
    assert spec.intra_node.p2p_bw_fraction == pytest.approx(300 / 450, rel=1e-6)
    assert spec.inter_node == sheet.inter_node  # one node: the datasheet's NIC level, said so
    assert "not measured" in profile.comments["inter_node.bw_bytes_per_s"]
    assert profile.warnings == ()


def test_cpu_measurements_use_the_fitted_rates_as_nominal() -> None:
    profile = build_profile(_raw("cpu-x86_64", "gloo", n=2, train="fp32"), name="cpu")
    spec = profile.spec
    assert spec.device.matmul_efficiency == 1.0
    assert spec.device.peak("fp32") == pytest.approx(989e12 * 0.7, rel=1e-3)  # the fitted asymptote
    assert spec.device.peak("tf32") == spec.device.peak("fp32")
    assert spec.device.mem_bw_bytes_per_s == pytest.approx(3.0e12)
    assert spec.intra_node.bw_bytes_per_s == pytest.approx(360e9, rel=1e-6)  # best fitted bus bandwidth
    assert spec.intra_node.allreduce_busbw_fraction == pytest.approx(1.0)
    assert spec.inter_node == spec.intra_node and spec.devices_per_node == 2


def test_noise_is_flagged() -> None:
    raw = _raw("cpu", "gloo", n=2, train="fp32")
    raw["comm"][0]["samples_s"] = [1e-3, 1e-3, 2e-3, 3e-3, 3e-3]
    profile = build_profile(raw, name="cpu")
    assert any("noisy: intra_node all_reduce 4096 B" in w for w in profile.warnings)
    assert profile.measured["warnings"] == list(profile.warnings)


def test_written_profile_loads_back_with_its_measurements(tmp_path: Path) -> None:
    profile = build_profile(_raw("NVIDIA H100 80GB HBM3", "nccl"), name="my-h100")
    path = tmp_path / "my-h100.yaml"
    path.write_text(dump_profile(profile.spec, comments=profile.comments, measured=profile.measured))
    loaded = Cluster.load(path, num_nodes=2)
    assert loaded.num_devices == 16 and loaded.name == "my-h100"
    assert loaded.intra_node.latency_s == pytest.approx(ALPHA["all_reduce"], rel=1e-5)
    assert loaded.device.matmul_efficiency == pytest.approx(profile.spec.device.matmul_efficiency, rel=1e-5)
    text = path.read_text()
    assert "measured:" in text and "# alpha of the all_reduce fit" in text
    assert len(summary_tables(profile)) == 2


def _profile_args(*argv: str):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["profile", *argv])


def test_unwritable_output_fails_before_measuring(tmp_path: Path, monkeypatch) -> None:
    def must_not_measure(*args, **kwargs):
        raise AssertionError("measured before checking --out")

    monkeypatch.setattr(probe, "probe_local", must_not_measure)
    args = _profile_args("--out", str(tmp_path / "missing" / "x.yaml"), "--quick")
    with pytest.raises(ValueError, match="cannot write --out .*x.yaml: directory .*missing does not exist"):
        args.func(args)
    args = _profile_args("--out", str(tmp_path))
    with pytest.raises(ValueError, match="is a directory"):
        args.func(args)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="does not exist"):
        check_writable(blocker / "x.yaml")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_bad_flags_are_one_clear_error(monkeypatch, tmp_path: Path) -> None:
    real_probe = probe.probe_local

    def must_not_measure(opts):
        if opts.nnodes == 1:
            raise AssertionError("measured despite a bad flag")
        return real_probe(opts)  # raises at once: --nnodes > 1 without torchrun

    monkeypatch.setattr(probe, "probe_local", must_not_measure)
    for argv, message in (
        (("--nproc-per-node", "0"), "--nproc-per-node must be a positive integer"),
        (("--nproc-per-node", "1"), "at least 2 ranks"),
        (("--nnodes", "2"), "needs one launcher per node: run under torchrun"),
        (("--backend", "nccl"), "needs CUDA GPUs"),
    ):
        out = tmp_path / "never-written.yaml"
        args = _profile_args("--out", str(out), *argv)
        with pytest.raises(ValueError, match=message):
            args.func(args)
        assert not out.exists()


def test_atomic_write_leaves_nothing_on_failure(tmp_path: Path) -> None:
    out = tmp_path / "p.yaml"

    def half_then_fail(tmp: str) -> None:
        Path(tmp).write_text("schema_version: 1\nname: half")
        raise RuntimeError("rank died")

    with pytest.raises(RuntimeError):
        write_atomic(out, half_then_fail)
    assert list(tmp_path.iterdir()) == []
    write_atomic(out, lambda tmp: Path(tmp).write_text("ok"))
    assert out.read_text() == "ok" and len(list(tmp_path.iterdir())) == 1
