"""What one CPU core does, timed in thread CPU seconds (so other processes on a shared machine barely
move the figures): fp32 / bf16 matmuls over sizes, causal attention, memory copy / add bandwidth, the
host time of a tiny op, and the host time per captured graph node of a real forward + backward (the
cost model's op_overhead_s: Layer.num_nodes x op_overhead_s forward, twice that backward).

    python bench/cpu_core_rates.py

One thread (as every rank of an `autoplan run` on CPU: torchrun sets OMP_NUM_THREADS=1). A rank of N on
C cores gets min(1, C / N) of these rates (cluster/cpu_share.py). profiles/local-cpu.yaml quotes them.
"""

from __future__ import annotations

import statistics
import time


def _cpu_s(fn, *, repeats: int = 7, min_s: float = 0.2) -> float:
    """Median thread CPU seconds of one call, each sample looping for at least min_s."""
    fn()
    calls, t = 1, 0.0
    while t < min_s:
        calls *= 2
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        t = time.thread_time() - t0
    samples = []
    for _ in range(repeats):
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        samples.append((time.thread_time() - t0) / calls)
    return statistics.median(samples)


def matmuls(torch) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for n in (32, 64, 128, 256, 512, 1024):
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            t = _cpu_s(lambda a=a, b=b: a @ b)
            print(f"matmul {str(dtype)[6:]:8} {n:5}^3: {2 * n**3 / t / 1e9:7.1f} GFLOP/s")


def attention(torch) -> None:
    import torch.nn.functional as F

    q, k, v = (torch.randn(1, 8, 512, 64) for _ in range(3))
    t = _cpu_s(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    print(f"causal SDPA fp32 [1, 8, 512, 64]: {4 * 8 * 512**2 * 64 / 2 / t / 1e9:.1f} GFLOP/s (causal half)")


def memory(torch) -> None:
    x, z = torch.rand(16 * 2**20), torch.rand(16 * 2**20)
    y = torch.empty_like(x)
    nbytes = x.numel() * 4
    print(f"copy 64 MiB: {2 * nbytes / _cpu_s(lambda: y.copy_(x)) / 1e9:.1f} GB/s (read + write)")
    print(f"add 64 MiB: {3 * nbytes / _cpu_s(lambda: torch.add(x, z, out=y)) / 1e9:.1f} GB/s (2 reads + write)")


def op_overheads(torch) -> None:
    x, y = torch.ones(16), torch.empty(16)
    print(f"tiny add: {_cpu_s(lambda: torch.add(x, 1.0, out=y)) * 1e6:.2f} us")
    from autoplan.execute.train import cross_entropy
    from autoplan.models import preset
    from autoplan.search.api import model_graph

    torch.manual_seed(0)
    model = preset("tiny-gpt")
    nodes = sum(layer.num_nodes for layer in model_graph("tiny-gpt", 32).layers)
    per_mb = {}
    for mb in (1, 2, 4):
        ids = torch.randint(0, model.config.vocab_size, (mb, 33))

        def step(ids=ids) -> None:
            cross_entropy(model(ids[:, :-1]), ids[:, 1:]).backward()

        per_mb[mb] = _cpu_s(step, min_s=0.3)
    slope = (per_mb[4] - per_mb[1]) / 3  # compute per extra sequence
    host = per_mb[1] - slope  # the microbatch-independent part: issuing the ops
    print(f"tiny-gpt forward + backward, seq 32: microbatch 1/2/4 = "
          f"{' / '.join(f'{t * 1e3:.2f}' for t in per_mb.values())} ms; host part {host * 1e3:.2f} ms = "
          f"{host / (3 * nodes) * 1e6:.1f} us per captured node (x{nodes} forward, x{2 * nodes} backward)")


def main() -> int:
    import torch

    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, one thread")
    matmuls(torch)
    attention(torch)
    memory(torch)
    op_overheads(torch)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
