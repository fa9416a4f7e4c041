"""Fits behind the profiler: alpha-beta models of collectives (nccl-tests bus bandwidth) and the
matmul efficiency curve eff(f) = eff * f / (f + f_half). Pure numpy/scipy, no torch.

Collective times for n ranks and a message of S bytes (Thakur et al., "Optimization of Collective
Communication Operations in MPICH", 2005; bus-bandwidth factors from nccl-tests doc/PERFORMANCE.md):
    all_reduce      t = 2 (n-1) alpha + 2 (n-1)/n * S / B
    all_gather      t =   (n-1) alpha +   (n-1)/n * S / B   (S = full output)
    reduce_scatter  t =   (n-1) alpha +   (n-1)/n * S / B   (S = full input)
    all_to_all      t =   (n-1) alpha +   (n-1)/n * S / B   (S = bytes each rank sends)
    send_recv       t =         alpha +           S / B
B is then exactly the asymptotic bus bandwidth nccl-tests reports: busbw = S / t * factor.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import OptimizeWarning, curve_fit, nnls

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def _check_op(op: str, n: int) -> None:
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}: expected one of {', '.join(OPS)}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"group size must be an integer >= 2 for {op}, got {n!r}")


def bus_bw_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw: 2(n-1)/n for all-reduce, (n-1)/n for all-gather, reduce-scatter
    and all-to-all, 1 for send/recv."""
    _check_op(op, n)
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op == "send_recv":
        return 1.0
    return (n - 1) / n


def latency_steps(op: str, n: int) -> int:
    """Number of latency-bound ring steps: 2(n-1) for all-reduce, n-1 for the one-pass collectives,
    1 for send/recv."""
    _check_op(op, n)
    if op == "all_reduce":
        return 2 * (n - 1)
    return 1 if op == "send_recv" else n - 1


def bus_bandwidth(op: str, n: int, nbytes: float, time_s: float) -> float:
    """Bus bandwidth (bytes/s) of one measurement, as nccl-tests defines it: S / t * factor."""
    if not (nbytes > 0 and time_s > 0):
        raise ValueError(f"bus bandwidth needs positive bytes and time, got {nbytes!r} bytes in {time_s!r} s")
    return nbytes / time_s * bus_bw_factor(op, n)


@dataclass(frozen=True, slots=True, kw_only=True)
class AlphaBeta:
    """t(S) = steps(op, n) * alpha_s + factor(op, n) * S / bw_bytes_per_s; bw is bus bandwidth."""

    op: str
    group_size: int
    alpha_s: float
    bw_bytes_per_s: float
    rel_rms_error: float  # root-mean-square of (predicted - measured) / measured over the fitted points
    num_points: int

    def predict_s(self, nbytes: float) -> float:
        n = self.group_size
        return (
            latency_steps(self.op, n) * self.alpha_s
            + bus_bw_factor(self.op, n) * nbytes / self.bw_bytes_per_s
        )


