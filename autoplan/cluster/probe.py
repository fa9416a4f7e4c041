"""The profiler's measuring half: start the ranks (forked locally with a FileStore, or the ranks
torchrun started), time compute on every rank at once and the collectives per link level, and hand
rank 0 the raw medians. report.py fits them into a profile. NCCL on GPUs, gloo on CPUs."""

from __future__ import annotations

import datetime
import math
import os
import pickle
import platform
import resource
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autoplan.cluster import kernels
from autoplan.cluster.fit import OPS, bus_bandwidth, spread


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeOptions:
    """What to measure and how long to wait. timeout_s bounds every rendezvous and collective;
    deadline_s the whole run (default 900 s, 300 s quick). fail_rank / fail_mode are a test hook:
    before the collectives that rank exits abruptly ("exit", a crashed peer) or stops answering
    ("hang", an unreachable peer)."""

    nproc_per_node: int = 1
    nnodes: int = 1
    backend: str = "gloo"
    quick: bool = False
    timeout_s: float = 60.0
    deadline_s: float | None = None
    fail_rank: int | None = None
    fail_mode: str = "exit"

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"--backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("--backend nccl needs CUDA GPUs, and torch sees none here: use --backend gloo")
        for name in ("nproc_per_node", "nnodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.backend == "nccl" and self.nproc_per_node > torch.cuda.device_count():
            raise ValueError(
                f"--nproc-per-node {self.nproc_per_node} exceeds the {torch.cuda.device_count()} GPUs here"
            )
        if self.nproc_per_node * self.nnodes < 2:
            raise ValueError(
                "profiling the interconnect needs at least 2 ranks: pass --nproc-per-node 2 or more"
            )
        if not self.timeout_s > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout_s!r}")

    @property
    def warmup(self) -> int:
        return 1 if self.quick else 2

    @property
    def repeats(self) -> int:
        return 5 if self.quick else 7

    def message_sizes(self) -> tuple[int, ...]:
        """Bytes per message, x4 steps from 4 KiB. GPU: to 64 MiB quick, 1 GiB full. gloo: to 16 MiB
        quick (scheduling noise on a shared CPU is ~1-3 ms: the top sizes must take well over that)
        and 64 MiB full (already ~1 s per call at 8 ranks on 2 cores, deep in the bandwidth regime)."""
        if self.backend == "gloo":
            top = 24 if self.quick else 26
        else:
            top = 26 if self.quick else 30
        return tuple(2**k for k in range(12, top + 1, 2))


@dataclass(frozen=True, slots=True, kw_only=True)
class Rendezvous:
    """Where this process sits: from torchrun's environment (init 'env://') or a local fork."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    store_path: str = ""  # FileStore for forked local ranks; empty under torchrun


class ProbeFailed(RuntimeError):
    """Some rank failed or the run exceeded its deadline; `tracebacks` maps rank -> text."""

    def __init__(self, message: str, tracebacks: dict[int, str]) -> None:
        super().__init__(message)
        self.tracebacks = tracebacks


def _say(rdv: Rendezvous) -> Callable[[str], None]:
    def say(line: str) -> None:
        if rdv.rank == 0:
            print(f"[profile {time.strftime('%H:%M:%S')}] {line}", flush=True)

    return say


def _environment(opts: ProbeOptions, rdv: Rendezvous, device: torch.device) -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "backend": opts.backend,
        "world_size": rdv.world_size,
        "nnodes": rdv.world_size // rdv.local_world_size,
        "nproc_per_node": rdv.local_world_size,
        "quick": opts.quick,
        "warmup": opts.warmup,
        "repeats": opts.repeats,
        "cpu_count": os.cpu_count(),
        "threads_per_rank": torch.get_num_threads(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        nccl = torch.cuda.nccl.version()
        info.update(
            device_name=props.name,
            cuda=torch.version.cuda,
            mem_bytes=int(props.total_memory),
            nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
        )
        try:
            info["driver"] = (
                subprocess.run(
                    ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                    check=False,
                )
                .stdout.split("\n")[0]
                .strip()
            )
        except (OSError, subprocess.SubprocessError):
            info["driver"] = "unknown"
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        info.update(
            device_name=f"cpu-{platform.processor() or platform.machine()}",
            mem_bytes=int(total // rdv.local_world_size),
        )
    return info


def _sync(group: dist.ProcessGroup | None, device: torch.device) -> None:
    if device.type == "cuda":
        dist.barrier(group=group, device_ids=[device.index])
    else:
        dist.barrier(group=group)


def _collective(op: str, nbytes: int, group: dist.ProcessGroup, device: torch.device) -> Callable[[], object]:
    """One call of `op` moving a message of nbytes as nccl-tests sizes it (full output for
    all-gather, full input for reduce-scatter, each rank's send buffer for all-to-all)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = dist.get_world_size(group)
    numel = max(n, nbytes // torch.tensor([], dtype=dtype).element_size() // n * n)
    full = torch.ones(numel, dtype=dtype, device=device)
    part = torch.ones(numel // n, dtype=dtype, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if op == "all_gather":  # *_single: torch >= 2.13 names; *_tensor before
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(full, part, group=group)
    if op == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(part, full, group=group)
    if op == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full, group=group)
    # send_recv: a ring shift, each rank sends to the next and receives from the previous
    me = dist.get_rank(group)
    nxt, prv = (dist.get_global_rank(group, (me + s) % n) for s in (1, -1))
    recv = torch.empty_like(full)

    def shift() -> None:
        for work in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, full, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)]
        ):
            work.wait()

    return shift


