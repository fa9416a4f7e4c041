"""Timing one device's compute for the profiler: matmuls over a shape sweep (square and the narrow
shapes tensor-parallel splits produce), fused attention (SDPA) and memory bandwidth (copy, add).
probe.py runs these on every local rank at once; torch only, no torch.distributed."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32, "fp32": torch.float32}


@dataclass(frozen=True, slots=True)
class Clock:
    """Times a callable on one device: CUDA events on a GPU (kernel time, no host jitter), the
    monotonic host clock on a CPU. Each sample times enough back-to-back calls to last min_sample_s,
    so on an oversubscribed CPU (8 ranks on 2 cores) it includes the rank's share of the scheduler's
    time slices (~4 ms) instead of a lucky unpreempted microsecond call."""

    device: torch.device
    min_sample_s: float = 0.02

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _batch(self, fn: Callable[[], object], calls: int) -> float:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / calls
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls

    def samples(self, fn: Callable[[], object], *, warmup: int, repeats: int) -> list[float]:
        """Per-call times of `repeats` samples after `warmup` calls."""
        for _ in range(max(1, warmup)):
            fn()
        self.sync()
        single = self._batch(fn, 1)
        calls = int(min(1000, max(1, math.ceil(self.min_sample_s / max(single, 1e-9)))))
        return [self._batch(fn, calls) for _ in range(repeats)]


def matmul_shapes(device_type: str, dtype: str, quick: bool) -> tuple[tuple[int, int, int], ...]:
    """(m, k, n) shapes: squares over two-plus decades of FLOPs, then Megatron TP splits of a
    (tokens x h) @ (h x h) layer: column-parallel (h -> h/t) and row-parallel (h/t -> h), t = 2, 4, 8."""
    if device_type == "cuda":
        squares = (512, 2048, 4096) if quick else (256, 512, 1024, 2048, 4096, 8192)
        h = 4096 if quick else 8192
    elif dtype in ("bf16", "fp16"):  # CPUs without bf16/fp16 FMA run these on a slow path
        squares, h = ((64, 128) if quick else (64, 96, 128)), 0
    else:
        squares = (32, 128, 512) if quick else (32, 64, 128, 256, 512, 1024)
        h = 512 if quick else 1024
    shapes = [(s, s, s) for s in squares]
    splits = (4,) if quick else (2, 4, 8)
    if h:
        shapes += [(h, h, h // t) for t in splits] + [(h, h // t, h) for t in splits]
    return tuple(shapes)


def time_matmuls(
    clock: Clock,
    dtypes: tuple[str, ...],
    *,
    quick: bool,
    warmup: int,
    repeats: int,
    progress: Callable[[str], None],
    together: Callable[[], object] = lambda: None,
) -> list[dict]:
    """One record per (dtype, shape): FLOPs 2 m k n and this rank's repeat times. `together` (a
    barrier) starts every shape on all ranks at once."""
    records = []
    for dtype in dtypes:
        if clock.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
        for m, k, n in matmul_shapes(clock.device.type, dtype, quick):
            a = torch.randn(m, k, device=clock.device).to(TORCH_DTYPES[dtype])
            b = torch.randn(k, n, device=clock.device).to(TORCH_DTYPES[dtype])
            together()
            times = clock.samples(lambda a=a, b=b: torch.mm(a, b), warmup=warmup, repeats=repeats)
            flops = 2.0 * m * k * n
            records.append({"dtype": dtype, "shape": [m, k, n], "flops": flops, "samples_s": times})
            progress(
                f"matmul {dtype} {m}x{k}x{n}: {flops / sorted(times)[len(times) // 2] / 1e9:.1f} GFLOP/s"
            )
    if clock.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    return records


def time_attention(clock: Clock, dtype: str, *, quick: bool, warmup: int, repeats: int) -> dict:
    """Causal SDPA forward; FLOPs 4 b a s^2 d / 2 (QK^T and AV, half masked), the FlashAttention
    papers' convention (Dao 2023, Sec. 4.1)."""
    if clock.device.type == "cuda":
        b, heads, s, d = (2, 16, 2048, 128) if quick else (4, 32, 4096, 128)
    else:
        b, heads, s, d = (1, 4, 256, 64) if quick else (1, 8, 512, 64)
    q, k, v = (torch.randn(b, heads, s, d, device=clock.device).to(TORCH_DTYPES[dtype]) for _ in range(3))
    times = clock.samples(
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), warmup=warmup, repeats=repeats
    )
    return {
        "dtype": dtype,
        "shape": [b, heads, s, d],
        "flops": 4.0 * b * heads * s * s * d / 2,
        "samples_s": times,
    }


def time_memory(clock: Clock, *, quick: bool, warmup: int, repeats: int) -> dict:
    """A large copy (2 bytes moved per byte) and an add (3 per byte): the STREAM copy and add
    kernels (McCalpin, STREAM benchmark). Buffers far larger than the caches."""
    if clock.device.type == "cuda":
        numel = (256 if quick else 1024) * 2**20 // 4
    else:
        numel = (16 if quick else 64) * 2**20 // 4
    x = torch.rand(numel, device=clock.device)
    y = torch.empty_like(x)
    z = torch.rand(numel, device=clock.device)
    copy = clock.samples(lambda: y.copy_(x), warmup=warmup, repeats=repeats)
    add = clock.samples(lambda: torch.add(x, z, out=y), warmup=warmup, repeats=repeats)
    nbytes = numel * x.element_size()
    return {
        "bytes": nbytes,
        "copy_samples_s": copy,
        "copy_bytes_moved": 2 * nbytes,
        "add_samples_s": add,
        "add_bytes_moved": 3 * nbytes,
    }


def time_op_overhead(clock: Clock, *, repeats: int) -> dict:
    """Host time to issue one small framework op (Python, dispatcher, kernel launch): loops of tiny
    adds on the host clock, each loop lasting at least clock.min_sample_s so that an oversubscribed
    CPU's time slicing is in it; on a GPU the kernels (~2 us) queue faster than they issue."""
    x = torch.ones(16, device=clock.device)
    y = torch.empty_like(x)

    def loop(calls: int) -> float:
        clock.sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            torch.add(x, 1.0, out=y)
        elapsed = time.perf_counter() - t0
        clock.sync()
        return elapsed / calls

    calls = int(min(100_000, max(200, math.ceil(clock.min_sample_s / max(loop(200), 1e-9)))))
    return {"calls": calls, "samples_s": [loop(calls) for _ in range(repeats)]}
