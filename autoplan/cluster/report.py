"""The profiler's fitting half: raw measurements (probe.py) -> a ClusterSpec with a source comment
for every number and a `measured:` section of medians and spreads; plus the summary table and the
bus-bandwidth plot. No torch: this runs on recorded measurements too (tests/fixtures/profiles)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from itertools import chain

from autoplan.cluster.fit import (
    AlphaBeta,
    MatmulFit,
    bus_bandwidth,
    fit_alpha_beta,
    fit_matmul,
    latency_steps,
    spread,
)
from autoplan.cluster.load import Cluster
from autoplan.cluster.types import ClusterSpec, DeviceSpec, LinkSpec

NOISY_SPREAD = 0.25  # IQR / median above which a measurement is called noisy
POOR_FIT = 0.30  # relative RMS error above which a fit is called poor
# device-name fragment -> shipped profile holding its datasheet peaks and nominal link speeds
DATASHEETS = {"H200": "h200", "H100": "dgx-h100-80gb", "A100": "dgx-a100-80gb"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    spec: ClusterSpec
    comments: dict[str, str]  # "device.matmul_efficiency" -> where the number came from
    measured: dict
    link_fits: dict[str, dict[str, AlphaBeta]]
    matmul_fit: MatmulFit
    warnings: tuple[str, ...]


def datasheet_for(device_name: str) -> ClusterSpec | None:
    for fragment, profile in DATASHEETS.items():
        if fragment in device_name.upper():
            return Cluster.load(profile)
    return None


def _pooled(compute: list[dict], pick) -> list[list[float]]:
    """For each item, the repeat times of every rank pooled: the concurrency the step sees."""
    return [
        list(chain.from_iterable(pick(rank)[i] for rank in compute)) for i in range(len(pick(compute[0])))
    ]


def _all_ranks(compute: list[dict], kind: str, key: str = "samples_s") -> list[float]:
    return list(chain.from_iterable(rank[kind][key] for rank in compute))


def _compute(raw: dict, base: ClusterSpec | None, comments: dict, measured: dict, warnings: list) -> tuple:
    compute, train = raw["compute"], raw["train_dtype"]
    mm = compute[0]["matmul"]
    pooled = _pooled(compute, lambda r: [m["samples_s"] for m in r["matmul"]])
    rows, by_dtype = [], defaultdict(list)
    for rec, samples in zip(mm, pooled):
        median, rel = spread(samples)
        rows.append(
            {
                "dtype": rec["dtype"],
                "shape": rec["shape"],
                "flops": rec["flops"],
                "time_s": median,
                "spread": rel,
                "flops_per_s": rec["flops"] / median,
            }
        )
        by_dtype[rec["dtype"]].append((rec["flops"], rec["flops"] / median))
        if rel > NOISY_SPREAD:
            warnings.append(f"noisy: matmul {rec['dtype']} {rec['shape']} spread {rel:.0%}")
    measured["matmul"] = rows
    fits = {
        d: fit_matmul([f for f, _ in pts], [r for _, r in pts], base.device.peak(d) if base else None)
        for d, pts in by_dtype.items()
    }
    measured["matmul_fits"] = {
        d: {
            "peak_flops": f.peak_flops,
            "efficiency": f.efficiency,
            "half_size_flops": f.half_size_flops,
            "rel_rms_error": f.rel_rms_error,
        }
        for d, f in fits.items()
    }
    main = fits[train]
    src = (
        f"fit of {main.num_points} {train} matmuls, all ranks busy (rel. RMS error {main.rel_rms_error:.0%})"
    )
    peaks = {}
    for dtype in ("bf16", "fp16", "tf32", "fp32"):
        if base:
            peaks[dtype] = base.device.peak(dtype)
            comments[f"device.peak_flops.{dtype}"] = f"datasheet, from shipped profile {base.name}"
        elif dtype in fits:
            peaks[dtype] = fits[dtype].peak_flops * fits[dtype].efficiency / main.efficiency
            comments[f"device.peak_flops.{dtype}"] = (
                f"no datasheet: fitted large-matmul rate ({fits[dtype].num_points} shapes)"
            )
        else:  # not measured: tf32 runs as fp32 off-GPU; fp16 takes bf16's path on a CPU
            like = "fp32" if dtype == "tf32" else "bf16"
            like = like if like in fits else train
            fit = fits[like]
            peaks[dtype] = fit.peak_flops * fit.efficiency / main.efficiency
            comments[f"device.peak_flops.{dtype}"] = (
                f"not measured (--quick or no such unit): taken as {like}"
            )
    comments["device.matmul_efficiency"] = src + ("" if base else "; 1 since the peak is the fitted rate")
    comments["device.matmul_half_size_flops"] = src
    att_samples = _all_ranks(compute, "attention")
    att = compute[0]["attention"]
    att_median, att_rel = spread(att_samples)
    att_eff = float(min(1.0, att["flops"] / att_median / peaks[train]))
    measured["attention"] = {
        "shape": att["shape"],
        "dtype": att["dtype"],
        "flops": att["flops"],
        "time_s": att_median,
        "spread": att_rel,
        "flops_per_s": att["flops"] / att_median,
    }
    comments["device.attention_efficiency"] = (
        f"causal SDPA forward {att['shape']} {att['dtype']}: {att['flops'] / att_median / 1e9:.3g} GFLOP/s / peak"
    )
    mem = compute[0]["memory"]
    copy_t, copy_rel = spread(_all_ranks(compute, "memory", "copy_samples_s"))
    add_t, add_rel = spread(_all_ranks(compute, "memory", "add_samples_s"))
    copy_bw, add_bw = mem["copy_bytes_moved"] / copy_t, mem["add_bytes_moved"] / add_t
    measured["memory"] = {
        "bytes": mem["bytes"],
        "copy_bytes_per_s": copy_bw,
        "copy_spread": copy_rel,
        "add_bytes_per_s": add_bw,
        "add_spread": add_rel,
    }
    if base:
        mem_bw, mem_eff = base.device.mem_bw_bytes_per_s, min(1.0, add_bw / base.device.mem_bw_bytes_per_s)
        comments["device.mem_bw_bytes_per_s"] = f"datasheet, from shipped profile {base.name}"
    else:
        mem_bw, mem_eff = copy_bw, min(1.0, add_bw / copy_bw)
        comments["device.mem_bw_bytes_per_s"] = (
            f"measured: copy of {mem['bytes'] / 2**20:.0f} MiB per rank, all ranks at once"
        )
    comments["device.mem_bw_efficiency"] = f"measured: add (3 streams) {add_bw / 1e9:.3g} GB/s / mem_bw"
    env = raw["env"]
    reserve = env.get("runtime_used_bytes", env.get("process_rss_bytes", 0)) + int(0.05 * env["mem_bytes"])
    comments["device.mem_bytes"] = (
        "measured: device memory" if base else "measured: physical memory / ranks per node"
    )
    comments["device.runtime_reserve_bytes"] = (
        "measured: memory held outside tensors (context, communicators) + 5 % of capacity for allocator fragmentation (estimate)"
    )
    overhead, overhead_rel = spread(_all_ranks(compute, "op_overhead"))
    measured["op_overhead"] = {"time_s": overhead, "spread": overhead_rel}
    comments["device.op_overhead_s"] = (
        f"measured: host time per tiny op, loops of {compute[0]['op_overhead']['calls']} adds, all ranks at once"
    )
    device = DeviceSpec(
        name=env["device_name"],
        op_overhead_s=overhead,
        peak_flops=tuple(peaks.items()),
        mem_bytes=int(env["mem_bytes"]),
        mem_bw_bytes_per_s=mem_bw,
        matmul_efficiency=main.efficiency,
        matmul_half_size_flops=main.half_size_flops,
        attention_efficiency=att_eff,
        mem_bw_efficiency=mem_eff,
        runtime_reserve_bytes=reserve,
    )
    return device, main


def _link(level: str, fits: dict[str, AlphaBeta], base: ClusterSpec | None, comments: dict) -> LinkSpec:
    """Latency from the all-reduce fit; nominal bandwidth from the datasheet when known, else the
    best fitted bus bandwidth (fractions <= 1 then by construction)."""
    nominal = getattr(base, level).bw_bytes_per_s if base else max(f.bw_bytes_per_s for f in fits.values())
    comments[f"{level}.bw_bytes_per_s"] = (
        f"datasheet, from shipped profile {base.name}"
        if base
        else "measured: best fitted bus bandwidth over the collectives"
    )
    ar = fits["all_reduce"]
    latency = ar.alpha_s if ar.alpha_s > 0 else fits["send_recv"].alpha_s or 1e-9
    comments[f"{level}.latency_s"] = (
        f"alpha of the all_reduce fit over {ar.num_points} sizes, n={ar.group_size}"
    )
    values = {}
    for field, op in (
        ("allreduce_busbw_fraction", "all_reduce"),
        ("alltoall_bw_fraction", "all_to_all"),
        ("p2p_bw_fraction", "send_recv"),
    ):
        values[field] = min(1.0, fits[op].bw_bytes_per_s / nominal)
        comments[f"{level}.{field}"] = (
            f"fitted {op} bus bandwidth {fits[op].bw_bytes_per_s / 1e9:.3g} GB/s "
            f"(rel. RMS error {fits[op].rel_rms_error:.0%}) / bw"
        )
    name = ("measured-" + (getattr(base, level).name if base else "gloo")) if fits else level
    return LinkSpec(name=name, bw_bytes_per_s=nominal, latency_s=latency, **values)


def _fit_or_fallback(
    op: str, n: int, sizes: list[float], times: list[float], level: str, warnings: list[str]
) -> AlphaBeta:
    """The least-squares fit; when noise hides the size dependence, the best measured bus bandwidth
    and the smallest time as latency, with a warning in the profile."""
    try:
        return fit_alpha_beta(op, n, sizes, times)
    except ValueError as exc:
        warnings.append(
            f"no fit for {level} {op} ({exc}); used best measured bus bandwidth and smallest time"
        )
    best = max(bus_bandwidth(op, n, s, t) for s, t in zip(sizes, times))
    alpha = min(times) / latency_steps(op, n)
    fallback = AlphaBeta(
        op=op, group_size=n, alpha_s=alpha, bw_bytes_per_s=best, rel_rms_error=0.0, num_points=len(sizes)
    )
    errors = [(fallback.predict_s(s) - t) / t for s, t in zip(sizes, times)]
    return replace(fallback, rel_rms_error=float(sum(e * e for e in errors) / len(errors)) ** 0.5)


def build_profile(raw: dict, *, name: str) -> Profile:
    """Fit everything; warn (in the result and the file) on noisy measurements and poor fits."""
    env = raw["env"]
    base = datasheet_for(env["device_name"]) if env["backend"] == "nccl" else None
    comments: dict[str, str] = {}
    warnings: list[str] = []
    measured: dict = {k: env[k] for k in sorted(env)}
    device, main = _compute(raw, base, comments, measured, warnings)
    comm_rows, link_fits, links = [], {}, {}
    for level in ("intra_node", "inter_node"):
        recs = [r for r in raw["comm"] if r["level"] == level]
        if not recs:
            continue
        link_fits[level] = {}
        for op in dict.fromkeys(r["op"] for r in recs):
            pts = [(r["bytes"], *spread(r["samples_s"]), r["group_size"]) for r in recs if r["op"] == op]
            n = pts[0][3]
            for nbytes, median, rel, _ in pts:
                comm_rows.append(
                    {
                        "level": level,
                        "op": op,
                        "group_size": n,
                        "bytes": nbytes,
                        "time_s": median,
                        "spread": rel,
                        "busbw_bytes_per_s": bus_bandwidth(op, n, nbytes, median),
                    }
                )
                if rel > NOISY_SPREAD:
                    warnings.append(f"noisy: {level} {op} {nbytes} B spread {rel:.0%}")
            fit = _fit_or_fallback(op, n, [p[0] for p in pts], [p[1] for p in pts], level, warnings)
            link_fits[level][op] = fit
            if fit.rel_rms_error > POOR_FIT:
                warnings.append(f"poor fit: {level} {op} rel. RMS error {fit.rel_rms_error:.0%}")
        links[level] = _link(level, link_fits[level], base, comments)
    if "intra_node" not in links:  # one rank per node: only the inter-node level was measured
        links["intra_node"] = links["inter_node"]
        comments.update(
            {
                k.replace("inter_node", "intra_node"): "one rank per node: copied from inter_node"
                for k in list(comments)
                if k.startswith("inter_node")
            }
        )
    if "inter_node" not in links:
        if base:
            links["inter_node"] = base.inter_node
            source = f"not measured (one node): from shipped profile {base.name}"
        else:
            links["inter_node"] = links["intra_node"]
            source = "not measured (one node): same as intra_node (local processes share the machine)"
        comments.update({f"inter_node.{f}": source for f in LinkSpec.__slots__})
    measured["comm"] = comm_rows
    measured["comm_fits"] = {
        lvl: {
            op: {
                "alpha_s": f.alpha_s,
                "bw_bytes_per_s": f.bw_bytes_per_s,
                "group_size": f.group_size,
                "rel_rms_error": f.rel_rms_error,
            }
            for op, f in fits.items()
        }
        for lvl, fits in link_fits.items()
    }
    measured["warnings"] = list(warnings)
    spec = ClusterSpec(
        name=name,
        device=device,
        devices_per_node=env["nproc_per_node"],
        num_nodes=1,
        intra_node=links["intra_node"],
        inter_node=links["inter_node"],
        dtype=raw["train_dtype"],
        source="autoplan profile",
        notes=(f"measured by `autoplan profile` on {env['hostname']} at {env['date']}",),
    )
    return Profile(
        spec=spec,
        comments=comments,
        measured=measured,
        link_fits=link_fits,
        matmul_fit=main,
        warnings=tuple(warnings),
    )


def summary_tables(profile: Profile) -> list:
    """rich tables: the fitted link parameters per collective, then the device figures."""
    from rich.table import Table

    comm = Table(title="Interconnect: alpha-beta fits, bus bandwidth as nccl-tests defines it (GB/s)")
    for column in ("level", "collective", "ranks", "alpha us", "busbw fit", "best seen", "fit err", "spread"):
        comm.add_column(column, justify="left" if column in ("level", "collective") else "right")
    rows = profile.measured["comm"]
    for level, fits in profile.link_fits.items():
        for op, fit in fits.items():
            mine = [r for r in rows if r["level"] == level and r["op"] == op]
            comm.add_row(
                level.replace("_node", ""),
                op,
                str(fit.group_size),
                f"{fit.alpha_s * 1e6:.1f}",
                f"{fit.bw_bytes_per_s / 1e9:.3f}",
                f"{max(r['busbw_bytes_per_s'] for r in mine) / 1e9:.3f}",
                f"{fit.rel_rms_error:.0%}",
                f"{max(r['spread'] for r in mine):.0%}",
            )
    dev = profile.spec.device
    compute = Table(title=f"Device: {dev.name} ({profile.spec.dtype}, per rank, all ranks busy)")
    compute.add_column("quantity")
    compute.add_column("value", justify="right")
    fit = profile.matmul_fit
    for label, value in (
        (f"peak {profile.spec.dtype}", f"{profile.spec.peak_flops / 1e9:.3f} GFLOP/s"),
        ("matmul efficiency", f"{dev.matmul_efficiency:.3f}"),
        ("matmul half-size", f"{dev.matmul_half_size_flops:.3g} FLOP"),
        ("matmul fit error", f"{fit.rel_rms_error:.0%} over {fit.num_points} shapes"),
        ("attention efficiency", f"{dev.attention_efficiency:.3f}"),
        ("memory bandwidth", f"{dev.mem_bw_bytes_per_s / 1e9:.3f} GB/s x {dev.mem_bw_efficiency:.2f}"),
        ("memory", f"{dev.mem_bytes / 2**30:.2f} GiB (reserve {dev.runtime_reserve_bytes / 2**30:.2f})"),
    ):
        compute.add_row(label, value)
    return [comm, compute]


def plot_bus_bandwidth(profile: Profile, path: str) -> None:
    """PNG: measured bus bandwidth against message size per collective, the fitted alpha-beta curve
    over it; one panel per link level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    levels = list(profile.link_fits)
    fig, axes = plt.subplots(1, len(levels), figsize=(6.5 * len(levels), 4.5), squeeze=False)
    for ax, level in zip(axes[0], levels):
        for index, (op, fit) in enumerate(profile.link_fits[level].items()):
            rows = [r for r in profile.measured["comm"] if r["level"] == level and r["op"] == op]
            sizes = np.array([r["bytes"] for r in rows], dtype=float)
            color = f"C{index}"
            ax.plot(
                sizes, [r["busbw_bytes_per_s"] / 1e9 for r in rows], "o", color=color, label=f"{op} measured"
            )
            grid = np.geomspace(sizes.min(), sizes.max(), 100)
            ax.plot(
                grid,
                [bus_bandwidth(op, fit.group_size, s, fit.predict_s(s)) / 1e9 for s in grid],
                "-",
                color=color,
                alpha=0.7,
                label=f"{op} fit: {fit.alpha_s * 1e6:.0f} us, {fit.bw_bytes_per_s / 1e9:.2f} GB/s",
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(
            f"{profile.spec.name}: {level}, {next(iter(profile.link_fits[level].values())).group_size} ranks"
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