def _time_comm(
    opts: ProbeOptions,
    level: str,
    group: dist.ProcessGroup,
    device: torch.device,
    clock: kernels.Clock,
    say: Callable[[str], None],
) -> list[dict]:
    """Every (op, size) on `group`: warm-up, then repeats each fenced by a group barrier and timing
    enough back-to-back calls to outlast scheduler noise and the barrier's exit skew; each repeat's
    per-call time is the slowest rank's."""
    records = []
    n = dist.get_world_size(group)
    for op in OPS:
        for nbytes in opts.message_sizes():
            fn = _collective(op, nbytes, group, device)
            for _ in range(max(1, opts.warmup - 1)):  # the first call on a group also builds communicators
                fn()
            clock.sync()
            t_warm = time.perf_counter()
            fn()
            clock.sync()
            # rank 0's warm call sets, for the whole group, how many back-to-back calls make one
            # sample last clock.min_sample_s (longer than a scheduler slice on a shared CPU; nccl-tests
            # likewise averages 20 iterations), and cuts repeats to 3 for calls over 0.2 s
            single = torch.tensor([time.perf_counter() - t_warm], dtype=torch.float64, device=device)
            dist.broadcast(single, src=dist.get_global_rank(group, 0), group=group)
            single_s = max(single.item(), 1e-7)
            repeats = 3 if single_s > 0.2 else opts.repeats
            times, inner = [], int(min(100, max(1, math.ceil(clock.min_sample_s / single_s))))
            for _ in range(repeats):
                _sync(group, device)
                t0 = time.perf_counter()
                for _ in range(inner):
                    fn()
                clock.sync()
                times.append((time.perf_counter() - t0) / inner)
            worst = torch.tensor(times, dtype=torch.float64, device=device)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)  # as slow as its slowest rank
            times = worst.cpu().tolist()
            records.append({"level": level, "op": op, "group_size": n, "bytes": nbytes, "samples_s": times})
            median, rel = spread(times)
            say(
                f"{level} {op:<14} n={n} {nbytes / 2**20:9.3f} MiB  {median * 1e3:8.3f} ms  "
                f"busbw {bus_bandwidth(op, n, nbytes, median) / 1e9:7.3f} GB/s  spread {rel:4.0%}"
            )
            del fn
    return records


def _groups(rdv: Rendezvous, timeout: datetime.timedelta) -> dict[str, dist.ProcessGroup]:
    """This rank's intra-node group (its node's ranks) and, with several nodes, its inter-node group
    (the same local rank on every node, the ranks NCCL's per-NIC rings join). Every rank creates
    every group, as new_group requires; each group gets the run's timeout (its default is 30 min)."""
    local, nodes = rdv.local_world_size, rdv.world_size // rdv.local_world_size
    mine: dict[str, dist.ProcessGroup] = {}
    for node in range(nodes):
        group = dist.new_group(list(range(node * local, (node + 1) * local)), timeout=timeout)
        if rdv.rank // local == node and local > 1:
            mine["intra_node"] = group
    if nodes > 1:
        for index in range(local):
            group = dist.new_group([node * local + index for node in range(nodes)], timeout=timeout)
            if rdv.rank % local == index:
                mine["inter_node"] = group
    return mine