def fit_alpha_beta(op: str, n: int, nbytes: Sequence[float], times_s: Sequence[float]) -> AlphaBeta:
    """Least-squares alpha and bandwidth, non-negative (scipy nnls), minimising RELATIVE error so the
    kilobyte points (latency) weigh as much as the 100 MB ones (bandwidth)."""
    _check_op(op, n)
    sizes = np.asarray(nbytes, dtype=float)
    times = np.asarray(times_s, dtype=float)
    if sizes.shape != times.shape or sizes.ndim != 1:
        raise ValueError(f"{op}: need as many times as sizes, got {sizes.shape} and {times.shape}")
    if np.any(sizes <= 0) or np.any(times <= 0) or not np.all(np.isfinite(times)):
        raise ValueError(
            f"{op}: sizes and times must be positive and finite, got {sizes.tolist()} / {times.tolist()}"
        )
    if len(np.unique(sizes)) < 2:
        raise ValueError(
            f"{op}: need at least two distinct message sizes to fit alpha and bandwidth, got {sizes.tolist()}"
        )
    design = np.column_stack([np.full_like(sizes, latency_steps(op, n)), bus_bw_factor(op, n) * sizes])
    weights = 1.0 / times
    scale = design.max(axis=0)  # condition the columns (seconds vs seconds per byte)
    solution, _ = nnls(design * weights[:, None] / scale, np.ones_like(times))
    alpha, inv_bw = solution / scale
    largest = int(np.argmax(sizes))
    if inv_bw * design[largest, 1] < 0.05 * times[largest]:
        raise ValueError(
            f"{op}: time hardly grows with message size over {sizes.min():.0f}-{sizes.max():.0f} bytes (the "
            "bandwidth term is under 5 % of the largest time), so no bandwidth can be fitted: measure larger messages"
        )
    fit = AlphaBeta(
        op=op,
        group_size=n,
        alpha_s=float(alpha),
        bw_bytes_per_s=float(1.0 / inv_bw),
        rel_rms_error=0.0,
        num_points=len(sizes),
    )
    predicted = np.array([fit.predict_s(s) for s in sizes])
    error = float(np.sqrt(np.mean(((predicted - times) / times) ** 2)))
    return AlphaBeta(
        op=op,
        group_size=n,
        alpha_s=fit.alpha_s,
        bw_bytes_per_s=fit.bw_bytes_per_s,
        rel_rms_error=error,
        num_points=len(sizes),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class MatmulFit:
    """achieved(f) = peak * efficiency * f / (f + half_size_flops) for one matmul of f FLOPs."""

    peak_flops: float
    efficiency: float
    half_size_flops: float
    rel_rms_error: float
    num_points: int

    def predict_flops_per_s(self, flops: float) -> float:
        return self.peak_flops * self.efficiency * flops / (flops + self.half_size_flops)


def _log_saturating(f: np.ndarray, eff: float, log_half: float) -> np.ndarray:
    return np.log(eff * f / (f + np.exp(log_half)))


def fit_matmul(
    flops: Sequence[float], achieved_flops_per_s: Sequence[float], peak_flops: float | None = None
) -> MatmulFit:
    """Fit eff and f_half of eff(f) = eff * f / (f + f_half) to measured matmul rates, least squares
    on log(rate) so that a rate 2x too high and one 2x too low weigh the same. With peak_flops None
    (a CPU, no datasheet) the peak is the fitted large-matmul rate and eff = 1."""
    f = np.asarray(flops, dtype=float)
    rate = np.asarray(achieved_flops_per_s, dtype=float)
    if f.shape != rate.shape or f.ndim != 1 or len(np.unique(f)) < 2:
        raise ValueError(
            f"matmul fit needs >= 2 distinct sizes with one rate each, got {f.tolist()} / {rate.tolist()}"
        )
    if np.any(f <= 0) or np.any(rate <= 0):
        raise ValueError(f"matmul fit needs positive FLOPs and rates, got {f.tolist()} / {rate.tolist()}")
    scale = float(rate.max()) if peak_flops is None else float(peak_flops)
    y = rate / scale
    p0 = (float(y.max()) * 1.2, math.log(float(np.median(f))))
    bounds = ([1e-9, 0.0], [np.inf, math.log(f.max()) + 30])  # f_half >= 1 FLOP
    with warnings.catch_warnings():  # 2-3 points leave the covariance undefined; only the fit is used
        warnings.simplefilter("ignore", OptimizeWarning)
        (eff, log_half), _ = curve_fit(_log_saturating, f, np.log(y), p0=p0, bounds=bounds, maxfev=20000)
    predicted = np.exp(_log_saturating(f, eff, log_half))
    error = float(np.sqrt(np.mean(((predicted - y) / y) ** 2)))
    if peak_flops is None:
        peak, eff = scale * eff, 1.0
    else:
        peak = float(peak_flops)
    return MatmulFit(
        peak_flops=peak,
        efficiency=float(eff),
        half_size_flops=float(math.exp(log_half)),
        rel_rms_error=error,
        num_points=len(f),
    )


def spread(samples: Sequence[float]) -> tuple[float, float]:
    """(median, IQR / median) of repeated timings: the noise figure recorded beside each median."""
    values = np.asarray(samples, dtype=float)
    if values.size == 0:
        raise ValueError("spread of no samples")
    median = float(np.median(values))
    q1, q3 = np.percentile(values, [25, 75])
    return median, float((q3 - q1) / median) if median > 0 else 0.0