def run_rank(opts: ProbeOptions, rdv: Rendezvous) -> dict | None:
    """Everything one rank does; rank 0 returns the raw measurements, the others None."""
    device = torch.device("cuda", rdv.local_rank) if opts.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # ranks share the cores, as training processes would
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // rdv.local_world_size))
    timeout = datetime.timedelta(seconds=opts.timeout_s)
    if rdv.store_path:
        store = dist.FileStore(rdv.store_path, rdv.world_size)
        store.set_timeout(timeout)
        dist.init_process_group(
            opts.backend, store=store, rank=rdv.rank, world_size=rdv.world_size, timeout=timeout
        )
    else:
        dist.init_process_group(opts.backend, timeout=timeout)
    say, clock = _say(rdv), kernels.Clock(device, min_sample_s=0.005 if device.type == "cuda" else 0.02)
    env = _environment(opts, rdv, device)
    env["process_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    say(
        f"{rdv.world_size} ranks ({env['nnodes']} x {rdv.local_world_size}), {opts.backend}, {env['device_name']}"
    )
    dtypes = ("bf16", "fp16", "tf32", "fp32") if device.type == "cuda" else ("fp32", "bf16", "fp16")
    if opts.quick and device.type != "cuda":
        dtypes = ("fp32", "bf16")
    train = "bf16" if device.type == "cuda" else "fp32"
    _sync(None, device)  # all ranks busy at once from here, each shape started together
    compute = {
        "matmul": kernels.time_matmuls(
            clock,
            dtypes,
            quick=opts.quick,
            warmup=opts.warmup,
            repeats=opts.repeats,
            progress=say,
            together=lambda: _sync(None, device),
        ),
        "attention": kernels.time_attention(
            clock, train, quick=opts.quick, warmup=opts.warmup, repeats=opts.repeats
        ),
        "memory": kernels.time_memory(clock, quick=opts.quick, warmup=opts.warmup, repeats=opts.repeats),
        "op_overhead": kernels.time_op_overhead(clock, repeats=opts.repeats),
    }
    say("compute done; collectives next")
    if opts.fail_rank == rdv.rank:
        if opts.fail_mode == "hang":
            time.sleep(opts.timeout_s * 10)
        os._exit(3)
    records = []  # rank 0 keeps those of its own groups: node 0's intra-node group, local rank 0's inter-node one
    for level, group in _groups(rdv, timeout).items():
        records += _time_comm(opts, level, group, device, clock, say)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        env["runtime_used_bytes"] = int(total - free - torch.cuda.memory_reserved(device))
    gathered = [None] * rdv.world_size if rdv.rank == 0 else None
    dist.gather_object(compute, gathered, dst=0)
    _sync(None, device)
    dist.destroy_process_group()
    if rdv.rank != 0:
        return None
    return {"env": env, "train_dtype": train, "compute": gathered, "comm": records}


def _fork_entry(local_rank: int, opts: ProbeOptions, workdir: str) -> None:
    rdv = Rendezvous(
        rank=local_rank,
        world_size=opts.nproc_per_node,
        local_rank=local_rank,
        local_world_size=opts.nproc_per_node,
        store_path=os.path.join(workdir, "store"),
    )
    try:
        raw = run_rank(opts, rdv)
        if raw is not None:
            with open(os.path.join(workdir, "raw.pkl"), "wb") as handle:
                pickle.dump(raw, handle)
    except BaseException:
        Path(workdir, f"rank{local_rank}.err").write_text(traceback.format_exc())
        raise


def _failure(workdir: str, exc: BaseException | None, opts: ProbeOptions) -> ProbeFailed:
    tracebacks = {int(p.stem[4:]): p.read_text() for p in Path(workdir).glob("rank*.err")}
    if isinstance(exc, mp.ProcessRaisedException | mp.ProcessExitedException):
        rank = exc.error_index
        tracebacks.setdefault(rank, str(exc))
        first = [line for line in tracebacks[rank].strip().splitlines() if line.strip()][-1]
        code = getattr(exc, "exit_code", None)
        why = f"exited with code {code} (killed or crashed, no Python error)" if code is not None else first
        if code is None and any(k in first.lower() for k in ("timeout", "timed out", "connection closed")):
            why += (
                f" (a peer did not answer within --timeout {opts.timeout_s:g} s: "
                "a rank hung, died or cannot be reached)"
            )
        return ProbeFailed(f"rank {rank} of {opts.nproc_per_node} failed: {why}", tracebacks)
    return ProbeFailed(
        f"profiling did not finish within its deadline of {_deadline(opts):.0f} s "
        "(a rank hangs or the machine is overloaded); pass --timeout or --quick",
        tracebacks,
    )


def _deadline(opts: ProbeOptions) -> float:
    return opts.deadline_s if opts.deadline_s is not None else (300.0 if opts.quick else 900.0)


def probe_local(opts: ProbeOptions) -> dict:
    """Fork nproc_per_node ranks on this machine (FileStore rendezvous: ready in ~0.1 s, no port
    clash), wait at most the deadline, and return rank 0's raw measurements. Any failure: every rank
    stopped, ProbeFailed with each rank's traceback."""
    if opts.nnodes != 1:
        raise ValueError(
            f"--nnodes {opts.nnodes} needs one launcher per node: run under torchrun "
            f"(torchrun --nnodes {opts.nnodes} --nproc-per-node {opts.nproc_per_node} ...)"
        )
    with tempfile.TemporaryDirectory(prefix="autoplan-profile-") as workdir:
        context = mp.start_processes(
            _fork_entry, args=(opts, workdir), nprocs=opts.nproc_per_node, join=False, start_method="fork"
        )
        deadline = time.monotonic() + _deadline(opts)
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError
        except (mp.ProcessRaisedException, mp.ProcessExitedException, TimeoutError) as exc:
            raise _failure(workdir, None if isinstance(exc, TimeoutError) else exc, opts) from None
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join(5)
        with open(os.path.join(workdir, "raw.pkl"), "rb") as handle:
            return pickle.load(handle)


def probe_torchrun(opts: ProbeOptions, rdv: Rendezvous) -> dict | None:
    """Under torchrun (env:// rendezvous, one process per rank already): rank 0 gets the raw data."""
    try:
        return run_rank(opts, rdv)
    except Exception as exc:
        raise ProbeFailed(
            f"rank {rdv.rank} of {rdv.world_size} failed: {exc}", {rdv.rank: traceback.format_exc()}
        ) from exc
